"""Training under torchrun from the pipeline: how many processes `train_processes` means, and running a stage's
command line under torchrun with the run's settings file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from eagle3_train.utils.io import Eagle3InputError, read_json

log = logging.getLogger(__name__)


def train_processes(setting: int | str) -> int:
    """`train_processes` as a number: auto = the visible CUDA GPUs (1 on a machine without)."""
    if setting == "auto":
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return int(setting)


def under_torchrun(stage: str, args: list[str], processes: int) -> None:
    """`torchrun --standalone --nproc-per-node N -m eagle3_train.cli STAGE ARGS` on this machine (NCCL or gloo among
    the GPUs' processes, gloo on CPU); a failure names the stage and how to resume it."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
           "-m", "eagle3_train.cli", stage, *args]
    log.info("[%s] %d processes: %s", stage, processes, " ".join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise Eagle3InputError(f"the {stage} stage under torchrun ended with exit code {rc} (its output is above); "
                               f"rerun the same command to resume it")


def train_under_torchrun(cfg, processes: int, launch_file: Path) -> dict[str, Any]:
    """The train stage as `torchrun ... train --config FILE` (data parallel on this machine); its result read back
    from the run's training metadata."""
    launch_file.write_text(yaml.safe_dump({"train": cfg.to_dict()}, sort_keys=False))
    under_torchrun("train", ["--config", str(launch_file)], processes)
    meta = read_json(Path(cfg.out) / "training_metadata.json", "training metadata")
    metrics = meta.get("metrics") or {}
    return {"tokens_per_s": (meta.get("run") or {}).get("tokens_per_s"), "step": meta["progress"]["step"],
            "validation": metrics.get("validation"), "best": metrics.get("best"), "final": str(Path(cfg.out) / "final"),
            "world_size": (meta.get("run") or {}).get("world_size")}
