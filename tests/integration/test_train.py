"""Training on real extracted hidden states of a tiny random Llama verifier: learning, resume, DDP, metadata."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.stage_helpers import train_config
from support.torchrun_helpers import torchrun as run_torchrun

from eagle3_train import cli
from eagle3_train.data.prepare import prepare
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError


@pytest.fixture(scope="module")
def stages(tiny_stages):
    return tiny_stages


config = train_config


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.slow
def test_training_learns_and_records_metadata(stages, tmp_path):
    root, _ = stages
    result = train(config(root, tmp_path / "run", epochs=4))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["split"] == "train"]
    assert tr[-1]["loss_0"] < 0.8 * tr[0]["loss_0"], (tr[0]["loss_0"], tr[-1]["loss_0"])
    assert tr[-1]["acc_0"] > tr[0]["acc_0"], (tr[0]["acc_0"], tr[-1]["acc_0"])
    val = result["validation"]
    assert 1.0 <= val["accept_len_k1"] <= val["accept_len_k2"] <= val["accept_len_k3"] <= 4.0
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 10_000
    meta = json.loads((tmp_path / "run" / "training_metadata.json").read_text())
    assert meta["init"] == {"method": "random", "seed": 0, "lm_head_init": "verifier"}
    assert meta["run"]["status"] == "finished"
    assert meta["data"]["prepared_manifest_sha256"] and meta["vocab"]["sha256"]
    assert meta["verifier"]["config_sha256"]
    assert meta["settings"]["ttt_steps"] == 3 and meta["environment"]["versions"]["torch"]
    assert (tmp_path / "run" / "checkpoints" / "best" / "model.safetensors").is_file()


@pytest.mark.slow
def test_auto_precision_follows_the_hardware_and_is_recorded(stages, tmp_path, monkeypatch):
    root, _ = stages
    runs = {}
    for env, expected in (("1", "bf16"), ("0", "fp32")):  # native bf16 on this CPU, or not
        monkeypatch.setenv("EAGLE3_TRAIN_CPU_BF16", env)
        out = tmp_path / expected
        train(config(root, out, max_steps=3))
        meta = json.loads((out / "training_metadata.json").read_text())
        assert meta["settings"]["precision"] == "auto"
        assert (meta["run"]["precision"], meta["run"]["device"]) == (expected, "cpu")
        runs[expected] = weights(out)
    # bf16 autocast really ran: same data, seed and steps, other weights
    assert any(not torch.equal(runs["bf16"][k], runs["fp32"][k]) for k in runs["fp32"])


@pytest.mark.slow
def test_resume_continues_exactly(stages, tmp_path):
    root, _ = stages
    straight = tmp_path / "straight"
    train(config(root, straight, max_steps=6, noise=0.05))
    interrupted = tmp_path / "interrupted"
    first = train(config(root, interrupted, max_steps=6, noise=0.05, stop_after=3))
    assert first["stopped"] and first["step"] == 3
    with pytest.raises(Eagle3InputError, match="--resume"):
        train(config(root, interrupted, max_steps=6, noise=0.05))
    with pytest.raises(Eagle3InputError, match=r"other settings.*lr 0.003 -> 0.001"):  # never mix two runs
        train(config(root, interrupted, max_steps=6, noise=0.05, resume=True, lr=1e-3))
    train(config(root, interrupted, max_steps=6, noise=0.05, resume=True))
    a, b = weights(straight), weights(interrupted)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lines = [json.loads(x) for x in (interrupted / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if r["split"] == "train"]
    assert steps == sorted(set(steps)) == list(range(1, 7))  # no duplicated or missing log lines
    again = train(config(root, straight, max_steps=1, overwrite=True))  # --overwrite sets the old run aside
    (aside,) = tmp_path.glob("straight.previous-*")
    assert again["step"] == 1 and all(torch.equal(a[k], v) for k, v in weights(aside).items())


@pytest.mark.slow
def test_a_run_killed_between_its_last_checkpoint_and_final_resumes_without_logging_twice(stages, tmp_path):
    """The kill campaign found it: killed after the end-of-training checkpoint (validation already logged) but before
    final/ was written, the resumed run validated and logged step N a second time."""
    root, _ = stages
    run = tmp_path / "run"
    train(config(root, run, max_steps=4))
    before = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "final")  # what the kill leaves: checkpoints/step-0000004 and its metrics, no final/
    again = train(config(root, run, max_steps=4, resume=True))
    assert again["step"] == 4 and (run / "final").is_dir()
    assert (run / "metrics.jsonl").read_text() == before
    rows = [json.loads(x) for x in before.splitlines()]
    assert [r["step"] for r in rows if r["split"] == "validation"] == [4]


@pytest.mark.slow
@pytest.mark.parametrize("resume", [True, False])
def test_a_run_killed_before_its_first_checkpoint_starts_over_without_its_metric_lines(stages, tmp_path, resume):
    """The kill campaign found it: killed after logging a few steps but before the first checkpoint, the rerun
    (fresh, with or without --resume) appended to the killed run's metrics.jsonl."""
    root, _ = stages
    run = tmp_path / "run"
    train(config(root, run, max_steps=4))
    before = (run / "metrics.jsonl").read_text()
    # What the kill leaves: metric lines of the steps it trained, no checkpoint, no final/.
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").write_text("".join(before.splitlines(keepends=True)[:2]))
    again = train(config(root, run, max_steps=4, resume=resume))
    assert again["step"] == 4
    strip = ("time", "tokens_per_s")
    a, b = ([{k: v for k, v in json.loads(x).items() if k not in strip} for x in text.splitlines()]
            for text in (before, (run / "metrics.jsonl").read_text()))
    assert a == b
    assert [r["step"] for r in b if r["split"] == "train"] == [1, 2, 3, 4]

@pytest.mark.slow
def test_a_run_killed_after_a_periodic_checkpoint_of_its_last_step_resumes_to_the_same_record(stages, tmp_path):
    """Killed after the periodic save of the run's last step and after the final validation was logged (the kill
    campaign found it): the resumed run logs that validation once, with the epoch an uninterrupted run gives it."""
    from eagle3_train.checkpoints import native as ckpt

    root, _ = stages
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    steps = train(config(root, straight, epochs=1))["step"]
    train(config(root, killed, epochs=1, save_every=steps))
    # What the kill leaves: the periodic checkpoint of the last step (its epoch still open, nothing validated, the
    # metric lines up to that step's train row), the final validation already logged, no final/. The end-of-training
    # save overwrote that checkpoint, so write it back.
    shutil.rmtree(killed / "final")
    path = killed / "checkpoints" / f"step-{steps:07d}" / ckpt.STATE
    state = ckpt.load_training_state(path)
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 0)
    rows = (killed / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["split"] == "validation" and state["metrics_lines"] == len(rows)
    state.update(epoch=0, batch_in_epoch=steps, validated_step=-1, metrics_lines=len(rows) - 1)
    torch.save(state, path)
    train(config(root, killed, epochs=1, save_every=steps, resume=True))
    strip = ("time", "tokens_per_s")
    a, b = ([{k: v for k, v in json.loads(x).items() if k not in strip}
             for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (straight, killed))
    assert a == b and a[-1]["split"] == "validation"


class _RunsCode:
    """Unpickling this runs code: what a hostile training_state.pt would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.slow
def test_resume_refuses_a_training_state_that_would_run_code(stages, tmp_path):
    root, _ = stages
    run = tmp_path / "run"
    train(config(root, run, max_steps=4, stop_after=2))
    state_file = next((run / "checkpoints").glob("step-*")) / "training_state.pt"
    state = torch.load(state_file, weights_only=False)  # our own file: trusted here
    marker = tmp_path / "code-ran"
    torch.save({**state, "extra": _RunsCode(marker)}, state_file)
    with pytest.raises(Eagle3InputError, match=r"refusing to load .*training_state\.pt"):
        train(config(root, run, max_steps=4, resume=True))
    assert not marker.exists()


@pytest.mark.slow
def test_run_killed_mid_epoch_resumes_bit_exact_from_a_timed_checkpoint(stages, tmp_path):
    """No epoch ends before the kill: only the time-based checkpoint (checkpoint_every_minutes, here tiny so that
    every step is due) leaves something to resume, and the resumed run equals an uninterrupted one."""
    root, _ = stages
    steps = 12
    straight = tmp_path / "straight"
    train(config(root, straight, max_steps=steps, epochs=1, noise=0.05))
    killed = tmp_path / "killed"
    script = ("import sys; from pathlib import Path; from support.stage_helpers import train_config; "
              "from eagle3_train.train.trainer import train; "
              f"train(train_config(Path({str(root)!r}), Path({str(killed)!r}), max_steps={steps}, epochs=1, "
              "noise=0.05, checkpoint_every_minutes=1e-6, keep_last=100))")
    tests = str(Path(__file__).resolve().parents[1])  # the support package's parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    pointer = killed / "checkpoints" / "latest.json"
    try:
        while proc.poll() is None:
            if pointer.is_file() and json.loads(pointer.read_text())["dir"] >= "step-0000002":
                proc.kill()
                break
            time.sleep(0.02)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == -9, err[-2000:]
    assert not (killed / "final").exists()
    at = json.loads(pointer.read_text())["dir"]
    assert "step-0000002" <= at < f"step-{steps:07d}"
    train(config(root, killed, max_steps=steps, epochs=1, noise=0.05, resume=True))
    a, b = weights(straight), weights(killed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_best_checkpoint_is_ranked_at_the_exported_k(stages, tmp_path):
    import inspect

    from eagle3_train.export.exporter import export

    k = inspect.signature(export).parameters["speculative_tokens"].default  # what `export` writes for serving
    root, _ = stages
    result = train(config(root, tmp_path / "run", ttt_steps=k + 1, max_steps=6, eval_every=1, max_eval_batches=1))
    key = f"accept_len_k{k}"
    val = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r["split"] == "validation"]
    top = max(r[key] for r in val)
    assert result["best"] == {key: top, "step": next(r["step"] for r in val if r[key] == top)}
    best = json.loads((tmp_path / "run" / "checkpoints" / "best" / "training_metadata.json").read_text())
    assert best["progress"]["step"] == result["best"]["step"]


@pytest.mark.slow
def test_recomputation_in_backward_changes_memory_not_results(stages, tmp_path):
    """checkpoint_loss / checkpoint_mlp recompute activations in backward: same training, within float rounding."""
    root, _ = stages
    # AdamW: Muon's bf16 Newton-Schulz would turn the recomputation's float roundings into bf16 steps
    kept = train(config(root, tmp_path / "kept", max_steps=4, checkpoint_loss=False, checkpoint_mlp=False,
                        optimizer="adamw"))
    recomputed = train(config(root, tmp_path / "recomputed", max_steps=4, optimizer="adamw"))
    a, b = weights(tmp_path / "kept"), weights(tmp_path / "recomputed")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    assert kept["train"]["loss"] == pytest.approx(recomputed["train"]["loss"], rel=1e-5)


@pytest.mark.slow
def test_two_process_data_parallel_matches_single_process(stages, tmp_path):
    root, _ = stages
    single = tmp_path / "single"
    # AdamW: the engines' arithmetic; Muon's bf16 Newton-Schulz is compared at its own tolerance in
    # test_parallel_engines.py
    train(config(root, single, max_steps=3, grad_accum=2, optimizer="adamw"))
    ddp = tmp_path / "ddp"
    args = ["--prepared", str(root / "prepared"), "--hidden-states", str(root / "hidden"), "--vocab",
            str(root / "vocab"), "--out", str(ddp), "--ttt-steps", "3", "--token-budget", "512", "--lr", "3e-3",
            "--max-steps", "3", "--seed", "0", "--set", "train.warmup_ratio=0.1", "--set", "train.tensorboard=false",
            "--set", "train.optimizer=adamw"]
    proc = run_torchrun(["-m", "eagle3_train.cli", "train", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((ddp / "training_metadata.json").read_text())
    assert meta["run"]["world_size"] == 2
    a, b = weights(single), weights(ddp)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_refuses_hidden_states_of_other_data(stages, tmp_path, tiny_llama_dir):
    root, verifier = stages
    prepare("sharegpt", verifier, tmp_path / "other", max_length=128, limit=5, seed=1)
    with pytest.raises(Eagle3InputError, match="extracted from other data"):
        train(config(root, tmp_path / "run", prepared=str(tmp_path / "other"), max_steps=1))


@pytest.mark.slow
def test_refuses_hidden_states_with_unsorted_layer_ids(stages, tmp_path):
    root, _ = stages
    hidden = tmp_path / "hidden"
    shutil.copytree(root / "hidden", hidden)
    manifest = json.loads((hidden / "manifest.json").read_text())
    manifest["layer_ids"] = manifest["layer_ids"][::-1]  # as an older extract stored `--layer-ids 3,2,1`
    (hidden / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Eagle3InputError,
                       match=r"manifest\.json: aux layer ids .* are not in increasing order.*--overwrite"):
        train(config(root, tmp_path / "run", hidden_states=str(hidden), max_steps=1))


def _damaged_copy(root: Path, tmp_path: Path) -> tuple[Path, Path]:
    hidden = tmp_path / "hidden"
    shutil.copytree(root / "hidden", hidden)
    return hidden, sorted((hidden / "train").glob("shard-*.safetensors"))[-1]


def _repair_command(message: str) -> list[str]:
    found = re.search(r"delete that file and run `(eagle3-train extract [^`]*)`", message)
    assert found, message
    return shlex.split(found.group(1))[1:]


@pytest.mark.slow
def test_truncated_shard_stops_before_training_naming_it_and_the_repair(stages, tmp_path):
    root, _ = stages
    hidden, shard = _damaged_copy(root, tmp_path)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(Eagle3InputError, match=rf"{re.escape(str(shard))} has \d+ bytes but index.json records"):
        train(config(root, tmp_path / "run", hidden_states=str(hidden), max_steps=1))
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any step
    with pytest.raises(Eagle3InputError) as e:
        train(config(root, tmp_path / "run", hidden_states=str(hidden), max_steps=1))
    shard.unlink()
    assert cli.main(_repair_command(str(e.value))) == 0  # the command it names re-extracts the shard
    train(config(root, tmp_path / "run", hidden_states=str(hidden), max_steps=1))


@pytest.mark.slow
def test_shard_with_other_bytes_or_nan_stops_clearly(stages, tmp_path):
    root, _ = stages
    hidden, shard = _damaged_copy(root, tmp_path)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, other content
    shard.write_bytes(bytes(data))
    with pytest.raises(Eagle3InputError, match=rf"{re.escape(str(shard))} is corrupt \(its SHA-256 differs"):
        train(config(root, tmp_path / "run", hidden_states=str(hidden), max_steps=1))

    # NaN written into a shard whose index entry matches it (e.g. an extract from before the finiteness check).
    shutil.copy2(root / "hidden" / "train" / shard.name, shard)
    with safe_open(str(shard), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["aux"][:, 0] = float("nan")  # in every sample: the first step reads it
    save_file(tensors, str(shard), metadata=meta)
    index = json.loads((hidden / "train" / "index.json").read_text())
    entry = next(x for x in index["shards"] if x["file"] == shard.name)
    entry.update(bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (hidden / "train" / "index.json").write_text(json.dumps(index))
    with pytest.raises(Eagle3InputError, match=rf"{re.escape(str(shard))} holds NaN/Inf in 'aux' for sample"):
        train(config(root, tmp_path / "run2", hidden_states=str(hidden), max_steps=2))


@pytest.mark.slow
def test_refuses_a_different_verifier(stages, tmp_path, tiny_llama_dir):
    root, _ = stages
    other = tiny_llama_dir(initializer_range=0.5, num_hidden_layers=6)
    with pytest.raises(Eagle3InputError, match="not the one the hidden states"):
        train(config(root, tmp_path / "run", verifier=str(other), max_steps=1))


@pytest.mark.slow
def test_two_nodes_train_as_one_sharded_run(stages, tmp_path):
    """The multi-node launch of `eagle3-train launch` and scripts/slurm_train.sbatch, with two CPU processes standing
    in for two machines: one torchrun per node (--nnodes 2, c10d rendezvous on the first), FSDP across them; the same
    weights as one process with grad_accum 2 (fp32: FSDP gathers the fp32 weights themselves)."""
    import socket

    from eagle3_train.launch import LaunchSettings, node_command

    root, _ = stages
    single = tmp_path / "single"
    train(config(root, single, max_steps=3, grad_accum=2, precision="fp32", optimizer="adamw"))
    out = tmp_path / "nodes"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--prepared", str(root / "prepared"), "--hidden-states", str(root / "hidden"), "--vocab",
            str(root / "vocab"), "--out", str(out), "--ttt-steps", "3", "--token-budget", "512", "--lr", "3e-3",
            "--max-steps", "3", "--seed", "0", "--set", "train.warmup_ratio=0.1", "--set", "train.tensorboard=false",
            "--precision", "fp32", "--set", "train.parallel=fsdp", "--set", "train.optimizer=adamw"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # `eagle3-train launch`'s command, run once per "machine"
    cmd = node_command(LaunchSettings(2, 1, f"127.0.0.1:{port}", ["train", *args]),
                       [sys.executable, "-m", "torch.distributed.run"])
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in (0, 1)]
    for p in nodes:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    run = json.loads((out / "training_metadata.json").read_text())["run"]
    assert (run["world_size"], run["parallel"]) == (2, "fsdp")
    a, b = weights(single), weights(out)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_a_step_whose_gradients_blow_up_stops_before_it_is_applied(stages, tmp_path):
    """A finite but absurd lr drives the weights to inf within a few steps: the run stops at the first step whose
    loss or gradients are NaN/inf, names it, and the checkpoints it kept are finite (it used to finish, exit 0,
    with a draft of NaN)."""
    root, _ = stages
    out = tmp_path / "run"
    with pytest.raises(Eagle3InputError, match=r"training stopped at step \d+: .* is NaN/inf.*--resume"):
        train(config(root, out, max_steps=40, lr=1e30, grad_clip=0.0, warmup_ratio=0.0, save_every=1))
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())["dir"]
    saved = load_file(str(out / "checkpoints" / latest / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in saved.values() if t.is_floating_point())
