"""`eagle3-train launch`: the command that runs a stage on several machines, one torchrun per machine meeting at a
c10d rendezvous on the first machine (docs/GUIDE.md "Several GPUs and nodes"), printed, or started on this machine.

  eagle3-train launch --nodes 2 --gpus-per-node 8 --head 10.0.0.1 -- train --prepared /shared/prep ...
  eagle3-train launch --nodes 2 --gpus-per-node 8 --head 10.0.0.1 --start -- train --prepared /shared/prep ...

The command is the same on every machine: c10d gives each its ranks, and the rendezvous id is derived from the stage's
arguments, so launching the same arguments on each machine joins one run. Every machine needs the same paths (a
shared filesystem for the data and `--out`); only global rank 0 writes the run directory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import sys

from eagle3_train.settings import LaunchSettings
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

LAUNCHABLE = ("train", "extract")  # the stages that run one process per GPU under torchrun
DEFAULT_PORT = 29500


def _stage(s: LaunchSettings) -> list[str]:
    """The stage and its flags, without the `--` that separates them from launch's own."""
    return s.stage_args[1:] if s.stage_args[:1] == ["--"] else list(s.stage_args)


def _check(s: LaunchSettings) -> None:
    if s.nodes < 1 or s.gpus_per_node < 1:
        raise Eagle3InputError(f"launch: --nodes and --gpus-per-node must be at least 1, got {s.nodes} and "
                               f"{s.gpus_per_node}")
    if not s.head or s.head.startswith(":"):
        raise Eagle3InputError(f"launch: --head must be the first machine's address (HOST or HOST:PORT), got "
                               f"'{s.head}'")
    stage = _stage(s)
    if not stage or stage[0] not in LAUNCHABLE:
        got = stage[0] if stage else "nothing"
        raise Eagle3InputError(f"launch: after `--` comes the stage to run, one of {', '.join(LAUNCHABLE)}, and its "
                               f"flags; got {got}")


def node_command(s: LaunchSettings, torchrun: list[str] | None = None) -> list[str]:
    """The torchrun command every machine runs (`torchrun`: how to call it; default the `torchrun` on PATH)."""
    _check(s)
    endpoint = s.head if ":" in s.head else f"{s.head}:{DEFAULT_PORT}"
    stage = _stage(s)
    run_id = s.run_id or "eagle3-" + hashlib.sha256("\0".join(stage).encode()).hexdigest()[:12]
    return [*(torchrun or ["torchrun"]), "--nnodes", str(s.nodes), "--nproc-per-node", str(s.gpus_per_node),
            "--rdzv-id", run_id, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "-m", "eagle3_train.cli", *stage]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, LaunchSettings, set_option=False)


def launch(s: LaunchSettings) -> str:
    """The command every machine runs, as text; with `start`, this machine's torchrun replaces this process."""
    if s.start:  # this environment's torchrun, whatever PATH holds
        cmd = node_command(s, [sys.executable, "-m", "torch.distributed.run"])
        os.execv(cmd[0], cmd)
    return shlex.join(node_command(s))


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(LaunchSettings, args)
    command = launch(s)
    print(f"# on each of the {s.nodes} machines (the same command: c10d gives each its ranks):")
    print(command)
    return 0
