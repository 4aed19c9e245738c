"""No command deletes or overwrites what it did not write (utils/outputs.py), and a replaced directory survives a
kill mid-swap."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from support.draft_layouts import write_ours
from support.stage_helpers import another_writer

from eagle3_train import cli
from eagle3_train.checkpoints.native import prune
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.outputs import (
    MARKER,
    atomic_dir,
    make_temp_dir,
    read_marker,
    recover_replaced_dir,
    remove_owned,
    replace_dir,
    set_aside,
    write_marker,
)


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
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "model.safetensors",
                                                     "training_metadata.json"]
    assert read_marker(out)["stage"] == "export"
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
        assert str(models) in err and "not an earlier output" in err, (stage, err)
        assert _untouched(models), stage
        # --overwrite changes nothing about whose directory it is (it used to let extract delete files here)
        assert cli.main([*argv, str(models), "--overwrite"]) == 2, stage
        assert "even with --overwrite" in capsys.readouterr().err
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
    with pytest.raises(Eagle3InputError), atomic_dir(models, "export"):
        ran.append(1)
    assert ran == [] and _untouched(models)


def _dir_with(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "data").write_text(text)
    return path


def test_replace_swaps_through_a_backup(tmp_path):
    target = _dir_with(tmp_path / "out", "old")
    write_marker(target, "export", ["data"])  # an earlier export, listing what it wrote
    replace_dir(_dir_with(tmp_path / "new", "new"), target)
    assert (target / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_kill_between_the_two_renames_loses_nothing(tmp_path):
    # The state a kill leaves after `target -> backup` and before `new -> target`: the old directory survives under
    # its backup name and the next writer (or reader-side recovery) puts it back.
    target = tmp_path / "out"
    write_marker(_dir_with(tmp_path / ".out.eagle3-replaced-1234", "old"), "export", ["data"])
    (make_temp_dir(target, "export") / "data").write_text("half-written")  # the killed writer's temporary dir
    recover_replaced_dir(target)
    assert (target / "data").read_text() == "old"
    # After a kill between `new -> target` and the backup's removal, the stale backup is dropped, the new dir kept.
    write_marker(_dir_with(tmp_path / ".out.eagle3-replaced-99", "older"), "export", ["data"])
    with atomic_dir(target, "export") as tmp:
        (tmp / "data").write_text("newest")
    assert (target / "data").read_text() == "newest"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the backup and the killed temp dir are gone


def test_siblings_that_look_like_ours_but_are_not_are_kept(run_dir, tmp_path):
    """Only directories carrying our marker are removed beside --out: a user's `.draft.old/` and a lookalike of our
    temporary name survive every export (they used to be deleted as leftovers of a killed write)."""
    user = tmp_path / "userB"
    for name in (".draft.old", ".draft.eagle3-tmp-abc", ".draft.eagle3-replaced-1"):
        (user / name).mkdir(parents=True)
        (user / name / "keep.txt").write_text("mine")
    out = user / "draft"
    for _ in range(2):
        assert cli.main(["export", str(run_dir), "--out", str(out), "--format", "eagle"]) == 0
    assert sorted(p.name for p in user.iterdir()) == [".draft.eagle3-replaced-1", ".draft.eagle3-tmp-abc",
                                                     ".draft.old", "draft"]
    assert all((user / n / "keep.txt").read_text() == "mine" for n in (".draft.old", ".draft.eagle3-tmp-abc"))


def test_a_symlinked_out_is_written_through_and_kept(run_dir, tmp_path):
    real = tmp_path / "disk" / "draft"
    real.parent.mkdir()
    link = tmp_path / "draft"
    link.symlink_to(real, target_is_directory=True)
    for _ in range(2):  # first into an absent target, then replacing our own
        assert cli.main(["export", str(run_dir), "--out", str(link), "--format", "eagle"]) == 0
        assert link.is_symlink() and (real / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "draft"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["draft"]


def test_files_added_to_our_output_are_never_replaced_with_it(run_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    assert cli.main(["export", str(run_dir), "--out", str(out), "--format", "eagle"]) == 0
    (out / "notes.md").write_text("mine")
    assert cli.main(["export", str(run_dir), "--out", str(out), "--format", "eagle", "--overwrite"]) == 2
    assert "notes.md, which eagle3-train did not write" in capsys.readouterr().err
    assert (out / "notes.md").read_text() == "mine"


def test_an_output_of_another_stage_is_refused(tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    write_marker(out, "prepare", ["manifest.json"])
    (out / "manifest.json").write_text("{}")
    with pytest.raises(Eagle3InputError, match="is the output of eagle3-train prepare, not of export"), \
            atomic_dir(out, "export"):
        pass


def test_out_below_a_regular_file_is_a_clear_error(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "file" / "draft"), "--format", "eagle"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_two_writers_of_one_directory_the_second_stops(tmp_path):
    """A live writer's temporary directory is locked: a second atomic write stops instead of deleting it."""
    target = tmp_path / "draft"
    with another_writer(f"atomic_dir({str(target)!r}, 'export')") as (holder, in_flight):
        with pytest.raises(Eagle3InputError, match=rf"being written by another process \(pid {holder.pid}\)"), \
                atomic_dir(target, "export"):
            pass
        assert Path(in_flight).is_dir()
    with atomic_dir(target, "export") as tmp:  # a killed writer's leftovers are cleared
        (tmp / "data").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_prune_deletes_only_our_periodic_checkpoints(tmp_path, ref):
    from eagle3_train.checkpoints.native import save_checkpoint

    run = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(run / "checkpoints" / f"step-{step:07d}", ref, None, {"init": {}})
    for foreign in ("step-0", "step-final", "step-0000000"):
        (run / "checkpoints" / foreign).mkdir()
        (run / "checkpoints" / foreign / "keep.txt").write_text("mine")
    prune(run, keep_last=1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0", "step-0000000", "step-0000003",
                                                                       "step-final"]


def test_generate_accepts_the_log_of_the_server_it_started(tmp_path, capsys):
    # `run` and `generate --serve-verifier` start vLLM with its log in the output directory before generating.
    from eagle3_train.generate.resume import claim_generate_output

    out = claim_generate_output(tmp_path / "generated")  # claimed before the server writes its log there
    (out / "vllm.log").write_text("INFO started\n")
    argv = ["generate", "--data", "sharegpt", "--endpoint", "http://127.0.0.1:9/v1", "--limit", "2", "--out", str(out),
            "--max-retries", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "not an earlier output" not in err and "127.0.0.1:9" in err  # got past the claim, to the dead endpoint


def _chats(path: Path, n: int = 6) -> Path:
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?"},
                                                                    {"role": "assistant", "content": f"A{i}."}]})
                            + "\n" for i in range(n)))
    return path


def test_prepare_replaces_its_output_only_when_asked_and_never_its_data(tiny_llama_dir, tmp_path, capsys):
    verifier = str(tiny_llama_dir())
    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "prep"
    argv = ["prepare", "--data", str(data), "--verifier", verifier, "--out", str(out), "--val-count", "1"]
    assert cli.main(argv) == 0
    assert cli.main(argv) == 0  # the same inputs and settings: prepared again
    assert cli.main([*argv, "--max-length", "64"]) == 2  # other settings: refused, kept
    assert "other max_length; pass --overwrite" in capsys.readouterr().err
    assert cli.main([*argv, "--max-length", "64", "--overwrite"]) == 0
    # the user's only copy of the data inside --out: refused (replacing the directory would delete it)
    inside = _chats(out / "mine.jsonl")
    argv_inside = ["prepare", "--data", str(inside), "--verifier", verifier, "--out", str(out), "--overwrite"]
    assert cli.main(argv_inside) == 2
    assert "lies inside --out" in capsys.readouterr().err
    assert inside.is_file()
    assert cli.main([*argv, "--max-length", "64"]) == 2  # and a foreign file in our output is never deleted with it
    assert "mine.jsonl, which eagle3-train did not write" in capsys.readouterr().err
    assert inside.is_file()


@pytest.mark.slow
def test_train_refuses_a_foreign_run_dir_and_a_second_writer(tiny_stages, tmp_path, capsys):
    root, _ = tiny_stages
    user = tmp_path / "user"
    (user / "checkpoints" / "step-0").mkdir(parents=True)
    (user / "checkpoints" / "step-0" / "weights.pt").write_text("mine")
    (user / "metrics.jsonl").write_text('{"loss": 1}\n')
    argv = ["train", "--prepared", str(root / "prepared"), "--hidden-states", str(root / "hidden"),
            "--vocab", str(root / "vocab"), "--max-steps", "2", "--ttt-steps", "2", "--token-budget", "512"]
    assert cli.main([*argv, "--out", str(user), "--resume"]) == 2
    assert "not an earlier output of eagle3-train train" in capsys.readouterr().err
    assert (user / "metrics.jsonl").read_text() == '{"loss": 1}\n'
    assert sorted(p.name for p in user.iterdir()) == ["checkpoints", "metrics.jsonl"]
    # a run in progress holds its directory: a second train into it stops
    run = tmp_path / "run"
    with another_writer(f"claimed_output({str(run)!r}, 'train', 'x')") as (holder, _):
        assert cli.main([*argv, "--out", str(run)]) == 2
        assert f"being written by another process (pid {holder.pid})" in capsys.readouterr().err
    assert cli.main([*argv, "--out", str(run)]) == 0
    # a pointer to a checkpoint that is gone: an error, not a fresh start over the older checkpoints
    pointer = run / "checkpoints" / "latest.json"
    pointer.write_text(json.dumps({"dir": "step-0000009"}))
    assert cli.main([*argv, "--out", str(run), "--resume", "--max-steps", "3"]) == 2
    assert "points to step-0000009, which is missing" in capsys.readouterr().err
    pointer.write_text(json.dumps({"dir": "../../elsewhere"}))
    assert cli.main([*argv, "--out", str(run), "--resume", "--max-steps", "3"]) == 2
    assert "not a checkpoint of this run" in capsys.readouterr().err


def test_evaluate_and_convert_verifier_refuse_foreign_directories(run_dir, tmp_path, capsys):
    models = _foreign(tmp_path / "models")
    (models / "results.json").write_text('{"mine": true}')
    (models / "config.json").write_text('{"mine": true}')
    assert cli.main(["evaluate", "offline", "--draft", str(run_dir), "--verifier", "smollm2-135m-instruct",
                     "--out", str(models)]) == 2
    assert "not an earlier output of eagle3-train evaluate" in capsys.readouterr().err
    assert cli.main(["convert-verifier", "smollm2-135m-instruct", "--out", str(models)]) == 2
    assert "not an earlier output of eagle3-train convert-verifier" in capsys.readouterr().err
    assert json.loads((models / "results.json").read_text()) == {"mine": True}
    assert json.loads((models / "config.json").read_text()) == {"mine": True}
    copy = tmp_path / "copy"
    for _ in range(2):  # a copy of its own is refreshed
        assert cli.main(["convert-verifier", "smollm2-135m-instruct", "--out", str(copy)]) == 0
    assert (copy / "config.json").is_file() and read_marker(copy)["stage"] == "convert-verifier"
    assert os.listdir(tmp_path).count("copy") == 1


def test_an_empty_directory_another_stage_claimed_is_taken_over(tiny_stages, tmp_path):
    """A stage that claimed a directory and failed before writing into it leaves only its marker; the directory is
    still empty, so another stage may use it, and it is then marked as that stage's: a rerun of that stage is not
    refused as "the output of" the first."""
    root, _ = tiny_stages
    out = tmp_path / "vocab"
    out.mkdir()
    write_marker(out, "prepare", [])
    argv = ["vocab", "--prepared", str(root / "prepared"), "--size", "64", "--out", str(out)]
    assert cli.main(argv) == 0
    assert read_marker(out)["stage"] == "vocab"
    assert cli.main(argv) == 0


# --- ownership by file list (issue 38) -----------------------------------------------------------------------------

def _copy_without_dot_files(src: Path, dst: Path) -> Path:
    """What `cp -r out/* copy/` makes: every entry but the dot files (our marker among them), plus a user file."""
    dst.mkdir()
    for entry in src.iterdir():
        if not entry.name.startswith("."):
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, dst / entry.name)
    (dst / "NOTES.txt").write_text("mine")
    return dst


def test_a_copy_without_its_dot_files_is_refused_by_every_stage_and_adopted_on_request(tiny_stages, run_dir,
                                                                                        tmp_path, capsys):
    """A `manifest.json` proves nothing: a copy without the marker is the user's until `adopt` says otherwise."""
    root, verifier = tiny_stages
    export = tmp_path / "draft"
    assert cli.main(["export", str(run_dir), "--out", str(export), "--format", "eagle"]) == 0
    commands = {
        "prepare": (root / "prepared", ["prepare", "--data", "sharegpt", "--verifier", str(verifier), "--limit", "4",
                                        "--max-length", "192", "--val-count", "3", "--seed", "0", "--out"]),
        "vocab": (root / "vocab", ["vocab", "--prepared", str(root / "prepared"), "--size", "1024", "--out"]),
        "extract": (root / "hidden", ["extract", "--prepared", str(root / "prepared"), "--verifier", str(verifier),
                                      "--dtype", "float32", "--out"]),
        "export": (export, ["export", str(run_dir), "--format", "eagle", "--out"]),
        "convert-verifier": (None, ["convert-verifier", str(verifier), "--out"]),
    }
    for stage, (source, argv) in commands.items():
        if source is None:  # a converted verifier: convert once, then copy it
            source = tmp_path / "converted"
            assert cli.main([*argv, str(source)]) == 0
        copy = _copy_without_dot_files(source, tmp_path / f"copy-{stage}")
        before = sorted(p.name for p in copy.iterdir())
        for extra in ([], [] if stage == "convert-verifier" else ["--overwrite"]):
            assert cli.main([*argv, str(copy), *extra]) == 2, stage
            err = capsys.readouterr().err
            # named where the copy is recognisable (a converted HF verifier carries no record of the conversion)
            assert f"eagle3-train adopt {copy} --stage {stage}" in err or (
                stage == "convert-verifier" and "not an earlier output" in err), (stage, err)
        assert sorted(p.name for p in copy.iterdir()) == before and (copy / "NOTES.txt").read_text() == "mine"
        # adopted, every entry (NOTES.txt too: the user said so) is that stage's output
        assert cli.main(["adopt", str(copy), "--stage", stage]) == 0
        assert "NOTES.txt" in capsys.readouterr().out
        assert read_marker(copy)["files"] == before


def test_a_failed_replacing_run_leaves_no_marker_and_an_empty_listing_owns_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    with pytest.raises(RuntimeError), atomic_dir(out, "export"):
        raise RuntimeError("the export failed")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # a marker that lists nothing (an older failed run's): the user's files put there later are never replaced
    out.mkdir()
    write_marker(out, "export", [])
    (out / "serve.sh").write_text("vllm serve ...")
    assert cli.main(["export", str(run_dir), "--out", str(out), "--format", "eagle", "--overwrite"]) == 2
    assert "serve.sh, which eagle3-train did not write" in capsys.readouterr().err
    assert (out / "serve.sh").read_text() == "vllm serve ..."


def test_remove_owned_deletes_only_what_the_marker_lists(tmp_path):
    d = _dir_with(tmp_path / "old", "ours")
    write_marker(d, "export", ["data"])
    (d / "LICENSE.txt").write_text("mine")  # put there after the claim: a replacement must not take it along
    assert remove_owned(d) == ["LICENSE.txt"]
    assert sorted(p.name for p in d.iterdir()) == [MARKER, "LICENSE.txt"]
    (d / "LICENSE.txt").unlink()
    assert remove_owned(d) == [] and not d.exists()
    # a marker naming anything but a plain entry is no marker of ours: nothing is deleted through it
    d = _dir_with(tmp_path / "evil", "x")
    (tmp_path / "victim.txt").write_text("mine")
    (d / MARKER).write_text(json.dumps({"tool": "eagle3-train", "stage": "export", "files": ["../victim.txt"]}))
    assert read_marker(d) is None and remove_owned(d) == ["data"]
    assert (tmp_path / "victim.txt").read_text() == "mine"


def test_set_aside_moves_only_listed_entries(tmp_path):
    d = _dir_with(tmp_path / "train", "ours")
    write_marker(d, "train", ["data"])
    (d / "NOTES.txt").write_text("mine")
    aside = set_aside(d)
    assert sorted(p.name for p in aside.iterdir()) == [MARKER, "data"]
    assert (d / "NOTES.txt").read_text() == "mine" and read_marker(d)["files"] == []


def test_extract_overwrite_never_touches_a_backup_directory_of_shards(tiny_stages, tmp_path):
    """`extract --overwrite` replaces the shards of the splits it wrote, not those of a user's `train.bak/`."""
    root, verifier = tiny_stages
    out = tmp_path / "hidden"
    argv = ["extract", "--prepared", str(root / "prepared"), "--verifier", str(verifier), "--dtype", "float32",
            "--max-samples", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    shutil.copytree(out / "train", out / "train.bak")
    backup = {p.name: p.read_bytes() for p in (out / "train.bak").iterdir()}
    assert any(n.startswith("shard-") for n in backup)
    assert cli.main([*argv, "--overwrite", "--max-samples", "3"]) == 0
    assert {p.name: p.read_bytes() for p in (out / "train.bak").iterdir()} == backup
