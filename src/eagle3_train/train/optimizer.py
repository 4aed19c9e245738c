"""The draft's optimizer (`train.optimizer`): AdamW, or Muon on the 2-D weight matrices with AdamW on the rest.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations; with `match_rms_adamw`
its step has AdamW's RMS, so the learning rate tuned for AdamW carries over. As in speculators (whose GPU default it
is), the matrices of the fc and the decoder layers go to Muon and the lm_head, the norms and everything else to AdamW.
Each optimizer has its own schedule of the same shape, and both states go into the checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3_train.utils.io import Eagle3InputError

STATE_PREFIXES = ("", "muon_")  # training-state keys per optimizer: AdamW's as before Muon existed, then Muon's
ADAMW_ONLY = ("lm_head.",)  # 2-D, but a classifier: AdamW, as Muon's authors and speculators do


def muon_parameter_names(model: torch.nn.Module) -> list[str]:
    """Trainable 2-D weights that Muon updates."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and not n.startswith(ADAMW_ONLY)]


class DraftOptimizer:
    """One or two torch optimizers, each with a LambdaLR of the same schedule, stepped together."""

    def __init__(self, model: torch.nn.Module, cfg, schedule) -> None:
        if cfg.optimizer not in ("adamw", "muon"):
            raise Eagle3InputError(f"train.optimizer must be 'adamw' or 'muon', got '{cfg.optimizer}'")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        muon_names = set(muon_parameter_names(model)) if cfg.optimizer == "muon" else set()
        self.optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(
            [p for n, p in named if n not in muon_names], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
            weight_decay=cfg.weight_decay)]
        if muon_names:
            self.optimizers.append(torch.optim.Muon(
                [p for n, p in named if n in muon_names], lr=cfg.muon_lr or cfg.lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, adjust_lr_fn="match_rms_adamw"))
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def schedule_step(self) -> None:
        for s in self.schedulers:
            s.step()

    def last_lr(self) -> float:
        """The AdamW group's current learning rate (the one `train.lr` sets)."""
        return self.schedulers[0].get_last_lr()[0]

    def scheduler_state_dict(self) -> dict[str, Any]:
        """The schedules alone (the optimizer states go through torch.distributed.checkpoint: train/parallel.py)."""
        return {f"{prefix}scheduler": s.state_dict() for prefix, s in zip(STATE_PREFIXES, self.schedulers)}

    def load_scheduler_state_dict(self, state: dict[str, Any], where: str) -> None:
        for prefix, s in zip(STATE_PREFIXES, self.schedulers):
            if f"{prefix}scheduler" not in state:
                raise Eagle3InputError(f"cannot resume from {where}: its training state has no {prefix}scheduler "
                                       f"(it was trained with another train.optimizer)")
            s.load_state_dict(state[f"{prefix}scheduler"])

    def load_state_dict(self, state: dict[str, Any], where: str) -> None:
        """A checkpoint written before the optimizer states moved to `optimizer/` (both in training_state.pt)."""
        for prefix, o, s in zip(STATE_PREFIXES, self.optimizers, self.schedulers):
            if f"{prefix}optimizer" not in state:
                raise Eagle3InputError(f"cannot resume from {where}: its training state has no {prefix}optimizer "
                                       f"(it was trained with another train.optimizer)")
            o.load_state_dict(state[f"{prefix}optimizer"])
            s.load_state_dict(state[f"{prefix}scheduler"])


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    """The schedule both optimizers follow: linear warm-up, then cosine decay to min_ratio x the peak."""
    warmup = max(1, round(total_steps * warmup_ratio))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress_ = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))
    return f
