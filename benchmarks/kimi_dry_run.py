"""Rehearse the Kimi-K2.5 finetune on a CPU (issue 10); results are recorded in benchmarks/README.md.

Part `dry-run`: the full-size `eagle3-train train --dry-run --finetune-from` on a simulated
`AQ-MedAI/Kimi-K2-Instruct-eagle3` (exact keys, shapes, dtypes and config; zeros in sparse files) against a
Kimi-K2-shaped verifier (61 layers, hidden 7168, vocab 163840; embedding and lm_head as sparse headers) and a small
dataset with real hidden states at width 7168, extracted at the draft's layers (3, 31, 59).

Part `fwd-bwd`: one real optimizer step of the trainer (forward and backward over 7 TTT steps, targets from the
verifier's 163840-token lm_head) at Kimi's structure reduced in width: hidden 1024 (8 heads of 128), vocab 163840,
draft vocab 32000, 2048 tokens per micro-batch, fp32 on CPU (what `train` does here).

Each part runs in its own process, so its peak RSS is its own. Usage (from the repository root):
    PYTHONPATH=src:tests python benchmarks/kimi_dry_run.py [--part all|dry-run|fwd-bwd] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def part_dry_run(work: Path) -> dict:
    from support.kimi_layouts import (
        LAYERS,
        kimi_train_config,
        write_aq_medai_draft,
        write_kimi_verifier,
        write_run_inputs,
    )

    from eagle3_train.train.dry_run import dry_run, format_report

    t0 = time.time()
    verifier = write_kimi_verifier(work / "Kimi-K2-Instruct")
    paths = write_run_inputs(work / "inputs", verifier, layer_ids=LAYERS, samples=16, length=256)
    results = {}
    for with_embed in (False, True):
        source = write_aq_medai_draft(work / f"Kimi-K2-Instruct-eagle3{'-embed' if with_embed else ''}",
                                      with_embed=with_embed)
        t1 = time.time()
        report = dry_run(kimi_train_config(paths, work / f"train-{with_embed}", finetune_from=str(source),
                                           finetune_vocab="rebuild"))
        results[f"with_embed_tokens={with_embed}"] = {"dry_run_s": round(time.time() - t1, 1),
                                                       "source_file_bytes": (source / "model.safetensors").stat()
                                                       .st_size}
        if not with_embed:
            print(format_report(report))
    return {"part": "dry-run", "total_s": round(time.time() - t0, 1), "runs": results,
            "peak_rss_gib": round(_peak_rss_gib(), 2), "memory": report["memory"]}


def part_fwd_bwd(work: Path) -> dict:
    import torch
    from support.kimi_layouts import kimi_train_config, write_kimi_verifier, write_run_inputs

    from eagle3_train.train.trainer import Trainer

    hidden = 1024
    t0 = time.time()
    verifier = write_kimi_verifier(work / "kimi-w1024", hidden=hidden, real_head=True)
    paths = write_run_inputs(work / "inputs-w1024", verifier, layer_ids=(2, 30, 58), samples=8, length=256,
                             hidden=hidden)
    setup_s = time.time() - t0
    rss_setup = _peak_rss_gib()
    cfg = kimi_train_config(paths, work / "train-w1024", token_budget=2048, max_steps=1, device="cpu",
                            precision="fp32", eval_every=10**6, max_eval_batches=1, log_every=1)
    t1 = time.time()
    trainer = Trainer(cfg)
    build_s = time.time() - t1
    rss_built = _peak_rss_gib()
    t2 = time.time()
    result = trainer.run()
    step_s = time.time() - t2
    model = trainer.model
    return {"part": "fwd-bwd", "hidden": hidden, "vocab": model.config.vocab_size,
            "draft_vocab": model.config.draft_vocab_size, "ttt_steps": cfg.ttt_steps,
            "token_budget": cfg.token_budget,
            "trainable_parameters": sum(p.numel() for p in trainer.engine.parameters()),
            "embed_dtype": str(model.embed_tokens.weight.dtype), "setup_s": round(setup_s, 1),
            "build_s": round(build_s, 1), "one_step_and_validation_s": round(step_s, 1),
            "loss": result["train"]["loss"], "peak_rss_gib_after_setup": round(rss_setup, 2),
            "peak_rss_gib_after_build": round(rss_built, 2), "peak_rss_gib": round(_peak_rss_gib(), 2),
            "torch_threads": torch.get_num_threads()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=("all", "dry-run", "fwd-bwd"))
    p.add_argument("--work", help="scratch directory (default: a temporary one, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args()
    if args.part == "all":
        out = []
        for part in ("dry-run", "fwd-bwd"):
            cmd = [sys.executable, __file__, "--part", part] + (["--work", args.work] if args.work else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            sys.stderr.write(r.stderr[-3000:])
            if r.returncode:
                print(r.stdout)
                return r.returncode
            print(r.stdout.rsplit("RESULT ", 1)[0])
            out.append(json.loads(r.stdout.rsplit("RESULT ", 1)[1]))
        print(json.dumps(out, indent=2))
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="kimi-rehearsal-")) / args.part
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = part_dry_run(work) if args.part == "dry-run" else part_fwd_bwd(work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
