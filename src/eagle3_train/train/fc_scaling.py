"""`train.equalise_features`: train the draft's fc as if every aux feature had the same std.

A verifier's massive activations make a few aux features hundreds of times larger than the rest (SmolLM2-135M: one
feature of layers 15 and 27 has ~300x the median std). Adam moves every weight by about the learning rate, so the fc
columns that read those features change the fused state hundreds of times more per step than the others, and they
dominate the gradient norm that clipping sees.

The fix is a reparameterisation that keeps the served weights as they are: with s the per-feature std over its
median, fc.weight W = V / s column by column, and the optimizer (AdamW or Muon) runs on V (the weight of the features
divided by s). In W's terms: the init and each step's update of column d are divided by s_d, and the gradient that
clipping and the optimizer see is W.grad / s. Checkpoints and exports hold W, so vLLM and SGLang serve the draft
unchanged.
"""

from __future__ import annotations

import torch

from eagle3_train.train.data import feature_std
from eagle3_train.train.distributed import broadcast_

SAMPLE_ROWS = 32  # training rows whose aux features set s (the first ones: every rank and a resume get the same s)
MIN_SCALE = 1e-2  # a (nearly) constant feature must not get a huge step


def feature_scale(samples, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """[3H] s: each aux feature's std over the median feature's, from the first `rows` training rows."""
    batch = samples.batch(list(range(min(rows, len(samples)))))
    std = feature_std(batch.aux.float(), batch.lengths).float()
    return (std / std.median().clamp(min=1e-12)).clamp(min=MIN_SCALE)


def shared_feature_scale(samples, width: int, info, rows: int = SAMPLE_ROWS) -> torch.Tensor:
    """`feature_scale` computed by rank 0 alone and broadcast: every rank trains with the same s, and the other
    ranks fetch nothing (in hybrid mode a fetch writes shards; the same rows from two ranks stored them twice)."""
    scale = feature_scale(samples, rows) if info.is_main else torch.empty(width)
    return broadcast_(scale.float().contiguous(), info)


class EqualisedFC:
    """The optimizer on V = W * s for the fc weight W [H, 3H]: call `init` once on a random draft, `precondition`
    between backward and clipping, `step` instead of optimizer.step()."""

    def __init__(self, weight: torch.nn.Parameter, scale: torch.Tensor):
        self.weight = weight
        self.scale = scale.to(weight.device, torch.float32)

    @torch.no_grad()
    def init(self) -> None:
        self.weight.div_(self.scale)

    @torch.no_grad()
    def precondition(self) -> None:
        if self.weight.grad is not None:
            self.weight.grad.div_(self.scale)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        group = next(g for g in optimizer.param_groups if any(p is self.weight for p in g["params"]))
        decayed = self.weight.detach() * (1 - group["lr"] * group["weight_decay"])  # decoupled decay (AdamW, Muon)
        optimizer.step()
        self.weight.copy_(decayed + (self.weight - decayed) / self.scale)
