"""The planner's memory estimate (`eagle3-train plan`) vs the measured peak of a short real SmolLM2 training run.

Data and settings of `train_throughput.py` (its `build_data`: 200 ShareGPT conversations, max 512 tokens, draft vocab
8192, bf16 hidden states), 2048-token batches, AdamW, fp32 on CPU. Each TTT setting runs in its own process:

  .venv/bin/python benchmarks/plan_vs_measured.py --steps 3 --ttt 3,7

What is compared, honestly: the process's *anonymous* resident memory (RSS minus file-backed pages: the memory-mapped
Arrow data and safetensors shards are page cache, not training memory), sampled every 2 ms in a thread. The baseline is
taken after every import (torch, transformers, datasets, the trainer) and before the Trainer is built, so the
Python/torch runtime is not counted; training-attributable = peak - baseline. It is set against the plan's CPU total
(`host_memory.process_total`: the per-rank terms plus private host copies and the stored-dtype batches; the verifier's
fp32 embedding is memory-mapped from its safetensors file, page cache like the data, so neither side counts it),
planned at the geometry of the largest batch actually run (its B x L and supervised share). The steps run on the
batches with the most padded tokens, after one warm-up step (the optimizer states exist from the second step on).
glibc keeps freed heap memory, which would make RSS overstate the live peak: the child sets MALLOC_MMAP_THRESHOLD_ to
64 KB so that tensor memory goes back to the system when freed (`--default-malloc` measures without it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, PeakSampler, anon_rss, build_data, cpu_model, run_child  # noqa: E402  (shared with the others)


def run_one(ttt_steps: int, steps: int, threads: int | None) -> dict:
    import torch

    import eagle3_train.train.trainer  # noqa: F401  (every import before the baseline)
    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.plan import PlanSettings, plan
    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.batching import plan_batches
    from eagle3_train.train.trainer import Trainer

    if threads:
        torch.set_num_threads(threads)
    verifier = resolve_verifier("smollm2-135m-instruct")
    out = OUT / f"plan-run-ttt{ttt_steps}-{int(time.time())}"
    cfg = TrainConfig(prepared=str(OUT / "prepared"), hidden_states=str(OUT / "hidden"), vocab=str(OUT / "vocab"),
                      out=str(out), ttt_steps=ttt_steps, token_budget=2048, max_steps=steps + 1, lr=1e-4,
                      tensorboard=False, log_every=1000, device="cpu", precision="fp32")
    import gc

    gc.collect()
    baseline = anon_rss()
    sampler = PeakSampler()
    sampler.start()
    trainer = Trainer(cfg)
    after_build = anon_rss()
    data = trainer.train_data
    batches = plan_batches(data.lengths, cfg.token_budget, cfg.seed, 0)
    padded = lambda b: len(b) * max(data.lengths[i] for i in b)  # noqa: E731
    largest = sorted(batches, key=padded, reverse=True)[:steps + 1]
    t0 = time.perf_counter()
    for b in largest:
        trainer.train_step([b])
    seconds = time.perf_counter() - t0
    peak = sampler.stop()

    big = largest[0]
    batch = data.batch(big)
    B, L = batch.input_ids.shape
    supervised = float(batch.loss_mask[:, 2:].sum()) / (B * L)
    settings = PlanSettings(verifier=str(verifier), samples=len(data), tokens_per_sample=L, draft_vocab=8192,
                            ttt_steps=ttt_steps, token_budget=cfg.token_budget, precision="fp32", device="cpu",
                            supervised_fraction=supervised)
    p = plan(settings)
    planned = p.host_memory["process_total"]
    measured = peak - baseline
    return {
        "ttt_steps": ttt_steps, "optimizer_steps": len(largest), "seconds": round(seconds, 1),
        "largest_batch": [int(B), int(L)], "planned_batch": [p.batch["batch_size"], p.batch["seq_len"]],
        "supervised_share": round(supervised, 3),
        "baseline_anon_mb": round(baseline / 1e6, 1), "after_trainer_built_anon_mb": round(after_build / 1e6, 1),
        "peak_anon_mb": round(peak / 1e6, 1), "measured_training_mb": round(measured / 1e6, 1),
        "planned_mb": round(planned / 1e6, 1), "planned_peak_phase": p.memory["peak_phase"],
        "planned_terms_mb": {k: round(v / 1e6, 1) for k, v in p.memory.items() if isinstance(v, int)},
        "planned_host_mb": {k: round(v / 1e6, 1) for k, v in p.host_memory.items()},
        "ratio_planned_to_measured": round(planned / measured, 3),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(), "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations (train_throughput's data)")
    p.add_argument("--steps", type=int, default=4, help="measured optimizer steps after one warm-up step")
    p.add_argument("--ttt", default="3,7")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's mmap threshold alone")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child, args.steps, args.threads)))
        return
    build_data(args.limit)
    env = {**os.environ, "EAGLE3_TRAIN_MALLOC": "system"}  # glibc: the threshold below makes RSS track live memory
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = {"machine": {"cpu": cpu_model(), "nproc": os.cpu_count(), "platform": platform.platform(),
                           "loadavg_before": os.getloadavg()}, "runs": []}
    for k in [int(x) for x in args.ttt.split(",")]:
        cmd = [sys.executable, __file__, "--child", str(k), "--steps", str(args.steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        r = run_child(cmd, env)
        results["runs"].append(r)
        print(f"TTT {k}: measured {r['measured_training_mb']} MB (peak anon {r['peak_anon_mb']} - baseline "
              f"{r['baseline_anon_mb']}), planned {r['planned_mb']} MB -> ratio {r['ratio_planned_to_measured']} "
              f"(batch {r['largest_batch']}, {r['optimizer_steps']} steps, {r['seconds']} s)")
    results["machine"]["loadavg_after"] = os.getloadavg()
    name = "plan_vs_measured" + ("-default-malloc" if args.default_malloc else "") + ".json"
    (OUT.parent / name).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
