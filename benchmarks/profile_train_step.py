"""Where one training step's time goes: verifier targets, TTT forward, backward, optimizer, per operator.

Runs a few optimizer steps of `train_throughput.py`'s setting under `torch.profiler` and prints the phases and the
operators with the most self CPU time.

  .venv/bin/python benchmarks/profile_train_step.py --ttt 3 --steps 4
"""

from __future__ import annotations

import argparse
import json
import time

import common as bench
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.batching import plan_batches
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.trainer import Trainer
from eagle3_train.train.ttt import supervised_counts, ttt_forward
from eagle3_train.utils.settings import build_settings, parse_set


def phases(trainer: Trainer, micro: list[list[int]]) -> dict[str, float]:
    """One optimizer step, timed phase by phase (the trainer's `train_step`, unrolled)."""
    cfg, t = trainer.cfg, {}
    t0 = time.perf_counter()
    batches = trainer.rank_batches(micro)
    t["fetch"] = time.perf_counter() - t0
    denom = sum(supervised_counts(b.loss_mask, cfg.ttt_steps) for b in batches)
    trainer.optimizer.zero_grad(set_to_none=True)
    for name in ("targets", "forward", "backward"):
        t[name] = 0.0
    for b in batches:
        b = b.to(trainer.device, torch.float32)
        t0 = time.perf_counter()
        with record_function("verifier_targets"):
            targets = verifier_targets(b.final, b.loss_mask, trainer.inputs.lm_head_on(trainer.device),
                                       trainer.model.draft_token_ids(), trainer.model.t2d,
                                       trainer.inputs.logit_transform, full_argmax=b.verifier_argmax,
                                       full_lse=b.verifier_lse)  # the stored full-vocab stats, as the trainer does
        t["targets"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        with record_function("ttt_forward"):
            loss, _ = ttt_forward(trainer.model, b, targets, trainer.objective, denom)
        t["forward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        with record_function("backward"):
            loss.backward()
        t["backward"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    with record_function("optimizer"):
        torch.nn.utils.clip_grad_norm_(trainer.engine.parameters(), 0.5)
        trainer.optimizer.step()
    t["optimizer"] = time.perf_counter() - t0
    t["tokens"] = sum(b.num_tokens for b in batches)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=25, help="operators to list")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    bench.build_data(200)
    values = dict(prepared=str(bench.OUT / "prepared"), hidden_states=str(bench.OUT / "hidden"),
                  vocab=str(bench.OUT / "vocab"), out=str(bench.OUT / f"profile-{int(time.time())}"),
                  ttt_steps=args.ttt, token_budget=2048, max_steps=args.steps, tensorboard=False)
    cfg = build_settings(TrainConfig, {**values, **parse_set(args.set, TrainConfig, ("train",))}, "--set")
    trainer = Trainer(cfg)
    trainer.model.train()
    plan = plan_batches(trainer.train_data.lengths, cfg.token_budget, cfg.seed, 0)
    phases(trainer, plan[0:1])  # warm-up
    totals: dict[str, float] = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(1, args.steps + 1):
            for k, v in phases(trainer, plan[i:i + 1]).items():
                totals[k] = totals.get(k, 0.0) + v
    tokens = totals.pop("tokens")
    step_s = sum(totals.values())
    print(json.dumps({"ttt": args.ttt, "tokens_per_s": round(tokens / step_s, 1),
                      "share": {k: round(v / step_s, 3) for k, v in totals.items()}}, indent=1))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
