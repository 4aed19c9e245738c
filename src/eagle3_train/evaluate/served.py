"""Served evaluation: the acceptance length a draft really reaches in a running vLLM server.

Sends the prompts as chat completions (temperature 0 by default, bounded concurrency; MT-bench's second turn follows
the model's own first answer), reads vLLM's Prometheus counters at `/metrics` before and after, and derives
mean acceptance length = 1 + accepted / drafts and per-position acceptance = accepted_at_pos[i] / drafts.
At temperature 0 acceptance is the argmax match; above 0 vLLM verifies by rejection sampling (requests seeded).
With a baseline server (same verifier, no draft) it also measures the speed-up and, at temperature 0, compares the
greedy outputs, which must be identical: speculative decoding must not change what the verifier generates.

Python API: `evaluate_served(base_url or [urls], model, prompts, ...) -> dict` (with `completions`);
`add_served_arguments(parser)` / `run_served(ServedEvalSettings)` for the `evaluate` CLI's served mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from eagle3_train.evaluate.prompts import EvalPrompt, load_prompts
from eagle3_train.evaluate.report import REPORT_FILES
from eagle3_train.evaluate.served_regions import THINK_END, measure_regions, think_end_id
from eagle3_train.serving.client import (
    ChatPool,
    ContextTooLongError,
    EndpointUnavailable,
    FatalRequestError,
    RequestRejected,
    quiet_http_logs,
)
from eagle3_train.serving.metrics import servers_counters
from eagle3_train.settings import GenerateSettings, ServedEvalSettings
from eagle3_train.utils.io import Eagle3InputError, check_at_least, write_json
from eagle3_train.utils.outputs import claim_output_dir, claimed_output, has_file, json_says
from eagle3_train.utils.progress import progress
from eagle3_train.utils.settings import add_settings_arguments

log = logging.getLogger(__name__)


def request_seed(seed: int, prompt: int, turn: int) -> int:
    """A distinct seed per request (recorded with the results). vLLM 0.32 on CPU does not repeat seeded sampled
    outputs exactly under speculative decoding (measured), so sampled acceptance is compared over many prompts."""
    return (seed * 1_000_003 + prompt * 16 + turn) % 2**31


async def _run_prompts(base_urls: list[str], model: str, prompts: list[EvalPrompt], max_tokens: int,
                       concurrency: int, api_key: str, timeout_s: float, desc: str, temperature: float = 0.0,
                       seed: int = 0) -> tuple[list[dict], float]:
    pool = ChatPool(base_urls, model, api_key=api_key, timeout_s=timeout_s)
    results: list[dict | None] = [None] * len(prompts)
    sem = asyncio.Semaphore(concurrency)
    bar = progress(total=len(prompts), desc=desc, unit="prompt")

    async def one(i: int, p: EvalPrompt) -> None:
        async with sem:
            messages: list[dict[str, str]] = []
            rec: dict[str, Any] = {"id": p.id, "benchmark": p.benchmark, "turns": p.turns, "outputs": [],
                                   "finish_reasons": [], "completion_tokens": []}
            for t, turn in enumerate(p.turns):
                messages.append({"role": "user", "content": turn})
                try:
                    reply = await pool.chat(messages, max_tokens=max_tokens, temperature=temperature,
                                            seed=request_seed(seed, i, t) if temperature > 0 else None)
                except (ContextTooLongError, RequestRejected) as e:
                    rec["error"] = str(e)[:300]
                    break
                messages.append({"role": "assistant", "content": reply.content})
                rec["outputs"].append(reply.content)
                rec["finish_reasons"].append(reply.finish_reason)
                rec["completion_tokens"].append(int(reply.usage.get("completion_tokens", 0)))
            results[i] = rec
            bar.update(1)

    try:
        await pool.check_model()
        t0 = time.monotonic()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.monotonic() - t0
    finally:
        bar.close()
        await pool.aclose()
    return [r for r in results if r is not None], wall


def _throughput(completions: list[dict], wall: float) -> dict[str, Any]:
    tokens = sum(sum(c["completion_tokens"]) for c in completions)
    requests = sum(len(c["outputs"]) for c in completions)
    return {"requests": requests, "generated_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
            "requests_per_s": round(requests / wall, 3) if wall > 0 else None,
            "errors": sum("error" in c for c in completions)}


def _measure(base_urls: list[str], model: str, prompts: list[EvalPrompt], max_tokens: int, concurrency: int,
             api_key: str, timeout_s: float, desc: str, temperature: float = 0.0,
             seed: int = 0) -> tuple[dict, list[dict]]:
    before = servers_counters(base_urls)
    completions, wall = asyncio.run(_run_prompts(base_urls, model, prompts, max_tokens, concurrency, api_key,
                                                 timeout_s, desc, temperature, seed))
    after = servers_counters(base_urls)
    stats = {"endpoint": base_urls[0] if len(base_urls) == 1 else base_urls, "model": model,
             **_throughput(completions, wall)}
    diff = after.since(before)
    stats["speculative"] = diff.present
    stats["spec_decode_metric_names"] = diff.metric_names
    stats["acceptance"] = diff.summary() if diff.present else None
    return stats, completions


def evaluate_served(base_url: str | list[str], model: str, prompts: list[EvalPrompt],
                    max_tokens: int = ServedEvalSettings.max_tokens, concurrency: int = ServedEvalSettings.concurrency,
                    baseline_url: str | None = None, baseline_model: str | None = None, api_key: str = "EMPTY",
                    timeout_s: float = GenerateSettings.timeout_s, temperature: float = ServedEvalSettings.temperature,
                    seed: int = ServedEvalSettings.seed,
                    reasoning_split: bool | str = ServedEvalSettings.reasoning_split) -> dict[str, Any]:
    """Acceptance and throughput of a speculative vLLM server (and optionally of a baseline without a draft).

    `base_url` may list several servers of the same verifier + draft: the prompts are spread over them and their
    counters summed.
    The counters are server-wide: run nothing else against the server meanwhile. The baseline is measured after
    the speculative run, not at the same time, so the two do not share the CPU/GPU.
    Returns a dict with `acceptance` (None when the server has no spec-decode counters; with `by_region` for a
    thinking model, see `served_regions`), throughput, `baseline`, `speedup`, `greedy_identical` (temperature 0
    only), and the texts in `completions` / `baseline_completions`.
    """
    if not prompts:
        raise Eagle3InputError("no prompts to evaluate")
    check_at_least("concurrency", concurrency, 1)
    check_at_least("temperature", temperature, 0)
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    sampling = (temperature, seed)
    end_id = _think_end(urls, model, reasoning_split, api_key)
    stats, completions = _measure(urls, model, prompts, max_tokens, concurrency, api_key, timeout_s, "served",
                                  *sampling)
    if not stats["speculative"]:
        log.warning("%s exposes no vllm:spec_decode_* counters: is it started with a draft?", ", ".join(urls))
    result: dict[str, Any] = {"mode": "served", "n_prompts": len(prompts), "max_tokens": max_tokens,
                              "concurrency": concurrency, "temperature": temperature,
                              **({"seed": seed} if temperature > 0 else {}),
                              "benchmarks": sorted({p.benchmark for p in prompts}), **stats}
    if result["acceptance"]:
        a = result["acceptance"]
        log.info("mean acceptance length %.3f, per position %s", a["mean_acceptance_length"] or 0,
                 [round(x, 3) for x in a["per_position_acceptance"] or []])
        if end_id is not None:  # each region by a pass of its own, on the first turns
            seeds = [request_seed(seed, i, 0) if temperature > 0 else None for i in range(len(prompts))]
            split = measure_regions(urls, model, [[{"role": "user", "content": p.turns[0]}] for p in prompts], seeds,
                                    end_id, max_tokens=max_tokens, concurrency=concurrency, temperature=temperature,
                                    api_key=api_key, timeout_s=timeout_s)
            a["by_region"] = split.pop("by_region")
            a["region_split"] = split
    result["completions"] = completions
    if baseline_url:
        base_stats, base_completions = _measure([baseline_url], baseline_model or model, prompts, max_tokens,
                                                concurrency, api_key, timeout_s, "baseline", *sampling)
        base_stats.pop("acceptance", None)
        result["baseline"] = base_stats
        if stats["tokens_per_s"] and base_stats["tokens_per_s"]:
            result["speedup"] = round(stats["tokens_per_s"] / base_stats["tokens_per_s"], 4)
        result["greedy_identical"] = greedy_identical(completions, base_completions, temperature)
        result["baseline_completions"] = base_completions
    return result


def _think_end(urls: list[str], model: str, split: bool | str, api_key: str) -> int | None:
    """The `</think>` id when acceptance is measured by region (`served_regions`): None when not asked for, or
    (`auto`) when the served tokenizer has no one-token `</think>` or the server no /tokenize. Asked before any
    prompt is sent, so `reasoning_split: true` on a model that does not think costs nothing."""
    if split is False:
        return None
    try:
        end_id = think_end_id(urls[0], model, api_key)
    except Eagle3InputError as e:
        if split is True:
            raise
        log.warning("no reasoning split: %s", e)  # auto: a server without vLLM's /tokenize is judged whole
        return None
    if end_id is None and split is True:
        raise Eagle3InputError(f"reasoning_split: {THINK_END!r} is not one token of {model}'s tokenizer, so its "
                               f"replies have no reasoning to measure apart (set reasoning_split: auto or false)")
    return end_id


def acceptance_of(result: dict[str, Any]) -> dict[str, Any]:
    """What one temperature's pass measured: acceptance (mean length, per position, by region for a thinking model)
    and throughput."""
    acc = result.get("acceptance") or {}
    return {"mean_acceptance_length": acc.get("mean_acceptance_length"),
            "per_position_acceptance": acc.get("per_position_acceptance"), "num_drafts": acc.get("num_drafts"),
            **{key: acc[key] for key in ("by_region", "region_split") if acc.get(key)},
            "generated_tokens": result.get("generated_tokens"), "tokens_per_s": result.get("tokens_per_s")}


def add_temperatures(result: dict[str, Any], base_url: str | list[str], model: str, prompts: list[EvalPrompt],
                     temperatures: list[float], **kwargs: Any) -> None:
    """`result["at_temperature"]`: the acceptance `result` measured, then again at each of `temperatures` on the same
    server and prompts (a thinking model is served sampled: its draft is judged there too; the draft server alone,
    since outputs are compared with a baseline at temperature 0 only)."""
    result["at_temperature"] = {str(result["temperature"]): acceptance_of(result)}
    for t in temperatures:
        result["at_temperature"][str(t)] = acceptance_of(evaluate_served(base_url, model, prompts, temperature=t,
                                                                          **kwargs))


def greedy_identical(completions: list[dict], base_completions: list[dict], temperature: float) -> dict | None:
    """At temperature 0 speculative decoding must reproduce the verifier's own outputs; sampled outputs may differ
    (None: not compared)."""
    if temperature > 0:
        return None
    differing = [a["id"] for a, b in zip(completions, base_completions) if a["outputs"] != b["outputs"]]
    return {"identical": len(completions) - len(differing), "compared": len(completions), "differing_ids": differing}


# --- CLI wiring for `eagle3-train evaluate` (served mode) -----------------------------------------------------
def add_served_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, ServedEvalSettings)


def _served_model(base_url: str) -> str:
    """The one model `base_url` serves (the client's own lookup, as generate makes it)."""
    async def only() -> str:
        pool = ChatPool([base_url], "")
        try:
            return await pool.only_model()
        finally:
            await pool.aclose()

    try:
        return asyncio.run(only())
    except (EndpointUnavailable, FatalRequestError) as e:
        raise Eagle3InputError(str(e)) from None


_OUTPUT = ("evaluate", "evaluation output directory")
_WRITES = (*REPORT_FILES, "served_completions.jsonl", "vllm-draft.log", "vllm-baseline.log")


def _served_results(path: Path) -> bool:
    """A served evaluation's directory from before output markers."""
    return json_says("results.json", "mode", "served")(path) or has_file(
        "served_completions.jsonl", "vllm-draft.log", "vllm-baseline.log")(path)


def run_served(s: ServedEvalSettings) -> dict[str, Any]:
    quiet_http_logs()
    if not s.out:
        return _run_served(s)
    s.out = str(claim_output_dir(s.out, *_OUTPUT, _served_results, writes=_WRITES))  # before any server starts
    with claimed_output(s.out, *_OUTPUT, _served_results, writes=_WRITES):  # held while servers log and results land
        return _run_served(s)


def _trained_dtype_note(draft: str | None, served: str) -> dict[str, Any] | None:
    """When the draft's teacher (the verifier run by extract) ran in another dtype than this server runs the
    verifier in, the draft is judged against states a little unlike those it learned (bf16 against fp32 moves the
    verifier's top-1 on ~1.6% of tokens): say so instead of leaving it silent."""
    from eagle3_train.checkpoints.native import read_metadata

    trained = ((read_metadata(draft) or {}).get("data") or {}).get("hidden_states_compute_dtype") if draft else None
    if trained is None or trained == served:
        return None
    note = (f"the draft was trained on verifier states computed in {trained}, this server runs the verifier in "
            f"{served}; extract with --compute-dtype {served} (or serve with --server-dtype {trained}) to judge it on "
            f"the states it learned")
    log.warning("served evaluation: %s", note)
    return {"trained_on": trained, "served": served, "note": note}


def _run_served(s: ServedEvalSettings) -> dict[str, Any]:
    prompts = load_prompts(s.benchmark, limit=s.num_prompts, turns=s.turns)
    mismatch = None
    with ExitStack() as stack:
        endpoints, baseline = list(s.endpoint), s.baseline_endpoint
        servers: dict[str, Any] = {}
        if not endpoints:
            if not s.draft:
                raise Eagle3InputError("served evaluation needs --endpoint URL (a running server with the draft) "
                                       "or --draft DIR (a server is started for --verifier)")
            from eagle3_train.assets.verifier import resolve_verifier
            from eagle3_train.serving.vllm_options import speculative_config
            from eagle3_train.serving.vllm_server import VLLMServer, vllm_available

            ok, msg = vllm_available()
            if not ok:
                raise Eagle3InputError(msg)
            from eagle3_train.assets.verifier import required_verifier
            from eagle3_train.checkpoints.native import recorded_verifier

            verifier = resolve_verifier(required_verifier(s.verifier, recorded_verifier(s.draft),
                                                          f"the draft {s.draft}"))
            logs = Path(s.out) if s.out else None
            # A short measurement: on CPU an eager server (auto) starts minutes sooner than a compiled one.
            opts = dict(enforce_eager=s.enforce_eager, max_model_len=s.max_model_len, dtype=s.server_dtype,
                        vllm_args=s.vllm_args, startup_matters=True, trust_remote_code=s.trust_remote_code)
            spec = stack.enter_context(VLLMServer(
                verifier, speculative=speculative_config(s.draft, s.k), **opts,
                log_path=logs / "vllm-draft.log" if logs else None))
            endpoints, servers["draft"] = [spec.base_url], {"startup_s": spec.startup_s, "log": str(spec.log_path),
                                                            "dtype": spec.dtype}
            mismatch = _trained_dtype_note(s.draft, spec.dtype)
            if s.baseline and not baseline:
                base = stack.enter_context(VLLMServer(verifier, **opts,
                                                      log_path=logs / "vllm-baseline.log" if logs else None))
                baseline, servers["baseline"] = base.base_url, {"startup_s": base.startup_s,
                                                                "log": str(base.log_path)}
        model = s.model or _served_model(endpoints[0])
        result = evaluate_served(endpoints, model, prompts, max_tokens=s.max_tokens, concurrency=s.concurrency,
                                 baseline_url=baseline, baseline_model=_served_model(baseline) if baseline else None,
                                 temperature=s.temperature, seed=s.seed, reasoning_split=s.reasoning_split)
        add_temperatures(result, endpoints, model, prompts, s.also_temperature, max_tokens=s.max_tokens,
                         concurrency=s.concurrency, seed=s.seed, reasoning_split=s.reasoning_split)
    result["draft"] = s.draft
    result["servers_started"] = servers
    if mismatch:
        result["dtype_mismatch"] = mismatch
    if s.out:
        out = Path(s.out)
        out.mkdir(parents=True, exist_ok=True)
        completions = result.pop("completions")
        base_completions = result.pop("baseline_completions", None)
        with open(out / "served_completions.jsonl", "w") as f:
            for i, c in enumerate(completions):
                if base_completions:
                    c = {**c, "baseline_outputs": base_completions[i]["outputs"]}
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
        write_json(out / "results.json", result)
        log.info("served evaluation written to %s", out / "results.json")
    return result
