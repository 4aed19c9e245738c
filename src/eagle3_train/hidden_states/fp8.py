"""fp8 (e4m3) storage of hidden states with a per-row scale: half the bytes of bf16 (4·H instead of 8·H per token
for the three aux states and the final state).

Each stored row of each layer gets its own float32 scale `amax(|row|) / 448` (448 is e4m3's largest finite value), so
the row's largest element maps onto the top of the fp8 range. A row is one token's state of one layer: the aux
tensor [N, 3H] has 3 groups (scales [N, 3]), the final tensor [N, H] has 1 (scales [N, 1]). Per layer because layer
scales differ by orders of magnitude (the residual stream grows with depth and a few "massive activation" channels
reach thousands); per row (token) because massive activations sit on a few tokens only, so a per-tensor scale would
push every other token's values into fp8's subnormal range.

Python API: `encode_rows(x, groups) -> (q float8_e4m3fn, scale float32 [N, groups])`,
`decode_rows(q, scale, dtype) -> Tensor`; `STORE_NAME = "float8_e4m3"` (the extract `--store-dtype` value).
"""

from __future__ import annotations

import torch

STORE_NAME = "float8_e4m3"
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_SUFFIX = "_scale"  # shard tensor `aux` is stored with `aux_scale`, `final` with `final_scale`


def encode_rows(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [N, D] to e4m3 with one float32 scale per row and group of D/groups columns."""
    n, d = x.shape
    if d % groups:
        raise ValueError(f"{d} columns do not split into {groups} equal groups")
    g = x.reshape(n, groups, d // groups).float()
    scale = g.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(n, d), scale.reshape(n, groups)


def decode_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of `encode_rows` (up to e4m3 rounding: relative error <= 2^-4 per element above 2^-6 of the
    row's max), in `dtype`."""
    n, d = q.shape
    groups = scale.shape[-1]
    x = q.reshape(n, groups, d // groups).float() * scale.float().reshape(n, groups, 1)
    return x.reshape(n, d).to(dtype)
