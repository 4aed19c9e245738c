"""checkpoints.native: the one place that turns a run directory or checkpoint path into the checkpoint, and reads the
verifier a draft records. Only the marker files matter here, so the directories are written by hand."""

from __future__ import annotations

import json

import pytest

from eagle3_train.checkpoints.native import CONFIG, METADATA, recorded_verifier, resolve_checkpoint
from eagle3_train.utils.io import Eagle3InputError


def checkpoint(path, metadata=None):
    path.mkdir(parents=True)
    (path / CONFIG).write_text("{}")
    if metadata is not None:
        (path / METADATA).write_text(json.dumps(metadata))
    return path


def test_a_checkpoint_resolves_to_itself_and_a_run_to_final_else_latest(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    assert resolve_checkpoint(ckpt) == ckpt
    run = tmp_path / "run"
    step = checkpoint(run / "checkpoints" / "step-0000004")
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"dir": step.name}))
    notes: list[str] = []
    assert resolve_checkpoint(run, notes) == step and "unfinished training run" in notes[0]
    final = checkpoint(run / "final")
    assert resolve_checkpoint(run) == final


def test_a_dangling_pointer_and_a_foreign_directory_are_named(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"dir": "step-0000009"}))
    with pytest.raises(Eagle3InputError, match=r"latest\.json points to .*step-0000009, which is not a checkpoint"):
        resolve_checkpoint(run)
    (tmp_path / "other").mkdir()
    with pytest.raises(Eagle3InputError, match="neither an eagle3-train checkpoint nor a training run"):
        resolve_checkpoint(tmp_path / "other")


def test_recorded_verifier_prefers_the_local_directory_then_the_name_then_a_speculators_config(tmp_path):
    local = tmp_path / "verifier"
    local.mkdir()
    run = tmp_path / "run"
    checkpoint(run / "final", {"verifier": {"name": "org/model", "path": str(local)}})
    assert recorded_verifier(run) == str(local)  # exists on this machine: load it from there
    checkpoint(tmp_path / "moved", {"verifier": {"name": "org/model", "path": str(tmp_path / "gone")}})
    assert recorded_verifier(tmp_path / "moved") == "org/model"
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "org/x"}}}))
    assert recorded_verifier(export) == "org/x"
    assert recorded_verifier(tmp_path / "nothing") is None
