"""What this machine's CPU can do natively, for the stages that pick a compute dtype by it (train's `precision: auto`,
extract's default compute dtype)."""

from __future__ import annotations

import os

import torch

from eagle3_train.utils.io import Eagle3InputError

CPU_BF16_ENV = "EAGLE3_TRAIN_CPU_BF16"  # 1/0: take or refuse the CPU's bf16 (default: detect)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles; the EAGLE3_TRAIN_CPU_BF16 environment variable (1/0) overrides the detection.
    Without them (e.g. AVX2-only CPUs) bf16 is emulated and slower than fp32."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise Eagle3InputError(f"{CPU_BF16_ENV} must be 1 or 0 (or unset: detect), got '{forced}'")
    cpu = getattr(torch, "cpu", None)  # private probes: absent in some builds, then no native bf16 is assumed
    probes = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(p()) for p in probes if p is not None)
