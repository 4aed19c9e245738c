"""torch's engines under real torchrun (2 CPU processes, gloo): DDP and FSDP2 train the single process's run, a
sharded checkpoint resumes bit for bit after kill -9 and on another number of processes, two loopback "nodes"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.stage_helpers import train_config
from support.torchrun_helpers import free_port
from support.torchrun_helpers import torchrun as run_torchrun

from eagle3_train.train.trainer import train

pytestmark = pytest.mark.slow

# fp32: FSDP all-gathers the fp32 master weights themselves, so every rank computes exactly what DDP's ranks compute;
# only the order in which gradients are summed differs (reduce-scatter vs all-reduce vs accumulation in one process)
# and one float32 rounding of a sum, ~1e-7 relative, grows through 4 AdamW steps at lr 3e-3 to well under 1e-4.
# AdamW, not the default Muon, whose bf16 Newton-Schulz turns such roundings into bf16 steps: the Muon tests below
# compare at that tolerance.
FLAGS = ["--ttt-steps", "3", "--token-budget", "512", "--lr", "3e-3", "--seed", "0", "--log-every", "1",
         "--precision", "fp32", "--set", "train.warmup_ratio=0.1", "--set", "train.tensorboard=false",
         "--set", "train.optimizer=adamw"]


@pytest.fixture(scope="module")
def stages(tiny_stages):
    return tiny_stages[0]


def _args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", "eagle3_train.cli", "train", "--prepared", str(root / "prepared"), "--hidden-states",
            str(root / "hidden"), "--vocab", str(root / "vocab"), "--out", str(out), *FLAGS, *extra]


def torchrun(root: Path, out: Path, *extra: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`train` under torchrun, 2 processes; `ok`: it must succeed."""
    proc = run_torchrun(_args(root, out, *extra))
    assert proc.returncode == 0 or not ok, proc.stderr[-4000:]
    return proc


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def curve(run: Path, key: str = "loss", split: str = "train") -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r[key] for r in rows if r["split"] == split]


def assert_same_run(a: Path, b: Path, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    ca, cb = curve(a), curve(b)
    assert len(ca) == len(cb) >= 3 and all(abs(x - y) <= rtol * abs(y) + atol for x, y in zip(ca, cb)), (ca, cb)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=atol, msg=k)


def test_ddp_and_fsdp_train_what_one_process_trains(stages, tmp_path):
    single = tmp_path / "single"
    train(train_config(stages, single, max_steps=4, grad_accum=2, precision="fp32", optimizer="adamw"))
    for engine in ("ddp", "fsdp"):
        out = tmp_path / engine
        torchrun(stages, out, "--max-steps", "4", "--set", f"train.parallel={engine}")
        meta = json.loads((out / "training_metadata.json").read_text())
        run = meta["run"]
        assert (run["world_size"], run["parallel"], run["ttt_attention"]) == (2, engine, "merged")
        assert_same_run(out, single)
        # the final weights are whole (gathered), so export and finetune read them as a single process's
        assert weights(out)["fc.weight"].shape == weights(single)["fc.weight"].shape
    # FSDP's checkpoints hold the optimizer states as each rank's shard, torch.distributed.checkpoint's format
    step = tmp_path / "fsdp" / "checkpoints" / "step-0000004"
    assert sorted(p.name for p in (step / "optimizer").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]

    # 2 -> 1 process: the 2 x 1 micro-batches of a step become grad_accum 2 (the same steps over the same data)
    moved = tmp_path / "moved"
    torchrun(stages, moved, "--max-steps", "4", "--set", "train.parallel=fsdp", "--stop-after", "2")
    result = train(train_config(stages, moved, max_steps=4, precision="fp32", optimizer="adamw", resume=True,
                                parallel="fsdp"))
    assert result["step"] == 4
    assert_same_run(moved, single)
    # ... and 1 -> 2 processes, under DDP (either engine reads the other's checkpoints)
    back = tmp_path / "back"
    train(train_config(stages, back, max_steps=4, grad_accum=2, precision="fp32", optimizer="adamw", stop_after=2))
    torchrun(stages, back, "--max-steps", "4", "--set", "train.parallel=ddp", "--resume")
    assert json.loads((back / "training_metadata.json").read_text())["settings"]["grad_accum"] == 1
    assert_same_run(back, single)


def test_a_killed_fsdp_run_resumes_bit_for_bit(stages, tmp_path):
    """Under the default Muon: its momentum, sharded like the weights, resumes to the bit."""
    straight = tmp_path / "straight"
    muon = ("--set", "train.optimizer=muon")
    torchrun(stages, straight, "--max-steps", "6", "--set", "train.parallel=fsdp", "--set", "train.noise=0.05", *muon)
    # kill -9 (both ranks, as a lost node does) as soon as the step-3 checkpoint is in place, then resume
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), *_args(stages, killed, "--max-steps", "6", "--set",
                                                                    "train.parallel=fsdp", "--set", "train.noise=0.05",
                                                                    "--save-every", "1", *muon)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = killed / "checkpoints" / "latest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and json.loads(latest.read_text())["dir"] >= "step-0000003":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists()
    torchrun(stages, killed, "--max-steps", "6", "--set", "train.parallel=fsdp", "--set", "train.noise=0.05",
             "--save-every", "1", "--resume", *muon)
    a, b = weights(straight), weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert curve(killed) == curve(straight)



SHARDED_MUON_STEP = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from eagle3_train.train.optimizer import ShardedMuon
dist.init_process_group("gloo")
torch.manual_seed(0)
shapes = [(7, 5), (6, 9), (8, 8)]  # odd rows: FSDP pads the last rank's shard
weights = [torch.randn(s) for s in shapes]
grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
sharded = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in weights])
fully_shard(sharded)
whole = [torch.nn.Parameter(w.clone()) for w in weights]
kw = dict(lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
opt_s, opt_w = ShardedMuon(list(sharded), **kw), torch.optim.Muon(whole, **kw)
for step in grads:
    for p, q, g in zip(sharded, whole, step):
        p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
        q.grad = g.clone()
    opt_s.step()
    opt_w.step()
for p, q in zip(sharded, whole):
    assert torch.equal(p.full_tensor(), q.detach()), (p.full_tensor() - q).abs().max()
print("EQUAL", flush=True)
# FSDP's module and the DTensors hold the group: dropped before it is destroyed, as Trainer.release does (left to
# the interpreter's exit, gloo aborted with "terminate called ..." in 5-7 of 40 runs on a loaded host; 0 of 80 so)
del sharded, opt_s, p
import gc; gc.collect()
dist.destroy_process_group()
"""


def test_muon_under_fsdp_takes_torchs_muon_steps_exactly(tmp_path):
    """On the same gradients, ShardedMuon over row-sharded DTensors (uneven shards too) updates every weight
    bit for bit as torch.optim.Muon does on whole matrices: three steps, momentum and weight decay included."""
    script = tmp_path / "sharded_muon.py"
    script.write_text(SHARDED_MUON_STEP)
    proc = run_torchrun([str(script)])
    assert proc.returncode == 0 and "EQUAL" in proc.stdout, proc.stderr[-3000:]


def test_muon_under_fsdp_trains_what_ddp_trains(stages, tmp_path):
    """A whole run: Muon's Newton-Schulz runs in bf16 (torch's Muon), so the last-bit differences of the gradient
    sums (reduce-scatter vs all-reduce) round to different bf16 values in some update entries, ~0.4% of an entry, and
    the runs drift apart by about that much of the steps' updates: observed 1.1e-3 at most on weights of scale 0.08
    after 4 steps at muon_lr 0.01. Bounds: losses within 1e-3 relative, weights within 3e-3."""
    muon = ("--max-steps", "4", "--set", "train.optimizer=muon", "--set", "train.muon_lr=0.01")
    for engine in ("ddp", "fsdp"):
        torchrun(stages, tmp_path / engine, *muon, "--set", f"train.parallel={engine}")
    assert_same_run(tmp_path / "fsdp", tmp_path / "ddp", rtol=1e-3, atol=3e-3)
    # and Muon did act: the run is not AdamW's
    torchrun(stages, tmp_path / "adamw", "--max-steps", "4", "--set", "train.parallel=fsdp")
    assert (weights(tmp_path / "adamw")["fc.weight"] - weights(tmp_path / "fsdp")["fc.weight"]).abs().max() > 0.01


IDLE_STEP = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
from safetensors.torch import save_file
from support.stage_helpers import train_config
from eagle3_train.train.batching import plan_batches
from eagle3_train.train.trainer import Trainer
from eagle3_train.utils.distributed import destroy

root, out, engine = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
t = Trainer(train_config(root, out, precision="fp32", optimizer="adamw", parallel=engine, max_steps=2))
plan = plan_batches(t.train_data.lengths, t.cfg.token_budget, t.cfg.seed, 0)
sums, tokens = t.train_step([plan[0]])  # one micro-batch for the step: under torchrun rank 1 has none
val = t.evaluate()
weights = t.engine.full_state_dict()
if t.info.is_main:
    out.mkdir(parents=True, exist_ok=True)
    save_file({{k: v.contiguous() for k, v in weights.items()}}, str(out / "weights.safetensors"))
    (out / "result.json").write_text(json.dumps({{"loss": sums.summary()["loss"], "tokens": tokens,
                                                  "val_loss": val["loss"], "world": t.info.world_size}}))
t.release()  # DDP/FSDP hold the group: released before it is destroyed, as train() does
destroy(t.info)
"""


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_rank_without_a_micro_batch_runs_idle_and_the_step_is_one_processs(stages, tmp_path, engine):
    """A rank short of micro-batches (the source skipped all of one) runs a batch that supervises nothing, so the
    collectives stay in step: the update and the validation equal one process's on the same micro-batch."""
    script = tmp_path / "idle_step.py"
    script.write_text(IDLE_STEP.format(tests=str(Path(__file__).resolve().parents[1])))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, str(script), str(stages), str(tmp_path / "single"), engine],
                            capture_output=True, text=True, env=env, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    ranks = run_torchrun([str(script), str(stages), str(tmp_path / "ranks"), engine], timeout=300)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("single", "ranks"))
    assert (a["world"], b["world"]) == (1, 2) and a["tokens"] == b["tokens"] > 0
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    wa, wb = (load_file(str(tmp_path / d / "weights.safetensors")) for d in ("single", "ranks"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6, msg=k)
