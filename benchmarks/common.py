"""What the benchmark scripts share: the training-throughput data pool, the machine record, child processes, the
equal wall-clock train command, and serving a draft against the measures users serve with. Scripts import this
(they run from `benchmarks/`), never each other.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from eagle3_train.evaluate.pipeline_eval import acceptance_summary
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.evaluate.served import evaluate_served
from eagle3_train.serving.vllm_options import speculative_config
from eagle3_train.serving.vllm_server import VLLMServer
from eagle3_train.utils.host_memory import compute_env

HERE = Path(__file__).resolve().parent
# --- the training-throughput pool (train_throughput.py, vs_speculators.py, side_by_side.py's default pool, ...) ---
OUT = HERE / "out" / "train-bench"


def build_data(limit: int, out: Path = OUT) -> None:
    """ShareGPT conversations (max 512 tokens) prepared for SmolLM2, a 8192-token vocab, bf16 hidden states."""
    from eagle3_train.data.prepare import prepare
    from eagle3_train.hidden_states.extract import extract
    from eagle3_train.vocab.build import build_vocab

    if not (out / "prepared" / "manifest.json").is_file():
        prepare("sharegpt", "smollm2-135m-instruct", out / "prepared", max_length=512, limit=limit, val_count=0)
    if not (out / "vocab" / "vocab.safetensors").is_file():
        build_vocab(out / "prepared", out / "vocab", size=8192)
    # float32 compute: the store every earlier figure was measured on (the default is bf16 on native-bf16 CPUs now)
    extract(out / "prepared", "smollm2-135m-instruct", out / "hidden", dtype="bfloat16", splits=("train",),
            compute_dtype="float32")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def machine() -> dict:
    import torch

    info = {"nproc": len(os.sched_getaffinity(0)), "cpu_model": cpu_model(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# --- peak memory of this process -------------------------------------------------------------------------------
PAGE = os.sysconf("SC_PAGE_SIZE")


def anon_rss() -> int:
    """Resident anonymous bytes: /proc/self/statm resident - shared (file-backed) pages."""
    fields = Path("/proc/self/statm").read_text().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


class PeakSampler(threading.Thread):
    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.peak, self._halt = interval, anon_rss(), threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, anon_rss())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, anon_rss())
        return self.peak


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run one setting in a fresh process (clean peak RSS) and return the JSON of its `RESULT ` line. Our children
    get the host-memory environment `eagle3-train train` gives itself (tcmalloc, oneDNN cache; utils/host_memory.py);
    EAGLE3_TRAIN_MALLOC=system measures without."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=compute_env(os.environ if env is None else env))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"benchmark child failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


# --- training settings of the equal-data and equal wall-clock comparisons -------------------------------------
# equal data (side_by_side.py, equal_budget_acceptance.py)
BASE = dict(ttt_steps=3, epochs=3, token_budget=2048, lr=5e-4, warmup_ratio=0.05, grad_clip=0.5, seed=0,
            log_every=20, tensorboard=False)
# equal wall-clock (equal_wall_clock.py, recipe_sweep.py, train_memory.py): its pool, settings and our best overrides
WALL_CLOCK_DATA = HERE / "out" / "wall_clock" / "data"
WALL_CLOCK_TRAIN = dict(ttt_steps=3, token_budget=2048, warmup_ratio=0.05, grad_clip=0.5, seed=0, tensorboard=False)
WALL_CLOCK_BEST = ["precision=bf16", "checkpoint_loss=false", "checkpoint_mlp=false", "lr=0.002"]


def ours_command(out: Path, overrides: list[str], max_steps: int, save_every: int | None,
                 log_every: int = 5, data: Path | None = None) -> list[str]:
    """Our train command on the pool (`data`, default the equal wall-clock pool) with the equal wall-clock settings."""
    data = data or WALL_CLOCK_DATA
    cmd = [sys.executable, "-m", "eagle3_train.cli", "train", "--prepared", str(data / "prepared"),
           "--hidden-states", str(data / "hidden"), "--vocab", str(data / "vocab"), "--out", str(out), "--overwrite"]
    settings = {**WALL_CLOCK_TRAIN, "epochs": 1000, "max_steps": max_steps, "log_every": log_every, "keep_last": 100,
                "save_every": save_every}
    for k, v in settings.items():
        if v is not None:
            cmd += ["--set", f"train.{k}={str(v).lower() if isinstance(v, bool) else v}"]
    for o in overrides:
        cmd += ["--set", f"train.{o}"]
    return cmd


# --- the extraction benchmarks' prepared rows (extract_throughput.py, extract_vllm_throughput.py, online_training.py)
def build_prepared(work: Path, samples: int, max_length: int, verifier: str) -> Path:
    from eagle3_train.data.prepare import prepare

    out = work / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    # val_count=5: both splits exist; all samples are extracted (train + validation).
    prepare("sharegpt", verifier, out, max_length=max_length, limit=samples, val_count=5)
    return out


# --- judging drafts and reading training curves -----------------------------------------------------------------
# (name, benchmark, temperature): what users serve with, greedy and sampled
MEASURES = (("mtbench_t0", "mtbench", 0.0), ("humaneval_t0", "humaneval", 0.0), ("mtbench_t1", "mtbench", 1.0))


def serve(draft: str, num_prompts: int, log_dir: Path, measures: tuple = MEASURES, dtype: str = "auto",
          verifier: str | Path | None = None, k: int = 3) -> dict:
    """One vLLM server per draft, `measures` against it: a speculators-format draft alone (its config names the
    verifier), or with `verifier` any export beside it (`speculative_config`: the draft method's vLLM options, k
    drafts); `dtype`: the server's (a ServerDtype: auto, native, ...)."""
    out = {}
    model, spec = (draft, None) if verifier is None else (verifier, speculative_config(draft, k))
    with VLLMServer(model, speculative=spec, startup_matters=True, log_path=log_dir / "vllm.log",
                    dtype=dtype) as server:
        for name, bench, temperature in measures:
            prompts = load_prompts(bench, limit=num_prompts, turns=1)
            r = evaluate_served(server.base_url, server.model_name, prompts, max_tokens=128, concurrency=8,
                                temperature=temperature, seed=0)
            out[name] = {**acceptance_summary(r), "num_prompts": len(prompts), "temperature": temperature,
                         "first_outputs": [c["outputs"][0][:300] for c in r["completions"][:3] if c["outputs"]]}
            print(f"  {name}: {out[name]['mean_acceptance_length']:.3f}", flush=True)
    return out


def ours_train_rows(path: str | Path) -> list[dict]:
    """Our metrics.jsonl: the train-window records (each with `tokens_seen` and `time`)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("split") == "train" and "tokens_seen" in r]


def spec_train_steps(path: str | Path) -> list[dict]:
    """speculators' metrics.jsonl: one record per train step (its `data`: train metrics, profile, epoch)."""
    steps = [json.loads(x)["data"] for x in Path(path).read_text().splitlines() if x.strip()]
    return [d for d in steps if d.get("train") and d.get("profile")]


def curve_speculators(path: str, window: int = 5) -> tuple[list[int], list[float]]:
    """Its per-step train metrics, averaged over `window` steps like our logging windows; tokens from its profile."""
    steps = spec_train_steps(path)
    tokens, est, seen = [], [], 0.0
    for i, d in enumerate(steps):
        seen += d["profile"]["tokens_per_s"] * d["profile"]["step_ms"] / 1000
        if (i + 1) % window == 0 or i + 1 == len(steps):
            chunk = steps[max(0, i + 1 - window):i + 1]
            tokens.append(round(seen))
            est.append(1 + sum(sum(c["train"].get(f"full_acc_{j}", 0.0) for c in chunk) / len(chunk)
                               for j in range(3)))
    return tokens, est
