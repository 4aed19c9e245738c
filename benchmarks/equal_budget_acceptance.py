"""vLLM acceptance length at the budget of the speculators 0.9.0 reference draft (issue "Train and ship"): 200
ShareGPT conversations tokenized for SmolLM2 (max 512 tokens), draft vocab 8192, 3 TTT steps, 3 epochs, 2048-token
batches; judged in vLLM on the 80 MT-bench first turns, 128 tokens each, k=3. The reference reached 1.24
(per position 0.20 / 0.035 / 0.006).

Each variant is a set of `train` overrides on the same data (built once, shared with `train_throughput.py`):

  .venv/bin/python benchmarks/equal_budget_acceptance.py --variant default --variant lr2e-3:lr=0.002
  .venv/bin/python benchmarks/equal_budget_acceptance.py --variant tv:lr=0.002,loss=tv --no-vllm   # estimates only
  .venv/bin/python benchmarks/equal_budget_acceptance.py --variant tv:lr=0.002,loss=tv --serve-only  # then vLLM
Results: benchmarks/out/equal_budget_acceptance.json (appended per variant) and a printed table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import BASE, OUT, build_data

from eagle3_train.evaluate.pipeline_eval import acceptance_summary, served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.export.exporter import export
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.trainer import train
from eagle3_train.utils.config import to_dataclass
from eagle3_train.utils.io import read_json, write_json
from eagle3_train.utils.settings import parse_set

RESULTS = OUT.parent / "equal_budget_acceptance.json"


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    return name, parse_set([item for item in rest.split(",") if item], TrainConfig, ("train",))


def train_variant(name: str, overrides: dict) -> dict:
    run = OUT / "acceptance" / name
    settings = {**BASE, **overrides}
    t0 = time.perf_counter()
    result = train(to_dataclass(TrainConfig, dict(prepared=str(OUT / "prepared"), hidden_states=str(OUT / "hidden"),
                                                  vocab=str(OUT / "vocab"), out=str(run / "train"), **settings),
                                f"variant {name}"))
    train_s = time.perf_counter() - t0
    export(run / "train", run / "export-eagle", fmt="eagle")
    # the training-time estimates: argmax chain (temperature 0) and alpha / p(draft argmax) (temperature 1)
    keys = ("acc_", "accept_len", "alpha_", "p_draft_")
    return {"variant": name, "settings": settings, "steps": result["step"], "train_s": round(train_s, 1),
            "train_metrics": {k: v for k, v in result["train"].items() if k.startswith(keys)}, "vllm": None}


def serve_variant(name: str, args) -> dict:
    run = OUT / "acceptance" / name
    verifier = Path(read_json(OUT / "hidden" / "manifest.json")["verifier"]["path"])
    prompts = load_prompts("mtbench", limit=args.num_prompts, turns=1)
    return acceptance_summary(served_acceptance(verifier, run / "export-eagle", prompts, k=3,
                                                max_tokens=args.max_tokens, concurrency=8, log_dir=run))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="train overrides on top of the base settings; repeatable (default: one 'default' run)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations")
    phase = p.add_mutually_exclusive_group()
    phase.add_argument("--no-vllm", action="store_true", help="train and record the estimates only")
    phase.add_argument("--serve-only", action="store_true", help="serve variants trained earlier (--no-vllm)")
    args = p.parse_args()
    build_data(args.limit)
    results = read_json(RESULTS) if RESULTS.is_file() else {}
    for text in args.variant or ["default"]:
        name, overrides = parse_variant(text)
        if not args.serve_only:
            results[name] = train_variant(name, overrides)
            write_json(RESULTS, results)
            m = results[name]["train_metrics"]
            print(f"{name}: estimates k=3 argmax {m.get('accept_len_k3', 0):.3f} alpha "
                  f"{m.get('accept_len_alpha_k3', 0):.3f} ({results[name]['steps']} steps, "
                  f"{results[name]['train_s']} s)", flush=True)
        if not args.no_vllm:
            results.setdefault(name, {"variant": name})["vllm"] = v = serve_variant(name, args)
            write_json(RESULTS, results)
            print(f"{name}: vLLM acceptance {v['mean_acceptance_length']} per position "
                  f"{v.get('per_position_acceptance')}", flush=True)
    print(json.dumps({k: (r["vllm"] or {}).get("mean_acceptance_length") for k, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
