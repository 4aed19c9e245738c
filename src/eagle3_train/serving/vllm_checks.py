"""Checks before a vLLM server starts: refuse a draft, dtype or memory share that vLLM would accept and then serve
uselessly (acceptance ~1, aux states off by a factor) or would fail on only after minutes of loading; the error
names the fix.

Python API: `check_draft_embedding(speculative, vllm_args)`, `check_draft_dtype(config, dtype, speculative)`,
`check_memory_share(model_dir, command, gpu_bytes=None)`, `weight_bytes(model_dir)`,
`check_draft_serves_beside(draft, verifier_dir)`, `uses_mla(model_dir)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3_train.assets.families import text_config
from eagle3_train.serving.vllm_options import option, option_value
from eagle3_train.utils.io import Eagle3InputError


def check_draft_embedding(speculative: dict[str, Any] | None, vllm_args: list[str]) -> None:
    """vLLM gives an EAGLE draft the verifier's embedding only at pipeline-parallel size 1; at 2 or more, a draft
    without its own `embed_tokens` runs on an uninitialised one (acceptance ~1, no error). Refuse that here."""
    draft = (speculative or {}).get("model")
    pp = option_value(vllm_args, "--pipeline-parallel-size", "-pp")
    if not draft or pp is None or int(pp) < 2:
        return
    from safetensors import safe_open

    files = sorted(Path(draft).glob("*.safetensors"))
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            keys |= set(h.keys())
    if files and not any(k.endswith("embed_tokens.weight") for k in keys):
        raise Eagle3InputError(f"the draft {draft} has no embed_tokens, and vLLM shares the verifier's embedding with "
                               f"a draft only at --pipeline-parallel-size 1 (at {pp} the draft would run on an "
                               f"uninitialised embedding): export it with --include-embed, or serve without "
                               f"pipeline parallelism")


def check_draft_dtype(config: dict[str, Any], dtype: str, speculative: dict[str, Any] | None) -> None:
    """vLLM's DeepSeek-V2/V3 layers (Kimi's too) divide the residual stream by routed_scaling_factor in float16 (an
    overflow guard), so the aux states an EAGLE draft reads beside such a verifier are off by that factor from the
    ones it was trained on: refused, rather than served with an acceptance that says nothing about the draft."""
    text = text_config(config)
    scale = float(text.get("routed_scaling_factor") or 1.0)
    method = (speculative or {}).get("method", "")
    if dtype == "float16" and scale != 1.0 and method and method != "extract_hidden_states":
        raise Eagle3InputError(f"--dtype float16 with a draft beside this DeepSeek/Kimi verifier: vLLM divides its "
                               f"residual stream by routed_scaling_factor {scale:g} in float16, so the draft would "
                               f"read aux states {scale:g}x smaller than it was trained on; serve in bfloat16")


def weight_bytes(model_dir: Path) -> int | None:
    """The checkpoint's weight bytes: its index's total_size, else its safetensors files; None when unknown."""
    index = model_dir / "model.safetensors.index.json"
    try:
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size") if index.is_file() else None
    except (OSError, ValueError):
        total = None
    if total:
        return int(total)
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) or None


def check_memory_share(model_dir: Path, command: list[str], gpu_bytes: int | None = None) -> None:
    """Refuse a --gpu-memory-utilization that cannot hold this GPU's share of the weights (vLLM then fails after
    minutes of loading, or, for an extraction server at 0.3 on 8 x 96 GB beside a 595 GB Kimi-K2.5, never starts):
    the share needed is named. `gpu_bytes`: one GPU's memory (default: this machine's first GPU)."""
    share = float(option(command, "--gpu-memory-utilization") or 0.9)
    weights = weight_bytes(model_dir)
    if gpu_bytes is None:
        try:
            import torch

            gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001 - no usable CUDA in this process: vLLM will say
            gpu_bytes = None
    if not weights or not gpu_bytes:
        return
    gpus = int(option(command, "--tensor-parallel-size", "-tp") or 1) * int(
        option(command, "--pipeline-parallel-size", "-pp") or 1)
    need = weights / gpus * 1.1  # the weights plus a tenth for activations and CUDA graphs, before any KV cache
    if share * gpu_bytes < need:
        raise Eagle3InputError(
            f"--gpu-memory-utilization {share:g} gives vLLM {share * gpu_bytes / 2**30:.1f} GiB of each GPU's "
            f"{gpu_bytes / 2**30:.1f} GiB, but {model_dir}'s weights need {weights / gpus / 2**30:.1f} GiB per GPU "
            f"({weights / 2**30:.1f} GiB over {gpus} GPU(s)) before any KV cache: pass --gpu-memory-utilization "
            f"{min(0.95, need / gpu_bytes + 0.05):.2f} or more, or spread the model over more GPUs "
            f"(--vllm-arg=--tensor-parallel-size=N)")


def uses_mla(model_dir: Path) -> bool:
    """The model's config (a verifier's, or a draft's in either export format) has MLA attention."""
    try:
        text = (model_dir / "config.json").read_text()
    except OSError:
        return False
    return '"kv_lora_rank"' in text and '"kv_lora_rank": null' not in text


def check_draft_serves_beside(draft: str | os.PathLike, verifier_dir: Path) -> None:
    """Refuse, before vLLM spends minutes loading, a draft made for another verifier (hidden size, vocabulary,
    layers): vLLM itself would start and serve it, accepting nothing (a Kimi-K2 draft beside SmolLM2 came up)."""
    from eagle3_train.checkpoints.fit import check_draft_fits_verifier, verifier_dims
    from eagle3_train.checkpoints.formats import fill_default_aux_ids, load_draft_source
    from eagle3_train.utils.io import read_json

    verifier = read_json(verifier_dir / "config.json", "verifier config")
    loaded = load_draft_source(draft, shapes_only=True, aux_convention="vllm")  # as the engine will read them
    fill_default_aux_ids(loaded.config, verifier_dims(verifier)[2])  # none recorded: vLLM's default layers
    check_draft_fits_verifier(loaded.config, verifier, f"the draft {draft}", str(verifier_dir),
                              {**loaded.tensors, **loaded.extra}, loaded.source_name)
