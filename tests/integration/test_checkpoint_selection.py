"""Choosing the checkpoint to ship (evaluate/select.py) and stopping when validation stops improving
(train.early_stop), on real training runs of a tiny random Llama verifier. The served ranking starts vLLM: its test
is marked vllm and slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stage_helpers import train_config

from eagle3_train.evaluate.select import checkpoint_candidates, select_checkpoint
from eagle3_train.export.exporter import export
from eagle3_train.train.trainer import train


def _validations(run: Path, key: str = "accept_len_k3") -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if r["split"] == "validation"}


@pytest.fixture(scope="module")
def run_of_six(tiny_stages, tmp_path_factory):
    """Six steps, validated and checkpointed at every one, all kept."""
    root, verifier = tiny_stages
    run = tmp_path_factory.mktemp("select") / "train"
    train(train_config(root, run, max_steps=6, eval_every=1, save_every=1, keep_last=10, max_eval_batches=1))
    return root, verifier, run


def test_candidates_are_the_kept_checkpoints_with_their_logged_estimates(run_of_six):
    _, _, run = run_of_six
    cands = checkpoint_candidates(run)
    assert [c.step for c in cands] == [1, 2, 3, 4, 5, 6]
    assert {c.step: c.estimate for c in cands} == _validations(run)


def test_estimate_picks_the_best_validated_step_and_final_the_last(run_of_six, tmp_path):
    root, verifier, run = run_of_six
    estimates = _validations(run)
    best_step = max(estimates, key=lambda s: (estimates[s], s))
    r = select_checkpoint(run, verifier, root / "prepared", tmp_path / "by-estimate", by="estimate")
    assert r["selected_step"] == best_step and r["by"] == "estimate"
    on_disk = json.loads((tmp_path / "by-estimate" / "selection.json").read_text())
    assert on_disk["selected"] == r["selected"] and len(on_disk["candidates"]) == 6
    last = select_checkpoint(run, verifier, root / "prepared", tmp_path / "by-final", by="final")
    assert last["selected_step"] == 6 and Path(last["selected"]) == run / "final"
    # the chosen checkpoint is what export ships: its metadata records that step
    out = export(r["selected"], tmp_path / "export", fmt="eagle")
    meta = json.loads((Path(out["out"]) / "training_metadata.json").read_text())
    assert meta["progress"]["step"] == best_step


def test_early_stop_ends_the_run_when_validation_stops_improving(tiny_stages, tmp_path):
    root, _ = tiny_stages
    # lr 0: the estimate never improves after the first validation, so the second and third are stale
    result = train(train_config(root, tmp_path / "run", lr=0.0, max_steps=8, eval_every=1, early_stop=2,
                                max_eval_batches=1))
    assert result["step"] == 3 and not result.get("stopped")
    meta = json.loads((tmp_path / "run" / "training_metadata.json").read_text())
    assert meta["run"]["status"] == "finished" and meta["progress"]["step"] == 3
    assert sorted(_validations(tmp_path / "run")) == [1, 2, 3]
    # without early_stop the same run trains every step
    full = train(train_config(root, tmp_path / "full", lr=0.0, max_steps=8, eval_every=1, max_eval_batches=1))
    assert full["step"] == 8


@pytest.mark.vllm
@pytest.mark.slow
def test_served_selection_serves_the_best_by_estimate_and_records_both(run_of_six, tmp_path):
    from support.vllm_helpers import require_vllm

    require_vllm()
    root, verifier, run = run_of_six
    r = select_checkpoint(run, verifier, root / "prepared", tmp_path / "served", by="served", max_candidates=2,
                          num_prompts=3, max_tokens=16)
    served = [c for c in r["candidates"] if c["served"] is not None]
    ranked = sorted(r["candidates"], key=lambda c: (c["estimate"], c["step"]), reverse=True)
    assert [c["step"] for c in served] == sorted(c["step"] for c in ranked[:2])
    best = max(served, key=lambda c: (c["served"], c["step"]))
    assert r["selected_step"] == best["step"] and all(c["served"] >= 1.0 for c in served)
    assert r["prompts"]["num_prompts"] == 3
    assert (tmp_path / "served" / "selection.png").stat().st_size > 5_000
