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
from dataclasses import dataclass, field

from eagle3_train.utils.io import Eagle3InputError

LAUNCHABLE = ("train", "extract")  # the stages that run one process per GPU under torchrun
DEFAULT_PORT = 29500


@dataclass
class LaunchSettings:
    nodes: int
    gpus_per_node: int
    head: str  # the first machine's address, HOST or HOST:PORT
    stage_args: list[str] = field(default_factory=list)  # the stage and its flags, e.g. ["train", "--out", ...]
    run_id: str | None = None  # None: derived from stage_args (the same on every machine)


def _check(s: LaunchSettings) -> None:
    if s.nodes < 1 or s.gpus_per_node < 1:
        raise Eagle3InputError(f"launch: --nodes and --gpus-per-node must be at least 1, got {s.nodes} and "
                               f"{s.gpus_per_node}")
    if not s.head or s.head.startswith(":"):
        raise Eagle3InputError(f"launch: --head must be the first machine's address (HOST or HOST:PORT), got "
                               f"'{s.head}'")
    if not s.stage_args or s.stage_args[0] not in LAUNCHABLE:
        got = s.stage_args[0] if s.stage_args else "nothing"
        raise Eagle3InputError(f"launch: after `--` comes the stage to run, one of {', '.join(LAUNCHABLE)}, and its "
                               f"flags; got {got}")


def node_command(s: LaunchSettings, torchrun: list[str] | None = None) -> list[str]:
    """The torchrun command every machine runs (`torchrun`: how to call it; default the `torchrun` on PATH)."""
    _check(s)
    endpoint = s.head if ":" in s.head else f"{s.head}:{DEFAULT_PORT}"
    run_id = s.run_id or "eagle3-" + hashlib.sha256("\0".join(s.stage_args).encode()).hexdigest()[:12]
    return [*(torchrun or ["torchrun"]), "--nnodes", str(s.nodes), "--nproc-per-node", str(s.gpus_per_node),
            "--rdzv-id", run_id, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "-m", "eagle3_train.cli", *s.stage_args]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, required=True, help="machines in the run")
    p.add_argument("--gpus-per-node", type=int, required=True, help="processes per machine (its GPUs)")
    p.add_argument("--head", required=True, help=f"the first machine's address, HOST[:PORT] (port {DEFAULT_PORT})")
    p.add_argument("--run-id", default=None, help="rendezvous id (default: derived from the stage's arguments)")
    p.add_argument("--start", action="store_true", help="start this machine's torchrun instead of printing it")
    p.add_argument("stage_args", nargs=argparse.REMAINDER, help="-- STAGE FLAGS...: the stage to run (train, "
                   "extract) and its flags")


def main(args: argparse.Namespace) -> int:
    stage_args = args.stage_args[1:] if args.stage_args[:1] == ["--"] else args.stage_args
    s = LaunchSettings(args.nodes, args.gpus_per_node, args.head, stage_args, args.run_id)
    if args.start:  # this environment's torchrun, whatever PATH holds
        cmd = node_command(s, [sys.executable, "-m", "torch.distributed.run"])
        os.execv(cmd[0], cmd)
    print(f"# on each of the {s.nodes} machines (the same command: c10d gives each its ranks):")
    print(shlex.join(node_command(s)))
    return 0
