"""Offline evaluation: greedy chain speculative decoding with the HF verifier and our draft, batch size 1.

Each round drafts k tokens in a chain and verifies them in one verifier forward, as vLLM runs EAGLE-3: see
`evaluate/decode.py`.
The output must equal plain greedy decoding token for token; `check_greedy` runs that decoding and compares.

Python API: `evaluate_offline(draft, verifier, prompts, k=..., max_new_tokens=..., ...) -> dict` (defaults:
OfflineEvalSettings),
`load_verifier(verifier, device, dtype) -> (dir, tokenizer, model)`, `GreedyMismatchError`; the draft is loaded by
`evaluate/draft_loading.py`, the prompts checked against the training data by `evaluate/held_out.py`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.tokenizer import load_tokenizer
from eagle3_train.assets.verifier import Verifier, as_verifier
from eagle3_train.evaluate.chat_render import render_prompt, stop_token_ids
from eagle3_train.evaluate.decode import (
    Tally,
    TappedVerifier,
    ThinkTags,
    TurnOutput,
    chain_decode,
    compare_with_greedy,
    greedy_decode,
)
from eagle3_train.evaluate.draft_loading import check_fits, load_draft_for_eval
from eagle3_train.evaluate.held_out import held_out
from eagle3_train.evaluate.prompts import EvalPrompt
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.settings import OfflineEvalSettings
from eagle3_train.utils.io import Eagle3InputError, check_at_least
from eagle3_train.utils.progress import progress

log = logging.getLogger(__name__)


class GreedyMismatchError(AssertionError):
    """Speculative decoding produced a different token than plain greedy decoding (and not on a near-tie)."""


# --- the evaluation ---------------------------------------------------------------------------------------------
def load_verifier(verifier: str | Path | Verifier, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    from eagle3_train.assets.verifier import from_pretrained

    vdir = as_verifier(verifier).path
    tokenizer = load_tokenizer(vdir, trust_remote_code)
    model = from_pretrained(AutoModelForCausalLM, vdir, trust_remote_code, dtype=dtype).to(device).eval()
    return vdir, tokenizer, model


_D = OfflineEvalSettings  # keyword defaults below are the settings dataclass's


def evaluate_offline(draft: str | Path | Eagle3Draft, verifier: str | Path, prompts: list[EvalPrompt], k: int = _D.k,
                     max_new_tokens: int = _D.max_new_tokens, device: str = _D.device,
                     dtype: torch.dtype = getattr(torch, _D.dtype), check_greedy: bool = _D.check_greedy,
                     prepared: str | Path | None = _D.prepared, tie_tol: float = _D.tie_tol,
                     record_rounds: bool = False, verifier_model=None, tokenizer=None,
                     trust_remote_code: bool = _D.trust_remote_code,
                     think: ThinkTags | None = None) -> dict[str, Any]:
    """Acceptance of `draft` for `verifier` on `prompts` by chain speculative decoding (see `evaluate/decode.py`).

    `draft`: a checkpoint/run dir, an exported dir (EAGLE or speculators format) or a built draft module (used as is,
    embedding included). `prepared`: the prepared data to test the prompts against (default: the draft's
    training_metadata `data.prepared`). `think`: the reasoning tags whose rounds are counted apart (`by_region`;
    default: `<think>`/`</think>` when each is one token of the verifier's vocabulary). Raises GreedyMismatchError
    when the output differs from greedy decoding other than on a near-tie (logit gap < tie_tol); near-tie
    differences are reported in `greedy_check`.
    """
    check_at_least("k (draft tokens per round)", k, 1)
    check_at_least("max_new_tokens", max_new_tokens, 1)
    if not prompts:
        raise Eagle3InputError("no prompts to evaluate")
    if verifier_model is None:
        vdir, tokenizer, verifier_model = load_verifier(verifier, device, dtype, trust_remote_code)
    else:
        vdir = Path(verifier)
        if tokenizer is None:
            tokenizer = load_tokenizer(vdir, trust_remote_code)
    if isinstance(draft, torch.nn.Module):  # a built draft of any method
        check_fits(draft, verifier_model)
        draft_info: dict[str, Any] = {"path": None, "format": "module", "metadata": None, "notes": []}
    else:
        draft, draft_info = load_draft_for_eval(draft, verifier_model, vdir)
    draft = draft.to(device=device, dtype=dtype).eval()
    metadata = draft_info.pop("metadata", None) or {}
    if prepared is None:
        prepared = (metadata.get("data") or {}).get("prepared")
    held = held_out(prompts, prepared, tokenizer)

    tapped = TappedVerifier(verifier_model, draft.config.aux_layer_ids)
    stop = stop_token_ids(tokenizer, verifier_model)
    if think is None:
        think = ThinkTags.of(tokenizer)
    run = _OfflineRun(tapped, draft, tokenizer, stop, k=k, max_new_tokens=max_new_tokens, check_greedy=check_greedy,
                      tie_tol=tie_tol, record_rounds=record_rounds, think=think)
    records: list[dict[str, Any]] = []
    bar = progress(total=len(prompts), desc="offline eval", unit="prompt")
    try:
        for p in prompts:
            records.append(run.prompt(p))
            bar.update(1)
            bar.set_postfix_str(f"{run.overall.new_tokens / max(run.overall.seconds, 1e-9):.1f} tok/s, "
                                f"τ={run.overall.summary()['mean_acceptance_length'] or 0:.2f}")
    finally:
        bar.close()
        tapped.close()

    summary = run.overall.summary()
    return {
        "mode": "offline",
        "settings": {"k": k, "max_new_tokens": max_new_tokens, "device": str(device), "dtype": str(dtype),
                     "num_prompts": len(prompts), "check_greedy": check_greedy, "tie_tol": tie_tol},
        "draft": draft_info,
        "verifier": {"path": str(vdir), "num_layers": verifier_model.config.get_text_config().num_hidden_layers},
        "stop_token_ids": sorted(stop),
        "overall": summary,
        "benchmarks": {name: t.summary() for name, t in run.by_benchmark.items()},
        "held_out": held.get("held_out"),
        "held_out_check": held,
        "greedy_check": {"checked": check_greedy, "passed": (not run.mismatches) if check_greedy else None,
                         "mismatches": run.mismatches},
        "speed": run.speed(summary),
        "prompts": records,
    }


class _OfflineRun:
    """Decodes the prompts one turn at a time and keeps the tallies (overall, per benchmark, greedy reference)."""

    def __init__(self, tapped: TappedVerifier, draft: Eagle3Draft, tokenizer, stop: set[int], *, k: int,
                 max_new_tokens: int, check_greedy: bool, tie_tol: float, record_rounds: bool,
                 think: ThinkTags | None) -> None:
        self.tapped, self.draft, self.tokenizer, self.stop = tapped, draft, tokenizer, stop
        self.k, self.max_new_tokens, self.check_greedy = k, max_new_tokens, check_greedy
        self.tie_tol, self.record_rounds = tie_tol, record_rounds
        self.think = think
        self.overall, self.greedy = Tally(k), Tally(k)
        self.by_benchmark: dict[str, Tally] = {}
        self.mismatches: list[dict[str, Any]] = []

    def prompt(self, p: EvalPrompt) -> dict[str, Any]:
        """Every turn of one prompt; turn 2 follows the model's own answer to turn 1."""
        messages: list[dict[str, str]] = []
        rec: dict[str, Any] = {"id": p.id, "benchmark": p.benchmark, "turns": []}
        for t, turn in enumerate(p.turns):
            messages.append({"role": "user", "content": turn})
            turn_rec = self.turn(p, t, render_prompt(self.tokenizer, messages))
            rec["turns"].append(turn_rec)
            messages.append({"role": "assistant", "content": turn_rec["output"]})
        return rec

    def turn(self, p: EvalPrompt, t: int, prompt_ids: list[int]) -> dict[str, Any]:
        spec = chain_decode(self.tapped, self.draft, prompt_ids, self.k, self.max_new_tokens, self.stop,
                            self.record_rounds, self.think)
        self.overall.add(spec)
        self.by_benchmark.setdefault(p.benchmark, Tally(self.k)).add(spec)
        turn_rec: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "new_tokens": len(spec.tokens),
                                    "drafts": spec.drafts, "accepted": sum(spec.accepted_per_pos),
                                    "matched": spec.matched,
                                    "verifier_forwards": spec.verifier_forwards,
                                    "seconds": round(spec.seconds, 3)}
        if self.check_greedy:
            turn_rec["greedy_identical"] = self.same_as_greedy(p, t, prompt_ids, spec)
        if self.record_rounds:
            turn_rec["tokens"] = spec.tokens
            turn_rec["rounds"] = spec.rounds
        turn_rec["output"] = self.tokenizer.decode([x for x in spec.tokens if x not in self.stop],
                                                   skip_special_tokens=True)
        return turn_rec

    def same_as_greedy(self, p: EvalPrompt, t: int, prompt_ids: list[int], spec: TurnOutput) -> bool:
        """Whether the speculative output equals greedy decoding; raises GreedyMismatchError unless on a near-tie."""
        ref = greedy_decode(self.tapped, prompt_ids, self.max_new_tokens, self.stop)
        self.greedy.add(ref)
        diff = compare_with_greedy(self.tapped, prompt_ids, spec.tokens, ref, self.tie_tol)
        if diff is None:
            return True
        diff = {"prompt": p.id, "turn": t + 1, **diff}
        self.mismatches.append(diff)
        if not diff["near_tie"]:
            raise GreedyMismatchError(f"prompt {p.id} turn {t + 1}: speculative output differs from greedy decoding "
                                      f"at new token {diff['position']}: {diff}")
        log.warning("near-tie difference from greedy decoding: %s", diff)
        return False

    def speed(self, summary: dict[str, Any]) -> dict[str, Any]:
        speed: dict[str, Any] = {"speculative_tokens_per_s": summary["tokens_per_s"],
                                 "speculative_seconds": summary["seconds"]}
        if self.check_greedy and self.greedy.seconds:
            g = self.greedy.summary()
            speed.update(greedy_tokens_per_s=g["tokens_per_s"], greedy_seconds=g["seconds"],
                         wall_speedup=g["seconds"] / summary["seconds"] if summary["seconds"] else None)
        return speed
