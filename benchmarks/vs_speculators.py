"""Training throughput and peak memory of eagle3-train and speculators 0.9.0 measured in ONE run, on the same tokens.

Both trainers read the same prepared rows (our `prepare` output, turned into speculators rows by the anchor's
`prepared_to_pretok.py`), draft vocab 8192, 2048-token steps, AdamW, fp32 on CPU. Runs alternate (ours, theirs, ours,
theirs, ...) so that both see the same machine load; each run is its own process (peak RSS = `ru_maxrss`). Tokens/s
counts the non-padding tokens of the timed steps over their summed step time, the first (warm-up) step left out, as
the anchor's `summarize.py` does for speculators. Ours runs with the host-memory environment `eagle3-train train`
gives itself (tcmalloc where installed, src/eagle3_train/utils/host_memory.py), speculators as its CLI runs; start
this script with LD_PRELOAD=libtcmalloc_minimal.so.4 to give both the same allocator.

  .venv/bin/python benchmarks/vs_speculators.py --ttt 3,7 --steps 20 --rounds 2
  (needs the anchor venv: bash benchmarks/speculators_harness/setup_venv.sh, ~3 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common as ours

from eagle3_train.utils.host_memory import compute_env

HERE = Path(__file__).resolve().parent
SPEC_WORK = HERE / "out" / "speculators"


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def run_ours(ttt: int, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(HERE / "train_throughput.py"), "--child", str(ttt), "--steps", str(steps)]
    for o in overrides:
        cmd += ["--set", o]
    r = ours.run_child(cmd)
    return {"tokens_per_s": r["tokens_per_s"], "peak_rss_gib": round(r["peak_rss_gb"], 2), "steps": steps}


def run_speculators(ttt: int, steps: int, anchor: Path, venv: Path, tag: str, knobs: list[str]) -> dict:
    rows = SPEC_WORK / "rows.jsonl"
    if not rows.is_file():
        subprocess.run([str(venv / "bin" / "python"), str(anchor / "prepared_to_pretok.py"),
                        str(ours.OUT / "prepared"), str(rows)], check=True)
    run = f"ttt{ttt}-{tag}"
    env = {**os.environ, "WORK": str(SPEC_WORK), "VENV": str(venv), "PRETOK": str(rows), "TTT": str(ttt),
           "MAX_STEPS": str(steps + 1), "EPOCHS": "1", "RUN": run,
           **dict(k.split("=", 1) for k in knobs)}  # the anchor's knobs, e.g. CPU_AUTOCAST=1 HS_DTYPE=bfloat16
    proc = subprocess.run(["bash", str(anchor / "bench.sh")], env=env, capture_output=True, text=True)
    summary = SPEC_WORK / "runs" / run / "summary.json"
    if proc.returncode != 0 or not summary.is_file():
        sys.exit(f"speculators run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    s = json.loads(summary.read_text())
    return {"tokens_per_s": s["train_tokens_per_s_excl_first_step"], "peak_rss_gib": round(s["peak_rss_mib"] / 1024, 2),
            "steps": s["train_steps"] - 1, "command": (SPEC_WORK / "runs" / run / "command.txt").read_text().strip()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttt", default="3,7")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per trainer and TTT setting")
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations (max 512 tokens each)")
    p.add_argument("--anchor", type=Path, default=HERE / "speculators_harness")
    p.add_argument("--venv", type=Path, default=Path("/tmp/anchors/specvenv"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override our TrainConfig field")
    p.add_argument("--spec", action="append", default=[], metavar="KNOB=VALUE",
                   help="an environment knob of the anchor's bench.sh, e.g. CPU_AUTOCAST=1 (with HS_DTYPE=bfloat16)")
    args = p.parse_args()
    if not (args.venv / "bin" / "speculators").exists():
        sys.exit(f"no speculators venv at {args.venv}: run `VENV={args.venv} bash {args.anchor}/setup_venv.sh`")
    ours.build_data(args.limit)
    manifest = json.loads((ours.OUT / "prepared" / "manifest.json").read_text())
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpu": ours.cpu_model(), "nproc": os.cpu_count()}, "data": manifest.get("counts"),
              "steps": args.steps, "rounds": args.rounds, "overrides": args.set, "speculators_knobs": args.spec,
              # ours runs in the host-memory environment `eagle3-train train` gives itself (tcmalloc where installed);
              # speculators in this script's own environment (LD_PRELOAD=... here preloads an allocator for both)
              "ours_host_env": {k: v for k, v in compute_env(os.environ).items()
                                if k in ("LD_PRELOAD", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "EAGLE3_TRAIN_MALLOC")},
              "speculators_ld_preload": os.environ.get("LD_PRELOAD"),
              "settings": []}
    for ttt in [int(x) for x in args.ttt.split(",")]:
        runs: dict[str, list[dict]] = {"eagle3-train": [], "speculators": []}
        for r in range(args.rounds):
            for name in runs:
                before = load_average()
                out = (run_ours(ttt, args.steps, args.set) if name == "eagle3-train"
                       else run_speculators(ttt, args.steps, args.anchor, args.venv, f"r{r}", args.spec))
                out["load_before"], out["load_after"] = before, load_average()
                runs[name].append(out)
                print(f"TTT {ttt} round {r} {name}: {out['tokens_per_s']} tokens/s, {out['peak_rss_gib']} GiB "
                      f"(load {before} -> {out['load_after']})", flush=True)
        med = {n: statistics.median(x["tokens_per_s"] for x in v) for n, v in runs.items()}
        rss = {n: max(x["peak_rss_gib"] for x in v) for n, v in runs.items()}
        row = {"ttt": ttt, "runs": runs, "median_tokens_per_s": med, "peak_rss_gib": rss,
               "speed_ratio": round(med["eagle3-train"] / med["speculators"], 2)}
        result["settings"].append(row)
        print(f"TTT {ttt}: ours {med['eagle3-train']:.0f} tokens/s at {rss['eagle3-train']} GiB, speculators "
              f"{med['speculators']:.0f} tokens/s at {rss['speculators']} GiB: {row['speed_ratio']}x", flush=True)
    tag = "-".join([x.replace("=", "_") for x in args.set + args.spec]
                   + (["preload_" + Path(os.environ["LD_PRELOAD"].split()[0]).name.split(".")[0]]
                      if os.environ.get("LD_PRELOAD") else []))
    (HERE / "out" / f"vs_speculators{'-' + tag if tag else ''}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
