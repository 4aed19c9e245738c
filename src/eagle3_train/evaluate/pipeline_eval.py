"""Acceptance of exported drafts, measured the way users will see it: a real vLLM server (and the offline evaluator).

`served_acceptance` starts vLLM with the verifier and a draft, sends held-out prompts (temperature 0 unless set) and
reads the Prometheus counters; with `baseline=True` it also serves the verifier alone and checks that greedy outputs
are identical (temperature 0). `pipeline_evaluate` is the evaluate stage of `eagle3-train run`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_train.evaluate.prompts import EvalPrompt, load_prompts
from eagle3_train.evaluate.served import acceptance_of, add_temperatures, evaluate_served, greedy_identical
from eagle3_train.serving.vllm_options import model_config, resolve_dtype, speculative_config
from eagle3_train.serving.vllm_server import VLLMServer, vllm_available
from eagle3_train.settings import EvaluateSettings
from eagle3_train.utils.io import write_json

log = logging.getLogger(__name__)
_D = EvaluateSettings  # keyword defaults below are the settings dataclass's


def served_acceptance(verifier_dir: str | Path, draft_dir: str | Path, prompts: list[EvalPrompt], *, k: int = _D.k,
                      fmt: str = "eagle", max_tokens: int = _D.max_tokens, concurrency: int = _D.concurrency,
                      baseline: bool = _D.baseline, log_dir: str | Path | None = None,
                      serving: dict[str, Any] | None = None, trust_remote_code: bool = False,
                      temperature: float = _D.temperature, seed: int = _D.seed,
                      also_temperature: tuple[float, ...] = ()) -> dict[str, Any]:
    """Serve verifier + draft in vLLM, send `prompts`, return acceptance (and the greedy-equality check), also at
    each of `also_temperature` (`at_temperature`). `serving`: ServingSettings values (dtype, enforce_eager,
    max_model_len, vllm_args; auto by device)."""
    log_dir = Path(log_dir) if log_dir else None
    # a few hundred prompts: on CPU, eager start-up pays off
    opts = {"startup_matters": True, "trust_remote_code": trust_remote_code, **(serving or {})}
    if fmt == "speculators":  # the speculators config names the verifier: `vllm serve DRAFT` alone
        server = VLLMServer(draft_dir, log_path=log_dir / "vllm-speculators.log" if log_dir else None, **opts)
    else:
        server = VLLMServer(verifier_dir, speculative=speculative_config(draft_dir, k), **opts,
                            log_path=log_dir / f"vllm-{fmt}.log" if log_dir else None)
    with server:
        result = evaluate_served(server.base_url, server.model_name, prompts, max_tokens=max_tokens,
                                 concurrency=concurrency, temperature=temperature, seed=seed)
        add_temperatures(result, server.base_url, server.model_name, prompts, list(also_temperature),
                         max_tokens=max_tokens, concurrency=concurrency, seed=seed)
        result["startup_s"] = server.startup_s
    result.update({"format": fmt, "draft": str(draft_dir), "k": k})
    if baseline:
        with VLLMServer(verifier_dir, log_path=log_dir / "vllm-baseline.log" if log_dir else None, **opts) as base:
            plain = evaluate_served(base.base_url, base.model_name, prompts, max_tokens=max_tokens,
                                    concurrency=concurrency, temperature=temperature, seed=seed,
                                    reasoning_split=False)  # no draft, no acceptance to split
        result["baseline"] = {k_: plain[k_] for k_ in ("tokens_per_s", "generated_tokens", "wall_s") if k_ in plain}
        result["greedy_identical"] = greedy_identical(result["completions"], plain["completions"], temperature)
        if result.get("tokens_per_s") and plain.get("tokens_per_s"):
            result["speedup"] = round(result["tokens_per_s"] / plain["tokens_per_s"], 4)
    return result


def acceptance_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's line for one served draft: its acceptance, the greedy check, the speed-up, each temperature."""
    return {**acceptance_of(result), "greedy_identical": result.get("greedy_identical"),
            "speedup": result.get("speedup"),
            "at_temperature": {t: a["mean_acceptance_length"] for t, a in result.get("at_temperature", {}).items()}}


def pipeline_evaluate(exports: dict[str, str], verifier_dir: Path, out_dir: Path, *, vllm: bool | str = _D.vllm,
                      offline: bool = _D.offline, benchmark: str = _D.benchmark, num_prompts: int = _D.num_prompts,
                      turns: int = _D.turns, max_tokens: int = _D.max_tokens, k: int = _D.k,
                      concurrency: int = _D.concurrency, baseline: bool = _D.baseline,
                      offline_prompts: int = _D.offline_prompts, serving: dict[str, Any] | None = None,
                      trust_remote_code: bool = False, temperature: float = _D.temperature,
                      seed: int = _D.seed, also_temperature: tuple[float, ...] = (),
                      formats: list[str] | None = _D.formats) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(benchmark, limit=num_prompts, turns=turns)
    results: dict[str, Any] = {"benchmark": benchmark, "num_prompts": len(prompts), "k": k, "max_tokens": max_tokens,
                               "temperature": temperature}
    if vllm:
        ok, message = vllm_available()
        if ok:
            for fmt, draft in exports.items():
                if formats is not None and fmt not in formats:
                    continue
                r = served_acceptance(verifier_dir, draft, prompts, k=k, fmt=fmt, max_tokens=max_tokens,
                                      concurrency=concurrency, baseline=baseline and fmt == "eagle", log_dir=out_dir,
                                      serving=serving, trust_remote_code=trust_remote_code,
                                      temperature=temperature, seed=seed, also_temperature=also_temperature)
                write_json(out_dir / f"vllm-{fmt}.json", r)
                results[f"vllm_{fmt}"] = acceptance_summary(r)
        elif vllm == "auto":
            log.warning("vLLM evaluation skipped: %s", message)
            results["vllm_skipped"] = message
        else:
            from eagle3_train.utils.io import Eagle3InputError

            raise Eagle3InputError(message)
    if offline:
        import torch

        from eagle3_train.evaluate.offline import evaluate_offline

        draft = exports.get("eagle") or next(iter(exports.values()))
        # a dtype chosen for the servers is the offline verifier's too (auto: the evaluator's float32)
        chosen = (serving or {}).get("dtype")
        dtype = "float32" if chosen in (None, "auto") else resolve_dtype("cpu", chosen, model_config(verifier_dir))
        r = evaluate_offline(draft, verifier_dir, prompts[:offline_prompts], k=k, max_new_tokens=max_tokens,
                             dtype=getattr(torch, dtype))
        write_json(out_dir / "offline.json", r)
        overall = r["overall"]
        results["offline"] = {"mean_acceptance_length": overall["mean_acceptance_length"],
                              "per_position_acceptance": overall["per_position_acceptance"],
                              "num_prompts": len(prompts[:offline_prompts]),
                              "greedy_identical": r["greedy_check"]["passed"]}
    write_json(out_dir / "results.json", results)
    return results
