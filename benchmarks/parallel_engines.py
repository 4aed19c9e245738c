"""Two CPU processes under torchrun on the same rows: the hand-written gradient sync this project had (a git commit,
run from a worktree), torch's DDP and FSDP2 (`train.parallel`): tokens/s, peak anonymous memory per rank, the final
loss, and the planner's per-rank figure against the measured one.

Data of `train_throughput.py` (`common.build_data`: 200 ShareGPT conversations for SmolLM2, max 512 tokens, draft
vocab 8192, bf16 hidden states); fp32, TTT 7, 2048-token micro-batches, OMP_NUM_THREADS=1 per rank (2 cores).

  .venv/bin/python benchmarks/parallel_engines.py --steps 12 [--sync-commit d67a30a]

Memory: each rank's RssAnon (/proc/PID/status) sampled every 20 ms; a rank's training memory is its peak minus the
anonymous memory of a process that imported the trainer and nothing else (`baseline`). Planned: `eagle3-train plan`'s
CPU process total (`host_memory.process_total`) for 2 ranks, the engine, 512-token samples and the data's supervised
share. Results: benchmarks/out/parallel_engines.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, build_data, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = OUT.parent / "parallel_engines.json"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def workers(parent: int) -> list[int]:
    """The torchrun workers: processes whose command line runs eagle3_train.cli, below `parent`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"eagle3_train.cli" in cmd and b"torch.distributed.run" not in cmd and ppid == parent:
            found.append(int(d.name))
    return sorted(found)


def baseline(src: Path) -> int:
    code = ("import eagle3_train.train.trainer, torch.distributed, pathlib\n"
            "print([int(l.split()[1]) for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
            "if l.startswith('RssAnon:')][0] * 1024)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(src),
                                                            "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


def run(name: str, src: Path, steps: int, extra: list[str]) -> dict:
    out = OUT / f"engines-{name}-{int(time.time())}"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "EAGLE3_TRAIN_NO_PROGRESS": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536", "EAGLE3_TRAIN_MALLOC": "system"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "eagle3_train.cli", "train", "--prepared", str(OUT / "prepared"), "--hidden-states", str(OUT / "hidden"),
           "--vocab", str(OUT / "vocab"), "--out", str(out), "--precision", "fp32", "--ttt-steps", "7",
           "--token-budget", "2048", "--max-steps", str(steps), "--lr", "1e-4", "--log-every", "1",
           "--set", "train.tensorboard=false", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    halt = threading.Event()

    def sample() -> None:
        while not halt.is_set():
            for pid in workers(proc.pid):
                peaks[pid] = max(peaks.get(pid, 0), rss_anon(pid))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    log, _ = proc.communicate()
    halt.set()
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{log[-3000:]}")
    meta = json.loads((out / "training_metadata.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    loss = [r["loss"] for r in rows if r["split"] == "train"]
    return {"engine": name, "tokens_per_s": round(meta["run"].get("tokens_per_s", 0.0), 1),
            "peak_anon_mb_per_rank": [round(v / 1e6, 1) for _, v in sorted(peaks.items())],
            "final_loss": loss[-1] if loss else None, "out": str(out)}


def planned(engine: str) -> int:
    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.plan import PlanSettings, plan

    manifest = json.loads((OUT / "prepared" / "manifest.json").read_text())
    counts = manifest.get("counts", {})
    share = (counts.get("supervised_tokens") or {}).get("train", 0) / max(1, (counts.get("tokens") or {}).get(
        "train", 0)) or 1.0
    p = plan(PlanSettings(verifier=str(resolve_verifier("smollm2-135m-instruct")), samples=200, tokens_per_sample=512,
                          draft_vocab=8192, ttt_steps=7, token_budget=2048, precision="fp32", device="cpu", gpus=2,
                          parallel=engine, supervised_fraction=min(1.0, share)))
    return p.host_memory["process_total"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--sync-commit", default="d67a30a", help="the last commit with the hand-written gradient sync")
    args = ap.parse_args()
    build_data(args.limit)
    old = Path("/tmp/eagle3-sync-worktree")
    if not old.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.sync_commit], check=True)
    results = {"machine": machine(), "steps": args.steps, "date": time.strftime("%Y-%m-%d"), "runs": []}
    base = {"sync": baseline(old / "src"), "new": baseline(ROOT / "src")}
    results["baseline_anon_mb"] = {k: round(v / 1e6, 1) for k, v in base.items()}
    for name, src, extra, b in (("sync", old / "src", [], base["sync"]),
                                ("ddp", ROOT / "src", ["--set", "train.parallel=ddp"], base["new"]),
                                ("fsdp", ROOT / "src", ["--set", "train.parallel=fsdp"], base["new"])):
        r = run(name, src, args.steps, extra)
        measured = max(r["peak_anon_mb_per_rank"]) * 1e6 - b
        r["training_mb_per_rank"] = round(measured / 1e6, 1)
        if name != "sync":
            r["planned_mb_per_rank"] = round(planned(name) / 1e6, 1)
            r["planned_over_measured"] = round(planned(name) / measured, 3)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
    RESULT.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
