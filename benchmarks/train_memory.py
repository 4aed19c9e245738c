"""Host memory of a long CPU training run under different allocators: where the anonymous RSS growth comes from and
what stops it at what cost in speed.

Each variant (`default`: what `eagle3-train train` does by itself) trains the same `--steps` steps on the
equal-wall-clock data pool (benchmarks/out/wall_clock/data, made by equal_wall_clock.py) with our best CPU settings,
one after the other with the same thread count, while this script samples /proc/PID/status. Variants: glibc's malloc,
with a fixed mmap threshold, with malloc_trim after every step (`train.release_host_memory`); oneDNN's primitive cache
(one compiled kernel per matmul shape: batches of varying shape fill it) cut from 1024 to 16 entries; jemalloc and
tcmalloc via LD_PRELOAD (Debian: apt-get install libjemalloc2 libtcmalloc-minimal4); and combinations.

  .venv/bin/python benchmarks/train_memory.py --steps 100
Results: benchmarks/out/train_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import WALL_CLOCK_BEST as OURS_BEST
from common import WALL_CLOCK_DATA as DATA
from common import ours_command

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "train_memory"
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
VARIANTS: dict[str, dict[str, str]] = {
    "default": {"EAGLE3_TRAIN_MALLOC": ""},
    "glibc": {},
    "glibc-mmap-threshold-128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "glibc-trim": {"release_host_memory": "true"},
    "onednn-cache-16": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"},
    "onednn-cache-16+trim": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "release_host_memory": "true"},
    "jemalloc": {"LD_PRELOAD": str(LIBDIR / "libjemalloc.so.2")},
    "tcmalloc": {"LD_PRELOAD": str(LIBDIR / "libtcmalloc_minimal.so.4")},
    "tcmalloc+onednn-cache-16": {"LD_PRELOAD": str(LIBDIR / "libtcmalloc_minimal.so.4"),
                                 "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"},
}


def status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def run_variant(name: str, steps: int, threads: int, interval: float) -> dict:
    settings = dict(VARIANTS[name])
    overrides = list(OURS_BEST)
    if settings.pop("release_host_memory", None):
        overrides.append("release_host_memory=true")
    if "LD_PRELOAD" in settings and not Path(settings["LD_PRELOAD"]).is_file():
        return {"variant": name, "skipped": f"{settings['LD_PRELOAD']} not installed"}
    out = OUT / name
    cmd = ours_command(out, overrides, max_steps=steps, save_every=None, log_every=10)
    cmd += ["--set", "train.checkpoint_every_minutes=0", "--set", "train.eval_every=100000"]
    # variants name their allocator; "default" is what `eagle3-train train` picks by itself (utils/allocator.py)
    env = {**os.environ, "EAGLE3_TRAIN_MALLOC": "system", **settings, "OMP_NUM_THREADS": str(threads)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        s = status_kb(proc.pid)
        if s:
            samples.append({"t": round(time.time() - t0, 1), **s})
        time.sleep(interval)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: trainer exited {proc.returncode}\n{err[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    # steady rate: tokens/s over the second half of the logged steps (skips start-up)
    half = train[len(train) // 2:]
    rate = None
    if len(half) >= 2 and "tokens_seen" in half[0] and "time" in half[0]:
        rate = (half[-1]["tokens_seen"] - half[0]["tokens_seen"]) / max(1e-9, half[-1]["time"] - half[0]["time"])
    anon = [s["RssAnon"] for s in samples if "RssAnon" in s]
    q = len(anon) // 4
    return {
        "variant": name, "env": settings, "overrides": overrides, "steps": steps, "threads": threads,
        "wall_s": round(time.time() - t0, 1),
        "tokens_per_s": train[-1].get("tokens_per_s") if train else None,
        "steady_tokens_per_s": rate,
        "rss_anon_gib": {"first_quarter_max": round(max(anon[:q or 1]) / 2**20, 2),
                         "last_quarter_max": round(max(anon[-(q or 1):]) / 2**20, 2),
                         "max": round(max(anon) / 2**20, 2)} if anon else None,
        "peak_rss_gib": round(max(s.get("VmHWM", 0) for s in samples) / 2**20, 2) if samples else None,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between /proc samples")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    args = ap.parse_args()
    if not (DATA / "hidden").is_dir():
        sys.exit(f"{DATA} is missing: run benchmarks/equal_wall_clock.py once (it builds the data pool)")
    results = []
    for name in args.variants.split(","):
        r = run_variant(name.strip(), args.steps, args.threads, args.interval)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "samples"}), flush=True)
    machine = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                             capture_output=True, text=True).stdout.strip()
    path = HERE / "out" / "train_memory.json"
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
                                "command": " ".join(sys.argv), "results": results}, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
