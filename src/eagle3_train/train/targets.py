"""The verifier's next-token distribution, recomputed from its final hidden state and restricted to the draft vocab.

Only positions whose next token is supervised are computed. Positions whose verifier argmax lies outside the draft
vocabulary are flagged: the draft cannot propose that token, so they are excluded from the loss (as in EAGLE-3 and
SpecForge) and count as misses in the accuracy metrics (unlike speculators, whose metrics are optimistic there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Targets:
    row_of: torch.Tensor  # [B, L] int64: row in `probs` for verifier position p, or -1 when not needed
    probs: torch.Tensor  # [N, Vd] verifier distribution over the draft vocab (softmax of its restricted logits)
    argmax: torch.Tensor  # [N] draft-vocab index of the restricted argmax
    in_vocab: torch.Tensor  # [N] bool: the full-vocab argmax is inside the draft vocab
    # [N] float32: the verifier's probability mass on the draft vocab; probs * in_mass is its unrenormalised
    # distribution there, which the acceptance metrics (alpha) compare with the draft's
    in_mass: torch.Tensor


@torch.no_grad()
def verifier_targets(final: torch.Tensor, loss_mask: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor,
                     t2d: torch.Tensor, chunk: int = 1024) -> Targets:
    """final: [B, L, H]; lm_head: verifier [V, H]; draft_ids: [Vd] target id of each draft row."""
    B, L, _ = final.shape
    need = torch.zeros(B, L, dtype=torch.bool, device=final.device)
    need[:, :-1] = loss_mask[:, 1:]  # verifier position p predicts token p+1
    pos = need.nonzero(as_tuple=False)
    row_of = torch.full((B, L), -1, dtype=torch.long, device=final.device)
    row_of[pos[:, 0], pos[:, 1]] = torch.arange(pos.shape[0], device=final.device)
    h = final[pos[:, 0], pos[:, 1]]
    head_d = lm_head[draft_ids]
    probs, argmax, in_vocab, in_mass = [], [], [], []
    for s in range(0, h.shape[0], chunk):
        hc = h[s:s + chunk]
        full = hc @ lm_head.T
        in_vocab.append(t2d[full.argmax(-1)])
        restricted = hc @ head_d.T
        argmax.append(restricted.argmax(-1))
        probs.append(torch.softmax(restricted.float(), dim=-1).to(final.dtype))
        in_mass.append((torch.logsumexp(restricted.float(), -1) - torch.logsumexp(full.float(), -1)).exp())
    Vd = draft_ids.shape[0]

    def cat(xs: list[torch.Tensor], shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return torch.cat(xs) if xs else torch.zeros(shape, dtype=dt, device=final.device)
    return Targets(row_of, cat(probs, (0, Vd), final.dtype), cat(argmax, (0,), torch.long),
                   cat(in_vocab, (0,), torch.bool), cat(in_mass, (0,), torch.float32))
