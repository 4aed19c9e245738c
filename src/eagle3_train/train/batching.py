"""Token-budget batching: samples of similar length share a [B, L] batch (B*L <= budget), attention never crosses
samples, and the order is a pure function of (seed, epoch) so that resume and data-parallel ranks agree."""

from __future__ import annotations

import random


def plan_batches(lengths: list[int], token_budget: int, seed: int, epoch: int, shuffle: bool = True,
                 bucket_factor: int = 64) -> list[list[int]]:
    """Return batches of positions into `lengths`. Each batch's padded size (count * max length) fits the budget.

    Samples are shuffled, grouped in windows of `bucket_factor` batches' worth, sorted by length inside a window
    (little padding), cut greedily at the budget, and the batches are shuffled again.
    """
    order = list(range(len(lengths)))
    rng = random.Random(f"{seed}-{epoch}")
    if shuffle:
        rng.shuffle(order)
    mean_len = max(1, sum(lengths) // max(1, len(lengths)))
    window = max(1, bucket_factor * max(1, token_budget // mean_len))
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        cur: list[int] = []
        cur_max = 0
        for i in chunk:
            new_max = max(cur_max, lengths[i])
            if cur and new_max * (len(cur) + 1) > token_budget:
                batches.append(cur)
                cur, new_max = [], lengths[i]
            cur.append(i)
            cur_max = new_max
        if cur:
            batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches
