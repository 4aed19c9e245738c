"""Train/validation split by conversation id, deterministic in the seed.

Each id gets a pseudo-random score in [0, 1) from a hash of (seed, id). With a fraction, a conversation is in
validation when its score is below the fraction, so a conversation keeps its split when more data is added (a larger
`--limit` never moves a validation conversation into train). With a count, the lowest scores are taken.

Python API: `split_score(conv_id, seed) -> float`,
`assign_splits(ids, val_fraction, seed, val_count=None) -> list[str]`, `check_split_settings(val_fraction, val_count)`
(Eagle3InputError when out of range).
"""

from __future__ import annotations

import hashlib

from eagle3_train.utils.io import Eagle3InputError, check_at_least

TRAIN, VALIDATION = "train", "validation"


def check_split_settings(val_fraction: float, val_count: int | None) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise Eagle3InputError(f"val_fraction must be in [0, 1), got {val_fraction}")
    check_at_least("val_count", val_count, 0)


def split_score(conv_id: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\0{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(ids: list[str], val_fraction: float, seed: int, val_count: int | None = None,
                  group: list[str] | None = None) -> list[str]:
    """Split name for each id. When a non-zero validation share is asked for and there are at least two
    conversations, validation and train both get at least one (a tiny run still has something to validate on).
    `group` (one key per id): ids of one group score alike, so they land in one split (with val_count, except a
    group that straddles the count)."""
    check_split_settings(val_fraction, val_count)
    scores = [split_score(i, seed) for i in (ids if group is None else group)]
    if val_count is not None:
        if len(ids) >= 2 and val_count >= len(ids):  # clipping would leave one conversation to train on
            raise Eagle3InputError(f"val_count {val_count} is not smaller than the {len(ids)} conversations kept: "
                                   f"lower it (or val_fraction) so that most of them are left for training")
        order = sorted(range(len(ids)), key=lambda k: (scores[k], ids[k]))
        chosen = set(order[:min(val_count, max(len(ids) - 1, 0))])
        return [VALIDATION if k in chosen else TRAIN for k in range(len(ids))]
    out = [VALIDATION if s < val_fraction else TRAIN for s in scores]
    if len(ids) >= 2 and val_fraction > 0:
        if VALIDATION not in out:
            out[min(range(len(ids)), key=lambda k: scores[k])] = VALIDATION
        if TRAIN not in out:
            out[max(range(len(ids)), key=lambda k: scores[k])] = TRAIN
    return out
