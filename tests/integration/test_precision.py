"""What `train.precision: auto` resolves to, and its errors (the training run that records it:
integration/test_train.py)."""

from __future__ import annotations

import pytest
import torch

from eagle3_train.train.precision import resolve_precision
from eagle3_train.utils.hardware import CPU_BF16_ENV, cpu_has_native_bf16
from eagle3_train.utils.io import Eagle3InputError

CPU = torch.device("cpu")


@pytest.mark.parametrize(("env", "expected"), [("1", "bf16"), ("0", "fp32")])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, env, expected):
    monkeypatch.setenv(CPU_BF16_ENV, env)
    assert resolve_precision("auto", CPU) == expected
    # an explicit choice is never changed by the hardware
    assert resolve_precision("fp32", CPU) == "fp32" and resolve_precision("bf16", CPU) == "bf16"


def test_detection_without_override_matches_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    flags = open("/proc/cpuinfo").read().split() if __import__("os").path.exists("/proc/cpuinfo") else None
    if flags is None:
        pytest.skip("no /proc/cpuinfo to compare with")
    # torch's probes and the kernel's flags agree on this host (avx512_bf16, or AMX tiles)
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_tile" in flags)


def test_bad_values_are_named(monkeypatch):
    with pytest.raises(Eagle3InputError, match="train.precision must be auto, fp32, bf16, got 'fp16'"):
        resolve_precision("fp16", CPU)
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(Eagle3InputError, match=f"{CPU_BF16_ENV} must be 1 or 0"):
        resolve_precision("auto", CPU)


@pytest.mark.slow
def test_extract_runs_the_verifier_in_the_dtype_the_judge_serves(tmp_path, tiny_llama_dir, monkeypatch):
    """extract's default compute dtype is the one the vLLM server started here serves the verifier in (float32 on
    CPU, native bf16 or not: the stored teacher is the judge); an explicit one is kept."""
    from eagle3_train.data.prepare import prepare
    from eagle3_train.hidden_states.extract import extract

    verifier = tiny_llama_dir()
    prepare("sharegpt", verifier, tmp_path / "prepared", max_length=64, limit=4, val_count=1)
    for env in ("1", "0"):
        monkeypatch.setenv(CPU_BF16_ENV, env)
        manifest = extract(tmp_path / "prepared", verifier, tmp_path / f"hidden-{env}", dtype="float32")
        assert manifest["compute_dtype"] == "float32"
    explicit = extract(tmp_path / "prepared", verifier, tmp_path / "hidden-explicit", dtype="float32",
                       compute_dtype="bfloat16")
    assert explicit["compute_dtype"] == "bfloat16"
