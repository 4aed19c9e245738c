"""DFlash (train.method dflash, model/dflash.py, train/dflash_blocks.py) on tiny tensors: a training block at anchor a
is the block vLLM drafts after verifying x_a (context keys and values of positions < a straight from the features,
the anchor token and the mask slots attending both ways), its slot k is scored against the verifier's distribution
at a+k-1, and the chain counts what vLLM accepts of the block.

The reference decodes one anchor at a time with `DFlashDraft.propose_block`, which lays a round out as vLLM 0.32's
`dflash.py` does (context cache from `precompute_and_store_context_kv`, then one non-causal block)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.tiny_ttt import STEPS, forward_and_reference, peaked, tiny_batch, tiny_draft

from eagle3_train.model.networks import build_draft
from eagle3_train.train.dflash_blocks import block_anchors, block_counts, block_forward
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import verifier_targets
from eagle3_train.utils.io import Eagle3InputError

MASK = 6


def tiny_dflash(seed: int = 0):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(tiny_draft(seed).config, method="dflash", mask_token_id=MASK, block_size=STEPS + 1)
    return peaked(build_draft(cfg))


def reference_sums(model, batch, lm_head, draft_ids, t2d) -> torch.Tensor:
    """[5, STEPS] loss_sum, supervised, valid, correct, full_correct over the batch's blocks, decoded one by one."""
    sums = torch.zeros(5, STEPS, dtype=torch.float64)
    anchors = block_anchors(batch, STEPS)
    for b in range(batch.input_ids.shape[0]):
        final, ids, n = batch.final[b], batch.input_ids[b], int(batch.lengths[b])
        target = torch.softmax(final @ lm_head[draft_ids].T, dim=-1)
        valid = t2d[(final @ lm_head.T).argmax(-1)]
        for a in anchors[b].tolist():
            if a < 0:
                continue
            # verified up to x_a: context features of positions 0..a-1, then the block anchored at a
            logits, _ = model.propose_block(None, model.fuse(batch.aux[b, None, :a]), torch.arange(a)[None],
                                            int(ids[a]), STEPS)
            chain = True
            for k, lg in enumerate(logits, start=1):
                if a + k >= n or not batch.loss_mask[b, a + k]:
                    chain = False
                    continue
                p = a + k - 1
                ce = -(target[p] * torch.log_softmax(lg, -1)).sum()
                correct = bool(valid[p]) and int(lg.argmax()) == int(target[p].argmax())
                chain = chain and correct
                sums[:, k - 1] += torch.tensor([float(ce) * bool(valid[p]), 1, bool(valid[p]), correct, chain],
                                               dtype=torch.float64)
    return sums


def test_training_blocks_are_the_blocks_vllm_drafts():
    # seeds 1, 0: some blocks stay right through the last slot
    expected, loss, sums, denominators = forward_and_reference(tiny_dflash(1).eval(), reference_sums, 0,
                                                               block_forward, block_counts)
    assert expected[4, -1] > 0  # blocks right through their last slot
    assert torch.equal(denominators, expected[1])
    torch.testing.assert_close(sums[1:5], expected[1:5], rtol=0, atol=0)
    torch.testing.assert_close(sums[0], expected[0], rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(float((expected[0] / denominators).sum()), rel=1e-5)


def test_anchors_are_supervised_positions_drawn_the_same_for_the_same_batch(monkeypatch):
    import eagle3_train.train.dflash_blocks as blocks

    batch, *_ = tiny_batch(2)
    anchors = block_anchors(batch, STEPS)
    for b in range(anchors.shape[0]):
        for a in anchors[b][anchors[b] >= 0].tolist():
            assert 1 <= a <= int(batch.lengths[b]) - 2 and batch.loss_mask[b, a + 1]
    monkeypatch.setattr(blocks, "ANCHORS", 3)
    few = block_anchors(batch, STEPS)
    assert few.shape[1] == 3 and torch.equal(few, block_anchors(batch, STEPS))  # seeded by the batch


def test_the_draft_learns_and_its_embedding_stays_the_verifiers():
    model = tiny_dflash(2)
    batch, lm_head, draft_ids, t2d = tiny_batch(1)
    targets = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d)
    loss, _ = block_forward(model, batch, targets, Objective(STEPS, (1.0, 0.8, 0.64)), block_counts(batch, STEPS))
    loss.backward()
    assert not model.embed_tokens.weight.requires_grad
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad), \
        [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


def test_block_size_belongs_to_the_method():
    cfg = tiny_draft().config
    with pytest.raises(Eagle3InputError, match="block_size is for the methods that draft a block"):
        dataclasses.replace(cfg, method="dflash", mask_token_id=MASK)
    with pytest.raises(Eagle3InputError, match="block_size is for the methods that draft a block"):
        dataclasses.replace(cfg, block_size=4)
    with pytest.raises(Eagle3InputError, match="block_size must be a whole number >= 2"):
        dataclasses.replace(cfg, method="dflash", mask_token_id=MASK, block_size=1)
