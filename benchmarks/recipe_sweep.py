"""Per-token recipe sweep on the equal-wall-clock pool: which settings make a better draft from the same tokens?

Each variant trains our draft with the settings of `equal_wall_clock.py` (TTT 3, 2048-token steps, our best CPU
settings) plus its own overrides, for a given number of optimizer steps, on a pool built by that script. The score is
the training metrics averaged over the last 20% of the tokens: while a run stays inside its first epoch, every batch is
scored before the draft has learned from it, so this is a held-out estimate. `--vllm` then serves each draft in vLLM
(the judge: a draft is better when vLLM accepts more of its tokens).

  cd benchmarks && ../.venv/bin/python recipe_sweep.py --pool out/wall_clock_2000/data \\
      --variant base:250 --variant lr4e-3:250:lr=0.004 --vllm mtbench_t0
Results: benchmarks/out/recipe_sweep.json (one entry per variant, kept across invocations) and a printed table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

from common import MEASURES, ours_command, ours_train_rows, serve
from common import WALL_CLOCK_BEST as OURS_BEST

from eagle3_train.export.exporter import export
from eagle3_train.utils.io import read_json, write_json

HERE = Path(__file__).resolve().parent
SCORED = ("acc_0", "acc_1", "full_acc_1", "accept_len_k3", "alpha_0", "tokens_per_s")


def train_variant(pool: Path, out: Path, steps: int, overrides: list[str], threads: int) -> float:
    cmd = ours_command(out, OURS_BEST + overrides, steps, save_every=None, data=pool)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "EAGLE3_TRAIN_NO_PROGRESS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def score(metrics: Path, tail: float = 0.2) -> dict[str, float]:
    """Training metrics averaged over the logging windows in the last `tail` of the tokens."""
    rows = ours_train_rows(metrics)
    total = rows[-1]["tokens_seen"]
    last = [r for r in rows if r["tokens_seen"] >= (1 - tail) * total]
    return {"tokens": total, **{k: round(sum(r[k] for r in last) / len(last), 4) for k in SCORED}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", type=Path, required=True, help="data/ of an equal_wall_clock.py run")
    p.add_argument("--variant", action="append", required=True, metavar="NAME:STEPS[:KEY=VALUE,...]")
    p.add_argument("--work", type=Path, default=HERE / "out" / "recipe_sweep")
    p.add_argument("--results", type=Path, default=HERE / "out" / "recipe_sweep.json")
    p.add_argument("--threads", type=int, default=1, help="as each trainer has in equal_wall_clock.py")
    p.add_argument("--vllm", default="", help=f"comma-separated measures to serve each draft with: "
                                              f"{', '.join(m[0] for m in MEASURES)}")
    p.add_argument("--num-prompts", type=int, default=80)
    args = p.parse_args()
    results = read_json(args.results) if args.results.is_file() else {}
    measures = tuple(m for m in MEASURES if m[0] in args.vllm.split(","))
    for text in args.variant:
        name, steps, *rest = text.split(":", 2)
        overrides = [o for o in (rest[0].split(",") if rest else []) if o]
        run = args.work / name
        entry = {"steps": int(steps), "overrides": overrides,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        entry["train_s"] = round(train_variant(args.pool, run, int(steps), overrides, args.threads), 1)
        entry["score"] = score(run / "metrics.jsonl")
        if measures:
            export(run / "final", run / "export", fmt="speculators")
            served = serve(str(run / "export"), args.num_prompts, run, measures)
            entry["vllm"] = {k: {"mean_acceptance_length": v["mean_acceptance_length"],
                                 "per_position_acceptance": v["per_position_acceptance"]} for k, v in served.items()}
        results[name] = entry
        write_json(args.results, results)
    for name, e in results.items():
        vllm = " ".join(f"{k} {v['mean_acceptance_length']:.3f}" for k, v in e.get("vllm", {}).items())
        print(f"{name:12s} {e['steps']:5d} steps {e['score']['tokens'] / 1e6:.2f}M tokens  "
              + "  ".join(f"{k} {e['score'][k]}" for k in SCORED) + f"  {vllm}")


if __name__ == "__main__":
    main()
