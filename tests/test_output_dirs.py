"""No command deletes or overwrites what it did not write, and a replaced directory survives a kill mid-swap."""

from __future__ import annotations

from pathlib import Path

import pytest
from draft_layouts import write_ours

from eagle3_train import cli
from eagle3_train.utils.io import Eagle3InputError, atomic_dir, has_file, recover_replaced_dir, replace_dir


def _foreign(d: Path) -> Path:
    """A directory of the user's own files (e.g. ~/models)."""
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    (d / "other-model").mkdir()
    (d / "other-model" / "config.json").write_text("{}")
    return d


def _untouched(d: Path) -> bool:
    names = sorted(p.name for p in d.iterdir())
    return names == ["notes.txt", "other-model"] and (d / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, ref):
    return write_ours(ref, tmp_path_factory.mktemp("run") / "run")


def test_export_refuses_a_foreign_directory_and_replaces_its_own(run_dir, tmp_path, capsys):
    models = _foreign(tmp_path / "models")
    assert cli.main(["export", str(run_dir), "--out", str(models), "--format", "eagle"]) == 2
    assert "not an earlier output" in capsys.readouterr().err
    assert _untouched(models)
    # A fresh directory, then the same one again: our own export is replaced, nothing left beside it.
    out = tmp_path / "draft"
    assert cli.main(["export", str(run_dir), "--out", str(out), "--format", "eagle"]) == 0
    assert cli.main(["export", str(run_dir), "--out", str(out), "--format", "eagle"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "training_metadata.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_every_writing_stage_refuses_a_foreign_directory(tiny_stages, tmp_path, capsys):
    root, verifier = tiny_stages
    models = _foreign(tmp_path / "models")
    commands = {
        "prepare": ["prepare", "--data", "sharegpt", "--verifier", str(verifier), "--limit", "4", "--out"],
        "vocab": ["vocab", "--prepared", str(root / "prepared"), "--size", "64", "--out"],
        "generate": ["generate", "--data", "sharegpt", "--endpoint", "http://127.0.0.1:9/v1", "--limit", "2",
                     "--out"],
        "extract": ["extract", "--prepared", str(root / "prepared"), "--verifier", str(verifier), "--out"],
        "train": ["train", "--prepared", str(root / "prepared"), "--hidden-states", str(root / "hidden"),
                  "--vocab", str(root / "vocab"), "--epochs", "1", "--out"],
    }
    for stage, argv in commands.items():
        assert cli.main([*argv, str(models)]) == 2, stage
        err = capsys.readouterr().err
        assert str(models) in err and ("not an earlier output" in err or "not empty" in err), (stage, err)
        assert _untouched(models), stage


def test_pipeline_refuses_a_foreign_run_dir(tmp_path, capsys):
    models = _foreign(tmp_path / "models")
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {models}\n")
    assert cli.main(["run", "--config", str(config)]) == 2
    assert "run_dir" in capsys.readouterr().err
    assert _untouched(models)


def test_atomic_dir_refuses_before_the_block_runs(tmp_path):
    models = _foreign(tmp_path / "models")
    ran = []
    with pytest.raises(Eagle3InputError), atomic_dir(models, has_file("marker")):
        ran.append(1)
    assert ran == [] and _untouched(models)


def _dir_with(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "data").write_text(text)
    return path


def test_replace_swaps_through_a_backup(tmp_path):
    target = _dir_with(tmp_path / "out", "old")
    replace_dir(_dir_with(tmp_path / "new", "new"), target)
    assert (target / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_kill_between_the_two_renames_loses_nothing(tmp_path):
    # The state a kill leaves after `target -> backup` and before `new -> target`: the old directory survives under
    # its backup name and the next writer (or reader-side recovery) puts it back.
    target = tmp_path / "out"
    _dir_with(tmp_path / ".out.replaced-1234", "old")
    _dir_with(tmp_path / ".out.abc123", "half-written")  # the unfinished temporary dir of the killed writer
    recover_replaced_dir(target)
    assert (target / "data").read_text() == "old"
    # After a kill between `new -> target` and the backup's removal, the stale backup is dropped, the new dir kept.
    _dir_with(tmp_path / ".out.replaced-99", "older")
    with atomic_dir(target) as tmp:
        (tmp / "data").write_text("newest")
    assert (target / "data").read_text() == "newest"
    assert not list(tmp_path.glob(".out.replaced-*"))


def test_generate_accepts_the_log_of_the_server_it_started(tmp_path, capsys):
    # `run` and `generate --serve-verifier` start vLLM with its log in the output directory before generating.
    out = tmp_path / "generated"
    out.mkdir()
    (out / "vllm.log").write_text("INFO started\n")
    argv = ["generate", "--data", "sharegpt", "--endpoint", "http://127.0.0.1:9/v1", "--limit", "2", "--out", str(out),
            "--max-retries", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "not an earlier output" not in err and "127.0.0.1:9" in err  # got past the claim, to the dead endpoint
