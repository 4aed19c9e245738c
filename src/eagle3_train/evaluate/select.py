"""Which of a training run's checkpoints to ship: the one vLLM accepts most from on held-out prompts.

The training estimate (acceptance from training-time test on the validation split) ranks checkpoints cheaply; it
stayed within 0.026 of vLLM on one run's checkpoints (benchmarks/checkpoint_selection.py) but is not what the engine
does, and more epochs can lower served acceptance while the loss still falls. So `by: served` exports each
candidate as the EAGLE format, serves it beside the verifier and sends the first user turns of the validation split
(never trained on); `by: estimate` ranks by the training estimate;
`final` keeps the last weights. `auto`: served when vLLM judges the run (evaluate.vllm), else estimate. Candidates
are the checkpoints the run kept (`checkpoints/step-*`, `checkpoints/best`); only the `max_candidates` best by
estimate are served (each is a server start).

Python API: `checkpoint_candidates(train_dir) -> list[Candidate]`, `select_checkpoint(train_dir, verifier_dir,
prepared_dir, out_dir, **SelectSettings values) -> dict` (writes OUT/selection.json and selection.png).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_train.checkpoints.native import METADATA, is_checkpoint
from eagle3_train.settings import SelectSettings
from eagle3_train.settings.common import NUM_SPECULATIVE_TOKENS
from eagle3_train.utils.io import Eagle3InputError, read_json, read_jsonl, write_json

log = logging.getLogger(__name__)
_D = SelectSettings


@dataclass
class Candidate:
    name: str  # step-NNNNNNN or best
    path: str
    step: int
    estimate: float | None  # the training estimate at this step (None: not validated at this step)
    served: float | None = None  # vLLM's mean acceptance length on the selection prompts


def _estimates(train_dir: Path, k: int) -> dict[int, float]:
    """step -> the validation estimate logged at that step (metrics.jsonl; the last line of a step wins): acceptance
    at min(ttt_steps, k) draft tokens, the figure train ranks `best/` by."""
    path = train_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    out: dict[int, float] = {}
    for _, row in read_jsonl(path):
        if row.get("split") != "validation" or "step" not in row:
            continue
        for n in range(k, 0, -1):
            if f"accept_len_k{n}" in row:
                out[int(row["step"])] = float(row[f"accept_len_k{n}"])
                break
    return out


def checkpoint_candidates(train_dir: str | Path, k: int = NUM_SPECULATIVE_TOKENS) -> list[Candidate]:
    """The checkpoints a run kept, one per step (`best/` only when no step checkpoint has its step), by step."""
    train_dir = Path(train_dir)
    found: dict[int, Candidate] = {}
    estimates = _estimates(train_dir, k)
    dirs = sorted(p for p in (train_dir / "checkpoints").glob("step-*") if is_checkpoint(p))
    best = train_dir / "checkpoints" / "best"
    for d in [*dirs, *([best] if is_checkpoint(best) else [])]:
        meta = read_json(d / METADATA, "checkpoint metadata")
        step = int((meta.get("progress") or {}).get("step", -1))
        if step in found:
            continue
        found[step] = Candidate(d.name, str(d), step, estimates.get(step))
    if not found:
        raise Eagle3InputError(f"{train_dir} holds no checkpoints to choose from (checkpoints/step-*, "
                               f"checkpoints/best)")
    return [found[s] for s in sorted(found)]


def _by_estimate(cands: list[Candidate]) -> Candidate:
    scored = [c for c in cands if c.estimate is not None]
    if not scored:
        return cands[-1]
    return max(scored, key=lambda c: (c.estimate, c.step))


def resolve_by(by: str, vllm: bool | str = "auto") -> str:
    """`auto` -> served when vLLM is wanted (`vllm`: the run's evaluate.vllm; auto: when its env exists), else
    estimate."""
    if by != "auto":
        return by
    if vllm == "auto":
        from eagle3_train.serving.vllm_server import vllm_available

        vllm = vllm_available()[0]
    return "served" if vllm else "estimate"


def select_checkpoint(train_dir: str | Path, verifier_dir: str | Path, prepared_dir: str | Path,
                      out_dir: str | Path, *, by: str = _D.by, max_candidates: int = _D.max_candidates,
                      num_prompts: int = _D.num_prompts, max_tokens: int = _D.max_tokens,
                      k: int = NUM_SPECULATIVE_TOKENS,
                      serving: dict[str, Any] | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """Choose the checkpoint to ship; returns {"by", "selected", "candidates", ...} and writes OUT/selection.json."""
    train_dir, out_dir = Path(train_dir), Path(out_dir)
    how = resolve_by(by, vllm="auto")
    cands = checkpoint_candidates(train_dir, k)
    result: dict[str, Any] = {"by": how, "asked": by, "k": k}
    if how == "final":
        chosen = cands[-1]
    elif how == "estimate" or len(cands) == 1:
        chosen = _by_estimate(cands)
    else:
        chosen = _by_served(cands, verifier_dir, prepared_dir, out_dir, max_candidates=max_candidates,
                            num_prompts=num_prompts, max_tokens=max_tokens, k=k, serving=serving,
                            trust_remote_code=trust_remote_code, result=result)
    final = train_dir / "final"  # the last step's weights, as train finished them (what export reads by default)
    path = str(final) if chosen.step == cands[-1].step and is_checkpoint(final) else chosen.path
    result.update({"selected": path, "selected_step": chosen.step, "last_step": cands[-1].step,
                   "candidates": [asdict(c) for c in cands]})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "selection.json", result)
    _plot(cands, chosen, out_dir / "selection.png")
    log.info("[select] %s by %s (step %d of %d)", chosen.name, how, chosen.step, cands[-1].step)
    return result


def _by_served(cands: list[Candidate], verifier_dir: str | Path, prepared_dir: str | Path, out_dir: Path, *,
               max_candidates: int, num_prompts: int, max_tokens: int, k: int, serving: dict[str, Any] | None,
               trust_remote_code: bool, result: dict[str, Any]) -> Candidate:
    from eagle3_train.assets.tokenizer import load_tokenizer
    from eagle3_train.evaluate.held_out import validation_prompts
    from eagle3_train.evaluate.pipeline_eval import served_acceptance
    from eagle3_train.evaluate.served import acceptance_of
    from eagle3_train.export.exporter import export

    prompts = validation_prompts(prepared_dir, load_tokenizer(verifier_dir, trust_remote_code), num_prompts)
    # the best by estimate first (an unvalidated checkpoint last, the newest first among equals)
    ranked = sorted(cands, key=lambda c: (c.estimate is not None, c.estimate or 0.0, c.step), reverse=True)
    served = ranked[:max_candidates]
    for c in served:
        draft = out_dir / "candidates" / c.name
        export(c.path, draft, fmt="eagle", speculative_tokens=k, overwrite=True)
        r = served_acceptance(verifier_dir, draft, prompts, k=k, max_tokens=max_tokens, serving=serving,
                              log_dir=out_dir / "candidates", trust_remote_code=trust_remote_code)
        mean = acceptance_of(r)["mean_acceptance_length"]
        if mean is None:
            raise Eagle3InputError(f"select: vLLM reported no drafts for {c.path} (spec-decode counters absent: "
                                   f"see the server log in {out_dir / 'candidates'})")
        c.served = float(mean)
        log.info("[select] %s (step %d): served %.3f, estimate %s", c.name, c.step, c.served,
                 "-" if c.estimate is None else f"{c.estimate:.3f}")
    result.update({"prompts": {"source": "validation split, first user turns", "num_prompts": len(prompts),
                               "max_tokens": max_tokens}})
    return max(served, key=lambda c: (c.served, c.step))


def _plot(cands: list[Candidate], chosen: Candidate, path: Path) -> None:
    """Estimate and served acceptance against the step, the chosen checkpoint marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are a convenience; selection.json has the figures
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for attr, label, mark in (("estimate", "training estimate", "o-"), ("served", "vLLM (served)", "s-")):
        pts = [(c.step, getattr(c, attr)) for c in cands if getattr(c, attr) is not None]
        if pts:
            ax.plot(*zip(*pts), mark, label=label)
    ax.axvline(chosen.step, color="grey", ls=":", label=f"chosen: {chosen.name}")
    ax.set_xlabel("step")
    ax.set_ylabel("acceptance length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
