"""Training throughput (tokens/s) and peak memory of `eagle3-train train` at the settings of the speculators
comparison: 200 ShareGPT conversations tokenized for SmolLM2 (max 512 tokens each), draft vocab 8192, 2048-token
batches, AdamW, 3 and 7 TTT steps. Each setting runs in its own process (separate peak RSS).

  .venv/bin/python benchmarks/train_throughput.py --steps 30        # builds the data once under benchmarks/out/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

from common import OUT, build_data, cpu_model, run_child


def run_one(ttt_steps: int, steps: int, threads: int | None, overrides: list[str]) -> dict:
    """Child process: train `steps` optimizer steps and report tokens/s (after the first step) and peak RSS."""
    import torch

    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.trainer import Trainer
    from eagle3_train.utils.settings import build_settings, parse_set

    if threads:
        torch.set_num_threads(threads)
    out = OUT / f"run-ttt{ttt_steps}-{int(time.time())}"
    values = dict(prepared=str(OUT / "prepared"), hidden_states=str(OUT / "hidden"), vocab=str(OUT / "vocab"),
                  out=str(out), ttt_steps=ttt_steps, token_budget=2048, max_steps=steps, lr=1e-4,
                  tensorboard=False, log_every=1000)
    # e.g. checkpoint_mlp=false, for A/B runs of one setting; unknown keys are named, not silently ignored
    cfg = build_settings(TrainConfig, {**values, **parse_set(overrides, TrainConfig, ("train",))}, "--set")
    trainer = Trainer(cfg)
    plan = __import__("eagle3_train.train.batching", fromlist=["plan_batches"]).plan_batches(
        trainer.train_data.lengths, cfg.token_budget, cfg.seed, 0)
    trainer.train_step(plan[0:1])  # warm-up (allocator, first-call overheads)
    tokens, t0 = 0, time.perf_counter()
    for i in range(1, steps + 1):
        _, n = trainer.train_step(plan[i % len(plan):i % len(plan) + 1])
        tokens += n
    dt = time.perf_counter() - t0
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    return {"ttt_steps": ttt_steps, "optimizer_steps": steps, "tokens": tokens, "seconds": round(dt, 2),
            "tokens_per_s": round(tokens / dt, 1), "peak_rss_gb": round(rss_gb, 2), "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per setting")
    p.add_argument("--ttt", default="3,7")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TrainConfig field, e.g. --set checkpoint_mlp=false")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child, args.steps, args.threads, args.set)))
        return
    build_data(args.limit)
    manifest = json.loads((OUT / "prepared" / "manifest.json").read_text())
    results = {"machine": {"cpu": cpu_model(), "nproc": os.cpu_count(), "platform": platform.platform()},
               "data": manifest.get("counts"), "draft_vocab": 8192, "token_budget": 2048,
               "overrides": args.set, "runs": []}
    for k in [int(x) for x in args.ttt.split(",")]:
        cmd = [sys.executable, __file__, "--child", str(k), "--steps", str(args.steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        for o in args.set:
            cmd += ["--set", o]
        r = run_child(cmd)
        results["runs"].append(r)
        print(f"TTT steps {k}: {r['tokens_per_s']} tokens/s, peak RSS {r['peak_rss_gb']} GB "
              f"({r['tokens']} tokens in {r['seconds']} s, {r['threads']} threads)")
    (OUT.parent / "train_throughput.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
