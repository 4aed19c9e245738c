"""speculators 0.9.0 at its own defaults against the main job's draft, on the main job's data, judged by one vLLM.

The main job (`scripts/run_default.sh`) trains our draft at our defaults for this scale (configs/smollm2-sharegpt.yaml).
speculators gets the same training rows (`prepared_to_pretok.py`: the prepared train split, same tokens and loss
masks) and the same verifier states (`HS_FROM_STORE`: converted from the run's store, no second verifier pass), and
trains with its defaults for EAGLE-3: Muon at lr 1e-3, norm_before_fc, norm_output and norm_before_residual, one
Llama layer, KL loss, bf16 hidden states and autocast (`CPU_AUTOCAST=1`: this host has native bf16). What the CPU
harness changes is listed in speculators_harness/README.md; here also `--total-seq-len` 2048 (ours: 2048-token steps)
and `--train-data-ratio 0.99` (it takes values below 1: the rows are already our train split, so 1% of them go to
its validation instead of its default 10%).
- equal data: as many epochs over the rows as ours (the run's train.epochs);
- equal wall clock: the optimizer steps that fill our training time at speculators' measured rate (a probe of
  `--probe-steps` steps right before), so its learning-rate schedule decays over them.
Each draft is then served beside the same verifier (the run's serving dtype) on MT-bench and HumanEval at T 0 and
MT-bench at T 1 (benchmarks/common.py MEASURES), none of them trained on.

  .venv/bin/python benchmarks/vs_speculators_defaults.py --run /tmp/mj/runs/smollm2-sharegpt
Results: benchmarks/out/vs_speculators_defaults.json
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

from common import MEASURES, serve

from eagle3_train.utils.io import read_json, write_json

HERE = Path(__file__).resolve().parent
ANCHOR = HERE / "speculators_harness"


def spec_env(args, cfg: dict, run: str, epochs: int, max_steps: int | None) -> dict[str, str]:
    """bench.sh's settings: speculators' EAGLE-3 defaults on the run's rows and states (`cfg`: the run's config)."""
    return {**os.environ, "WORK": str(args.work), "VENV": str(args.venv), "DATA": str(args.work / "data"),
           "PRETOK": str(args.work / "rows.jsonl"), "SEQ": str(cfg["prepare"]["max_length"]),
           "TTT": str(cfg["train"]["ttt_steps"]), "EPOCHS": str(epochs), "MAX_STEPS": str(max_steps or ""),
           "OPTIMIZER": "muon", "LR": "1e-3", "HS_DTYPE": "bfloat16", "CPU_AUTOCAST": "1",
           "DRAFT_VOCAB": str(cfg["vocab"]["size"]), "HS_FROM_STORE": str(args.run / "hidden_states"),
           "TRAIN_DATA_RATIO": "0.99", "OUR_PY": sys.executable, "RUN": run}


def train_spec(args, cfg: dict, run: str, epochs: int, max_steps: int | None = None) -> dict:
    summary = args.work / "runs" / run / "summary.json"
    if not summary.is_file() or not read_json(summary)["checkpoint"]["ok"]:
        subprocess.run(["bash", str(ANCHOR / "bench.sh")], env=spec_env(args, cfg, run, epochs, max_steps),
                       check=True)
    return read_json(summary)


def ours_train_seconds(run: Path) -> float:
    """Our train stage's wall time, as the pipeline recorded it (model set-up, validations and checkpoints included)."""
    return float(read_json(run / "pipeline_state.json")["stages"]["train"]["seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True, help="the main job's run directory")
    p.add_argument("--work", type=Path, default=HERE / "out" / "vs_speculators_defaults")
    p.add_argument("--venv", type=Path, default=Path("/tmp/anchors/specvenv"))
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--only", choices=("equal_data", "equal_wall_clock", "serve"))
    p.add_argument("--results", type=Path, default=HERE / "out" / "vs_speculators_defaults.json")
    args = p.parse_args()
    args.run, args.work = args.run.resolve(), args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.work / "source.json"  # rows, states and runs under --work belong to one main-job run
    if source.is_file() and read_json(source)["run"] != str(args.run):
        sys.exit(f"{args.work} holds speculators data and runs for {read_json(source)['run']}: give another --work")
    write_json(source, {"run": str(args.run)})
    results = read_json(args.results) if args.results.is_file() else {}
    rows = args.work / "rows.jsonl"
    if not rows.is_file():
        subprocess.run([sys.executable, str(ANCHOR / "prepared_to_pretok.py"), str(args.run / "prepared"), str(rows)],
                       check=True)
    cfg = read_json(args.run / "pipeline_config.json")["config"]
    epochs = math.ceil(float(cfg["train"]["epochs"]))
    runs = {}
    if args.only in (None, "equal_wall_clock"):
        probe = train_spec(args, cfg, f"probe{args.probe_steps}", 1, args.probe_steps)
        rate = probe["train_tokens_per_s_excl_first_step"]
        tokens_per_step = probe["tokens_trained"] / probe["train_steps"]
        seconds = ours_train_seconds(args.run)
        steps = max(1, round(seconds * rate / tokens_per_step))
        results["equal_wall_clock_budget"] = {"ours_train_s": seconds, "speculators_tokens_per_s": rate,
                                              "speculators_tokens_per_step": tokens_per_step, "steps": steps}
        runs["speculators_equal_wall_clock"] = train_spec(args, cfg, f"wall{steps}", epochs, steps)
    if args.only in (None, "equal_data"):
        runs["speculators_equal_data"] = train_spec(args, cfg, f"data_e{epochs}", epochs)
    results.setdefault("training", {}).update(runs)
    write_json(args.results, results)
    if args.only in (None, "serve"):
        drafts = {"ours": args.run / "export-speculators"}
        for d in sorted((args.work / "runs").glob("*/summary.json")):
            ckpt = read_json(d).get("checkpoint", {})
            if not d.parent.name.startswith("probe") and ckpt.get("ok"):
                drafts[f"speculators_{d.parent.name}"] = Path(ckpt["dir"])
        dtype = cfg.get("serving", {}).get("dtype") or "auto"
        served = results.setdefault("served", {})
        for name, draft in drafts.items():
            print(f"serving {name}: {draft}", flush=True)
            served[name] = {"draft": str(draft), **serve(str(draft), args.num_prompts, args.work / "vllm" / name,
                                                       MEASURES, dtype=dtype)}
            write_json(args.results, results)
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
