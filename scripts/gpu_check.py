"""One self-contained GPU check of eagle3-train: the real pipeline on CUDA in bf16, torchrun/NCCL, and the training
step's throughput at users' shapes. Every part runs in its own process with its own time limit; a failed part is
recorded and the independent ones still run. Results: OUT/summary.json, OUT/summary.md, OUT/log.txt (all output),
OUT/bench.json, OUT/train-metrics.jsonl.

Inputs come from the (git-ignored) carry folder `.gpucheck/`: `verifier/` (SmolLM2-135M-Instruct's config, tokenizer
and chat template; the weights are made random here, the real ones are too big to carry), `sharegpt-120.jsonl` (the
first ShareGPT conversations) and `prompts.txt`. Parts:

  pipeline: prepare -> vocab -> extract (HF, --device cuda) -> train (bf16, TTT 3, stopped after 25 of 40 steps) ->
            train --resume (to 40) -> export eagle + speculators -> load both exports -> evaluate offline (cuda)
  torchrun: the same train stage under `torchrun --nproc_per_node 1`
  extract-torchrun: the extract stage under `torchrun --nproc_per_node gpu` (a verifier replica per GPU, disjoint
            shards, one store), its tensors compared with the single-process store's
  fsdp:     `train --set train.parallel=fsdp` under torchrun (NCCL; one GPU: a group of one rank, every FSDP2 piece
            runs: bf16 all-gather, fp32 reduce-scatter, the sharded optimizer checkpoint), stopped, resumed and
            exported; its losses against the torchrun part's (same steps, replicated)
  ttt-kernel: the merged later-step TTT attention checked against the masked one on the GPU, and the peak memory
            of one step's attention fwd+bwd from 4K to 32K tokens (merged) and to 16K (masked)
  bench:    benchmarks/gpu_train_throughput.py (Llama-3.1-8B and Kimi-K2 shapes, TTT 7 and 3, checkpointing on/off)

  python3 scripts/gpu_check.py --out "$OUT"              # on the GPU machine (scripts/gpu_check.sh sets it up)
  PYTHONPATH=src python scripts/gpu_check.py --tiny   # CPU rehearsal, small sizes (results in /tmp/gpucheck-out)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".gpucheck"


class CheckFailed(Exception):
    pass


class Checker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work)
        self.log_path = self.out / "log.txt"
        self.results: list[dict[str, Any]] = []
        self.deadline = time.monotonic() + args.budget_s
        self.device = args.device
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                               os.environ.get("PYTHONPATH")])),
                    "EAGLE3_TRAIN_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "HF_DATASETS_OFFLINE": "1", "EAGLE3_TRAIN_CACHE": str(self.work / "cache"),
                    "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

    # --- running ------------------------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def sh(self, argv: list[str], timeout: float, name: str) -> tuple[int, str]:
        """Run a command in its own process group (torchrun's workers die with it); output appended to log.txt."""
        remaining = self.deadline - time.monotonic()
        timeout = min(timeout, remaining)
        if timeout < 5:
            raise CheckFailed("no time left in the check's budget")
        self.log(f"\n===== [{name}] $ {' '.join(argv)}  (limit {timeout:.0f} s)")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            self.log(output or "")
            raise CheckFailed(f"timed out after {timeout:.0f} s: {_tail(output)}") from None
        self.log(output or "")
        self.log(f"===== [{name}] rc={proc.returncode} in {time.monotonic() - t0:.1f} s")
        return proc.returncode, output or ""

    def cli(self, stage: list[str], timeout: float, name: str) -> str:
        rc, output = self.sh([sys.executable, "-m", "eagle3_train.cli", *stage], timeout, name)
        if rc != 0:
            raise CheckFailed(f"exit {rc}: {_tail(output)}")
        return output

    def part(self, name: str, fn: Callable[[], dict[str, Any] | None], needs: tuple[str, ...] = ()) -> bool:
        failed_needs = [n for n in needs if not self.ok(n)]
        rec: dict[str, Any] = {"part": name}
        t0 = time.monotonic()
        if failed_needs:
            rec.update(status="skipped", detail=f"needs {', '.join(failed_needs)}")
        elif self.deadline - time.monotonic() < 10:
            rec.update(status="skipped", detail="the check's time budget is spent")
        else:
            try:
                rec.update(status="ok", **(fn() or {}))
            except CheckFailed as e:
                rec.update(status="FAILED", error=str(e))
            except Exception as e:  # noqa: BLE001 - a bug in a check must not stop the others
                rec.update(status="FAILED", error=f"{type(e).__name__}: {e}")
        rec["seconds"] = round(time.monotonic() - t0, 1)
        self.results.append(rec)
        print(f"[{rec['status']:>7}] {name} ({rec['seconds']} s) "
              f"{rec.get('error') or json.dumps({k: v for k, v in rec.items() if k not in ('part', 'status')})}",
              flush=True)
        self.write_summary()
        return rec["status"] == "ok"

    def ok(self, name: str) -> bool:
        return any(r["part"] == name and r["status"] == "ok" for r in self.results)

    def write_summary(self) -> None:
        summary = {"device": self.device, "tiny": self.args.tiny, "parts": self.results,
                   "all_ok": all(r["status"] == "ok" for r in self.results)}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        lines = ["| part | status | s | detail |", "|---|---|---|---|"]
        for r in self.results:
            detail = r.get("error") or r.get("detail") or json.dumps(
                {k: v for k, v in r.items() if k not in ("part", "status", "seconds")}, default=str)
            lines.append(f"| {r['part']} | {r['status']} | {r['seconds']} | {str(detail)[:600].replace('|', '/')} |")
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")

    # --- paths and sizes --------------------------------------------------------------------------------------------
    @property
    def verifier(self) -> Path:
        return self.work / "verifier"

    def p(self, name: str) -> str:
        return str(self.work / name)

    def train_args(self, out: str, max_steps: int, extra: list[str]) -> list[str]:
        return ["train", "--prepared", self.p("prepared"), "--hidden-states", self.p("hidden"), "--vocab",
                self.p("vocab"), "--out", out, "--device", self.device, "--precision", "bf16", "--ttt-steps", "3",
                "--max-steps", str(max_steps), "--epochs", "100", "--lr", "3e-4", "--log-every", str(self.sizes["log"]),
                "--eval-every", str(self.sizes["eval"]), "--max-eval-batches", "4", *extra]

    @property
    def sizes(self) -> dict[str, int]:
        if self.args.tiny:
            return {"limit": 24, "max_length": 256, "vocab": 2048, "steps": 12, "stop": 8, "log": 2, "eval": 6,
                    "ddp_steps": 4, "layers": 8}
        return {"limit": 120, "max_length": 1024, "vocab": 8192, "steps": 40, "stop": 25, "log": 5, "eval": 20,
                "ddp_steps": 8, "layers": 0}

    # --- parts ------------------------------------------------------------------------------------------------------
    def env_part(self) -> dict[str, Any]:
        code = ("import json, importlib.metadata as m, torch\n"
                "names = ['torch', 'transformers', 'tokenizers', 'safetensors', 'datasets', 'dill', 'multiprocess',"
                " 'pyarrow', 'fsspec', 'huggingface-hub', 'accelerate', 'tensorboard', 'numpy']\n"
                "v = {}\n"
                "for n in names:\n"
                "    try: v[n] = m.version(n)\n"
                "    except Exception: v[n] = None\n"
                "c = torch.cuda.is_available()\n"
                "print('ENV ' + json.dumps({'versions': v, 'cuda': c,"
                " 'gpu': torch.cuda.get_device_name(0) if c else None,"
                " 'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if c else None,"
                " 'bf16': torch.cuda.is_bf16_supported() if c else None}))\n"
                "import datasets, eagle3_train.train.trainer, eagle3_train.hidden_states.extract\n")
        rc, output = self.sh([sys.executable, "-c", code], 120, "env")
        if shutil.which("nvidia-smi"):
            self.sh(["nvidia-smi"], 30, "nvidia-smi")
        line = next((x for x in output.splitlines() if x.startswith("ENV ")), None)
        info = json.loads(line[4:]) if line else {}
        if rc != 0:
            raise CheckFailed(f"imports failed (exit {rc}): {_tail(output)} {info}")
        if self.device.startswith("cuda") and not info.get("cuda"):
            raise CheckFailed(f"torch sees no CUDA device: {info}")
        return info

    def verifier_part(self) -> dict[str, Any]:
        argv = [sys.executable, str(Path(__file__).resolve()), "make-verifier", "--src", str(CARRY / "verifier"),
                "--dst", str(self.verifier)]
        if self.sizes["layers"]:
            argv += ["--layers", str(self.sizes["layers"])]
        rc, output = self.sh(argv, 180, "verifier")
        if rc != 0:
            raise CheckFailed(f"exit {rc}: {_tail(output)}")
        return {"dir": str(self.verifier), "random_weights": True}

    def prepare_part(self) -> dict[str, Any]:
        s = self.sizes
        self.cli(["prepare", "--data", str(CARRY / "sharegpt-120.jsonl"), "--verifier", str(self.verifier), "--out",
                  self.p("prepared"), "--max-length", str(s["max_length"]), "--val-count", "8", "--limit",
                  str(s["limit"])], 240, "prepare")
        return {"counts": json.loads((self.work / "prepared" / "manifest.json").read_text()).get("counts")}

    def vocab_part(self) -> dict[str, Any]:
        self.cli(["vocab", "--prepared", self.p("prepared"), "--out", self.p("vocab"), "--size",
                  str(self.sizes["vocab"])], 120, "vocab")
        return {}

    def extract_part(self) -> dict[str, Any]:
        self.cli(["extract", "--prepared", self.p("prepared"), "--verifier", str(self.verifier), "--out",
                  self.p("hidden"), "--device", self.device], 300, "extract")
        m = json.loads((self.work / "hidden" / "manifest.json").read_text())
        return {"throughput": m.get("throughput"), "layer_ids": m.get("layer_ids"),
                "compute_dtype": m.get("compute_dtype")}

    def train_part(self) -> dict[str, Any]:
        s = self.sizes
        out = self.p("train")
        output = self.cli(self.train_args(out, s["steps"], ["--stop-after", str(s["stop"]), "--save-every", "10"]),
                          300, "train")
        latest = self.work / "train" / "checkpoints" / f"step-{s['stop']:07d}"
        if not latest.is_dir():
            raise CheckFailed(f"no checkpoint {latest} after --stop-after {s['stop']}")
        losses = _train_losses(self.work / "train" / "metrics.jsonl")
        if not losses or not all(math.isfinite(x) for _, x in losses):
            raise CheckFailed(f"train losses missing or not finite: {losses}")
        return {"stopped_at": s["stop"], "losses": losses, "result": _last_json(output)}

    def resume_part(self) -> dict[str, Any]:
        s = self.sizes
        output = self.cli(self.train_args(self.p("train"), s["steps"], ["--resume"]), 300, "train-resume")
        if f"at step {s['stop']}" not in output:
            raise CheckFailed(f"the resumed run did not report continuing from step {s['stop']}")
        meta = json.loads((self.work / "train" / "training_metadata.json").read_text())
        if meta["run"].get("ttt_attention") != "merged":
            raise CheckFailed(f"training ran the {meta['run'].get('ttt_attention')} TTT attention, not merged")
        step = meta.get("progress", {}).get("step")
        if step != s["steps"]:
            raise CheckFailed(f"resumed run ended at step {step}, expected {s['steps']}")
        metrics = self.work / "train" / "metrics.jsonl"
        shutil.copy(metrics, self.out / "train-metrics.jsonl")
        losses = _train_losses(metrics)
        steps = [st for st, _ in losses]
        if steps != sorted(set(steps)):
            raise CheckFailed(f"logged steps repeat or go back after the resume: {steps}")
        if not all(math.isfinite(x) for _, x in losses):
            raise CheckFailed(f"non-finite train loss: {losses}")
        first, last = losses[0][1], sum(x for _, x in losses[-2:]) / len(losses[-2:])
        if not last < first:
            raise CheckFailed(f"train loss did not decrease: {first:.4f} -> {last:.4f} ({losses})")
        return {"final_step": step, "loss_first": round(first, 4), "loss_last": round(last, 4),
                "validation": {k: v for k, v in (meta.get("metrics", {}).get("validation") or {}).items()
                               if k in ("loss", "acc_0", "accept_len_k3")},
                "result": _last_json(output)}

    def export_part(self) -> dict[str, Any]:
        for fmt in ("eagle", "speculators"):
            self.cli(["export", self.p("train"), "--out", self.p(f"export-{fmt}"), "--format", fmt], 180,
                     f"export-{fmt}")
        rc, output = self.sh([sys.executable, str(Path(__file__).resolve()), "load-exports", "--work",
                              str(self.work)], 120, "load-exports")
        if rc != 0:
            raise CheckFailed(f"loading the exports failed (exit {rc}): {_tail(output)}")
        return _last_json(output) or {}

    def evaluate_part(self) -> dict[str, Any]:
        # Through the Python API: the `evaluate` CLI also imports the served mode's client (openai), not installed
        # on the GPU machine.
        rc, output = self.sh([sys.executable, str(Path(__file__).resolve()), "evaluate", "--work", str(self.work),
                              "--device", self.device], 180, "evaluate-offline")
        if rc != 0:
            raise CheckFailed(f"exit {rc}: {_tail(output)}")
        return _last_json(output) or {}

    def torchrun_train(self, out: str, steps: int, extra: list[str], name: str) -> str:
        """The train stage under `torchrun --nproc_per_node 1`; its output."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
                "eagle3_train.cli", *self.train_args(out, steps, extra)]
        rc, output = self.sh(argv, 240, name)
        if rc != 0:
            raise CheckFailed(f"{name}: exit {rc}: {_tail(output)}")
        return output

    def torchrun_part(self) -> dict[str, Any]:
        output = self.torchrun_train(self.p("train-ddp"), self.sizes["ddp_steps"], [], "torchrun")
        losses = _train_losses(self.work / "train-ddp" / "metrics.jsonl")
        if not losses or not all(math.isfinite(x) for _, x in losses):
            raise CheckFailed(f"losses missing or not finite: {losses}")
        return {"losses": losses, "result": _last_json(output)}

    def extract_torchrun_part(self) -> dict[str, Any]:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                "gpu" if self.device.startswith("cuda") else "2", "-m", "eagle3_train.cli", "extract", "--prepared",
                self.p("prepared"), "--verifier", str(self.verifier), "--out", self.p("hidden-ranks"), "--device",
                self.device]
        rc, output = self.sh(argv, 300, "extract-torchrun")
        if rc != 0:
            raise CheckFailed(f"exit {rc}: {_tail(output)}")
        rc, output = self.sh([sys.executable, str(Path(__file__).resolve()), "compare-stores", "--src",
                              self.p("hidden"), "--dst", self.p("hidden-ranks")], 120, "compare-stores")
        if rc != 0:
            raise CheckFailed(f"the stores differ (exit {rc}): {_tail(output)}")
        m = json.loads((self.work / "hidden-ranks" / "manifest.json").read_text())
        return {"processes": m.get("processes"), "throughput": m.get("throughput"), "compare": _last_json(output)}

    def fsdp_part(self) -> dict[str, Any]:
        steps = self.sizes["ddp_steps"]
        out = self.p("train-fsdp")
        fsdp = ["--set", "train.parallel=fsdp", "--save-every", "1"]
        # stopped where a log window ends: the resumed run's windows are then the uninterrupted run's
        stop = self.sizes["log"] if self.sizes["log"] < steps else steps // 2
        self.torchrun_train(out, steps, [*fsdp, "--stop-after", str(stop)], "fsdp-train")
        shards = sorted(p.name for p in (self.work / "train-fsdp" / "checkpoints" / f"step-{stop:07d}"
                                         / "optimizer").iterdir())
        self.torchrun_train(out, steps, [*fsdp, "--resume"], "fsdp-resume")
        meta = json.loads((self.work / "train-fsdp" / "training_metadata.json").read_text())
        if meta["run"].get("parallel") != "fsdp" or meta["progress"]["step"] != steps:
            raise CheckFailed(f"not an FSDP run to step {steps}: {meta['run']}, {meta['progress']}")
        got, ref = _train_losses(self.work / "train-fsdp" / "metrics.jsonl"), \
            _train_losses(self.work / "train-ddp" / "metrics.jsonl")
        # bf16 weights on the wire (FSDP) vs bf16 autocast casts of fp32 weights (replicated): the same roundings
        # of the same fp32 masters, so the curves agree to bf16 noise
        diff = max((abs(a - b) / max(1.0, abs(b)) for (_, a), (_, b) in zip(got, ref)), default=None)
        if diff is None or len(got) != len(ref) or diff > 2e-2:
            raise CheckFailed(f"FSDP losses {got} differ from the replicated run's {ref} (max rel diff {diff})")
        self.cli(["export", out, "--out", self.p("export-fsdp"), "--format", "eagle"], 180, "export-fsdp")
        return {"losses": got, "replicated": ref, "max_rel_diff": round(diff, 5), "optimizer_files": shards}

    def ttt_kernel_part(self) -> dict[str, Any]:
        rc, output = self.sh([sys.executable, str(Path(__file__).resolve()), "ttt-kernel", "--device", self.device,
                              *(["--tiny"] if self.args.tiny else [])], 180, "ttt-kernel")
        if rc != 0:
            raise CheckFailed(f"exit {rc}: {_tail(output)}")
        return _last_json(output) or {}

    def bench_part(self) -> dict[str, Any]:
        argv = [sys.executable, str(ROOT / "benchmarks" / "gpu_train_throughput.py"), "--out",
                str(self.out / "bench.json"), "--device", self.device]
        argv += ["--tiny", "--ttt", "3", "--steps", "2", "--warmup", "1"] if self.args.tiny else \
            ["--shapes", self.args.bench_shapes, "--ttt", "7,3", "--steps", str(self.args.bench_steps)]
        rc, output = self.sh(argv, self.args.bench_timeout, "bench")
        lines = [x for x in output.splitlines() if " tok/s" in x or "FAILED" in x]
        if rc != 0:
            raise CheckFailed(f"exit {rc}: {' | '.join(lines) or _tail(output)}")
        return {"runs": lines}

    def run(self) -> int:
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        self.part("env", self.env_part)
        self.part("verifier", self.verifier_part)
        self.part("prepare", self.prepare_part, ("verifier",))
        self.part("vocab", self.vocab_part, ("prepare",))
        self.part("extract", self.extract_part, ("prepare",))
        self.part("train", self.train_part, ("vocab", "extract"))
        self.part("train-resume", self.resume_part, ("train",))
        self.part("export", self.export_part, ("train-resume",))
        self.part("torchrun", self.torchrun_part, ("vocab", "extract"))
        self.part("extract-torchrun", self.extract_torchrun_part, ("extract",))
        self.part("fsdp", self.fsdp_part, ("torchrun",))
        self.part("ttt-kernel", self.ttt_kernel_part, ("env",))
        if not self.args.skip_bench:
            self.part("bench", self.bench_part)
        self.part("evaluate-offline", self.evaluate_part, ("export",))
        self.write_summary()
        print((self.out / "summary.md").read_text())
        return 0 if all(r["status"] == "ok" for r in self.results) else 1


# --- helpers run in their own processes -----------------------------------------------------------------------------
EMBED_SCALE = 8.0


def compare_stores(a: Path, b: Path) -> None:
    """Every shard of store `a` in store `b` with bit-identical tensors (prints the count as JSON; exit 1 if not)."""
    from safetensors.torch import load_file

    files = sorted(p.relative_to(a) for p in a.glob("*/shard-*.safetensors"))
    differ = []
    for f in files:
        want = load_file(str(a / f))
        got = load_file(str(b / f)) if (b / f).is_file() else {}
        if want.keys() != got.keys() or not all(want[k].equal(got[k]) for k in want):
            differ.append(str(f))
    print(json.dumps({"shards": len(files), "differ": differ}))
    if differ or not files:
        sys.exit(1)


def ttt_kernel(device: str, tiny: bool) -> None:
    """The merged TTT attention on this device: it agrees with the masked reference (`check_merged`), and the peak
    memory of one later step's attention fwd+bwd grows linearly in length (merged) vs quadratically (masked), at a
    Kimi-like head shape (16 heads of 192; bf16). Prints JSON; exit 1 when the check fails."""
    import torch

    from eagle3_train.model.ttt_attention import check_merged, masked_ttt_attention, ttt_attention

    dev = torch.device(device)
    agrees = check_merged(dev, torch.bfloat16)
    lengths = (512, 1024) if tiny else (4096, 8192, 16384, 32768)
    peaks: dict[str, dict[int, float]] = {"merged": {}, "masked": {}}
    for name, fn in (("merged", ttt_attention), ("masked", masked_ttt_attention)):
        for L in lengths:
            if name == "masked" and L > 16384:
                continue  # its masks alone would take tens of GB
            q = torch.randn(1, 16, L, 192, device=dev, dtype=torch.bfloat16, requires_grad=True)
            kv = [torch.randn(1, 16, L, 192, device=dev, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(8)]
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn(q, kv[0], kv[1], kv[2:5], kv[5:8]).float().sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                peaks[name][L] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            peaks[name][f"{L}_s"] = round(time.perf_counter() - t0, 3)
            del q, kv
    print(json.dumps({"merged_agrees": agrees, "peak_mib_fwd_bwd_j3": peaks}))
    if not agrees:
        sys.exit(1)


def make_verifier(src: Path, dst: Path, layers: int | None) -> None:
    """SmolLM2-135M-Instruct's config and tokenizer with random weights (bf16), as a plain HF checkpoint dir.

    The (tied) embedding is scaled up EMBED_SCALE times from the config's init: at the init's own scale the random
    verifier's next-token distributions are nearly uniform, which a draft matches from its first step (the loss
    would barely move); peaked ones give the training curve something to learn."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(EMBED_SCALE)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    print(f"random verifier: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {dst}")


def load_exports(work: Path) -> None:
    """Both exports load through our reader, match the final checkpoint's tensors (bf16) and carry the vocab."""
    import torch

    from eagle3_train.checkpoints.formats import load_draft_source, load_tensor_data
    from eagle3_train.checkpoints.native import load_draft

    final = load_draft(work / "train" / "final")
    ref = {k: v for k, v in final.trainable_state_dict().items()}
    report: dict[str, Any] = {}
    for fmt in ("eagle", "speculators"):
        loaded = load_tensor_data(load_draft_source(work / f"export-{fmt}"))
        common = sorted(set(ref) & set(loaded.tensors))
        missing = sorted(set(k for k in ref if k not in ("d2t", "t2d")) - set(loaded.tensors))
        if missing:
            raise SystemExit(f"{fmt} export lacks {missing}")
        worst = max(float((loaded.tensors[k].float() - ref[k].to(torch.bfloat16).float()).abs().max())
                    for k in common if ref[k].is_floating_point())
        if worst > 0:
            raise SystemExit(f"{fmt} export differs from the final checkpoint by up to {worst}")
        files = sorted(p.name for p in (work / f"export-{fmt}").iterdir())
        report[fmt] = {"format": loaded.format, "tensors": len(loaded.tensors), "files": files}
    print(json.dumps(report))


def evaluate(work: Path, device: str) -> None:
    """Offline chain speculative decoding of the eagle export with the verifier on `device` (greedy check on)."""
    import torch

    from eagle3_train.evaluate.offline import evaluate_offline
    from eagle3_train.evaluate.prompts import load_prompts

    prompts = load_prompts(str(CARRY / "prompts.txt"), limit=2)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    r = evaluate_offline(str(work / "export-eagle"), str(work / "verifier"), prompts, k=3, max_new_tokens=24,
                         device=device, dtype=dtype, prepared=str(work / "prepared"))
    print(json.dumps({"overall": r["overall"], "greedy_check": r["greedy_check"], "speed": r["speed"],
                      "settings": r["settings"]}, default=str))


def _train_losses(path: Path) -> list[tuple[int, float]]:
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in rows if r.get("split") == "train" and "loss" in r]


def _last_json(output: str) -> Any:
    """The last JSON object the command printed (a stage's result), or None."""
    start = output.rfind("\n{")
    start = 0 if start < 0 and output.startswith("{") else start
    if start < 0:
        return None
    text = output[start:].strip()
    end = text.find("\n}")
    try:
        return json.loads(text[:end + 2] if end >= 0 else text)
    except json.JSONDecodeError:
        return None


def _tail(output: str | None, n: int = 1500) -> str:
    return (output or "")[-n:].strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("helper", nargs="?", choices=["make-verifier", "load-exports", "evaluate", "compare-stores",
                                                 "ttt-kernel"],
                   help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpucheck-out"), help="results folder (default $OUT)")
    p.add_argument("--work", default="/tmp/gpucheck-work", help="scratch folder (deleted first)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (--tiny's default)")
    p.add_argument("--tiny", action="store_true", help="small sizes (8-layer verifier, 24 conversations): CPU run")
    p.add_argument("--budget-s", type=float, default=420, help="stop starting parts after this many seconds")
    p.add_argument("--bench-shapes", default="llama3.1-8b,kimi-k2")
    p.add_argument("--bench-steps", type=int, default=8)
    p.add_argument("--bench-timeout", type=float, default=240)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--src"), p.add_argument("--dst"), p.add_argument("--layers", type=int)
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.helper == "make-verifier":
        make_verifier(Path(args.src), Path(args.dst), args.layers)
        return 0
    if args.helper == "compare-stores":
        compare_stores(Path(args.src), Path(args.dst))
        return 0
    if args.helper == "ttt-kernel":
        ttt_kernel(args.device, args.tiny)
        return 0
    if args.helper == "load-exports":
        load_exports(Path(args.work))
        return 0
    if args.helper == "evaluate":
        evaluate(Path(args.work), args.device)
        return 0
    return Checker(args).run()


if __name__ == "__main__":
    sys.exit(main())
