"""How a batch becomes a loss: the training-time-test objective as one frozen value, built once from the config.

`ttt_forward(model, batch, targets, objective, denominators)` (train/ttt.py) reads everything it needs about the
loss from here; noise on the features is a batch transform (`FeatureNoise`), applied by the trainer to training
batches only, so the objective itself has no randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from eagle3_train.train.data import Batch, feature_std


@dataclass(frozen=True)
class Objective:
    steps: int  # TTT steps unrolled
    step_weights: tuple[float, ...]  # loss weight of step j (step_decay ** j)
    loss: str = "ce"  # per-step loss (train/losses.py)
    loss_mix: float = 0.5  # CE weight in the kl+tv / kl+nla mixes
    target_temperature: float = 1.0  # sharpening of the verifier distribution the loss fits
    feature_loss: float = 0.0  # weight of EAGLE-1's regression onto the verifier's final state
    chain_mask: bool = False  # steps > 0 train only the positions a greedy chain reaches
    checkpoint_loss: bool = True  # recompute each step's logits in backward
    checkpoint_mlp: bool = True  # recompute each step's MLP in backward

    @classmethod
    def from_config(cls, cfg) -> Objective:
        return cls(steps=cfg.ttt_steps, step_weights=tuple(cfg.step_weights()), loss=cfg.loss,
                   loss_mix=cfg.loss_mix, target_temperature=cfg.target_temperature, feature_loss=cfg.feature_loss,
                   chain_mask=cfg.chain_mask, checkpoint_loss=cfg.checkpoint_loss, checkpoint_mlp=cfg.checkpoint_mlp)


@dataclass(frozen=True)
class FeatureNoise:
    """Training batches with noise on the aux features: `uniform` +-absolute (train.noise) and `relative` Gaussian
    noise of that many times each feature's std over the batch's real tokens (train.feature_noise)."""
    uniform: float = 0.0
    relative: float = 0.0

    def __call__(self, batch: Batch) -> Batch:
        aux = batch.aux
        if self.uniform > 0:
            aux = aux + (torch.rand_like(aux) * 2 - 1) * self.uniform
        if self.relative > 0:
            aux = add_feature_noise(aux, batch.lengths, self.relative)
        return batch if aux is batch.aux else dataclasses.replace(batch, aux=aux)


def add_feature_noise(aux: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """aux + Gaussian noise of std `scale` x each feature's std (`train.feature_noise`): the same relative
    perturbation for a layer of std 3 as for one of std 80, which an absolute noise cannot give."""
    return aux + torch.randn_like(aux) * (scale * feature_std(aux, lengths))
