"""A run's resumable checkpoints: what a save writes (the gathered weights, every rank's optimizer shard, progress,
the schedules and every rank's RNG), when a timed save is due, and loading the latest back on resume. Every rank
takes part in each; the trainer decides when (`t`: the `Trainer`, which imports this module)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from eagle3_train.checkpoints import native as ckpt
from eagle3_train.train.parallel import OPTIMIZER_DIR
from eagle3_train.train.resume import check_resumable
from eagle3_train.utils.distributed import all_gather_object, all_reduce_sum_, barrier
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)


def training_state(t: Any, rng_ranks: list[Any]) -> dict[str, Any]:
    """What a resume needs besides the weights and the optimizer states (`optimizer/`): progress, the
    schedules, every rank's RNG (`rng`: rank 0's, as before there were ranks' own)."""
    return {**t.optimizer.scheduler_state_dict(),
            "step": t.step, "epoch": t.epoch, "batch_in_epoch": t.batch_in_epoch,
            "tokens_seen": t.tokens_seen, "best": t.best, "rng": rng_ranks[0], "rng_ranks": rng_ranks,
            "last_val": t.last_val, "last_train": t.last_train, "started": t.started,
            "skipped_samples": t.skipped_samples(), "validated_step": t.validated_step,
            "stale_validations": t.stale_validations,
            "metrics_lines": t.metrics.lines}


def save(t: Any, reason: str) -> None:
    """A resumable checkpoint; every rank takes part (weights gathered, optimizer shards written by each)."""
    weights = t.engine.full_state_dict()
    optim = t.engine.optimizer_state_dict(t.optimizer.optimizers)
    rng_ranks = all_gather_object(ckpt.rng_state(), t.info)
    if t.info.is_main:
        d = ckpt.save_checkpoint(t.out / "checkpoints" / f"step-{t.step:07d}", t.model,
                                 training_state(t, rng_ranks), t.metadata("running"), weights=weights,
                                 shards=lambda tmp: t.engine.save_optimizer(tmp, optim))
        ckpt.mark_latest(t.out, d)
        ckpt.prune(t.out, t.cfg.keep_last)
        log.info("saved %s (%s)", d, reason)
    else:
        t.engine.save_optimizer(None, optim)
    barrier(t.info)
    t.last_save = time.monotonic()


def checkpoint_due(t: Any) -> bool:
    """checkpoint_every_minutes passed since the last save (on any rank: all ranks must save together)."""
    minutes = t.cfg.checkpoint_every_minutes
    if not minutes or minutes <= 0:
        return False
    due = torch.tensor([float(time.monotonic() - t.last_save >= 60.0 * minutes)], dtype=torch.float64)
    all_reduce_sum_(due, t.info)
    return bool(due.item() > 0)


def resume(t: Any) -> bool:
    """Continue from the run's latest checkpoint (False: there is none), once `check_resumable` found it this run's."""
    latest = ckpt.latest_checkpoint(t.out)
    if latest is None:
        return False
    prev = check_resumable(t.cfg, t.inputs, latest, t.info.world_size)
    state = ckpt.load_training_state(latest / ckpt.STATE)
    src = ckpt.load_draft(latest, embed=t.inputs.embed)
    if src.config.to_dict() != t.model.config.to_dict():
        raise Eagle3InputError(f"cannot resume from {latest}: its draft config differs from this run's settings")
    t.engine.load_full_state_dict(src.trainable_state_dict())
    if (latest / OPTIMIZER_DIR).is_dir():
        t.engine.load_optimizer(latest, t.optimizer.optimizers)
        t.optimizer.load_scheduler_state_dict(state, str(latest))
    elif t.engine.sharded:
        raise Eagle3InputError(f"cannot resume {latest} under train.parallel fsdp: it was written before "
                               f"optimizer states were sharded ({OPTIMIZER_DIR}/ missing); resume it with "
                               f"train.parallel ddp")
    else:
        t.optimizer.load_state_dict(state, str(latest))
    for k in ("step", "epoch", "batch_in_epoch", "tokens_seen", "best", "last_val", "last_train", "started"):
        setattr(t, k, state[k])
    ranks = state.get("rng_ranks") or [state["rng"]]
    if len(ranks) != t.info.world_size:
        log.warning("resumed on %d processes from a run of %d: ranks without a saved RNG state take rank 0's "
                    "(only train.noise draws from it)", t.info.world_size, len(ranks))
    ckpt.set_rng_state(ranks[t.info.rank] if t.info.rank < len(ranks) else ranks[0])
    t.skipped_before = int(state.get("skipped_samples", 0))
    t.validated_step = int(state.get("validated_step", -1))
    t.stale_validations = int(state.get("stale_validations", 0))
    t.init_record = prev.get("init", t.init_record)
    t.metrics.keep_until(t.step, state.get("metrics_lines"))
    log.info("resumed from %s at step %d (epoch %d, batch %d)", latest, t.step, t.epoch, t.batch_in_epoch)
    return True
