"""Read just the verifier tensors the draft needs (input embedding, lm_head; the final norm for hidden states
served before it) without loading the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_train.utils.io import Eagle3InputError

_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight",
               "language_model.model.embed_tokens.weight")
_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
_NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
              "norm.weight")
# Final norms that are not y = w * x / rms(x) (Gemma stores w - 1): applying ours would give wrong `final` states.
_OTHER_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text")


def _tensor_locations(verifier_dir: Path) -> dict[str, Path]:
    index = verifier_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: verifier_dir / f for k, f in wm.items()}
    single = verifier_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {k: single for k in f.keys()}
    raise Eagle3InputError(f"verifier {verifier_dir} has no model.safetensors or model.safetensors.index.json")


def _load(locations: dict[str, Path], keys: tuple[str, ...]) -> torch.Tensor | None:
    for k in keys:
        if k in locations:
            with safe_open(str(locations[k]), "pt") as f:
                return f.get_tensor(k)
    return None


def load_verifier_head(verifier_dir: str | Path, dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Return (embedding [V, H], lm_head [V, H], config dict) of a HF verifier checkpoint."""
    verifier_dir = Path(verifier_dir)
    config = json.loads((verifier_dir / "config.json").read_text())
    loc = _tensor_locations(verifier_dir)
    embed = _load(loc, _EMBED_KEYS)
    if embed is None:
        raise Eagle3InputError(f"verifier {verifier_dir}: no embedding tensor (looked for {', '.join(_EMBED_KEYS)})")
    head = _load(loc, _HEAD_KEYS)
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    if head is None:
        if not tied:
            raise Eagle3InputError(f"verifier {verifier_dir}: no lm_head.weight and tie_word_embeddings is false")
        head = embed
    return embed.to(dtype), head.to(dtype), config


def load_final_norm(verifier_dir: str | Path) -> tuple[torch.Tensor, float]:
    """(weight [H], eps) of the verifier's final RMSNorm, read from the checkpoint (that tensor only)."""
    verifier_dir = Path(verifier_dir)
    config = json.loads((verifier_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if text.get("model_type") in _OTHER_NORMS:
        raise Eagle3InputError(f"verifier {verifier_dir}: model_type {text.get('model_type')!r} has a final norm "
                               f"other than w * x / rms(x); not supported by the vLLM hidden-state backend")
    weight = _load(_tensor_locations(verifier_dir), _NORM_KEYS)
    if weight is None:
        raise Eagle3InputError(f"verifier {verifier_dir}: no final norm tensor (looked for {', '.join(_NORM_KEYS)})")
    return weight, float(text.get("rms_norm_eps", 1e-6))


def verifier_head_shapes(verifier_dir: str | Path, dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[torch.Tensor, torch.Tensor, dict, str]:
    """(embedding, lm_head, config, origin) as meta tensors, for a dry run: shapes from the safetensors headers, or from
    config.json when the directory has no weights (origin says which; no tensor data is read)."""
    verifier_dir = Path(verifier_dir)
    config = json.loads((verifier_dir / "config.json").read_text())
    c = config.get("text_config", config)
    V, H = int(c["vocab_size"]), int(c["hidden_size"])
    try:
        loc = _tensor_locations(verifier_dir)
    except Eagle3InputError:
        meta = torch.empty(V, H, dtype=dtype, device="meta")
        return meta, meta, config, "config.json only (no weight files)"

    def shape_of(keys: tuple[str, ...]) -> tuple[int, ...] | None:
        for k in keys:
            if k in loc:
                with safe_open(str(loc[k]), "pt") as f:
                    return tuple(f.get_slice(k).get_shape())
        return None
    embed = shape_of(_EMBED_KEYS)
    if embed is None:
        raise Eagle3InputError(f"verifier {verifier_dir}: no embedding tensor (looked for {', '.join(_EMBED_KEYS)})")
    head = shape_of(_HEAD_KEYS)
    tied = config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))
    if head is None and not tied:
        raise Eagle3InputError(f"verifier {verifier_dir}: no lm_head.weight and tie_word_embeddings is false")
    for name, shape in (("embedding", embed), ("lm_head", head or embed)):
        if shape != (V, H):
            raise Eagle3InputError(f"verifier {verifier_dir}: its {name} has shape {list(shape)}, but config.json "
                                   f"says vocab_size {V} x hidden_size {H}")
    return (torch.empty(embed, dtype=dtype, device="meta"), torch.empty(head or embed, dtype=dtype, device="meta"),
            config, "safetensors headers (shapes only)")
