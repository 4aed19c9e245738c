"""`eagle3-train evaluate offline|served`: measure a draft's acceptance length.

- offline: chain speculative decoding with the HF verifier in this process (CPU float32 by default), checked
  token for token against plain greedy decoding; see `evaluate/offline.py`.
- served: the counters of a real vLLM server with the draft; see `evaluate/served.py`.

CLI: `eagle3-train evaluate offline --draft DIR [--verifier NAME] [--benchmark mt-bench|humaneval|FILE]
[--num-prompts N] [--turns 1|2] [-k 3] [--max-new-tokens 128] [--prepared DIR] [--no-check-greedy] [--threads N]
[--out DIR]`;
`eagle3-train evaluate served ...` (options of `evaluate.served.add_served_arguments`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from eagle3_train.utils.io import Eagle3InputError, claim_output_dir, has_file, read_json

log = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")


def add_offline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", required=True,
                   help="training run dir, checkpoint dir, or exported draft (EAGLE or speculators format)")
    p.add_argument("--verifier", help="verifier name or HF dir (default: the one recorded with the draft)")
    p.add_argument("--benchmark", "--prompts", dest="benchmark", default="mt-bench",
                   help="mt-bench, humaneval, or a .jsonl/.txt prompt file (default mt-bench)")
    p.add_argument("--num-prompts", "--limit", dest="num_prompts", type=int, help="first N prompts (default all)")
    p.add_argument("--turns", type=int, choices=(1, 2), help="turns per prompt (MT-bench has 2; default all)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=3,
                   help="draft tokens per round (default 3)")
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=128,
                   help="new tokens per turn (default 128)")
    p.add_argument("--prepared", help="prepared data dir to test the prompts against (default: the draft's "
                                      "training metadata data.prepared)")
    p.add_argument("--no-check-greedy", action="store_true",
                   help="skip the token-for-token comparison with plain greedy decoding (about 2x faster)")
    p.add_argument("--tie-tol", type=float, default=1e-3,
                   help="logit gap under which a difference from greedy decoding counts as a near-tie")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="verifier and draft dtype (default float32)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is often fastest "
                                               "for small verifiers on a shared CPU)")
    p.add_argument("--out", help="output dir: results.json and acceptance_by_position.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_mode", metavar="MODE")
    sub.required = True
    add_offline_arguments(sub.add_parser("offline", help="chain speculative decoding with the HF verifier",
                                         description="chain speculative decoding with the HF verifier"))
    from eagle3_train.evaluate.served import add_served_arguments

    add_served_arguments(sub.add_parser("served", help="acceptance measured by a running vLLM server",
                                        description="acceptance measured by a running vLLM server"))


def recorded_verifier(draft: str | Path) -> str | None:
    """The verifier a draft was trained for: its training metadata, else a speculators config's verifier."""
    from eagle3_train.export.exporter import resolve_checkpoint

    path = Path(draft).expanduser()
    try:
        path = resolve_checkpoint(path)
    except Eagle3InputError:
        pass
    meta = path / "training_metadata.json"
    if meta.is_file():
        found = (read_json(meta, "training metadata").get("verifier") or {}).get("path")
        if found:
            return found
    cfg = path / "config.json"
    if cfg.is_file():
        return ((read_json(cfg, "draft config").get("speculators_config") or {}).get("verifier") or {}
                ).get("name_or_path")
    return None


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from eagle3_train.evaluate.offline import evaluate_offline
    from eagle3_train.evaluate.prompts import load_prompts
    from eagle3_train.evaluate.report import format_table, write_report

    if args.out:  # refuse a foreign directory before the (long) evaluation, not after
        claim_output_dir(args.out, "evaluation output directory", has_file("results.json"))
    if args.threads:
        torch.set_num_threads(args.threads)
    verifier = args.verifier or recorded_verifier(args.draft)
    if not verifier:
        raise Eagle3InputError(f"no verifier recorded with the draft {args.draft}: pass --verifier")
    prompts = load_prompts(args.benchmark, limit=args.num_prompts, turns=args.turns)
    results = evaluate_offline(args.draft, verifier, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                               device=args.device, dtype=getattr(torch, args.dtype),
                               check_greedy=not args.no_check_greedy, prepared=args.prepared, tie_tol=args.tie_tol)
    results["settings"].update(benchmark=args.benchmark, turns=args.turns, verifier=str(verifier))
    if args.out:
        paths = write_report(results, args.out)
        log.info("offline evaluation written to %s", ", ".join(paths.values()))
    print(format_table(results))
    return results


def main(args: argparse.Namespace) -> int:
    if args.eval_mode == "served":
        from eagle3_train.evaluate.report import CHART, format_table, plot_acceptance
        from eagle3_train.evaluate.served import run_served

        results = run_served(args)
        if args.out:
            plot_acceptance(results, Path(args.out) / CHART)
        print(format_table(results))
        if results.get("greedy_identical"):
            print("greedy outputs vs baseline: " + json.dumps(results["greedy_identical"]))
        return 0
    from eagle3_train.evaluate.offline import GreedyMismatchError

    try:
        results = run_offline(args)
    except GreedyMismatchError as e:
        print(f"eagle3-train evaluate: FAILED greedy check: {e}")
        return 1
    return 0 if results["greedy_check"]["passed"] in (True, None) else 1
