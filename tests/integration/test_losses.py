"""Training objectives (train/losses.py) on tiny tensors, and training end-to-end with each on the tiny fixture."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.stage_helpers import train_config

from eagle3_train.train.losses import LOSSES, acceptance, row_loss, soft_cross_entropy
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError


def toy(seed: int, rows: int = 4, vocab: int = 7, sharp: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, draft logits): a random target distribution and unrelated draft logits."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, vocab, generator=g) * sharp, -1)
    return p, torch.randn(rows, vocab, generator=g) * sharp


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mix", [0.0, 0.5, 1.0])
def test_gradients_are_finite(name, mix):
    p, logits = toy(0)
    # plus a hopeless row: p on one token to which the draft gives ~e^-60 (alpha ~ 0, NLA at its floor)
    p = torch.cat([p, torch.nn.functional.one_hot(torch.tensor([0]), p.shape[1]).float()])
    logits = torch.cat([logits, torch.tensor([[-60.0] + [0.0] * (p.shape[1] - 1)])]).requires_grad_(True)
    loss = row_loss(torch.log_softmax(logits, -1), p, name, mix)
    assert loss.shape == (p.shape[0],) and torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["tv", "nla"])
def test_lk_losses_are_minimal_when_draft_equals_verifier(name):
    p, logits = toy(1)
    at_p = row_loss(p.log(), p, name)
    assert torch.allclose(at_p, torch.zeros_like(at_p), atol=1e-6)  # alpha = 1: the lower bound 0 of both
    g = torch.Generator().manual_seed(2)
    for _ in range(50):  # any other draft distribution costs more
        other = torch.log_softmax(p.log() + torch.randn(p.shape, generator=g), -1)
        assert (row_loss(other, p, name) > at_p + 1e-4).all()
    # and gradient descent from unrelated logits moves the draft onto p
    logits = logits.clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=0.1)
    for _ in range(400):
        opt.zero_grad()
        row_loss(torch.log_softmax(logits, -1), p, name).sum().backward()
        opt.step()
    assert (torch.softmax(logits.detach(), -1) - p).abs().sum(-1).max() < 0.05


def test_alpha_is_the_acceptance_rate_of_speculative_sampling():
    p, logits = toy(3, rows=3, vocab=6, sharp=1.5)
    q = torch.softmax(logits, -1)
    alpha = acceptance(p, q)
    n = 200_000
    g = torch.Generator().manual_seed(4)
    for r in range(p.shape[0]):
        x = torch.multinomial(q[r], n, replacement=True, generator=g)  # draft proposes x ~ q
        # the verifier keeps x with probability min(1, p(x)/q(x))
        accept = torch.rand(n, generator=g) < torch.clamp(p[r, x] / q[r, x], max=1.0)
        rate = accept.double().mean().item()
        sigma = math.sqrt(alpha[r].item() * (1 - alpha[r].item()) / n)
        assert abs(rate - alpha[r].item()) < 5 * sigma + 1e-9, (r, rate, alpha[r].item())
        assert 0.05 < alpha[r].item() < 0.95  # a non-trivial case


@pytest.mark.parametrize("lk", ["tv", "nla"])
def test_hybrid_reduces_to_its_parts(lk):
    p, logits = toy(5)
    log_q = torch.log_softmax(logits, -1)
    assert torch.equal(row_loss(log_q, p, f"kl+{lk}", 1.0), row_loss(log_q, p, "ce"))
    assert torch.equal(row_loss(log_q, p, f"kl+{lk}", 0.0), row_loss(log_q, p, lk))
    mid = row_loss(log_q, p, f"kl+{lk}", 0.25)
    assert torch.allclose(mid, 0.25 * row_loss(log_q, p, "ce") + 0.75 * row_loss(log_q, p, lk))


@pytest.mark.parametrize("p_sum", [1.0, 0.7])  # the renormalised targets, and rows that do not sum to 1
def test_fused_cross_entropy_has_the_loss_and_gradients_of_autograd(p_sum):
    p, logits = toy(7, rows=6, vocab=11)
    p = p * p_sum
    weights = torch.linspace(-1.0, 2.0, p.shape[0])  # a non-uniform upstream gradient
    ref_logits = logits.clone().requires_grad_(True)
    ref = row_loss(torch.log_softmax(ref_logits, -1), p, "ce")
    (ref * weights).sum().backward()
    fused_logits = logits.clone().requires_grad_(True)
    loss, q = soft_cross_entropy(fused_logits, p)
    (loss * weights).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q, torch.softmax(logits, -1))
    torch.testing.assert_close(fused_logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert not q.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the loss stays float32 under the trainer's bf16 autocast
        loss_bf16, _ = soft_cross_entropy(logits, p)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16, ref.detach(), rtol=1e-5, atol=1e-6)


def test_verifier_mass_on_the_draft_vocab():
    g = torch.Generator().manual_seed(6)
    final, head = torch.randn(1, 5, 8, generator=g), torch.randn(20, 8, generator=g)
    mask = torch.ones(1, 5, dtype=torch.bool)
    t2d = torch.ones(20, dtype=torch.bool)
    full = verifier_targets(final, mask, head, torch.arange(20), t2d)
    assert torch.allclose(full.in_mass, torch.ones_like(full.in_mass))
    part = verifier_targets(final, mask, head, torch.arange(0, 20, 2), t2d)
    expect = torch.softmax(final[0, :4] @ head.T, -1)[:, ::2].sum(-1)
    assert torch.allclose(part.in_mass, expect, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", LOSSES)
def test_training_runs_with_each_loss(tiny_stages, tmp_path, name):
    root, _ = tiny_stages
    result = train(train_config(root, tmp_path / "run", max_steps=4, loss=name))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "validation"}
    for r in rows:
        assert math.isfinite(r["loss"])
        for j in range(3):
            assert 0.0 <= r[f"alpha_{j}"] <= 1.0 and 0.0 <= r[f"p_draft_{j}"] <= 1.0
        assert 1.0 <= r["accept_len_alpha_k1"] <= r["accept_len_alpha_k2"] <= r["accept_len_alpha_k3"] <= 4.0
        assert 1.0 <= r["accept_len_pdraft_k3"] <= 4.0
    assert result["validation"]["alpha_0"] > 0


def test_unknown_loss_is_refused(tiny_stages, tmp_path):
    root, _ = tiny_stages
    with pytest.raises(Eagle3InputError, match="train.loss must be one of"):
        train(train_config(root, tmp_path / "run", loss="kl"))
    with pytest.raises(Eagle3InputError, match="train.loss_mix"):
        train(train_config(root, tmp_path / "run2", loss="kl+tv", loss_mix=2.0))
