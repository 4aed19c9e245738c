"""`eagle3-train run --config FILE`: the whole pipeline on one YAML config, resumable stage by stage.

[generate ->] prepare -> vocab -> extract -> train -> export -> evaluate, declared in `STAGES` (one `Stage` entry
each: name, settings section, the stages it reads, the output it writes, how its key is computed, the function it
runs); `Pipeline.run` loops over that list. On a rerun a stage is skipped when it ran with the same key (settings and
the keys of what it reads) and after every stage it reads; train resumes a run started with the same key and sets
any other aside. `run --dry-run` prints the plan. Ends with a summary table.
"""

from __future__ import annotations

import argparse

from eagle3_train.pipeline.engine import Pipeline
from eagle3_train.settings import RunSettings
from eagle3_train.utils.config import apply_overrides, load_yaml
from eagle3_train.utils.settings import (
    add_settings_arguments,
    explicit,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (see configs/ and docs/CONFIG.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting of a section (values read as YAML; an unknown key is an error)")
    add_settings_arguments(p, RunSettings, set_option=False)  # --run-dir, --verifier: override the config's


def main(args: argparse.Namespace) -> int:
    raw = apply_overrides(load_yaml(args.config), args.set)
    raw.update({k: getattr(args, k) for k in explicit(args) if k != "dry_run"})
    if getattr(args, "dry_run", False):
        Pipeline(raw).dry_run()
        return 0
    Pipeline(raw).run()
    return 0
