"""The verifier's next-token distribution, recomputed from its final hidden state and restricted to the draft vocab.

Only positions whose next token is supervised are computed. Positions whose verifier argmax lies outside the draft
vocabulary are flagged: the draft cannot propose that token, so they are excluded from the loss (as in EAGLE-3 and
SpecForge) and count as misses in the accuracy metrics (unlike speculators, whose metrics are optimistic there).
The verifier's own logit transforms (softcapping, logit scale, lm_head bias) are applied, and the soft targets (the
distribution over the draft vocab) are computed in float32 even under bf16 autocast: they are the verifier's
distribution, not a rounding of it. The full-vocabulary pass, which only finds whether the argmax lies in the draft
vocab and the mass the draft vocab holds (a metric), runs in the dtype the trainer keeps the lm_head in (bf16 under
bf16 training: it is the largest matmul of a step, ~6x the draft's lm_head at a 49K/8K vocabulary).

That pass never changes (the verifier is frozen), so the extract stage stores its two results per token
(`full_vocab_stats`: the full-vocab argmax and logsumexp, in float32) and `verifier_targets` takes them when given
(`full_argmax`, `full_lse`): then only the draft-vocab pass runs. Online/hybrid training and stores without them
(older stores, the vLLM extract backend, which has no lm_head) take the full pass here as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_train.model.verifier_head import LOGITS_CHUNK_ELEMENTS, LogitTransform, chunk_rows, full_vocab_stats


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
                     t2d: torch.Tensor, transform: LogitTransform | None = None, chunk: int = 1024,
                     max_elements: int = LOGITS_CHUNK_ELEMENTS, full_argmax: torch.Tensor | None = None,
                     full_lse: torch.Tensor | None = None) -> Targets:
    """final: [B, L, H]; lm_head: verifier [V, H]; draft_ids: [Vd] target id of each draft row; `transform`: what
    the verifier does to `final @ lm_head.T` (see `model.verifier_head.logit_transform`); `full_argmax` [B, L]
    (token ids) and `full_lse` [B, L] (float32): the stored full-vocab stats of every position (see
    `full_vocab_stats`), which skip the full-vocab pass; both or neither.

    Autocast off: the draft-vocab distribution in float32, the full-vocab pass (without stats) in lm_head's dtype
    (then float32). Full-vocabulary logits exist only for one chunk of rows at a time, only to find the argmax and
    logsumexp; what is kept is over the draft vocab."""
    if (full_argmax is None) != (full_lse is None):
        raise ValueError("full_argmax and full_lse go together")
    chunk = chunk_rows(chunk, lm_head.shape[0], max_elements)
    with torch.autocast(final.device.type, enabled=False):
        return _targets(final, loss_mask, lm_head, draft_ids, t2d, transform or LogitTransform(), chunk,
                        full_argmax, full_lse)


def _targets(final: torch.Tensor, loss_mask: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor,
             t2d: torch.Tensor, transform: LogitTransform, chunk: int, full_argmax: torch.Tensor | None,
             full_lse: torch.Tensor | None) -> Targets:
    B, L, _ = final.shape
    need = torch.zeros(B, L, dtype=torch.bool, device=final.device)
    need[:, :-1] = loss_mask[:, 1:]  # verifier position p predicts token p+1
    pos = need.nonzero(as_tuple=False)
    row_of = torch.full((B, L), -1, dtype=torch.long, device=final.device)
    row_of[pos[:, 0], pos[:, 1]] = torch.arange(pos.shape[0], device=final.device)
    h = final[pos[:, 0], pos[:, 1]].float()
    if full_argmax is None:
        top, lse_full = full_vocab_stats(h, lm_head, transform, chunk, max_elements=chunk * lm_head.shape[0])
    else:
        top, lse_full = full_argmax[pos[:, 0], pos[:, 1]].long(), full_lse[pos[:, 0], pos[:, 1]].float()
    head_d = lm_head[draft_ids].float()
    probs, argmax, in_vocab, in_mass = [], [], [], []
    for s in range(0, h.shape[0], chunk):
        hc = h[s:s + chunk]
        in_vocab.append(t2d[top[s:s + chunk]])
        restricted = transform.apply(hc @ head_d.T, rows=draft_ids)
        argmax.append(restricted.argmax(-1))
        probs.append(torch.softmax(restricted, dim=-1).to(final.dtype))
        # <= 1 by definition; a bf16 full pass can round its logsumexp a little below the restricted one
        in_mass.append((torch.logsumexp(restricted, -1) - lse_full[s:s + chunk]).exp().clamp(max=1.0))
    Vd = draft_ids.shape[0]

    def cat(xs: list[torch.Tensor], shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return torch.cat(xs) if xs else torch.zeros(shape, dtype=dt, device=final.device)
    return Targets(row_of, cat(probs, (0, Vd), final.dtype), cat(argmax, (0,), torch.long),
                   cat(in_vocab, (0,), torch.bool), cat(in_mass, (0,), torch.float32))
