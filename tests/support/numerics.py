"""What makes a numeric comparison hold on every CI host (AMX, AVX512-BF16, AVX2-only).

- Bit-exact claims run both sides on the same thread count: Intel MKL's fp32 GEMM splits the reduction differently
  with one thread than with two on AMX hosts, so a reference computed under the fast tier's one thread and compared
  under a slow test's default would differ in the last bits there (and nowhere else). conftest.py also turns MKL's
  dynamic thread choice off (MKL_DYNAMIC=FALSE) for this process and the subprocesses tests start: with it on, a
  subprocess may run a GEMM on fewer threads than the in-process side of the comparison.
- Comparisons across different computations (a padded batch against one unpadded sample) use `fp32_atol`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def fixed_threads(n: int = 1) -> Iterator[None]:
    """Run the block on `n` intra-op threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fp32_atol(reference: torch.Tensor, ulps: int = 16) -> float:
    """Absolute tolerance for two fp32 computations of `reference` that differ only in summation order: `ulps` units
    of fp32 rounding of its largest element. Hidden states carry a few huge entries (SmolLM2's reach 2.5e4 at the
    first token), and every GEMM and norm downstream mixes their rounding into the other elements; measured on
    SmolLM2, padded against unpadded, the gap is 0.02-2.4 of these units, so 16 leaves a margin and still catches any
    real error (a wrong layer, position or mask moves elements by far more)."""
    return ulps * torch.finfo(torch.float32).eps * reference.abs().max().item()
