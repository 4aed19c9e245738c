"""The offline evaluator (HF verifier + our draft, chain speculative decoding) and real vLLM, for the same draft and
the same prompts, side by side: mean acceptance length and per-position rates.

  .venv/bin/python benchmarks/offline_vs_vllm.py --draft runs/smollm2-sharegpt/export-eagle --num-prompts 10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle3_train.assets.verifier import resolve_verifier
from eagle3_train.evaluate.offline import evaluate_offline
from eagle3_train.evaluate.pipeline_eval import acceptance_summary, served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.utils.io import write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="exported draft (EAGLE format)")
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--benchmark", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--out", default="benchmarks/out/offline_vs_vllm.json")
    args = p.parse_args()
    verifier = resolve_verifier(args.verifier)
    prompts = load_prompts(args.benchmark, limit=args.num_prompts, turns=1)
    offline_full = evaluate_offline(args.draft, verifier, prompts, k=args.k, max_new_tokens=args.max_tokens)
    write_json(Path(args.out).with_suffix(".offline.json"), offline_full)
    offline = offline_full["overall"]
    served = served_acceptance(verifier, Path(args.draft), prompts, k=args.k, max_tokens=args.max_tokens,
                               concurrency=1, log_dir=Path(args.out).parent)
    rows = {"offline": {"mean_acceptance_length": offline["mean_acceptance_length"],
                        "per_position_acceptance": offline["per_position_acceptance"],
                        "num_drafts": offline.get("num_drafts"), "greedy_check": offline_full["greedy_check"]},
            "vllm": acceptance_summary(served)}
    write_json(args.out, {"draft": args.draft, "prompts": [q.id for q in prompts], "k": args.k,
                          "max_tokens": args.max_tokens, **rows})
    for name, r in rows.items():
        per = " / ".join(f"{x:.3f}" for x in r["per_position_acceptance"] or [])
        print(f"{name:8s} acceptance length {r['mean_acceptance_length']:.3f}  per position {per}")
    print(json.dumps(rows["offline"].get("greedy_check"), default=str)[:300])


if __name__ == "__main__":
    main()
