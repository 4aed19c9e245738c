"""Recipe variants on one run's data, judged by vLLM: EAGLE-3 vs EAGLE 3.1 vs speculators' norm set, AdamW vs Muon, and
the draft methods (EAGLE-3 vs P-EAGLE vs DFlash: `--variant peagle:method=peagle --variant dflash:method=dflash`).

Every variant trains on the prepared data, vocabulary and hidden states of a finished `eagle3-train run` (the main
job's, by default), with that run's train settings plus the variant's overrides, and is served beside the verifier on
held-out prompts (MT-bench first turns at T 0 and T 1 by default; HumanEval with --measures). Two variants train at a
time, one thread each on 2 cores (`--parallel 1`: one on both); the servers run one at a time afterwards, in the
run's serving dtype, each draft exported in the EAGLE format (DFlash's z-lab layout) and served beside the verifier
with the `--speculative-config` our tools write (P-EAGLE: parallel drafting; DFlash: vLLM's dflash method).

  .venv/bin/python benchmarks/recipe_variants.py --run /tmp/mj/runs/smollm2-sharegpt \\
      --variant plain-adamw:optimizer=adamw,fc_norm=false,norm_output=false --variant ...
A variant named `as-run` with no overrides reuses the run's own draft (its train stage) instead of training again.
Results: benchmarks/out/recipe_variants.json (kept across invocations, one entry per label) and a printed table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from common import MEASURES, machine, serve

from eagle3_train.assets.verifier import resolve_verifier
from eagle3_train.export.exporter import export
from eagle3_train.utils.io import read_json, write_json

HERE = Path(__file__).resolve().parent
# the settings that decide the recipe; the run's other train settings are kept
RECIPE_KEYS = ("method", "num_layers", "optimizer", "muon_lr", "fc_norm", "norm_output", "norm_before_fc",
               "norm_before_residual")
# draft forwards per round of k drafts: sequential EAGLE-3 runs k, the parallel methods one
DRAFT_FORWARDS = {"eagle3": "k", "peagle": 1, "dflash": 1}


def train_command(run: Path, out: Path, overrides: list[str]) -> list[str]:
    """`eagle3-train train` on the run's stage outputs with its train settings and the variant's overrides."""
    cfg = read_json(run / "pipeline_config.json", "pipeline config")["config"]["train"]
    cmd = [sys.executable, "-m", "eagle3_train.cli", "train", "--prepared", str(run / "prepared"),
           "--hidden-states", str(run / "hidden_states"), "--vocab", str(run / "vocab"), "--out", str(out),
           "--overwrite", "--set", "train.report_to=[]"]
    for k, v in cfg.items():
        if v is not None and k not in ("report_to", "tensorboard"):
            cmd += ["--set", f"train.{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return cmd + [a for o in overrides for a in ("--set", f"train.{o}")]


def train_all(run: Path, work: Path, variants: dict[str, list[str]], parallel: int) -> dict[str, float]:
    """Train the variants, `parallel` at a time with the cores split between them; returns each one's wall seconds."""
    threads = max(1, (os.cpu_count() or 1) // parallel)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "EAGLE3_TRAIN_NO_PROGRESS": "1"}
    pending, running, took = list(variants.items()), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, overrides = pending.pop(0)
            out = work / name
            out.parent.mkdir(parents=True, exist_ok=True)
            log = open(work / f"{name}.log", "w")  # noqa: SIM115 (closed when the child ends)
            proc = subprocess.Popen(train_command(run, out, overrides), env=env, stdout=log, stderr=subprocess.STDOUT)
            running[name] = (proc, log, time.perf_counter())
            print(f"training {name} ({' '.join(overrides) or 'the run settings'})", flush=True)
        for name, (proc, log, t0) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                if proc.returncode:
                    raise SystemExit(f"{name} failed (rc {proc.returncode}): see {work / name}.log")
                took[name] = round(time.perf_counter() - t0, 1)
                print(f"  {name} trained in {took[name]:.0f} s", flush=True)
                del running[name]
        time.sleep(2)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a finished `eagle3-train run` directory")
    p.add_argument("--variant", action="append", required=True, metavar="LABEL[:KEY=VALUE,...]")
    p.add_argument("--work", type=Path, default=HERE / "out" / "recipe_variants")
    p.add_argument("--results", type=Path, default=HERE / "out" / "recipe_variants.json")
    p.add_argument("--parallel", type=int, default=2, help="trainings at a time (the cores split between them)")
    p.add_argument("--measures", default="mtbench_t0,mtbench_t1",
                   help=f"comma-separated: {', '.join(m[0] for m in MEASURES)}")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--serve-only", action="store_true", help="serve the variants trained before")
    args = p.parse_args()
    run = args.run.resolve()
    variants = {}
    for text in args.variant:
        label, _, rest = text.partition(":")
        variants[label] = [o for o in rest.split(",") if o]
    results = read_json(args.results) if args.results.is_file() else {}
    to_train = {k: v for k, v in variants.items() if not (k == "as-run" and not v)}
    took = {} if args.serve_only else train_all(run, args.work, to_train, args.parallel)
    measures = tuple(m for m in MEASURES if m[0] in args.measures.split(","))
    run_config = read_json(run / "pipeline_config.json", "pipeline config")["config"]
    serving = run_config.get("serving") or {}
    verifier = resolve_verifier(run_config["verifier"])
    for label, overrides in variants.items():
        trained = run / "train" if label == "as-run" and not overrides else args.work / label
        draft = args.work / f"{label}-export"
        export(trained, draft, fmt="eagle", overwrite=True)
        print(f"serving {label}", flush=True)
        served = serve(str(draft), args.num_prompts, args.work, measures, dtype=serving.get("dtype", "auto"),
                       verifier=verifier, k=3)
        meta = read_json(trained / "final" / "training_metadata.json", "training metadata")
        method = meta["settings"].get("method") or "eagle3"
        results[label] = {
            "overrides": overrides, "recipe": {k: meta["settings"].get(k) for k in RECIPE_KEYS},
            "draft_forwards_per_round": DRAFT_FORWARDS.get(method),
            "train_s": took.get(label), "estimate": (meta.get("metrics") or {}).get("validation", {}).get(
                "accept_len_k3"), "tokens": (meta.get("progress") or {}).get("tokens"),
            "vllm": {k: {"mean_acceptance_length": v["mean_acceptance_length"],
                         "per_position_acceptance": v["per_position_acceptance"]} for k, v in served.items()},
            "run": str(run), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "command": " ".join(sys.argv)}
        write_json(args.results, results)
    names = [m[0] for m in measures]
    print(f"{'label':14s} {'estimate':>8s} " + " ".join(f"{n:>13s}" for n in names))
    for label in variants:
        e = results[label]
        print(f"{label:14s} {e['estimate'] or 0:8.3f} "
              + " ".join(f"{e['vllm'][n]['mean_acceptance_length']:13.3f}" for n in names))


if __name__ == "__main__":
    main()
