"""Which objective trains a draft method (`DraftMethod.objective`, model/draft_methods.py): training-time test
(EAGLE-3, P-EAGLE: train/ttt.py) or DFlash's blocks (train/dflash_blocks.py). The trainer and the parallel engines
call these functions and nothing else of an objective."""

from __future__ import annotations

import torch

from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.ttt_attention import select_kernel
from eagle3_train.train.data import Batch
from eagle3_train.train.dflash_blocks import block_counts, block_forward
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import Targets
from eagle3_train.train.ttt import supervised_counts, ttt_forward

_FORWARD = {"ttt": ttt_forward, "blocks": block_forward}
_COUNTS = {"ttt": lambda batch, steps: supervised_counts(batch.loss_mask, steps), "blocks": block_counts}
# what runs the objective's attention, chosen and checked on the device (recorded as run.ttt_attention): the later TTT
# steps' kernel (model/ttt_attention.py), or DFlash's one SDPA call over its block mask
_KERNEL = {"ttt": lambda model, device, dtype: select_kernel(device, dtype, model.layers[0].self_attn.ttt_shape()),
           "blocks": lambda model, device, dtype: "block mask (sdpa)"}


def method_forward(model, batch: Batch, targets: Targets, objective: Objective,
                   denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, metric sums [NUM_SUMS, steps]) of one micro-batch under the model's method."""
    return _FORWARD[model.method.objective](model, batch, targets, objective, denominators)


def attention_kernel(model, device: torch.device, dtype: torch.dtype) -> str:
    return _KERNEL[model.method.objective](model, device, dtype)


def method_denominators(method: str, batch: Batch, steps: int) -> torch.Tensor:
    """The supervised positions of each step or slot: the loss denominators (summed over a step's micro-batches)."""
    return _COUNTS[draft_method(method).objective](batch, steps)
