"""Training-time test: unroll the draft K steps on a batch and return the weighted soft cross-entropy and metrics.

Step j at position t reads token x_{t+1+j} and (j=0) the fused verifier features of position t or (j>0) the draft's
own hidden state from step j-1; its RoPE position is t+j; its target is the verifier distribution at position t+1+j
(over x_{t+2+j}), supervised when x_{t+2+j} is an assistant token. Ground-truth tokens are fed to later steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.train.data import Batch
from eagle3_train.train.targets import Targets


def supervised_counts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Positions supervised at each TTT step (depends on the loss mask only): the loss denominators."""
    return torch.stack([loss_mask[:, 2 + j:].sum() for j in range(steps)]).double()


@dataclass
class StepSums:
    """Additive metric sums over a set of batches; reduced across ranks with one all_reduce."""
    steps: int
    values: torch.Tensor = field(init=False)  # rows: loss_sum, supervised, valid, correct, full_correct

    def __post_init__(self) -> None:
        self.values = torch.zeros(5, self.steps, dtype=torch.float64)

    def add(self, other: torch.Tensor) -> None:
        self.values += other.detach().to("cpu", torch.float64)

    def summary(self, prefix: str = "") -> dict[str, float]:
        loss, sup, valid, correct, full = self.values
        out: dict[str, float] = {}
        est = 1.0
        for j in range(self.steps):
            s = max(sup[j].item(), 1.0)
            out[f"{prefix}loss_{j}"] = loss[j].item() / s
            out[f"{prefix}acc_{j}"] = correct[j].item() / s
            out[f"{prefix}full_acc_{j}"] = full[j].item() / s
            out[f"{prefix}coverage_{j}"] = valid[j].item() / s
            est += full[j].item() / s
            out[f"{prefix}accept_len_k{j + 1}"] = est  # 1 + sum_{i<=j} full_acc_i (the +1 is the bonus token)
        out[f"{prefix}loss"] = sum(out[f"{prefix}loss_{j}"] for j in range(self.steps)) / self.steps
        return out


def _head_loss(model: Eagle3Draft, hidden: torch.Tensor, all_probs: torch.Tensor, rows: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy over valid rows, and the draft's argmax (draft-vocab index) of every row.

    The target rows are gathered here, not by the caller: under checkpointing the inputs are kept for backward, and
    a gathered [rows, Vd] copy per TTT step was the largest thing kept (the shared `all_probs` costs nothing extra).
    """
    logits = model.logits(hidden).float()
    ce = -(all_probs[rows].float() * torch.log_softmax(logits, dim=-1)).sum(-1)
    return (ce * valid).sum(), logits.argmax(-1)


def ttt_forward(model: Eagle3Draft, batch: Batch, targets: Targets, steps: int, step_weights: list[float],
                denominators: torch.Tensor, noise: float = 0.0, checkpoint_loss: bool = True,
                checkpoint_mlp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss to backpropagate, metric sums [5, steps]).

    loss = sum_j w_j * sum_{valid t} CE_j(t) / denominators[j], so that summing over micro-batches and ranks gives the
    same gradient as one big batch.
    """
    B, L = batch.input_ids.shape
    aux = batch.aux
    if noise > 0 and model.training:
        aux = aux + (torch.rand_like(aux) * 2 - 1) * noise
    h = model.fuse(aux)
    caches = model.new_ttt_caches()
    positions = torch.arange(L, device=h.device).expand(B, L)
    chain_ok = torch.ones(B, L, dtype=torch.bool, device=h.device)
    sums = torch.zeros(5, steps, dtype=torch.float64, device=h.device)
    loss = h.new_zeros((), dtype=torch.float32)
    for j in range(steps):
        n = L - 2 - j  # positions t with a target token t+2+j inside the sequence
        if n <= 0:
            break
        ids_j = F.pad(batch.input_ids[:, 1 + j:], (0, 1 + j))
        out = model.ttt_step(h, ids_j, positions + j, caches, recompute_mlp=checkpoint_mlp)
        sup = batch.loss_mask[:, 2 + j:2 + j + n]
        b_idx, t_idx = sup.nonzero(as_tuple=True)
        rows = targets.row_of[b_idx, t_idx + 1 + j]
        valid = targets.in_vocab[rows]
        if checkpoint_loss and torch.is_grad_enabled():
            # Recompute the [rows, Vd] logits in backward instead of keeping them (and their log-softmax) for every
            # TTT step: the largest activations of a step, for one extra lm_head matmul.
            loss_sum, draft_argmax = torch.utils.checkpoint.checkpoint(
                _head_loss, model, out[b_idx, t_idx], targets.probs, rows, valid, use_reentrant=False)
        else:
            loss_sum, draft_argmax = _head_loss(model, out[b_idx, t_idx], targets.probs, rows, valid)
        loss = loss + step_weights[j] * loss_sum / denominators[j].clamp(min=1).to(loss.dtype)
        with torch.no_grad():
            correct = (draft_argmax == targets.argmax[rows]) & valid
            ok = chain_ok[b_idx, t_idx] & correct
            chain_ok[:, :n] &= False  # positions not supervised at this step break their chain
            chain_ok[b_idx, t_idx] = ok
            sums[:, j] = torch.stack([loss_sum.detach().double(), torch.tensor(float(len(rows)), device=h.device,
                                      dtype=torch.float64), valid.sum().double(), correct.sum().double(),
                                      ok.sum().double()])
        if j + 1 < steps:
            h = model.next_hidden(out)
    return loss, sums
