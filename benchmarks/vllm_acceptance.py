"""Real vLLM check: serve the verifier with exported drafts (EAGLE and/or speculators format), send held-out prompts
at temperature 0, read the acceptance from vLLM's Prometheus counters, and check greedy output equals plain greedy.

Example (after `scripts/setup.sh --vllm` and a training run):
  .venv/bin/python benchmarks/vllm_acceptance.py --verifier smollm2-135m-instruct \
      --draft runs/smollm2-sharegpt/export-eagle --draft runs/smollm2-sharegpt/export-speculators \
      --benchmark mtbench --num-prompts 80 --max-tokens 128 -k 3 --baseline --out benchmarks/out/vllm-acceptance.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from eagle3_train.assets.verifier import resolve_verifier
from eagle3_train.evaluate.pipeline_eval import acceptance_summary, served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.utils.io import read_json, write_json


def draft_format(path: Path) -> str:
    return "speculators" if "speculators_config" in read_json(path / "config.json") else "eagle"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--draft", action="append", required=True, help="exported draft dir (repeatable)")
    p.add_argument("--benchmark", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--baseline", action="store_true", help="also serve the verifier alone: greedy equality, speed-up")
    p.add_argument("--out", default="benchmarks/out/vllm-acceptance.json")
    p.add_argument("--trust-remote-code", action="store_true", help="a verifier with its own tokenizer code (Kimi)")
    args = p.parse_args()
    verifier = resolve_verifier(args.verifier)
    prompts = load_prompts(args.benchmark, limit=args.num_prompts, turns=args.turns)
    out = Path(args.out)
    results = {"machine": {"cpu": _cpu(), "nproc": __import__("os").cpu_count(), "platform": platform.platform()},
               "verifier": str(verifier), "benchmark": args.benchmark, "num_prompts": len(prompts), "k": args.k,
               "max_tokens": args.max_tokens, "drafts": {}}
    for i, d in enumerate(args.draft):
        d = Path(d)
        fmt = draft_format(d)
        r = served_acceptance(verifier, d, prompts, k=args.k, fmt=fmt, max_tokens=args.max_tokens,
                              concurrency=args.concurrency, baseline=args.baseline and i == 0, log_dir=out.parent,
                              trust_remote_code=args.trust_remote_code)
        results["drafts"][str(d)] = {"format": fmt, **acceptance_summary(r), "startup_s": r.get("startup_s")}
        print(json.dumps({str(d): results["drafts"][str(d)]}, indent=2))
    write_json(out, results)
    print(f"{'draft':60s} {'format':12s} {'accept len':>10s}  per-position")
    for d, r in results["drafts"].items():
        per = " / ".join(f"{x:.3f}" for x in (r["per_position_acceptance"] or []))
        print(f"{d[-60:]:60s} {r['format']:12s} {r['mean_acceptance_length'] or 0:10.3f}  {per}")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
