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
import logging
import os
import time
import typing
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3_train.assets.data_spec import DataSource
from eagle3_train.assets.thinking import ThinkingStyle
from eagle3_train.generate.conversation import regenerate_conversation, tool_server_args
from eagle3_train.generate.journal import AppendLog
from eagle3_train.generate.report import Report
from eagle3_train.generate.resume import OUTPUT, SERVER_LOG, Files, claim_generate_output, output_files, resume_point
from eagle3_train.generate.run_settings import Run, Sampling, resolve_concurrency, resolve_thinking, served_model
from eagle3_train.serving.client import ChatPool, EndpointUnavailable, FatalRequestError, quiet_http_logs
from eagle3_train.settings import GenerateSettings, Reasoning
from eagle3_train.utils.io import Eagle3InputError, check_at_least, write_json
from eagle3_train.utils.outputs import output_lock
from eagle3_train.utils.progress import progress
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

log = logging.getLogger(__name__)
REASONING_MODES = typing.get_args(Reasoning)


_D = GenerateSettings  # keyword defaults below are the settings dataclass's


def regenerate(source: DataSource, out_dir: str | Path, endpoints: list[str], model: str | None, *,
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
    run = Run(concurrency, timeout_s, max_retries, api_key, overwrite, extra_manifest or {}, skip_bad_records,
              thinking_style, estimate_only)
    return asyncio.run(_regenerate(source, Path(out_dir), endpoints, model, limit, sampling, run))


async def _run_recorded(report: Report, conversations: Any, sampling: Sampling, run: Run,
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


async def _regenerate(source: DataSource, out_dir: Path, endpoints: list[str], model: str | None,
                      limit: int | None, sampling: Sampling, run: Run) -> dict:
    out_dir = claim_generate_output(out_dir)
    with output_lock(out_dir, OUTPUT[1]):  # one writer: two would interleave their records
        return await _regenerate_locked(source, output_files(out_dir), endpoints, model, limit, sampling, run)


async def _regenerate_locked(source: DataSource, files: Files, endpoints: list[str], model: str | None,
                             limit: int | None, sampling: Sampling, run: Run) -> dict:
    from eagle3_train.assets.conversations import load_conversations

    pool = ChatPool(endpoints, model or "", api_key=run.api_key, timeout_s=run.timeout_s,
                    max_retries=run.max_retries)
    try:
        model = await served_model(pool, model)
        style, thinking = resolve_thinking(pool, model, sampling, run.thinking_style)
        concurrency_from = await resolve_concurrency(pool, run, sampling.max_tokens)
        resume = resume_point(files, source, limit, run.skip_bad_records, run.overwrite, model, sampling)
        conversations, info = load_conversations(source, limit, skip_bad_records=run.skip_bad_records)
        settings = {"model": model, "endpoints": endpoints, "sampling": asdict(sampling), "thinking": thinking,
                    "concurrency": run.concurrency, "concurrency_from": concurrency_from, "timeout_s": run.timeout_s,
                    "max_retries": run.max_retries,
                    "limit": limit}
        final = await _run_recorded(Report(files, pool, settings, info, resume, run.extra_manifest), conversations,
                                    sampling, run, style)
        log.info("generate: %d conversations done, %d skipped, %d turns cut at max_tokens, %.2f requests/s, "
                 "%.1f tokens/s -> %s", final["counts"]["done"], sum(final["counts"]["skipped"].values()),
                 final["this_run"]["cut_turns"], final["this_run"]["requests_per_s"] or 0,
                 final["this_run"]["completion_tokens_per_s"] or 0, files.conversations)
        return final
    finally:
        await pool.aclose()


# A server whose replies we cannot read is broken, not a source of a few bad samples: past this many (and half of the
# conversations handled) the run stops, resumable, instead of skipping the whole data set.
MALFORMED_STOP = 8


def _stop_on_malformed_replies(stats: Any, url: str) -> None:
    bad = {k: v for k, v in stats.skipped.items() if k.startswith("reply_")}
    if sum(bad.values()) >= MALFORMED_STOP and 2 * sum(bad.values()) > stats.handled:
        raise Eagle3InputError(f"{url} answered {sum(bad.values())} of {stats.handled} conversations with replies "
                               f"that are not OpenAI chat completions ({bad}; the details are in skipped.jsonl): "
                               f"check the endpoint, then rerun the same command (finished conversations are kept)")


async def _work(report: Report, conversations: Any, sampling: Sampling, run: Run, style: ThinkingStyle,
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
    # keys of the run config's generate section that only `eagle3-train run` reads: accepted by --set (they are
    # settings of this dataclass), they would be ignored here without a word
    run_only = [k for k in ("enabled", "allow_fallback", "original_answers")
                if getattr(s, k) != getattr(GenerateSettings(), k)]
    if run_only:
        raise Eagle3InputError(f"--set {', '.join(run_only)}: a key of `eagle3-train run`'s generate section, which "
                               f"the generate command does not read (use `eagle3-train run`)")
    data = s.data
    if s.max_turns:  # the first N user turns of each conversation, as the run's generate stage cuts them
        from eagle3_train.generate.first_turns import cut_turns_cached

        data = str(cut_turns_cached(s.data, s.limit, s.max_turns, s.skip_bad_records))
    endpoints = list(s.endpoint)
    kwargs = dict(limit=s.limit, concurrency=s.concurrency, max_tokens=s.max_tokens, temperature=s.temperature,
                  top_p=s.top_p, seed=s.seed, reasoning=s.reasoning, timeout_s=s.timeout_s,
                  max_retries=s.max_retries, api_key=s.api_key, overwrite=s.overwrite,
                  skip_bad_records=s.skip_bad_records, truncated_turns=s.truncated_turns,
                  thinking_style=s.thinking_style, estimate_only=s.estimate_only)
    if not s.serve_verifier:
        regenerate(data, s.out, endpoints, s.model, **kwargs)
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
                        extra_args=tool_server_args(data, name, verifier_dir, s.thinking_style, s.limit,
                                                    s.skip_bad_records))
    with server:
        regenerate(data, s.out, endpoints + [server.base_url], name,
                   extra_manifest={"embedded_server": {"verifier": str(s.serve_verifier),
                                                       "startup_s": round(server.startup_s or 0, 1)}}, **kwargs)
    return 0
