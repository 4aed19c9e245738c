"""Training precision: which one `auto` means on this hardware, the autocast context, the frozen tensors' dtype.

`auto` picks bf16 where the hardware multiplies bf16 natively: a CUDA GPU with bf16, or a CPU with AVX512-BF16 or
AMX (there a training step runs ~1.7x faster than in fp32, benchmarks/README.md). Elsewhere, e.g. AVX2-only CPUs,
bf16 is emulated and slower than fp32, so `auto` is fp32. bf16 means autocast with fp32 master weights; the soft
targets stay fp32 (train/targets.py). The precision a run used is recorded in its training metadata.
"""

from __future__ import annotations

import contextlib

import torch

from eagle3_train.utils.hardware import cpu_has_native_bf16
from eagle3_train.utils.io import Eagle3InputError

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(requested: str, device: torch.device) -> str:
    """fp32 or bf16 for a run on `device` (see the module docstring for what `auto` picks)."""
    if requested not in PRECISIONS:
        raise Eagle3InputError(f"train.precision must be {', '.join(PRECISIONS)}, got '{requested}'")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"


def autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def verifier_tensor_dtype(precision: str) -> torch.dtype:
    """dtype of the frozen verifier tensors the trainer keeps on the device (embedding, lm_head for the targets).
    Under bf16 autocast they are used in bf16 anyway: storing them so halves the largest frozen memory (at Kimi's size
    2 x 2.2 GiB instead of 2 x 4.4 GiB); they are never in the optimizer."""
    return torch.bfloat16 if precision == "bf16" else torch.float32
