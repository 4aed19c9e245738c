"""Reading conversation records out of a file, whole or torn, and the errors that name what is wrong with it.

Files are decoded value by value with `json.JSONDecoder.raw_decode`, which handles a JSON array, JSON Lines and
concatenated JSON alike, and lets a cut-off file (the embedded ShareGPT file ends mid-record) be read up to its last
complete record: the broken tail is skipped and reported in `SourceInfo.broken_tail`.

A broken record (invalid JSON, bytes that are not UTF-8, a record that is not a conversation) stops the read with
an error naming the file and line, unless `skip_bad_records=True`: then it is skipped, counted by reason in
`SourceInfo.bad_records` and the first few are named (file, line) in `SourceInfo.bad_record_examples`. Recovery
resumes at the next line, so it is exact for JSON Lines (one record per line).

Python API: `iter_file(path, info, limit) -> Iterator[Conversation]`, filling `info` (a `SourceInfo`) as it reads;
`regeneration_record(path)`: how a `generate` output (its manifest beside the file) was regenerated.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.assets.conversation_records import Conversation, messages_digest, parse_record
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

_WS = " \t\r\n"
_BAD_EXAMPLES = 5
# Undecodable bytes become lone surrogates under errors="surrogateescape"; valid UTF-8 text never holds them.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


@dataclass
class SourceInfo:
    """Where conversations came from. Counts are final once the iterator is exhausted."""

    source: str
    path: str
    sha256: str
    container: str = ""  # "json-array" or "json-lines"
    # record format: "sharegpt" (from/value turns), "messages" (role/content turns), a column pair such as
    # "question/answer" (assets/record_shapes.py), or "mixed"
    format: str = ""
    formats: dict[str, int] = field(default_factory=dict)  # record format -> count
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
    # What `--data` named, one entry per value: its spec and kind, the dataset id (or path), config, split, revision
    # (the Hub commit, or a local dataset's fingerprint) and rows taken; a mixture's entries add their weight and the
    # conversations each had (assets/data_sources.py)
    sources: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_TABULAR = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def _not_json(path: Path) -> str:
    """What to do with a file whose first record is not JSON: a table (by its suffix) is converted, not skipped
    (`--skip-bad-records` would skip every row)."""
    expected = ("conversations are read from JSON Lines or a JSON array of records: ShareGPT `conversations` "
                "(from/value) or OpenAI-style `messages`")
    kind = _TABULAR.get(path.suffix.lower())
    if kind:
        return (f"{path.name} is a {path.suffix[1:].upper()} file, and {expected}; pass the directory holding it "
                f"as --data DIR@train (a dataset directory, read with `datasets`; docs/DATA.md), or convert it, e.g. "
                f"`datasets.load_dataset('{kind}', data_files='{path}')['train'].to_json('{path.stem}.jsonl')`")
    return (f"{expected}, and its first record is not JSON; check the file's format (--skip-bad-records skips only "
            f"single broken records of a JSON file)")


def _bad(info: SourceInfo, path: Path, line: int, reason: str, detail: str) -> None:
    info.bad_records[reason] = info.bad_records.get(reason, 0) + 1
    if len(info.bad_record_examples) < _BAD_EXAMPLES:
        info.bad_record_examples.append({"file": str(path), "line": line, "reason": reason, "detail": detail[:200]})
    if sum(info.bad_records.values()) == 1:
        log.warning("%s, line %d: skipped a bad record (%s: %s); later ones are counted in the manifest",
                    path, line, reason, detail[:200])


def iter_file(path: Path, info: SourceInfo, limit: int | None) -> Iterator[Conversation]:
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
            fmt, conv = parse_record(record, path, n, line)
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
