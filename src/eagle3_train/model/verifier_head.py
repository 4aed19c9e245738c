"""Read just the verifier tensors the draft needs (input embedding, lm_head; the final norm for hidden states
served before it) without loading the whole model, and how the verifier turns `final @ lm_head.T` into its logits
(`logit_transform`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_train.assets.families import GENERIC, family_of, text_config
from eagle3_train.utils.io import Eagle3InputError, read_weight_map

log = logging.getLogger(__name__)
_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight",
               "language_model.model.embed_tokens.weight")
_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
_NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
              "norm.weight")
_BIAS_KEYS = ("lm_head.bias", "language_model.lm_head.bias")

# What each transformers family does to `lm_head(final)` (read from their modeling_*.py ForCausalLM.forward).
_SOFTCAP = {"gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "vaultgemma", "nanochat"}  # cap*tanh(x/cap)
_MULTIPLY = {"cohere": "logit_scale", "cohere2": "logit_scale", "cohere2_moe": "logit_scale",
             "falcon_h1": "lm_head_multiplier", "hyperclovax": "logits_scaling"}  # x * field
_DIVIDE = {m: "logits_scaling" for m in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                                         "granite_swa", "granitemoe_swa")}  # x / field
# Config fields that change a verifier's logits in some family; one outside the families above is refused.
_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                     "output_multiplier", "dim_model_base")


@dataclass
class LogitTransform:
    """The verifier's logits = softcap(scale * (final @ lm_head.T + bias)), as its transformers class computes them."""
    scale: float = 1.0
    softcap: float | None = None
    bias: torch.Tensor | None = None  # [V]

    def apply(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` over all V tokens, or over the token ids `rows` (e.g. the draft vocabulary)."""
        if self.bias is not None:
            bias = self.bias.to(logits.device, logits.dtype)
            logits = logits + (bias if rows is None else bias[rows])
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def describe(self) -> dict[str, Any]:
        return {"scale": self.scale, "softcap": self.softcap, "bias": self.bias is not None}


def tensor_locations(verifier_dir: Path) -> dict[str, Path]:
    index = verifier_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: verifier_dir / f for k, f in read_weight_map(index).items()}
    single = verifier_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {k: single for k in f.keys()}
    raise Eagle3InputError(f"verifier {verifier_dir} has no model.safetensors or model.safetensors.index.json")


def load_tensor(locations: dict[str, Path], keys: tuple[str, ...]) -> torch.Tensor | None:
    """The first of `keys` found in the checkpoint (`tensor_locations`), read alone (its shard fetched from the hub
    when only the index is here); None if none is there."""
    from eagle3_train.assets.verifier import fetch_file

    for k in keys:
        if k in locations:
            path = fetch_file(locations[k].parent, locations[k].name, f"'{k}'")
            with safe_open(str(path), "pt") as f:
                return f.get_tensor(k)
    return None


def load_verifier_head(verifier_dir: str | Path, dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Return (embedding [V, H], lm_head [V, H], config dict) of a HF verifier checkpoint."""
    verifier_dir = Path(verifier_dir)
    config = json.loads((verifier_dir / "config.json").read_text())
    loc = tensor_locations(verifier_dir)
    embed = load_tensor(loc, _EMBED_KEYS)
    if embed is None:
        raise Eagle3InputError(f"verifier {verifier_dir}: no embedding tensor (looked for {', '.join(_EMBED_KEYS)})")
    head = load_tensor(loc, _HEAD_KEYS)
    tied = config.get("tie_word_embeddings", text_config(config).get("tie_word_embeddings", False))
    if head is None:
        if not tied:
            raise Eagle3InputError(f"verifier {verifier_dir}: no lm_head.weight and tie_word_embeddings is false")
        head = embed
    return embed.to(dtype), head.to(dtype), config


def load_final_norm(verifier_dir: str | Path) -> tuple[torch.Tensor, float]:
    """(multiplier [H], eps) of the verifier's final RMSNorm, y = multiplier * x / rms(x), read from the checkpoint
    (that tensor only). Families that store w - 1 and apply (1 + w) (Gemma, Qwen3-Next/3.5) give 1 + w."""
    verifier_dir = Path(verifier_dir)
    config = json.loads((verifier_dir / "config.json").read_text())
    text, family = text_config(config), family_of(config)
    if family is GENERIC:  # guessing w*x/rms would corrupt every final state of a (1+w) or LayerNorm model silently
        raise Eagle3InputError(
            f"verifier {verifier_dir}: model_type {text.get('model_type')!r} is not a listed family "
            f"(docs/VERIFIER_FAMILIES.md), so the form of its final norm is unknown and the vLLM hidden-state backend "
            f"cannot apply it to the last layer the server gives: extract with --backend hf (the model's own forward "
            f"applies it), or add the model type to its family in assets/families.py")
    if family.final_norm == "layernorm":
        raise Eagle3InputError(f"verifier {verifier_dir}: model_type {text.get('model_type')!r} ends in a LayerNorm "
                               f"(mean and variance, with a bias), not an RMSNorm; the vLLM hidden-state backend "
                               f"supports RMSNorm verifiers only")
    weight = load_tensor(tensor_locations(verifier_dir), _NORM_KEYS)
    if weight is None:
        raise Eagle3InputError(f"verifier {verifier_dir}: no final norm tensor (looked for {', '.join(_NORM_KEYS)})")
    if family.final_norm == "rms_plus_one":
        weight = 1.0 + weight.float()
    return weight, float(text.get("rms_norm_eps", 1e-6))


def verifier_head_shapes(verifier_dir: str | Path, dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[torch.Tensor, torch.Tensor, dict, str]:
    """(embedding, lm_head, config, origin) as meta tensors, for a dry run: shapes from the safetensors headers, or from
    config.json when the directory has no weights (origin says which; no tensor data is read)."""
    verifier_dir = Path(verifier_dir)
    config = json.loads((verifier_dir / "config.json").read_text())
    c = text_config(config)
    V, H = int(c["vocab_size"]), int(c["hidden_size"])
    try:
        loc = tensor_locations(verifier_dir)
    except Eagle3InputError:
        meta = torch.empty(V, H, dtype=dtype, device="meta")
        return meta, meta, config, "config.json only (no weight files)"

    def shape_of(keys: tuple[str, ...]) -> tuple[int, ...] | None:
        for k in keys:
            if k in loc:
                with safe_open(str(loc[k]), "pt") as f:
                    return tuple(f.get_slice(k).get_shape())
        return None
    if any(k in loc and not loc[k].is_file() for k in (*_EMBED_KEYS, *_HEAD_KEYS)):
        # the index is here, the shards are not (a served verifier's hub snapshot): a dry run downloads nothing
        meta = torch.empty(V, H, dtype=dtype, device="meta")
        return meta, meta, config, "config.json (the weight index names shards that are not here)"
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


def _text_config(verifier_dir: Path, raw: dict) -> tuple[dict, str]:
    """The LM's config with transformers' class defaults filled in (config.json omits fields equal to them)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(verifier_dir, trust_remote_code=False).get_text_config()
        return cfg.to_dict(), str(getattr(cfg, "model_type", ""))
    except Exception as e:  # noqa: BLE001 - unknown model types: fall back to the file itself
        log.debug("AutoConfig could not read %s (%s); using config.json as written", verifier_dir, e)
        text = text_config(raw)
        return text, str(text.get("model_type") or raw.get("model_type") or "")


def logit_transform(verifier_dir: str | Path, read_bias: bool = True) -> LogitTransform:
    """How this verifier's logits differ from `final @ lm_head.T`; Eagle3InputError for a transform we cannot copy.
    `read_bias=False` (dry run, no weight data): the lm_head bias is not looked for."""
    verifier_dir = Path(verifier_dir)
    raw = json.loads((verifier_dir / "config.json").read_text())
    c, model_type = _text_config(verifier_dir, raw)
    where = f"verifier {verifier_dir} (model_type {model_type!r})"
    t = LogitTransform()
    handled: set[str] = set()
    if model_type in _SOFTCAP:
        t.softcap = c.get("final_logit_softcapping") or None
        handled.add("final_logit_softcapping")
    if model_type in _MULTIPLY:
        field = _MULTIPLY[model_type]
        t.scale = float(c.get(field) if c.get(field) is not None else 1.0)
        handled.add(field)
    if model_type in _DIVIDE:
        field = _DIVIDE[model_type]
        t.scale = 1.0 / float(c.get(field) or 1.0)
        handled.add(field)
    if model_type == "minicpm3":  # hidden states / (hidden_size / dim_model_base) before the lm_head
        t.scale = float(c.get("dim_model_base") or c["hidden_size"]) / float(c["hidden_size"])
        handled |= {"dim_model_base", "logits_scaling"}
    for field in _TRANSFORM_FIELDS:
        value = c.get(field)
        if field not in handled and value not in (None, 1, 1.0, False):
            raise Eagle3InputError(f"{where}: config field {field}={value!r} changes its logits in a way eagle3-train "
                                   f"does not reproduce for this model type, so the training targets would be "
                                   f"wrong; supported: softcapping for {sorted(_SOFTCAP)}, logit scales for "
                                   f"{sorted({**_MULTIPLY, **_DIVIDE, 'minicpm3': ''})}")
    bias = load_tensor(tensor_locations(verifier_dir), _BIAS_KEYS) if read_bias else None
    if bias is not None:
        t.bias = bias.float()
    return t


# Logits per chunk wherever a [rows, vocab] matrix is computed in pieces (the targets' full-vocabulary pass, the
# draft's loss): ~256 MB of fp32 each, whatever the number of rows
LOGITS_CHUNK_ELEMENTS = 2**26


def chunk_rows(chunk: int, vocab: int, max_elements: int) -> int:
    """Rows of a logits chunk: at most `chunk`, and at most `max_elements` logits over `vocab` entries."""
    return max(1, min(chunk, max_elements // vocab))


@torch.no_grad()
def full_vocab_stats(h: torch.Tensor, lm_head: torch.Tensor, transform: LogitTransform | None = None,
                     chunk: int = 1024, max_elements: int = LOGITS_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [N] int64, logsumexp [N] float32) of the verifier's full-vocabulary logits for final states h [N, H].

    The matmul runs in lm_head's dtype (h is cast to it), the transform and the reductions in float32; the logits
    exist for one chunk of rows at a time (at most `max_elements` values: 256 MB in fp32, e.g. 409 rows of Kimi's
    163840 tokens)."""
    transform = transform or LogitTransform()
    chunk = chunk_rows(chunk, lm_head.shape[0], max_elements)
    argmax, lse = [], []
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk):
            full = transform.apply((h[s:s + chunk].to(lm_head.dtype) @ lm_head.T).float())
            argmax.append(full.argmax(-1))
            lse.append(torch.logsumexp(full, -1))
    if not argmax:
        return (torch.zeros(0, dtype=torch.long, device=h.device), torch.zeros(0, dtype=torch.float32, device=h.device))
    return torch.cat(argmax), torch.cat(lse)
