"""The arithmetic of training-time test on tiny tensors: which verifier position each TTT step is scored against,
which positions it supervises, the chain (full) accuracy, the loss normalisation, and the acceptance estimate.

The reference decodes like an inference engine, one position at a time with a KV cache (`Eagle3Draft.forward_cached`):
drafting from position t, step j reads token x_{t+1+j} at RoPE position t+j and is scored against the verifier's
distribution at position t+1+j, when x_{t+2+j} is supervised.
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_ttt import STEPS, VD, H, V, forward_and_reference, tiny_batch, tiny_draft  # noqa: F401

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.train.data import Batch
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.ttt import NUM_SUMS, StepSums, supervised_counts, ttt_forward


def chain_steps(model: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list:
    """(draft logits, layer output before the final norm) of steps 0..steps-1 when drafting from position t (one
    row), decoded with a KV cache."""
    logits, h, kv = model.forward_cached(model.fuse(aux[None, :t + 1]), ids[None, 1:t + 2],
                                         torch.arange(t + 1)[None], None)
    h = h[:, -1:]
    out = [(logits[0, -1], h[0, -1])]
    for j in range(1, steps):
        logits, h, kv = model.forward_cached(h, ids[None, t + 1 + j:t + 2 + j], torch.tensor([[t + j]]), kv)
        out.append((logits[0, -1], h[0, -1]))
    return out


def chain_step_logits(model: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list:
    return [lg for lg, _ in chain_steps(model, aux, ids, t, steps)]


def reference_sums(model, batch, lm_head, draft_ids, t2d) -> torch.Tensor:
    """[6, STEPS]: loss_sum, supervised, valid, correct, full_correct, position by position. full_correct is what
    greedy serving accepts: the draft matches the verifier's argmax at every step so far, and each step was fed the
    token serving feeds it (the verifier's argmax, which is the data token only where the data is the verifier's
    own). Row 5: the chain that follows the data tokens instead (what the metrics counted before)."""
    sums = torch.zeros(6, STEPS, dtype=torch.float64)
    B, L = batch.input_ids.shape
    for b in range(B):
        final = batch.final[b]
        target = torch.softmax(final @ lm_head[draft_ids].T, dim=-1)  # verifier position p: distribution over x_{p+1}
        valid = t2d[(final @ lm_head.T).argmax(-1)]  # the verifier's own choice is a token the draft can propose
        for t in range(L - 2):
            logits = chain_step_logits(model, batch.aux[b], batch.input_ids[b], t, min(STEPS, L - 2 - t))
            chain, served = True, True
            for j, lg in enumerate(logits):
                if not batch.loss_mask[b, t + 2 + j]:
                    chain = served = False
                    continue
                p = t + 1 + j
                ce = -(target[p] * torch.log_softmax(lg, -1)).sum()
                correct = bool(valid[p]) and int(lg.argmax()) == int(target[p].argmax())
                chain = chain and correct
                accepted = served and correct
                served = accepted and int((final[p] @ lm_head.T).argmax()) == int(batch.input_ids[b, p + 1])
                sums[:, j] += torch.tensor([float(ce) * bool(valid[p]), 1, bool(valid[p]), correct, accepted, chain],
                                           dtype=torch.float64)
    return sums


def test_targets_rows_are_the_supervised_next_tokens():
    batch, lm_head, draft_ids, t2d = tiny_batch()
    tg = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d, chunk=4)
    B, L = batch.input_ids.shape
    for b in range(B):
        for p in range(L):
            needed = p + 1 < L and bool(batch.loss_mask[b, p + 1])
            assert (tg.row_of[b, p] >= 0) == needed, (b, p)
            if needed:
                r = tg.row_of[b, p]
                logits = batch.final[b, p] @ lm_head.T
                torch.testing.assert_close(tg.probs[r], torch.softmax(logits[draft_ids], -1))
                assert int(tg.argmax[r]) == int(logits[draft_ids].argmax())
                assert bool(tg.in_vocab[r]) == bool(t2d[logits.argmax()])
    assert tg.probs.shape == (int(batch.loss_mask[:, 1:].sum()), VD)
    one_chunk = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d)
    assert torch.equal(one_chunk.row_of, tg.row_of) and torch.allclose(one_chunk.probs, tg.probs)
    empty = verifier_targets(batch.final, torch.zeros_like(batch.loss_mask), lm_head, draft_ids, t2d)
    assert empty.probs.shape == (0, VD) and (empty.row_of == -1).all()


def test_ttt_steps_read_the_targets_chain_decoding_reads():
    model = tiny_draft(1).eval()  # seeds 1, 3: some chains stay right through the last step
    # batch rows 1, 2: data the verifier did not write
    expected, loss, sums, denominators = forward_and_reference(model, reference_sums, 3)
    assert expected[4, -1] > 0 and (expected[2] < expected[1]).all()  # the example has chains and out-of-vocab rows
    assert (expected[5] > expected[4]).any()  # and chains that only the data, not the verifier, would continue
    assert torch.equal(denominators, expected[1])
    n = 5  # loss, supervised, valid, correct, full_correct (the alpha rows: tests/integration/test_losses.py)
    torch.testing.assert_close(sums[1:n], expected[1:n], rtol=0, atol=0)
    torch.testing.assert_close(sums[0], expected[0], rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(float((expected[0] / denominators).sum()), rel=1e-5)


def test_loss_is_the_weighted_per_step_mean_and_checkpointing_changes_nothing():
    model = tiny_draft(1)
    batch, lm_head, draft_ids, t2d = tiny_batch(1)
    targets = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d)
    denominators = supervised_counts(batch.loss_mask, STEPS)
    weights = [1.0, 0.5, 0.25]
    grads = []
    for ckpt in (True, False):
        model.zero_grad()
        loss, sums = ttt_forward(model, batch, targets, Objective(STEPS, tuple(weights), checkpoint_loss=ckpt,
                                                                  checkpoint_mlp=ckpt), denominators)
        assert loss.item() == pytest.approx(float(sum(w * s / d for w, s, d in zip(weights, sums[0], denominators))),
                                            rel=1e-5)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


@pytest.mark.parametrize("loss", ["ce", "kl+tv"])
def test_the_loss_in_pieces_of_rows_is_the_loss_in_one(loss, monkeypatch):
    """Under checkpoint_loss a step's loss runs in pieces of rows (LOGITS_CHUNK_ELEMENTS logits each, so that a long
    sample's [rows, Vd] logits never exist at once): the same loss, metric sums and gradients as one piece."""
    import eagle3_train.train.ttt as ttt

    model = tiny_draft(2)
    batch, lm_head, draft_ids, t2d = tiny_batch(2, on_policy=(1,))
    targets = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d)
    denominators = supervised_counts(batch.loss_mask, STEPS)
    results = []
    for elements in (2**26, 4 * VD):  # one piece; pieces of 4 rows (the last one shorter)
        monkeypatch.setattr(ttt, "LOGITS_CHUNK_ELEMENTS", elements)
        model.zero_grad()
        loss_value, sums = ttt_forward(model, batch, targets, Objective(STEPS, (1.0, 0.8, 0.64), loss=loss),
                                       denominators)
        loss_value.backward()
        results.append((loss_value.detach(), sums, {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.requires_grad}))
    (l1, s1, g1), (l2, s2, g2) = results
    assert batch.loss_mask[:, 2:].sum() > 8  # step 0 runs in three pieces or more
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s2, s1, rtol=1e-6, atol=1e-7)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-6, msg=name)  # fp32 sums in pieces


def test_a_batch_shorter_than_the_steps_stops_early():
    model = tiny_draft().eval()
    batch, lm_head, draft_ids, t2d = tiny_batch()
    short = Batch(batch.input_ids[:, :3], torch.ones(3, 3, dtype=torch.bool), batch.aux[:, :3], batch.final[:, :3],
                  torch.tensor([3, 3, 3]))
    targets = verifier_targets(short.final, short.loss_mask, lm_head, draft_ids, t2d)
    with torch.no_grad():
        _, sums = ttt_forward(model, short, targets, Objective(STEPS, (1.0,) * STEPS),
                              supervised_counts(short.loss_mask, STEPS))
    assert sums[1].tolist() == [3.0, 0.0, 0.0]  # L=3: only step 0 (t=0 -> target token 2) has a target


def test_acceptance_estimate_is_the_mean_accepted_prefix_plus_one():
    """With every position drafted at every step, 1 + sum_j full_acc_j is the mean acceptance length: drafting K
    tokens from a position whose first a tokens are right accepts min(a, K) of them, plus the verifier's bonus."""
    g = torch.Generator().manual_seed(0)
    n = 50
    accepted_prefix = torch.randint(0, STEPS + 1, (n,), generator=g)  # leading correct draft tokens per position
    correct_extra = torch.randint(0, 2, (STEPS,), generator=g)  # per half: right at a step after a miss (not accepted)
    halves = StepSums(STEPS), StepSums(STEPS)
    for part, idx in zip(halves, (slice(0, n // 2), slice(n // 2, n))):
        a = accepted_prefix[idx]
        values = torch.zeros(NUM_SUMS, STEPS, dtype=torch.float64)  # the alpha rows stay 0 here
        for j in range(STEPS):
            full = (a > j).sum()
            values[:5, j] = torch.tensor([2.0 * (j + 1) * len(a), len(a), len(a), full + correct_extra[j], full])
        part.add(values)
    total = StepSums(STEPS)
    total.add(halves[0].values)
    total.add(halves[1].values)
    s = total.summary("val_")
    for k in range(1, STEPS + 1):
        assert s[f"val_accept_len_k{k}"] == pytest.approx(float((1 + accepted_prefix.clamp(max=k)).double().mean()))
    for j in range(STEPS):
        assert s[f"val_full_acc_{j}"] == pytest.approx(float((accepted_prefix > j).double().mean()))
        assert s[f"val_acc_{j}"] == pytest.approx(s[f"val_full_acc_{j}"] + 2 * float(correct_extra[j]) / n)
        assert s[f"val_loss_{j}"] == pytest.approx(2.0 * (j + 1)) and s[f"val_coverage_{j}"] == 1.0
    assert s["val_loss"] == pytest.approx(sum(2.0 * (j + 1) for j in range(STEPS)) / STEPS)
    assert StepSums(STEPS).summary()["accept_len_k3"] == 1.0  # nothing seen: no division by zero
