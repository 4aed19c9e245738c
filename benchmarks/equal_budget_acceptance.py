"""vLLM acceptance length at the budget of the speculators 0.9.0 reference draft (issue "Train and ship"): 200
ShareGPT conversations tokenized for SmolLM2 (max 512 tokens), draft vocab 8192, 3 TTT steps, 3 epochs, 2048-token
batches; judged in vLLM on the 80 MT-bench first turns, 128 tokens each, k=3. The reference reached 1.24
(per position 0.20 / 0.035 / 0.006).

Each variant is a set of `train` overrides on the same data (built once, shared with `train_throughput.py`):

  .venv/bin/python benchmarks/equal_budget_acceptance.py --variant default --variant lr2e-3:lr=0.002
Results: benchmarks/out/equal_budget_acceptance.json (appended per variant) and a printed table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from train_throughput import OUT, build_data

from eagle3_train.evaluate.pipeline_eval import acceptance_summary, served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.export.exporter import export
from eagle3_train.train.config import TrainConfig
from eagle3_train.train.trainer import train
from eagle3_train.utils.config import to_dataclass
from eagle3_train.utils.io import read_json, write_json
from eagle3_train.utils.settings import parse_set

RESULTS = OUT.parent / "equal_budget_acceptance.json"
BASE = dict(ttt_steps=3, epochs=3, token_budget=2048, lr=5e-4, warmup_ratio=0.05, grad_clip=0.5, seed=0,
            log_every=20, tensorboard=False)


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    return name, parse_set([item for item in rest.split(",") if item], TrainConfig, ("train",))


def run_variant(name: str, overrides: dict, args) -> dict:
    run = OUT / "acceptance" / name
    settings = {**BASE, **overrides}
    t0 = time.perf_counter()
    result = train(to_dataclass(TrainConfig, dict(prepared=str(OUT / "prepared"), hidden_states=str(OUT / "hidden"),
                                                  vocab=str(OUT / "vocab"), out=str(run / "train"), **settings),
                                f"variant {name}"))
    train_s = time.perf_counter() - t0
    export(run / "train", run / "export-eagle", fmt="eagle")
    verifier = Path(read_json(OUT / "hidden" / "manifest.json")["verifier"]["path"])
    prompts = load_prompts("mtbench", limit=args.num_prompts, turns=1)
    served = acceptance_summary(served_acceptance(verifier, run / "export-eagle", prompts, k=3,
                                                  max_tokens=args.max_tokens, concurrency=8, log_dir=run))
    return {"variant": name, "settings": settings, "steps": result["step"], "train_s": round(train_s, 1),
            "train_metrics": {k: v for k, v in result["train"].items() if k.startswith(("acc_", "accept_len"))},
            "vllm": served}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="train overrides on top of the base settings; repeatable (default: one 'default' run)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations")
    args = p.parse_args()
    build_data(args.limit)
    results = read_json(RESULTS) if RESULTS.is_file() else {}
    for text in args.variant or ["default"]:
        name, overrides = parse_variant(text)
        results[name] = run_variant(name, overrides, args)
        write_json(RESULTS, results)
        v = results[name]["vllm"]
        print(f"{name}: vLLM acceptance {v['mean_acceptance_length']} per position {v.get('per_position_acceptance')} "
              f"({results[name]['steps']} steps, {results[name]['train_s']} s)", flush=True)
    print(json.dumps({k: r["vllm"]["mean_acceptance_length"] for k, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
