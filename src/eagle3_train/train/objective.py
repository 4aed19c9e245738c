"""How a batch becomes a loss: the training-time-test objective as one frozen value, built once from the config.

`ttt_forward(model, batch, targets, objective, denominators)` (train/ttt.py) reads everything it needs about the
loss from here; noise on the features is a batch transform (`FeatureNoise`), applied by the trainer to training
batches only, so the objective itself has no randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from eagle3_train.train.data import Batch


@dataclass(frozen=True)
class Objective:
    steps: int  # TTT steps unrolled
    step_weights: tuple[float, ...]  # loss weight of step j (step_decay ** j)
    loss: str = "ce"  # per-step loss (train/losses.py)
    loss_mix: float = 0.5  # CE weight in the kl+tv / kl+nla mixes
    checkpoint_loss: bool = True  # recompute each step's logits in backward
    checkpoint_mlp: bool = True  # recompute each step's MLP in backward

    @classmethod
    def from_config(cls, cfg) -> Objective:
        return cls(steps=cfg.ttt_steps, step_weights=tuple(cfg.step_weights()), loss=cfg.loss,
                   loss_mix=cfg.loss_mix, checkpoint_loss=cfg.checkpoint_loss, checkpoint_mlp=cfg.checkpoint_mlp)


@dataclass(frozen=True)
class FeatureNoise:
    """Training batches with uniform +-`uniform` noise on the aux features (train.noise)."""
    uniform: float = 0.0

    def __call__(self, batch: Batch) -> Batch:
        if self.uniform <= 0:
            return batch
        return dataclasses.replace(batch, aux=batch.aux + (torch.rand_like(batch.aux) * 2 - 1) * self.uniform)
