"""The `generate` stage: regenerate the assistant turns of conversations with the verifier (on-policy data).

System and user turns are kept; each assistant turn is regenerated in order, on the model's OWN earlier answers,
through any OpenAI-compatible chat endpoint (vLLM, SGLang, ...). Several `--endpoint`s share the load.

Output (feeds `prepare` directly):
- `DIR/conversations.jsonl`: one record per finished conversation, `{"id", "messages": [{"role", "content"
  [, "reasoning_content"] [, "tool_calls"] [, "completion_token_ids"] [, "regenerated": false]}], "turns":
  [{"finish_reason", "usage"}], "model", ["tools"], ["truncated"]}` (`completion_token_ids`: what vLLM generated,
  which `prepare` compares with what it supervises; `regenerated: false`: a source turn kept as given), appended
  with one write + flush + fsync each, so a crash or kill -9 loses at most the conversations in flight. A rerun resumes:
  it reads the ids already written (cutting away a torn last line first) and does only the rest.
- `DIR/skipped.jsonl`: `{"id", "reason", "detail"}` for conversations that cannot be regenerated (bad turn
  structure, first turn longer than the server's context, rejected request); not retried on resume.
- `DIR/manifest.json`: endpoints, served model, sampling settings, counts, source (with SHA-256), throughput.

When a later turn no longer fits the context, the turns done so far are kept (`"truncated": "context_too_long"`);
a turn cut at max_tokens ends its conversation (`"truncated": "max_tokens"`, or dropped with `truncated_turns:
drop`). Agentic traces: an assistant turn that called tools is kept as given (the recorded tool results answer that
call), the assistant's other turns are regenerated with the calls and results in their history and the
conversation's `tools` in every request (a server started here gets the family's tool-call parser); a regenerated
turn that calls a tool ends the trace there (`"truncated": "tool_call_without_result"`). The thinking switch and the
recommended sampling come from the verifier's thinking style (assets/thinking.py). After the first wave of
conversations (one per request in flight) the rate so far gives the measured ETA of the rest (`eta` in the manifest,
on the long side; `estimate_only` stops there).
With `--seed S`, each request gets a seed derived from (S, conversation id, turn), so results do not depend on
scheduling or resumption.

Python API: `regenerate(source, out_dir, endpoints, model, ...) -> dict` (the manifest).
CLI: `eagle3-train generate --data sharegpt --endpoint http://127.0.0.1:8000/v1 --model NAME --out DIR --limit N
--concurrency N --max-tokens N --temperature T` or `--serve-verifier smollm2-135m-instruct` to start vLLM itself
(every flag: docs/CONFIG.md, defaults from `GenerateSettings`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import time
import typing
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.assets.conversations import REGENERATED, TOKEN_IDS
from eagle3_train.assets.thinking import GENERIC, ThinkingStyle, resolve_style
from eagle3_train.serving.client import (
    ChatPool,
    ContextTooLongError,
    EndpointUnavailable,
    FatalRequestError,
    RequestRejected,
    quiet_http_logs,
)
from eagle3_train.settings import GenerateSettings, Reasoning
from eagle3_train.utils.io import Eagle3InputError, check_at_least, read_json, write_json
from eagle3_train.utils.outputs import claim_output_dir, output_lock, stage_manifest
from eagle3_train.utils.progress import progress
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

if typing.TYPE_CHECKING:
    from eagle3_train.assets.conversations import SourceInfo

log = logging.getLogger(__name__)
SERVER_LOG = "vllm.log"  # the log of a server this stage starts, kept beside its output

OUTPUT_FILE = "conversations.jsonl"
SKIPPED_FILE = "skipped.jsonl"
MANIFEST_FILE = "manifest.json"
REASONING_MODES = typing.get_args(Reasoning)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


_D = GenerateSettings  # keyword defaults below are the settings dataclass's


DEFAULT_MAX_TOKENS = 512  # an answer without thinking
THINKING_MAX_TOKENS = 32768  # at most, when derived from the server's context
THINKING_MAX_TOKENS_UNKNOWN = 16384  # when the server does not say its max_model_len


@dataclass
class Sampling:
    """What shapes the regenerated text: a resume under other values is refused."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = _D.temperature
    top_p: float = _D.top_p
    seed: int | None = _D.seed
    reasoning: str = _D.reasoning  # keep (as reasoning_content), strip, or disable (the style's switch)
    thinking_style: str = "generic"  # resolved (assets/thinking.py)
    truncated_turns: str = _D.truncated_turns  # keep or drop a conversation whose turn hit max_tokens


@dataclass
class _Stats:
    requests: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    cut_turns: int = 0  # turns that hit max_tokens (kept or dropped)
    tool_call_turns_kept: int = 0  # assistant turns that called tools, kept as given
    # completion tokens split between reasoning and answer: as the server counted them (vLLM's usage
    # completion_tokens_details.reasoning_tokens), else by their share of the text
    reasoning_tokens: float = 0.0
    answer_tokens: float = 0.0

    @property
    def handled(self) -> int:
        """Conversations this run finished or skipped."""
        return self.finished + sum(self.skipped.values())


def default_max_tokens(style: ThinkingStyle, reasoning: str, max_model_len: int | None) -> tuple[int, str]:
    """(max new tokens per turn, why) when the user set none: a thinking model's reasoning needs thousands."""
    if style.name == GENERIC.name or reasoning == "disable":
        return DEFAULT_MAX_TOKENS, "default without thinking"
    if max_model_len:
        return min(max_model_len // 2, THINKING_MAX_TOKENS), f"half the server's max_model_len {max_model_len}"
    return THINKING_MAX_TOKENS_UNKNOWN, "thinking default (the server did not say its max_model_len)"


def split_inline_reasoning(content: str) -> tuple[str, str | None]:
    """(answer, reasoning) of a reply whose reasoning is inline (`<think>...</think>`: a server without a reasoning
    parser); a reply cut inside its reasoning (no `</think>`) is all reasoning."""
    match = _THINK.match(content)
    if match:
        return content[match.end():], match.group(1).strip("\n")
    stripped = content.lstrip()
    if stripped.startswith("<think>"):
        return "", stripped[len("<think>"):].strip("\n")
    return content, None


# --- crash-safe append-only JSONL -----------------------------------------------------------------------------
def _cut_torn_tail(path: Path) -> int:
    """Truncate the file after its last newline (a record is complete only with its newline); bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep, pos = 0, size
        while pos > 0:  # scan backwards: outputs can be gigabytes
            start = max(0, pos - (1 << 16))
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("%s: removed a torn last line (%d bytes) left by an interrupted run", path, size - keep)
    return size - keep


def recover_jsonl(path: Path, what: str = "output", ids_only: bool = False) -> tuple[list[dict], int]:
    """Read an append-only JSONL file, cutting away a torn last line (no trailing newline) in place.

    Returns (records, bytes removed); with `ids_only` each record is reduced to its `id` (and `reason`).
    A broken line in the middle was not written by us: error.
    """
    if not path.exists():
        return [], 0
    cut = _cut_torn_tail(path)
    records = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise Eagle3InputError(f"{what} file {path}, line {n} is not valid JSON ({e.msg}); the file was "
                                       f"modified outside `generate`: fix or remove that line, or use --overwrite"
                                       ) from None
            if not isinstance(rec, dict) or "id" not in rec:
                raise Eagle3InputError(f"{what} file {path}, line {n}: expected an object with field 'id'")
            records.append({k: rec[k] for k in ("id", "reason") if k in rec} if ids_only else rec)
    return records, cut


class AppendLog:
    """Append one JSON record per call with a single write, then flush and fsync."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop only guards against a short write
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


# --- one conversation -----------------------------------------------------------------------------------------
def request_seed(seed: int | None, conv_id: str, turn: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{conv_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _normalize(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]] | None, str | None]:
    from eagle3_train.assets.conversations import normalize_turns

    return normalize_turns(messages)


async def regenerate_conversation(pool: ChatPool, conv_id: str, messages: list[dict[str, str]],
                                  sampling: Sampling, stats: _Stats, style: ThinkingStyle = GENERIC,
                                  tools: list[dict[str, Any]] | None = None) -> tuple[dict | None, dict | None]:
    """Regenerate one conversation; returns (record, None) or (None, skip record). `tools`: the conversation's
    functions, sent with every request (so the template renders them as prepare will, and a new call comes back as
    `tool_calls` from a server with a tool-call parser) and kept in the record."""
    msgs, reason = _normalize(messages)
    if reason:
        return None, {"id": conv_id, "reason": reason, "detail": ""}
    # The text exactly as generated: vLLM (and SGLang) otherwise put a space on both sides of every special token when
    # they detokenize with a remote-code (slow) tokenizer such as Kimi's, so a reply would come back as
    # "  thought" / " answer" and train on tokens the model never produced (measured on the simulated Kimi).
    # return_token_ids: vLLM's completion token ids, kept so that prepare can compare what it supervises with them
    extra = {"spaces_between_special_tokens": False, "return_token_ids": True,
             **(style.request_extra(sampling.reasoning) or {})}
    out: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    prefer: int | None = None  # keep a conversation on one endpoint: its prefix cache holds the earlier turns
    truncated = None
    for m in msgs:
        if m["role"] != "assistant" or m.get("tool_calls"):
            # an assistant turn that called tools is kept as given: the recorded tool results answer that call;
            # the verifier did not produce it, so prepare does not supervise it (unless asked)
            out.append({**m, REGENERATED: False} if m["role"] == "assistant" else dict(m))
            if m["role"] == "assistant":
                turns.append({"kept": "tool_calls"})
                stats.tool_call_turns_kept += 1
            continue
        history = openai_history(out)
        try:
            reply = await pool.chat(history, prefer=prefer, max_tokens=sampling.max_tokens,
                                    temperature=sampling.temperature, top_p=sampling.top_p,
                                    seed=request_seed(sampling.seed, conv_id, len(turns)), extra_body=extra,
                                    tools=tools)
        except ContextTooLongError as e:
            if not turns:
                return None, {"id": conv_id, "reason": "context_too_long", "detail": str(e)[:300]}
            truncated = "context_too_long"
            break
        except RequestRejected as e:
            return None, {"id": conv_id, "reason": e.reason, "detail": str(e)[:300]}
        prefer = reply.endpoint
        stats.requests += 1
        tokens = int(reply.usage.get("completion_tokens", 0))
        stats.completion_tokens += tokens
        stats.prompt_tokens += int(reply.usage.get("prompt_tokens", 0))
        content, reasoning = reply.content, reply.reasoning
        if reasoning is None:  # a server without a reasoning parser leaves <think> inline
            content, reasoning = split_inline_reasoning(content)
        _count_text(stats, tokens, reasoning or "", content,
                    (reply.usage.get("completion_tokens_details") or {}).get("reasoning_tokens"))
        stripped = bool(reasoning) and sampling.reasoning != "keep"  # generated reasoning that is not trained
        if sampling.reasoning != "keep":
            reasoning = None
        cut = reply.finish_reason == "length"
        stats.cut_turns += cut
        if cut and sampling.truncated_turns == "drop":
            return None, {"id": conv_id, "reason": "max_tokens",
                          "detail": f"turn {len(turns)} reached max_tokens {sampling.max_tokens}"}
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if reply.tool_calls:
            msg["tool_calls"] = reply.tool_calls
        if reply.token_ids is not None and not stripped:
            msg[TOKEN_IDS] = list(reply.token_ids)  # (not where the reasoning was stripped: other text is trained)
        out.append(msg)
        turns.append({"finish_reason": reply.finish_reason, "usage": reply.usage})
        if cut:  # the next question would follow an unfinished answer
            truncated = "max_tokens"
            break
        if reply.tool_calls:  # a new call has no recorded result: the trace ends with it (it is on-policy)
            truncated = "tool_call_without_result"
            break
    while out and out[-1]["role"] != "assistant":  # the question whose answer did not fit
        out.pop()
    record: dict[str, Any] = {"id": conv_id, "messages": out, "turns": turns, "model": pool.model,
                              **({"tools": tools} if tools else {})}
    if truncated:
        record["truncated"] = truncated
    return record, None


def tool_server_args(source: str | Path, model_name: str, model_dir: str | Path | None, thinking_style: str = "auto",
                     limit: int | None = None, skip_bad_records: bool = False) -> list[str]:
    """vLLM flags for a server started here to regenerate `source`: the family's tool-call parser when its
    conversations offer tools (without one, vLLM refuses every request that carries them), else none."""
    from eagle3_train.assets.conversations import load_conversations

    conversations, _ = load_conversations(source, limit=limit, skip_bad_records=skip_bad_records)
    if not any(c.tools for c in conversations):
        return []
    style, _ = resolve_style(thinking_style, model_name, model_dir)
    if not style.tool_server_args():
        log.warning("the conversations offer tools, but no tool-call parser is known for %s (style %s): pass "
                    "--vllm-arg=--enable-auto-tool-choice --vllm-arg=--tool-call-parser=NAME", model_name, style.name)
    return style.tool_server_args()


def openai_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as an OpenAI chat request takes them: tool-call arguments as JSON text, every tool result naming its
    call (a ShareGPT `observation` answers the calls before it in order), and each turn's reasoning: the template
    decides what of it to render (Kimi's and Qwen3's keep the thinking of the tool-call turns after the last user
    turn), so every turn is generated from the prompt that `prepare` renders for it."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls not yet answered
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content"):  # vLLM (0.32 checked) hands it to the template as `reasoning`
            msg["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                                    if isinstance(c["function"]["arguments"], str)
                                                    else json.dumps(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]
            pending = [c["id"] for c in m["tool_calls"]]
        if m["role"] == "tool":
            call_id = m.get("tool_call_id") or (pending[0] if pending else "call_0")
            msg["tool_call_id"] = call_id
            pending = [p for p in pending if p != call_id]
        out.append(msg)
    return out


def _count_text(stats: _Stats, tokens: int, reasoning: str, answer: str, counted: int | None = None) -> None:
    total = len(reasoning) + len(answer)
    share = len(reasoning) / total if total else 0.0
    if counted is not None and tokens:
        share = min(1.0, int(counted) / tokens)
    stats.reasoning_tokens += tokens * share
    stats.answer_tokens += tokens * (1 - share)


# --- the stage ------------------------------------------------------------------------------------------------
def _check_resume(manifest_path: Path, model: str, sampling: Sampling, source_sha: str) -> None:
    if not manifest_path.exists():
        return
    old = read_json(manifest_path, "generate manifest")
    old_sampling = old.get("sampling", {})
    problems = []
    if old.get("model") != model:
        problems.append(f"model {old.get('model')!r} -> {model!r}")
    for k, v in asdict(sampling).items():
        if k in old_sampling and old_sampling[k] != v:
            problems.append(f"{k} {old_sampling[k]!r} -> {v!r}")
    if old.get("source", {}).get("sha256") not in (None, source_sha):
        problems.append("the source data changed (different SHA-256)")
    if problems:
        raise Eagle3InputError(f"{manifest_path.parent} holds a run with other settings ({'; '.join(problems)}); "
                               f"use another --out, the same settings to resume, or --overwrite to start over")


def _count_source(source: str | Path, limit: int | None, skip_bad_records: bool) -> tuple[int, str]:
    from eagle3_train.assets.conversations import load_conversations

    it, info = load_conversations(source, limit, skip_bad_records=skip_bad_records)
    n = sum(1 for _ in it)
    return n, info.sha256


def regenerate(source: str | Path, out_dir: str | Path, endpoints: list[str], model: str | None, *,
               limit: int | None = _D.limit, concurrency: int | None = _D.concurrency,
               max_tokens: int | None = _D.max_tokens,
               temperature: float = _D.temperature, top_p: float = _D.top_p, seed: int | None = _D.seed,
               reasoning: str = _D.reasoning, timeout_s: float = _D.timeout_s, max_retries: int = _D.max_retries,
               api_key: str | None = _D.api_key, overwrite: bool = _D.overwrite,
               extra_manifest: dict | None = None, skip_bad_records: bool = _D.skip_bad_records,
               truncated_turns: str = _D.truncated_turns, thinking_style: str = _D.thinking_style,
               estimate_only: bool = _D.estimate_only) -> dict:
    """Regenerate the assistant turns of `source` (see the module docstring); returns the manifest.

    `api_key` None: $OPENAI_API_KEY, else "EMPTY" (what vLLM accepts without --api-key). `skip_bad_records`: skip
    (and count in the manifest) source records that are not valid JSON/UTF-8 or not conversations, instead of
    stopping at the first. `max_tokens` None: derived from the thinking style and the server (`default_max_tokens`).
    `estimate_only`: stop after the first wave of conversations with the measured ETA in the manifest."""
    api_key = api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")
    if reasoning not in REASONING_MODES:
        raise Eagle3InputError(f"reasoning must be one of {REASONING_MODES}, got {reasoning!r}")
    if truncated_turns not in ("keep", "drop"):
        raise Eagle3InputError(f"truncated_turns must be keep or drop, got {truncated_turns!r}")
    if concurrency is not None:
        check_at_least("concurrency", concurrency, 1)
    if not endpoints:
        raise Eagle3InputError("no endpoint: pass --endpoint URL (repeatable) or --serve-verifier NAME")
    sampling = Sampling(max_tokens=max_tokens or 0, temperature=temperature, top_p=top_p, seed=seed,
                        reasoning=reasoning, truncated_turns=truncated_turns)
    run = _Run(concurrency, timeout_s, max_retries, api_key, overwrite, extra_manifest or {}, skip_bad_records,
               thinking_style, estimate_only)
    return asyncio.run(_regenerate(source, Path(out_dir), endpoints, model, limit, sampling, run))


@dataclass
class _Run:
    """How this invocation runs (none of it changes the text generated)."""
    concurrency: int | None  # None: from the servers (`_concurrency`)
    timeout_s: float
    max_retries: int
    api_key: str
    overwrite: bool
    extra_manifest: dict
    skip_bad_records: bool
    thinking_style: str
    estimate_only: bool


PROMPT_TOKENS_GUESS = 1024  # a request's prompt, for sizing concurrency by the KV cache
MAX_IN_FLIGHT_PER_SERVER = 256  # vLLM's usual max_num_seqs: more would only queue


async def _concurrency(pool: ChatPool, run: _Run, max_tokens: int) -> dict[str, Any]:
    """Set `run.concurrency` when unset: per endpoint, the requests its KV cache holds at `max_tokens` new tokens
    (vLLM's `cache_config_info`), at most MAX_IN_FLIGHT_PER_SERVER; CONCURRENCY for one that does not say."""
    if run.concurrency is not None:
        return {"setting": run.concurrency}
    from eagle3_train.serving.metrics import fetch_metrics, kv_cache_tokens, parse_prometheus
    from eagle3_train.settings import CONCURRENCY

    per: dict[str, Any] = {}
    for ep in pool.endpoints:
        try:
            tokens = kv_cache_tokens(parse_prometheus(await asyncio.to_thread(fetch_metrics, ep.url, 10.0)))
        except (Eagle3InputError, ValueError):
            tokens = None
        n = CONCURRENCY if tokens is None else max(1, min(MAX_IN_FLIGHT_PER_SERVER,
                                                          tokens // (max_tokens + PROMPT_TOKENS_GUESS)))
        per[ep.url] = {"kv_cache_tokens": tokens, "in_flight": n}
    run.concurrency = sum(p["in_flight"] for p in per.values())
    log.info("generate: %d conversations in flight (%s)", run.concurrency,
             ", ".join(f"{u}: {p['in_flight']}" + (f" of {p['kv_cache_tokens']} KV tokens" if p["kv_cache_tokens"]
                                                    else " (no KV size reported)") for u, p in per.items()))
    return {"endpoints": per}


def _thinking(pool: ChatPool, model: str, sampling: Sampling, setting: str) -> tuple[ThinkingStyle, dict]:
    """Resolve the thinking style and (when unset) max_tokens in `sampling`; the manifest's `thinking` record."""
    card = pool.model_card
    try:
        style, found_by = resolve_style(setting, model, card.get("root"))
    except ValueError as e:
        raise Eagle3InputError(str(e)) from None
    sampling.thinking_style = style.name
    why = "setting"
    if not sampling.max_tokens:
        sampling.max_tokens, why = default_max_tokens(style, sampling.reasoning, card.get("max_model_len"))
    recommended = style.recommended(sampling.reasoning)
    if recommended and (sampling.temperature, sampling.top_p) != (recommended.temperature, recommended.top_p):
        log.warning("generate: sampling at temperature %s, top_p %s; %s is served at temperature %s, top_p %s "
                    "(%s): drafts should learn what the model says when served", sampling.temperature,
                    sampling.top_p, style.name, recommended.temperature, recommended.top_p, style.source)
    return style, {"style": style.name, "found_by": found_by, "request_extra": style.request_extra(sampling.reasoning),
                   "recommended_sampling": recommended.to_dict() if recommended else None,
                   "max_tokens": sampling.max_tokens, "max_tokens_from": why,
                   "server_max_model_len": card.get("max_model_len")}


async def _resolve_model(pool: ChatPool) -> str:
    try:
        return await pool.only_model()
    except (EndpointUnavailable, FatalRequestError) as e:
        raise Eagle3InputError(f"{e} (or pass --model)") from None


class _Files(typing.NamedTuple):
    conversations: Path
    skipped: Path
    manifest: Path


OUTPUT = ("generate", "generate output directory")


def _written_by_generate(path: Path) -> bool:
    """From before output markers: an earlier generate output, or only the log of the server started for it."""
    return stage_manifest("generate")(path) or {f.name for f in path.iterdir()} <= {SERVER_LOG}


def claim_generate_output(out_dir: str | Path) -> Path:
    """Claim `out_dir` for generate; called before a server started for it writes its log there."""
    return claim_output_dir(out_dir, *OUTPUT, _written_by_generate,
                            writes=(OUTPUT_FILE, SKIPPED_FILE, MANIFEST_FILE, SERVER_LOG))


def _files(out_dir: Path) -> _Files:
    return _Files(out_dir / OUTPUT_FILE, out_dir / SKIPPED_FILE, out_dir / MANIFEST_FILE)


async def _served_model(pool: ChatPool, model: str | None) -> str:
    """The model to ask for (the only one served when not named), checked against the endpoints."""
    if not model:
        pool.model = model = await _resolve_model(pool)
    try:
        await pool.check_model()
    except (FatalRequestError, EndpointUnavailable) as e:
        raise Eagle3InputError(str(e)) from None
    return model


@dataclass
class _Resume:
    total: int  # conversations in the source (after `limit`)
    source_sha: str
    seen: set[str]  # ids already done or skipped by earlier runs
    torn_bytes: int  # removed from torn last lines


def _resume_point(files: _Files, source: str | Path, limit: int | None, skip_bad_records: bool, overwrite: bool,
                  model: str, sampling: Sampling) -> _Resume:
    """Start over (`overwrite`) or check that the earlier run had the same settings, and read what it finished."""
    total, source_sha = _count_source(source, limit, skip_bad_records)
    if overwrite:
        for p in files:
            p.unlink(missing_ok=True)
    _check_resume(files.manifest, model, sampling, source_sha)
    done_records, cut = recover_jsonl(files.conversations, ids_only=True)
    skipped_records, cut2 = recover_jsonl(files.skipped, "skipped", ids_only=True)
    seen = {r["id"] for r in done_records} | {r["id"] for r in skipped_records}
    return _Resume(total, source_sha, seen, cut + cut2)


@dataclass
class _Report:
    """What the manifest says at any point of the run (`info` and `stats` fill in as conversations are read)."""
    files: _Files
    pool: ChatPool
    settings: dict[str, Any]  # model, endpoints, sampling, ... in manifest order
    info: SourceInfo  # bad records are counted while the conversations are read
    resume: _Resume
    extra: dict[str, Any]
    stats: _Stats = field(default_factory=_Stats)
    started: str = field(default_factory=now_iso)
    t0: float = field(default_factory=time.monotonic)
    eta: dict[str, Any] | None = None  # measured after the first wave of conversations

    def remaining(self) -> int:
        """Conversations of the source not yet done or skipped (by earlier runs or this one)."""
        return max(0, self.resume.total - len(self.resume.seen) - self.stats.handled)

    def estimate(self) -> None:
        """The ETA of the rest of the run from the rate since the start (logged once), taken when the first wave of
        conversations (one per request in flight) is done. It runs long: the first wave also warms the server, and
        its slowest conversation sets its time (benchmarks/generate_eta.py: the rest took 0.70x the ETA; measured
        after two waves the ETA came out 28% short instead, the second wave's slow conversations still in flight)."""
        now = time.monotonic()
        wall = now - self.t0
        finished = self.stats.handled
        rate = finished / wall if wall > 0 else 0.0
        left = self.remaining()
        self.eta = {"measured_conversations": finished, "measured_s": round(wall, 1),
                    "conversations_per_s": round(rate, 4),
                    "completion_tokens_per_s": round(self.stats.completion_tokens / wall, 1) if wall > 0 else None,
                    "remaining_conversations": left, "estimated_remaining_s": round(left / rate, 1) if rate else None,
                    "estimated_total_s": round(wall + left / rate, 1) if rate else None}
        log.info("generate: first %d conversations in %.1f s (%.1f completion tokens/s): ETA %s for the %d left",
                 finished, wall, self.eta["completion_tokens_per_s"] or 0, _hours(self.eta["estimated_remaining_s"]),
                 left)

    def manifest(self, status: str) -> dict:
        done, skipped = _file_counts(self.files.conversations, self.files.skipped)
        wall = time.monotonic() - self.t0
        stats, total = self.stats, self.resume.total
        return {
            "stage": "generate", "status": status, **self.settings,
            "source": {**self.info.to_dict(), "sha256": self.resume.source_sha},
            "counts": {"source_conversations": total, "done": done["done"], "truncated": done["truncated"],
                       "cut_at_max_tokens_kept": done["cut_at_max_tokens"],
                       "skipped": skipped, "bad_records": dict(sorted(self.info.bad_records.items())),
                       "remaining": max(0, total - done["done"] - sum(skipped.values()))},
            "files": {"conversations": OUTPUT_FILE, "skipped": SKIPPED_FILE},
            "eta": self.eta,
            "this_run": {"started": self.started, "wall_s": round(wall, 2), "requests": stats.requests,
                         "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
                         "reasoning_tokens_est": round(stats.reasoning_tokens),
                         "answer_tokens_est": round(stats.answer_tokens), "cut_turns": stats.cut_turns,
                         "tool_call_turns_kept": stats.tool_call_turns_kept,
                         "requests_per_s": round(stats.requests / wall, 3) if wall > 0 else None,
                         "completion_tokens_per_s": round(stats.completion_tokens / wall, 2) if wall > 0 else None,
                         "retries": self.pool.retries, "torn_bytes_removed": self.resume.torn_bytes},
            "updated": now_iso(), "environment": environment(), **self.extra,
        }


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


async def _run_recorded(report: _Report, conversations: Any, sampling: Sampling, run: _Run,
                        style: ThinkingStyle) -> dict:
    """Regenerate what is left, appending to the output files; the manifest is written before and after (also when
    the run fails or is interrupted). Returns the final manifest."""
    files = report.files
    write_json(files.manifest, report.manifest("running"))
    out_log, skip_log = AppendLog(files.conversations), AppendLog(files.skipped)
    bar = progress(total=report.resume.total, desc="generate", unit="conv", initial=len(report.resume.seen))
    status = "failed"
    try:
        await _work(report, conversations, sampling, run, style, out_log, skip_log, bar)
        status = "estimated" if run.estimate_only and report.remaining() > 0 else "complete"
    except asyncio.CancelledError:
        status = "interrupted"
        raise
    except (FatalRequestError, EndpointUnavailable) as e:
        raise Eagle3InputError(f"{e}\nConversations finished so far are kept in {files.conversations}; "
                               f"rerun the same command to resume.") from None
    finally:
        bar.close()
        out_log.close()
        skip_log.close()
        final = report.manifest(status)
        write_json(files.manifest, final)
    return final


async def _regenerate(source: str | Path, out_dir: Path, endpoints: list[str], model: str | None,
                      limit: int | None, sampling: Sampling, run: _Run) -> dict:
    out_dir = claim_generate_output(out_dir)
    with output_lock(out_dir, OUTPUT[1]):  # one writer: two would interleave their records
        return await _regenerate_locked(source, _files(out_dir), endpoints, model, limit, sampling, run)


async def _regenerate_locked(source: str | Path, files: _Files, endpoints: list[str], model: str | None,
                             limit: int | None, sampling: Sampling, run: _Run) -> dict:
    from eagle3_train.assets.conversations import load_conversations

    pool = ChatPool(endpoints, model or "", api_key=run.api_key, timeout_s=run.timeout_s,
                    max_retries=run.max_retries)
    try:
        model = await _served_model(pool, model)
        style, thinking = _thinking(pool, model, sampling, run.thinking_style)
        concurrency_from = await _concurrency(pool, run, sampling.max_tokens)
        resume = _resume_point(files, source, limit, run.skip_bad_records, run.overwrite, model, sampling)
        conversations, info = load_conversations(source, limit, skip_bad_records=run.skip_bad_records)
        settings = {"model": model, "endpoints": endpoints, "sampling": asdict(sampling), "thinking": thinking,
                    "concurrency": run.concurrency, "concurrency_from": concurrency_from, "timeout_s": run.timeout_s,
                    "max_retries": run.max_retries,
                    "limit": limit}
        final = await _run_recorded(_Report(files, pool, settings, info, resume, run.extra_manifest), conversations,
                                    sampling, run, style)
        log.info("generate: %d conversations done, %d skipped, %d turns cut at max_tokens, %.2f requests/s, "
                 "%.1f tokens/s -> %s", final["counts"]["done"], sum(final["counts"]["skipped"].values()),
                 final["this_run"]["cut_turns"], final["this_run"]["requests_per_s"] or 0,
                 final["this_run"]["completion_tokens_per_s"] or 0, files.conversations)
        return final
    finally:
        await pool.aclose()


def _file_counts(out_path: Path, skip_path: Path) -> tuple[dict[str, int], dict[str, int]]:
    done, truncated, cut = 0, 0, 0
    if out_path.exists():
        with open(out_path, "rb") as f:
            for line in f:
                if line.strip():
                    done += 1
                    truncated += b'"truncated"' in line
                    cut += b'"truncated": "max_tokens"' in line
    skipped: Counter[str] = Counter()
    if skip_path.exists():
        for line in skip_path.read_bytes().splitlines():  # small: one short line per skipped conversation
            try:
                skipped[json.loads(line)["reason"]] += 1
            except (json.JSONDecodeError, KeyError):
                continue
    return {"done": done, "truncated": truncated, "cut_at_max_tokens": cut}, dict(sorted(skipped.items()))


# A server whose replies we cannot read is broken, not a source of a few bad samples: past this many (and half of the
# conversations handled) the run stops, resumable, instead of skipping the whole data set.
MALFORMED_STOP = 8


def _stop_on_malformed_replies(stats: Any, url: str) -> None:
    bad = {k: v for k, v in stats.skipped.items() if k.startswith("reply_")}
    if sum(bad.values()) >= MALFORMED_STOP and 2 * sum(bad.values()) > stats.handled:
        raise Eagle3InputError(f"{url} answered {sum(bad.values())} of {stats.handled} conversations with replies "
                               f"that are not OpenAI chat completions ({bad}; the details are in skipped.jsonl): "
                               f"check the endpoint, then rerun the same command (finished conversations are kept)")


async def _work(report: _Report, conversations: Any, sampling: Sampling, run: _Run, style: ThinkingStyle,
                out_log: AppendLog, skip_log: AppendLog, bar: Any) -> None:
    """`run.concurrency` workers share one iterator of conversations. After the first wave (one conversation per
    worker) the rate so far gives the ETA of the rest (logged, in the manifest); `estimate_only` stops there."""
    stats, skip = report.stats, report.resume.seen
    wave = min(run.concurrency, report.remaining())
    stop = asyncio.Event()

    async def worker() -> None:
        for conv in conversations:
            if stop.is_set():
                return
            if conv.id in skip:
                continue
            record, skipped = await regenerate_conversation(report.pool, conv.id, conv.messages, sampling, stats,
                                                            style, conv.tools)
            if record is not None:
                out_log.append(record)
                stats.finished += 1
                stats.truncated += "truncated" in record
            else:
                skip_log.append(skipped)
                stats.skipped[skipped["reason"]] += 1
                _stop_on_malformed_replies(stats, report.pool.endpoints[0].url)
            wall = max(time.monotonic() - report.t0, 1e-9)
            thought = stats.reasoning_tokens / max(stats.reasoning_tokens + stats.answer_tokens, 1e-9)
            bar.set_postfix(req_s=f"{stats.requests / wall:.2f}", tok_s=f"{stats.completion_tokens / wall:.1f}",
                            think=f"{thought:.0%}", cut=stats.cut_turns, skipped=sum(stats.skipped.values()),
                            refresh=False)
            bar.update(1)
            if report.eta is None and stats.handled >= wave:
                report.estimate()
                if run.estimate_only:
                    stop.set()

    tasks = [asyncio.create_task(worker()) for _ in range(run.concurrency)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- CLI ------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, GenerateSettings)


def main(args: argparse.Namespace) -> int:
    quiet_http_logs()
    s = settings_from_args(GenerateSettings, args)
    endpoints = list(s.endpoint)
    kwargs = dict(limit=s.limit, concurrency=s.concurrency, max_tokens=s.max_tokens, temperature=s.temperature,
                  top_p=s.top_p, seed=s.seed, reasoning=s.reasoning, timeout_s=s.timeout_s,
                  max_retries=s.max_retries, api_key=s.api_key, overwrite=s.overwrite,
                  skip_bad_records=s.skip_bad_records, truncated_turns=s.truncated_turns,
                  thinking_style=s.thinking_style, estimate_only=s.estimate_only)
    if not s.serve_verifier:
        regenerate(s.data, s.out, endpoints, s.model, **kwargs)
        return 0
    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.serving.vllm_server import VLLMServer, vllm_available

    ok, msg = vllm_available()
    if not ok:
        raise Eagle3InputError(f"--serve-verifier needs vLLM: {msg}")
    name = s.model or Path(str(s.serve_verifier)).name
    verifier_dir = resolve_verifier(s.serve_verifier)
    server = VLLMServer(verifier_dir, served_model_name=name,
                        max_model_len=s.max_model_len, enforce_eager=s.serve_enforce_eager, vllm_args=s.vllm_args,
                        log_path=claim_generate_output(s.out) / SERVER_LOG,
                        extra_args=tool_server_args(s.data, name, verifier_dir, s.thinking_style, s.limit,
                                                    s.skip_bad_records))
    with server:
        regenerate(s.data, s.out, endpoints + [server.base_url], name,
                   extra_manifest={"embedded_server": {"verifier": str(s.serve_verifier),
                                                       "startup_s": round(server.startup_s or 0, 1)}}, **kwargs)
    return 0
