"""`eagle3-train adopt DIR --stage STAGE`: the explicit way to let a stage take over a directory of its output that
carries no listing marker (written by an earlier version, or copied with `cp -r out/* copy/`, which drops dot files).

Every stage refuses such a directory, because nothing in it proves which files are ours (`utils/outputs.py`); adopt
lists every entry it holds as that stage's output, prints them, and from then on the stage may replace or delete them.
"""

from __future__ import annotations

import argparse

from eagle3_train.settings import AdoptSettings
from eagle3_train.utils.outputs import adopt
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, AdoptSettings)


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(AdoptSettings, args)
    names = adopt(s.directory, s.output_of)
    print(f"{s.directory}: {len(names)} entries are now eagle3-train {s.output_of}'s output (it may replace or delete "
          f"them):")
    for name in names:
        print(f"  {name}")
    return 0
