"""Peak training memory against sample length (2K-32K tokens), measured and planned, for both later-step attention
kernels (`merged`, what training runs; `masked`, the quadratic fallback).

One training step of a reduced-width Llama-layer draft (hidden 256, 4 heads of 64, 2 KV heads, verifier vocabulary
8192, draft vocabulary 2048; TTT 7 and the trainer's checkpointing defaults, fp32, every token supervised) on one
sample of L tokens: verifier targets, `ttt_forward`, backward, an AdamW step; each length in its own process. The
draft is the one `eagle3-train plan` plans for a verifier config of that shape (written to the output folder), so
the measured anonymous-RSS peak above the baseline (taken after imports) is set against the plan's CPU process total
at the same length, and the per-token figures (the slope between successive lengths) against each other.
glibc's mmap threshold is lowered so that freed tensors leave RSS (plan_vs_measured.py does the same).

  PYTHONPATH=src .venv/bin/python benchmarks/long_context_memory.py --lengths 2048,4096,8192,16384,32768
  PYTHONPATH=src .venv/bin/python benchmarks/long_context_memory.py --kernel masked --lengths 2048,4096,8192,16384
Results: benchmarks/out/long_context_memory-{kernel}.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, PeakSampler, anon_rss, machine, run_child  # noqa: E402

VERIFIER = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 8,
            "intermediate_size": 768, "vocab_size": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 65536, "tie_word_embeddings": False,
            "torch_dtype": "float32"}
DRAFT_VOCAB, TTT_STEPS = 2048, 7
FOLDER = OUT.parent / "long_context"


def plan_settings(length: int):
    from eagle3_train.plan import PlanSettings

    return PlanSettings(verifier=str(FOLDER / "verifier"), samples=1, tokens_per_sample=length,
                        draft_vocab=DRAFT_VOCAB, ttt_steps=TTT_STEPS, token_budget=length, precision="fp32",
                        device="cpu")


def run_one(length: int, kernel: str) -> dict:
    import torch

    from eagle3_train.model.attention import TTTAttention
    from eagle3_train.model.draft import Eagle3Draft
    from eagle3_train.plan import plan
    from eagle3_train.plan.memory import ttt_saved_bytes
    from eagle3_train.plan.verifier import build_meta_draft
    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.data import Batch
    from eagle3_train.train.objective import Objective
    from eagle3_train.train.targets import verifier_targets
    from eagle3_train.train.ttt import supervised_counts, ttt_forward

    TTTAttention.ttt_merged = kernel == "merged"
    settings = plan_settings(length)
    draft_cfg, _ = build_meta_draft(VERIFIER, settings)
    defaults = TrainConfig(prepared="", hidden_states="", vocab="", out="")
    objective = Objective(TTT_STEPS, (1.0,) * TTT_STEPS, checkpoint_loss=defaults.checkpoint_loss,
                          checkpoint_mlp=defaults.checkpoint_mlp)
    torch.manual_seed(0)
    H, V = VERIFIER["hidden_size"], VERIFIER["vocab_size"]
    lm_head = torch.randn(V, H) * 0.05  # the verifier's (targets): before the baseline, as planned
    import gc

    gc.collect()
    baseline = anon_rss()
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    model = Eagle3Draft(draft_cfg)
    model.set_vocab(torch.zeros(DRAFT_VOCAB, dtype=torch.long), torch.arange(V) < DRAFT_VOCAB)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(2):  # the second step holds the AdamW states, as every later step does
        ids = torch.randint(0, V, (1, length))
        mask = torch.ones(1, length, dtype=torch.bool)
        batch = Batch(ids, mask, torch.randn(1, length, 3 * H), torch.randn(1, length, H), torch.tensor([length]))
        targets = verifier_targets(batch.final, mask, lm_head, model.draft_token_ids(), model.t2d)
        loss, _ = ttt_forward(model, batch, targets, objective, supervised_counts(mask, TTT_STEPS))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del batch, targets, loss
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    p = plan(settings)
    # the plan counts the kernel CPU training runs (merged); for masked, its activation terms instead
    saved = {m: ttt_saved_bytes(draft_cfg, length, length, length, TTT_STEPS, False, objective.checkpoint_mlp,
                                objective.checkpoint_loss, DRAFT_VOCAB, merged=m)["total"] for m in (True, False)}
    extra = saved[kernel == "merged"] - saved[True]
    return {"length": length, "kernel": kernel, "seconds_two_steps": round(seconds, 1),
            "measured_mb": round((peak - baseline) / 1e6, 1),
            "planned_mb": round((p.host_memory["process_total"] + extra) / 1e6, 1),
            "planned_activations_mb": round((p.memory["ttt_activations"] + extra) / 1e6, 1),
            "planned_peak_phase": p.memory["peak_phase"], "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    ap.add_argument("--kernel", choices=("merged", "masked"), default="merged")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child, args.kernel)))
        return
    (FOLDER / "verifier").mkdir(parents=True, exist_ok=True)
    (FOLDER / "verifier" / "config.json").write_text(json.dumps(VERIFIER, indent=2))
    env = {**os.environ, "EAGLE3_TRAIN_MALLOC": "system", "MALLOC_MMAP_THRESHOLD_": "65536"}
    runs, previous = [], None
    for length in [int(x) for x in args.lengths.split(",")]:
        r = run_child([sys.executable, __file__, "--child", str(length), "--kernel", args.kernel], env)
        if previous:
            span = length - previous["length"]
            r["measured_kb_per_token"] = round((r["measured_mb"] - previous["measured_mb"]) * 1e3 / span, 1)
            r["planned_kb_per_token"] = round((r["planned_mb"] - previous["planned_mb"]) * 1e3 / span, 1)
        runs.append(r)
        previous = r
        print(json.dumps(r), flush=True)
    result = {"machine": {**machine(), "date": time.strftime("%Y-%m-%d"), "loadavg": os.getloadavg()}, "runs": runs}
    (OUT.parent / f"long_context_memory-{args.kernel}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
