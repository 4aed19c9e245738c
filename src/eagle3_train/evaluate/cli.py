"""`eagle3-train evaluate offline|served`: measure a draft's acceptance length.

- offline: chain speculative decoding with the HF verifier in this process (CPU float32 by default), checked
  token for token against plain greedy decoding; see `evaluate/offline.py`.
- served: the counters of a real vLLM server with the draft; see `evaluate/served.py`.

CLI: `eagle3-train evaluate offline --draft DIR [--verifier NAME]
[--prompts mt-bench|humaneval|gsm8k|math500|speed-bench[:CAT]|hub:ORG/NAME...|FILE] [--num-prompts N] [--turns 1|2]
[-k N] [--max-tokens N] [--prepared DIR] [--no-check-greedy] [--threads N] [--compute-dtype D]
[--out DIR]` (OfflineEvalSettings);
`eagle3-train evaluate served [--endpoint URL ...| --draft DIR] ...` (ServedEvalSettings); both: docs/CONFIG.md.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from eagle3_train.assets.verifier import required_verifier
from eagle3_train.evaluate.report import REPORT_FILES
from eagle3_train.settings import OfflineEvalSettings, ServedEvalSettings
from eagle3_train.utils.outputs import claim_output_dir, claimed_output, json_says
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

log = logging.getLogger(__name__)

def add_offline_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, OfflineEvalSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_mode", metavar="MODE")
    sub.required = True
    add_offline_arguments(sub.add_parser("offline", help="chain speculative decoding with the HF verifier",
                                         description="chain speculative decoding with the HF verifier"))
    from eagle3_train.evaluate.served import add_served_arguments

    add_served_arguments(sub.add_parser("served", help="acceptance measured by running vLLM servers",
                                        description=ServedEvalSettings.__doc__.replace("\n    ", " ")))


_OUTPUT = ("evaluate", "evaluation output directory")
_offline_results = json_says("results.json", "mode", "offline")  # a directory from before output markers


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from eagle3_train.checkpoints.native import recorded_verifier
    from eagle3_train.evaluate.offline import evaluate_offline
    from eagle3_train.evaluate.prompts import load_prompts
    from eagle3_train.evaluate.report import format_table, write_report

    s = settings_from_args(OfflineEvalSettings, args, prefixes=("evaluate", "offline"))
    if s.out:  # refuse a foreign directory before the (long) evaluation, not after
        s.out = str(claim_output_dir(s.out, *_OUTPUT, _offline_results, create=False, writes=REPORT_FILES))
    if s.threads:
        torch.set_num_threads(s.threads)
    verifier = required_verifier(s.verifier, recorded_verifier(s.draft), f"the draft {s.draft}")
    prompts = load_prompts(s.benchmark, limit=s.num_prompts, turns=s.turns)
    results = evaluate_offline(s.draft, verifier, prompts, k=s.k, max_new_tokens=s.max_new_tokens,
                               device=s.device, dtype=getattr(torch, s.dtype), check_greedy=s.check_greedy,
                               prepared=s.prepared, tie_tol=s.tie_tol, trust_remote_code=s.trust_remote_code)
    results["settings"].update(benchmark=s.benchmark, turns=s.turns, verifier=str(verifier))
    if s.out:
        with claimed_output(s.out, *_OUTPUT, _offline_results, writes=REPORT_FILES):
            paths = write_report(results, s.out)
        log.info("offline evaluation written to %s", ", ".join(paths.values()))
    print(format_table(results))
    return results


def main(args: argparse.Namespace) -> int:
    if args.eval_mode == "served":
        from eagle3_train.evaluate.report import CHART, format_table, plot_acceptance
        from eagle3_train.evaluate.served import run_served

        settings = settings_from_args(ServedEvalSettings, args, prefixes=("evaluate", "served"))
        results = run_served(settings)
        if settings.out:
            plot_acceptance(results, Path(settings.out) / CHART)
        print(format_table(results))  # the greedy comparison with the baseline included
        return 0
    from eagle3_train.evaluate.offline import GreedyMismatchError

    try:
        results = run_offline(args)
    except GreedyMismatchError as e:
        print(f"eagle3-train evaluate: FAILED greedy check: {e}")
        return 1
    # differences on near-ties (bf16 verifiers tie exactly often) are reported above, not failures
    return 0 if results["greedy_check"]["passed"] in (True, None) or all(
        m["near_tie"] for m in results["greedy_check"]["mismatches"]) else 1
