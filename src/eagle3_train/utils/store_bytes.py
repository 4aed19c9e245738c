"""Disk bytes of one token's stored hidden states per store dtype, from one formula: what extract and hybrid
training write (`hidden_states/store.py`) and what `plan` budgets (it may not import a stage)."""

from __future__ import annotations

FP8 = "float8_e4m3"  # the store dtype name extract and train use (hidden_states/fp8.py)
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, FP8: 1}  # per stored value
SCALE_BYTES = 4  # fp8: one float32 scale per stored row (`fp8.encode_rows`)


def bytes_per_token(hidden: int, name: str) -> int:
    """3 aux rows and the final row of `hidden` values, plus for fp8 their 4 scales. The verifier stats add
    `store.STATS_BYTES` where stored."""
    return 4 * hidden * ELEMENT_BYTES[name] + (4 * SCALE_BYTES if name == FP8 else 0)
