"""What `train --resume` checks before it continues a run from its latest checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_train.checkpoints import native as ckpt
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.inputs import RunInputs
from eagle3_train.utils.io import Eagle3InputError


def check_resumable(cfg: TrainConfig, inputs: RunInputs, latest: Path, world_size: int = 1) -> dict[str, Any]:
    """The training metadata of checkpoint `latest`, once its settings (those that shape the result), prepared data,
    hidden states and run vocabulary are found to be this run's; otherwise an error naming every difference.
    grad_accum may differ where the processes differ and grad_accum x processes (one step's micro-batches) does
    not."""
    prev = ckpt.read_metadata(latest)
    if prev is None:
        raise Eagle3InputError(f"checkpoint {latest} has no {ckpt.METADATA}: it cannot be resumed (train into a new "
                               f"--out, or start over with --overwrite)")
    settings = dict(prev.get("settings") or {})
    micro = micro_batches_per_step(prev)
    if micro is not None and micro[0] * micro[1] == cfg.grad_accum * world_size:
        settings["grad_accum"] = cfg.grad_accum  # the same micro-batches per step over another number of ranks
    conflicts = cfg.resume_conflicts(settings)
    hashes = {"prepared data": (prev.get("data", {}).get("prepared_manifest_sha256"),  # (then, now)
                                inputs.prepared_manifest_sha256),
              "hidden states": (prev.get("data", {}).get("hidden_states_manifest_sha256"),
                                inputs.hidden_manifest_sha256)}
    if prev.get("vocab", {}).get("origin") == "run":
        hashes["vocab"] = (prev["vocab"].get("sha256"), inputs.vocab_sha256)
    conflicts += [f"{name} changed (SHA-256 {then[:12]} -> {now[:12]})" for name, (then, now) in hashes.items()
                  if then and now and then != now]
    if conflicts:
        raise Eagle3InputError(f"cannot resume from {latest}: it was trained with other settings or data "
                               f"({'; '.join(conflicts)}). Resume with the same settings, or train into a new "
                               f"--out.")
    return prev



def micro_batches_per_step(meta: dict[str, Any] | None) -> tuple[int, int] | None:
    """(processes, grad_accum) of the run whose training metadata is `meta`; None where it does not say."""
    world = ((meta or {}).get("run") or {}).get("world_size")
    accum = ((meta or {}).get("settings") or {}).get("grad_accum")
    return (world, accum) if isinstance(world, int) and isinstance(accum, int) else None


def grad_accum_to_resume(latest: Path, world_size: int) -> int | None:
    """The grad_accum that resumes checkpoint `latest` on `world_size` processes with its micro-batches per step (so
    the same steps over the same data in the same order); None where the processes are the same or it cannot tell.
    An error where `world_size` does not divide them."""
    micro = micro_batches_per_step(ckpt.read_metadata(latest))
    if micro is None or micro[0] == world_size:
        return None
    world, accum = micro
    if (world * accum) % world_size:
        raise Eagle3InputError(
            f"cannot resume {latest} on {world_size} processes: it trained {world} x grad_accum {accum} = "
            f"{world * accum} micro-batches per step, which {world_size} processes cannot share evenly; resume on a "
            f"number of processes dividing {world * accum}")
    return world * accum // world_size
