"""Token-budget batching (train/batching.py) and the train/validation split (data/split.py), checked by their
properties on small inputs."""

from __future__ import annotations

import random

import pytest

from eagle3_train.data.split import TRAIN, VALIDATION, assign_splits, split_score
from eagle3_train.train.batching import plan_batches
from eagle3_train.utils.io import Eagle3InputError


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(5, 300) for _ in range(n)]


@pytest.mark.parametrize("budget", [300, 1000, 4096])
def test_every_sample_once_and_every_batch_within_the_budget(budget):
    lengths = _lengths(500) + [budget + 50]  # one sample longer than the budget: a batch of its own
    plan = plan_batches(lengths, budget, seed=3, epoch=0, bucket_factor=4)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    assert [len(lengths) - 1] in plan


def test_batches_are_cut_greedily_in_length_order():
    lengths = _lengths(300, seed=1)
    budget, factor = 1000, 2
    plan = plan_batches(lengths, budget, seed=0, epoch=0, shuffle=False, bucket_factor=factor)
    window = factor * (budget // (sum(lengths) // len(lengths)))
    flat = [i for b in plan for i in b]
    for start in range(0, len(lengths), window):  # unshuffled: windows of consecutive samples, each sorted by length
        part = flat[start:start + window]
        assert sorted(part) == list(range(start, min(start + window, len(lengths))))
        assert [lengths[i] for i in part] == sorted(lengths[i] for i in part)
    for b, nxt in zip(plan, plan[1:]):  # the next sample would not have fitted (or starts a new window)
        if flat.index(nxt[0]) % window:
            assert (len(b) + 1) * max(lengths[i] for i in b + nxt[:1]) > budget


def test_order_is_a_function_of_seed_and_epoch():
    lengths = _lengths(200, seed=2)
    plan = plan_batches(lengths, 1000, seed=5, epoch=1)
    assert plan == plan_batches(list(lengths), 1000, seed=5, epoch=1)  # resume and every rank agree
    assert plan != plan_batches(lengths, 1000, seed=5, epoch=2)
    assert plan != plan_batches(lengths, 1000, seed=6, epoch=1)
    assert plan_batches([], 1000, seed=0, epoch=0) == []


def test_split_fraction_is_stable_as_data_grows():
    ids = [f"conv-{i}" for i in range(4000)]
    small = dict(zip(ids[:1000], assign_splits(ids[:1000], 0.1, seed=7)))
    large = dict(zip(ids, assign_splits(ids, 0.1, seed=7)))
    assert all(large[i] == s for i, s in small.items())  # a larger --limit moves no conversation
    share = sum(s == VALIDATION for s in large.values()) / len(ids)
    assert 0.08 < share < 0.12
    assert all((s == VALIDATION) == (split_score(i, 7) < 0.1) for i, s in large.items())
    other_seed = assign_splits(ids, 0.1, seed=8)
    assert other_seed != list(large.values())
    assert assign_splits(ids[::-1], 0.1, seed=7) == [large[i] for i in ids[::-1]]  # by id, not by position


def test_split_count_takes_the_lowest_scores():
    ids = [f"c{i}" for i in range(50)]
    out = assign_splits(ids, 0.0, seed=1, val_count=5)
    chosen = {i for i, s in zip(ids, out) if s == VALIDATION}
    assert chosen == set(sorted(ids, key=lambda i: split_score(i, 1))[:5])
    with pytest.raises(Eagle3InputError, match="val_count 10 is not smaller than the 3 conversations"):
        assign_splits(ids[:3], 0.0, seed=1, val_count=10)  # clipped, it left one conversation to train on
    assert assign_splits(ids[:3], 0.0, seed=1, val_count=2).count(TRAIN) == 1
    assert assign_splits(ids, 0.5, seed=1, val_count=0) == [TRAIN] * 50


def test_a_group_lands_in_one_split():
    ids = [f"c{i}" for i in range(40)] + [f"c{i}#2" for i in range(40)]
    out = assign_splits(ids, 0.3, seed=2, group=[i.split("#")[0] for i in ids])
    assert out[:40] == out[40:] and VALIDATION in out and TRAIN in out


def test_tiny_sets_get_both_splits_and_bad_values_are_refused():
    for n in (2, 3):
        ids = [f"x{i}" for i in range(n)]
        for frac in (0.001, 0.999):
            out = assign_splits(ids, frac, seed=0)
            assert VALIDATION in out and TRAIN in out
    assert assign_splits(["only"], 0.5, seed=0) in ([TRAIN], [VALIDATION])
    assert assign_splits([f"x{i}" for i in range(5)], 0.0, seed=0) == [TRAIN] * 5
    with pytest.raises(ValueError, match="val_fraction"):
        assign_splits(["a"], 1.0, seed=0)
    with pytest.raises(ValueError, match="val_count"):
        assign_splits(["a"], 0.1, seed=0, val_count=-1)


def test_a_training_batch_pads_on_the_right_and_keeps_each_samples_rows(tiny_stages):
    """TrainingSamples.batch joins each prepared row with its stored hidden states by sample index, in the order asked,
    right-padded with zeros (token 0, mask off, zero features) to the longest sample."""
    import torch

    from eagle3_train.data.prepare import load_prepared
    from eagle3_train.hidden_states.store import HiddenStatesReader
    from eagle3_train.train.data import TrainingSamples

    root, _ = tiny_stages
    data = TrainingSamples(root / "prepared", root / "hidden", "train")
    reader = HiddenStatesReader(root / "hidden", "train")
    rows = load_prepared(root / "prepared")[0]["train"]
    short = min(range(len(data)), key=lambda p: data.lengths[p])
    longer = [p for p in range(len(data)) if data.lengths[p] > data.lengths[short]]
    positions = [longer[-1], short, longer[0]]  # not in sample order; the short one is padded
    lengths = [len(rows[data.indices[p]]["input_ids"]) for p in positions]
    batch = data.batch(positions)
    L = max(lengths)
    assert batch.input_ids.shape == batch.loss_mask.shape == (3, L) and batch.aux.shape[:2] == batch.final.shape[:2]
    assert batch.lengths.tolist() == lengths and batch.num_tokens == sum(lengths)
    for b, (p, n) in enumerate(zip(positions, lengths)):
        row, stored = rows[data.indices[p]], reader.load(data.indices[p])
        assert batch.input_ids[b, :n].tolist() == row["input_ids"] and not batch.input_ids[b, n:].any()
        assert batch.loss_mask[b, :n].tolist() == [bool(x) for x in row["loss_mask"]]
        assert not batch.loss_mask[b, n:].any()
        assert torch.equal(batch.aux[b, :n], stored["aux"]) and torch.equal(batch.final[b, :n], stored["final"])
        assert not batch.aux[b, n:].any() and not batch.final[b, n:].any()
