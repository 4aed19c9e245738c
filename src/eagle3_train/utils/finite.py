"""One check that numbers are finite: a NaN or an infinity anywhere in a source, a verifier tensor or a step's
gradients trains a draft of NaN that evaluates as "identical" (every draft rejected, the verifier's tokens kept), so
each reader stops at the first one, naming the tensor."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from eagle3_train.utils.io import Eagle3InputError


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int, int] | None:
    """(name, non-finite count, size) of the first floating-point tensor holding NaN or +-inf, else None."""
    for name, t in tensors:
        if t is None or not t.is_floating_point() or t.device.type == "meta":
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            return name, bad, t.numel()
    return None


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str, hint: str) -> None:
    """Raise Eagle3InputError naming `what`'s first tensor that holds NaN/inf, and the way out (`hint`)."""
    found = first_non_finite(tensors)
    if found is not None:
        name, bad, size = found
        raise Eagle3InputError(f"{what}: tensor '{name}' holds {bad} NaN/inf value(s) of {size}; {hint}")
