"""Memory honesty at Kimi's vocabulary: no [tokens, V] logits for the whole batch, and the frozen verifier tensors in
bf16 and out of the optimizer when training in bf16."""

from __future__ import annotations

import torch
from support.stage_helpers import train_config

from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.trainer import Trainer


def test_targets_over_the_full_vocab_are_cut_into_chunks_with_the_same_result():
    g = torch.Generator().manual_seed(0)
    V, H, Vd = 1000, 16, 100
    final = torch.randn(2, 30, H, generator=g)
    mask = torch.rand(2, 30, generator=g) > 0.3
    lm_head = torch.randn(V, H, generator=g)
    ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    whole = verifier_targets(final, mask, lm_head, ids, t2d, chunk=10**6, max_elements=10**9)
    chunked = verifier_targets(final, mask, lm_head, ids, t2d, max_elements=3 * V)  # 3 rows of [*, V] at a time
    for a, b in zip((whole.row_of, whole.argmax, whole.in_vocab), (chunked.row_of, chunked.argmax, chunked.in_vocab)):
        assert torch.equal(a, b)
    torch.testing.assert_close(chunked.probs, whole.probs)  # BLAS may round another row count differently


def test_bf16_training_keeps_the_verifier_tensors_in_bf16_and_out_of_the_optimizer(tiny_stages, tmp_path):
    root, _ = tiny_stages
    t = Trainer(train_config(root, tmp_path / "run", precision="bf16", device="cpu", max_steps=1))
    embed = t.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16 and not embed.requires_grad
    assert t.inputs.lm_head.dtype == torch.bfloat16
    in_optimizer = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert id(embed) not in in_optimizer
    assert all(p.dtype == torch.float32 for p in t.engine.parameters())  # fp32 master weights
    result = t.run()
    assert result["step"] == 1 and torch.isfinite(torch.tensor(result["train"]["loss"]))
