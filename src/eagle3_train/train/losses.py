"""Per-row training objectives of a TTT step: soft cross-entropy and the acceptance-aware LK family.

p is the verifier's distribution and q the draft's, both over the draft vocabulary (p restricted and renormalised, as
the training targets are). α = Σ_v min(p_v, q_v) is the probability that speculative sampling accepts a token drawn
from q (draw x ~ q, accept with min(1, p(x)/q(x))), i.e. the expected acceptance of one step at temperature 1.

  ce       −Σ p log q (the KL(p‖q) gradient; today's objective)
  tv       1 − α (the total-variation distance)
  nla      −log α
  kl+tv    mix·ce + (1 − mix)·tv
  kl+nla   mix·ce + (1 − mix)·nla
("LK losses", arXiv 2602.23881.) The hybrids use CE for the KL term: same gradient, and weight 1 gives exactly `ce`.
"""

from __future__ import annotations

from typing import get_args

import torch

from eagle3_train.settings.train import Loss
from eagle3_train.utils.io import Eagle3InputError

LOSSES = get_args(Loss)
_NLA_FLOOR = 1e-6  # α of a hopeless row: keeps −log α (and its 1/α gradient) bounded


def check_loss(name: str) -> None:
    """The loss name (its mix carries its range in TrainConfig)."""
    if name not in LOSSES:
        raise Eagle3InputError(f"train.loss must be one of {', '.join(LOSSES)}, got '{name}'")


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α per row: Σ min(p, q) over the last dim (q: the draft's probabilities)."""
    return torch.minimum(p, q).sum(-1)


class _SoftCrossEntropy(torch.autograd.Function):
    """−Σ p log softmax(z) per row, and q = softmax(z), with the gradient g·(q·Σp − p) in one pass over [N, V]:
    autograd would run a product backward and a log-softmax backward (which takes the exp again). q is what it keeps
    for backward, and what the acceptance metrics read, so the [N, V] exp is taken once per TTT step."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(logits.device.type, enabled=False):  # bmm would run in bf16 under autocast
            log_q = torch.log_softmax(logits, dim=-1)
            loss = -torch.bmm(p.unsqueeze(1), log_q.unsqueeze(2)).view(-1)  # row dot products, no [N, V] product
            q = log_q.exp_()
        ctx.save_for_backward(q, p, p.sum(-1, keepdim=True))
        ctx.mark_non_differentiable(q)
        return loss, q

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_q: torch.Tensor) -> tuple[torch.Tensor, None]:
        q, p, p_sum = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        return (q * (p_sum * g)).addcmul_(p, g, value=-1), None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ce` loss per row, the draft's distribution q) for float32 logits [N, Vd] and targets p [N, Vd] of the same
    dtype: the loss and gradients of `row_loss(log_softmax(logits), p, "ce")`, with less work (`_SoftCrossEntropy`)."""
    return _SoftCrossEntropy.apply(logits, p)


def row_loss(log_q: torch.Tensor, p: torch.Tensor, name: str = "ce", mix: float = 0.5) -> torch.Tensor:
    """Loss per row for the draft's log-probabilities log_q [N, Vd] and the target distribution p [N, Vd]."""
    p = p.to(log_q.dtype)
    if name == "ce":
        return -(p * log_q).sum(-1)
    alpha = acceptance(p, log_q.exp())
    lk = 1.0 - alpha if name in ("tv", "kl+tv") else -torch.log(alpha.clamp(min=_NLA_FLOOR))
    if name in ("tv", "nla") or mix == 0.0:  # mix 0: skip the CE term's work, exactly the LK loss
        return lk
    return mix * -(p * log_q).sum(-1) + (1.0 - mix) * lk
