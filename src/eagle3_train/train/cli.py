"""`eagle3-train train`: the command line of training (and of its dry run); the work is `train.trainer.train`."""

from __future__ import annotations

import argparse
import json

from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.dry_run import dry_run, format_report
from eagle3_train.train.trainer import train
from eagle3_train.utils.config import load_yaml
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config; its `train` section is used (flags and --set override it)")
    add_settings_arguments(p, TrainConfig)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig defaults < the --config file's `train` section < --set KEY=VALUE < flags given."""
    base = dict(load_yaml(args.config).get("train") or {}) if getattr(args, "config", None) else None
    return settings_from_args(TrainConfig, args, base)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "dry_run", False):
        print(format_report(dry_run(config_from_args(args))))
        return 0
    result = train(config_from_args(args))
    print(json.dumps({k: result[k] for k in ("out", "step", "tokens_per_s", "best", "final") if k in result},
                     indent=2))
    return 0
