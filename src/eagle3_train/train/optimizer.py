"""The draft's optimizer (`train.optimizer`): AdamW, or Muon on the 2-D weight matrices with AdamW on the rest.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations; with `match_rms_adamw`
its step has AdamW's RMS, so the learning rate tuned for AdamW carries over. As in speculators (whose GPU default it
is), the matrices of the fc and the decoder layers go to Muon and the lm_head, the norms and everything else to AdamW.
Each optimizer has its own schedule of the same shape, and both states go into the checkpoint.

Under FSDP2 a matrix is a DTensor sharded by rows, and Newton-Schulz needs the whole matrix: `ShardedMuon` keeps
the momentum sharded, gathers each matrix's (Nesterov) update, orthogonalises it on every rank (the same numbers on
each, so no broadcast) and applies the rank's own rows. Its steps are torch.optim.Muon's to the last bit on the
same gradients; the gather costs one matrix per parameter at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3_train.model.optimizer_groups import muon_parameter_names
from eagle3_train.utils.io import Eagle3InputError

STATE_PREFIXES = ("", "muon_")  # training-state keys per optimizer: AdamW's as before Muon existed, then Muon's


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose parameters may be DTensors sharded over ranks (FSDP2): see the module docstring."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                if isinstance(update, DTensor):
                    whole = _zeropower_via_newtonschulz(update.full_tensor(), group["ns_coefficients"],
                                                        group["ns_steps"], group["eps"])
                    update = _own_rows(whole, p)
                else:
                    update = _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"],
                                                         group["eps"])
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _own_rows(whole: torch.Tensor, like) -> Any:
    """The part of a whole matrix that the DTensor `like` holds on this rank, as a DTensor placed like it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(whole.shape, like.device_mesh, like.placements)
    local = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return DTensor.from_local(local.contiguous(), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def muon_lr(cfg) -> float:
    """The Muon group's peak rate: train.muon_lr (0 included), else train.lr; 0 with lr 0, which checks that a
    finetune loads unchanged."""
    return 0.0 if cfg.lr == 0 else (cfg.lr if cfg.muon_lr is None else cfg.muon_lr)


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
            self.optimizers.append(ShardedMuon(
                [p for n, p in named if n in muon_names], lr=muon_lr(cfg), momentum=cfg.muon_momentum,
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
