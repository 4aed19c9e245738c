"""The DFlash objective (train.method dflash): blocks anchored at verified positions, as DFlash trains and vLLM drafts.

A block at anchor a holds the token x_a at position a and `steps` mask tokens at a+1..a+steps; it sees the context
features of positions < a and its own block both ways (`model/dflash.py`). Slot k predicts x_{a+k}: its target is
the verifier's distribution at position a+k-1, supervised when x_{a+k} is (the loss mask). Anchors are positions
1..len-2 whose next token is supervised, at most ANCHORS per sample (the references' 512), drawn without replacement
by a generator seeded from the batch (the same batch, the same anchors: resume stays exact). Loss, metrics and step
weights are training-time test's (train/ttt.py): slot k is "step" k-1, and its chain (full_acc) holds while every
slot of the block so far was right, which is what vLLM accepts of a block.

Python API: `block_anchors(batch, steps)`, `block_counts(batch, steps)` (the loss denominators),
`block_forward(model, batch, targets, objective, denominators) -> (loss, sums [NUM_SUMS, steps])`.
"""

from __future__ import annotations

import torch

from eagle3_train.train.data import Batch
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import Targets
from eagle3_train.train.ttt import NUM_SUMS, step_loss

ANCHORS = 512  # blocks per sample and step (z-lab, SpecForge and speculators train 512)


def _seed(batch: Batch) -> int:
    return int(batch.lengths.sum()) * 1_000_003 + int(batch.input_ids[:, :16].sum())


def block_anchors(batch: Batch, steps: int) -> torch.Tensor:
    """[B, N] anchor positions of each sample (sorted; -1 pads a sample with fewer), on the batch's device."""
    mask = batch.loss_mask.cpu()
    B, L = mask.shape
    eligible = torch.zeros(B, L, dtype=torch.bool)
    eligible[:, 1:L - 1] = mask[:, 2:]  # a in 1..L-2 with x_{a+1} supervised (a+1 < len: padding is unsupervised)
    g = torch.Generator().manual_seed(_seed(batch))
    rows = []
    for b in range(B):
        idx = eligible[b].nonzero().flatten()
        if len(idx) > ANCHORS:
            idx = idx[torch.randperm(len(idx), generator=g)[:ANCHORS]].sort().values
        rows.append(idx)
    n = max(1, max(len(r) for r in rows))
    out = torch.full((B, n), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out.to(batch.loss_mask.device)


def _supervised(batch: Batch, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """[B, N] slot k of each block predicts a supervised token inside the sample."""
    L = batch.loss_mask.shape[1]
    p = anchors + k
    inside = (anchors >= 0) & (p < L)
    return inside & batch.loss_mask.gather(1, p.clamp(0, L - 1))


def block_counts(batch: Batch, steps: int) -> torch.Tensor:
    """Supervised slots 1..steps over the batch's blocks: the loss denominators."""
    anchors = block_anchors(batch, steps)
    return torch.stack([_supervised(batch, anchors, k).sum() for k in range(1, steps + 1)]).double()


def _attention_mask(anchors: torch.Tensor, L: int, size: int) -> torch.Tensor:
    """[B, 1, N*size, L + N*size]: a block's queries see the context before its anchor and their own block."""
    B, N = anchors.shape
    ctx = torch.arange(L, device=anchors.device)[None, None, :] < anchors.clamp(min=0)[..., None]  # [B, N, L]
    ctx = ctx[:, :, None, :].expand(B, N, size, L).reshape(B, N * size, L)
    block = torch.arange(N * size, device=anchors.device) // size
    own = (block[:, None] == block[None, :]).expand(B, N * size, N * size)
    return torch.cat([ctx, own], dim=-1)[:, None]


def block_forward(model, batch: Batch, targets: Targets, objective: Objective,
                  denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss to backpropagate, metric sums [NUM_SUMS, steps]); the loss is normalised like ttt_forward's."""
    B, L = batch.input_ids.shape
    steps, size = objective.steps, objective.steps + 1
    anchors = block_anchors(batch, steps)
    N = anchors.shape[1]
    start = anchors.clamp(min=0)
    pos = start[..., None] + torch.arange(size, device=start.device)  # [B, N, size]
    ids = torch.full((B, N, size), model.config.mask_token_id, dtype=batch.input_ids.dtype, device=start.device)
    ids[..., 0] = batch.input_ids.gather(1, start)
    ctx = model.fuse(batch.aux)
    ctx_pos = torch.arange(L, device=ctx.device).expand(B, L)
    h = model.blocks(ctx, ctx_pos, ids.view(B, N * size), pos.view(B, N * size),
                     _attention_mask(anchors, L, size)).view(B, N, size, -1)
    chain = anchors >= 0
    sums = torch.zeros(NUM_SUMS, steps, dtype=torch.float64, device=ctx.device)
    loss = ctx.new_zeros((), dtype=torch.float32)
    for k in range(1, size):
        b_idx, n_idx = _supervised(batch, anchors, k).nonzero(as_tuple=True)
        target_pos = start[b_idx, n_idx] + k  # the token slot k predicts
        rows = targets.row_of[b_idx, target_pos - 1]
        valid = targets.in_vocab[rows]
        scored = None if batch.scored_mask is None else batch.scored_mask[b_idx, target_pos]
        loss_sum, scored_loss, draft_argmax, alpha_sum, p_draft_sum = step_loss(
            model, h[b_idx, n_idx, k], targets, rows, valid, scored, objective)
        loss = loss + objective.step_weights[k - 1] * loss_sum / denominators[k - 1].clamp(min=1).to(loss.dtype)
        with torch.no_grad():
            if scored is not None:
                valid = valid & scored
            correct = (draft_argmax == targets.argmax[rows]) & valid
            ok = chain[b_idx, n_idx] & correct
            chain = torch.zeros_like(chain)
            chain[b_idx, n_idx] = ok
            counted = float(len(rows)) if scored is None else scored.sum().double()
            sums[:, k - 1] = torch.stack([scored_loss.double(), torch.as_tensor(counted, device=ctx.device,
                                          dtype=torch.float64), valid.sum().double(), correct.sum().double(),
                                          ok.sum().double(), alpha_sum.double(), p_draft_sum.double()])
    return loss, sums
