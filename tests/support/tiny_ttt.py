"""A tiny EAGLE-3 draft and a tiny batch with its verifier head, for the arithmetic of training-time test and of the
other draft methods' objectives, and one way to run an objective beside a decoding reference."""

from __future__ import annotations

import torch

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.train.data import Batch

V, VD, H, STEPS = 7, 3, 32, 3  # a tiny verifier vocabulary, so that draft and verifier argmaxes often agree
DRAFT_IDS = (1, 4, 5)


def peaked(model):
    """`model` with large weights (peaked, position-dependent draft predictions) and the draft vocabulary of
    tiny_batch's verifier head, as a run sets it."""
    model.reset_parameters(std=0.5)
    ids = torch.tensor(DRAFT_IDS)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab(ids - torch.arange(VD), t2d)
    return model


def tiny_draft(seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                      vocab_size=V, draft_vocab_size=VD, aux_layer_ids=(1, 2, 3), verifier_num_layers=6)
    return peaked(Eagle3Draft(cfg))


def forward_and_reference(model, reference, batch_seed: int, forward=None, counts=None):
    """(reference sums, loss, metric sums, denominators) of `model` on tiny_batch(batch_seed) with row 0 on-policy:
    `reference(model, batch, lm_head, draft_ids, t2d)` decodes as an engine does, `forward` (default ttt_forward)
    is the training objective, `counts(batch, steps)` its denominators (default: the TTT supervised counts); step
    weights 1, no gradients."""
    from eagle3_train.train.objective import Objective
    from eagle3_train.train.targets import verifier_targets
    from eagle3_train.train.ttt import supervised_counts, ttt_forward

    batch, lm_head, draft_ids, t2d = tiny_batch(batch_seed, on_policy=(0,))
    targets = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d)
    denominators = (counts or (lambda b, steps: supervised_counts(b.loss_mask, steps)))(batch, STEPS)
    with torch.no_grad():
        expected = reference(model, batch, lm_head, draft_ids, t2d)
        loss, sums = (forward or ttt_forward)(model, batch, targets, Objective(STEPS, (1.0,) * STEPS), denominators)
    return expected, loss, sums, denominators


def tiny_batch(seed: int = 0, on_policy: tuple[int, ...] = ()) -> tuple[Batch, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    """A right-padded batch of 3 rows with user/assistant spans, and a verifier head (lm_head, draft ids, t2d).
    Rows in `on_policy` hold the verifier's own greedy tokens (each token its argmax at the position before, as
    regenerated data does); the others random tokens (original answers the verifier would not have written)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([14, 9, 12])
    B, L = 3, int(lengths.max())
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, 3:7] = mask[0, 9:14] = True  # two assistant turns
    mask[1, 2:9] = True
    mask[2, 3:12:2] = True  # one-token replies: every supervised token starts a turn
    for b, n in enumerate(lengths.tolist()):
        ids[b, n:] = 0
    batch = Batch(ids, mask, torch.randn(B, L, 3 * H, generator=g), torch.randn(B, L, H, generator=g), lengths)
    lm_head = torch.randn(V, H, generator=g)
    for b in on_policy:
        n = int(lengths[b])
        ids[b, 1:n] = (batch.final[b, :n - 1] @ lm_head.T).argmax(-1)
    draft_ids = torch.tensor(DRAFT_IDS)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    return batch, lm_head, draft_ids, t2d
