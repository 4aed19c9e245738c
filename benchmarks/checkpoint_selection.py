"""The training estimate against vLLM on every kept checkpoint of one training run: how far off is the estimate, and
does ranking by it pick what vLLM would?

Runs `select` (src/eagle3_train/evaluate/select.py) with every checkpoint a candidate: each is exported, served beside
the verifier and sent the validation split's first user turns (held out from training). Train the run with
checkpoints along the way first, e.g. through recipe_variants.py with `save_every=80,eval_every=80,keep_last=100`.

  .venv/bin/python benchmarks/checkpoint_selection.py --train benchmarks/out/recipe_variants/e31-muon-ckpt \\
      --run /tmp/mj/runs/smollm2-sharegpt
Results: benchmarks/out/checkpoint_selection.json and a printed table (step, estimate, served, their difference).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import machine

from eagle3_train.assets.verifier import resolve_verifier
from eagle3_train.evaluate.select import checkpoint_candidates, select_checkpoint
from eagle3_train.utils.io import read_json, write_json

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=Path, required=True, help="a training run directory with step checkpoints")
    p.add_argument("--run", type=Path, required=True, help="the `eagle3-train run` whose data it trained on")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=HERE / "out" / "checkpoint_selection")
    args = p.parse_args()
    config = read_json(args.run / "pipeline_config.json", "pipeline config")["config"]
    n = len(checkpoint_candidates(args.train))
    t0 = time.perf_counter()
    r = select_checkpoint(args.train, resolve_verifier(config["verifier"]), args.run / "prepared", args.out,
                          by="served", max_candidates=n, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          serving=config.get("serving") or {})
    r.update({"wall_s": round(time.perf_counter() - t0, 1), "machine": machine(), "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    write_json(args.out.parent / "checkpoint_selection.json", r)
    print(f"{'checkpoint':>14s} {'step':>5s} {'estimate':>8s} {'served':>7s} {'est-served':>10s}")
    for c in r["candidates"]:
        est, srv = c["estimate"], c["served"]
        diff = f"{est - srv:+10.3f}" if est is not None and srv is not None else f"{'-':>10s}"
        print(f"{c['name']:>14s} {c['step']:5d} {est or 0:8.3f} {srv or 0:7.3f} {diff}")
    best_est = max((c for c in r["candidates"] if c["estimate"] is not None), key=lambda c: c["estimate"])
    print(f"served chooses step {r['selected_step']}; the estimate would choose step {best_est['step']}")


if __name__ == "__main__":
    main()
