"""What `plan` reads of the verifier (its config.json, the size of its weights from the safetensors headers) and
the draft it would train, built on the meta device exactly as the trainer builds it (parameters counted, not
estimated)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.families import text_config
from eagle3_train.settings.plan import PlanSettings
from eagle3_train.utils.io import Eagle3InputError


def read_verifier_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Return (config dict, config.json path). JSON only: no transformers class, no remote code, no weights."""
    p = Path(path).expanduser()
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        from eagle3_train.assets.verifier import EMBEDDED, resolve_verifier

        if not p.exists() and str(path) in EMBEDDED:
            return read_verifier_config(resolve_verifier(str(path)))
        if not p.exists() and "/" in str(path) and not str(path).startswith((".", "/", "~")):
            return read_verifier_config(_hub_config(str(path)))
        raise Eagle3InputError(f"plan: verifier config not found: {cfg_path} (pass a config.json or a directory "
                               f"holding one; weights are not needed)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3InputError(f"plan: {cfg_path} is not valid JSON: {e}") from None
    text = text_config(config)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                           "intermediate_size") if k not in text]
    if missing:
        where = f"{cfg_path} (text_config)" if "text_config" in config else str(cfg_path)
        raise Eagle3InputError(f"plan: {where} lacks {', '.join(missing)}")
    return config, cfg_path


def _hub_config(repo_id: str) -> Path:
    """Fetch only config.json (and the weight index, for the size) of a hub model: never its weights."""
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise Eagle3InputError(f"plan: could not fetch config.json of '{repo_id}' from the hub: {e}") from None
    try:
        hf_hub_download(repo_id, "model.safetensors.index.json")
    except Exception:  # noqa: BLE001 - optional: single-file models have no index
        pass
    return path


def verifier_weight_bytes(cfg_path: Path) -> int | None:
    """Size of the verifier's weights if its directory says so (index metadata or files); None from a bare config."""
    d = cfg_path.parent
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        except json.JSONDecodeError:
            pass
    files = [f for f in d.glob("*.safetensors") if f.is_file()]
    return sum(f.stat().st_size for f in files) or None


# --- the draft, counted -------------------------------------------------------------------------------------------
def build_meta_draft(verifier_config: dict[str, Any], s: PlanSettings):
    """The draft the trainer would build (same config code, same module), on the meta device: shapes, no memory."""
    from eagle3_train.model.config import DraftConfig
    from eagle3_train.model.draft_methods import draft_method
    from eagle3_train.model.networks import build_draft

    overrides = {"intermediate_size": s.intermediate_size, "num_layers": s.num_layers,
                 "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
                 "head_dim": s.head_dim, "architecture": s.architecture, **(s.mla_dims or {}),
                 # a method drafting from a mask token: any id plans the same shapes
                 "method": s.method, "mask_token_id": 0 if draft_method(s.method).needs_mask_token else None,
                 "block_size": draft_method(s.method).block_size_for(s.ttt_steps)}
    try:
        draft_cfg = DraftConfig.from_verifier(verifier_config, draft_vocab_size=s.draft_vocab,
                                              aux_layer_ids=s.layer_ids, verifier_name=f"verifier {s.verifier}",
                                              **overrides)
    except KeyError as e:
        raise Eagle3InputError(f"plan: verifier config lacks {e}") from None
    with torch.device("meta"):
        model = build_draft(draft_cfg)
    return draft_cfg, model


def count_parameters(model) -> dict[str, int]:
    from eagle3_train.model.optimizer_groups import muon_parameter_sizes

    muon, muon_largest = muon_parameter_sizes(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    by_module: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:3])
        by_module[key] = by_module.get(key, 0) + p.numel()
    return {"trainable": trainable, "frozen": frozen, "frozen_embedding": model.embed_tokens.weight.numel(),
            "trainable_bytes_bf16": 2 * trainable, "muon": muon, "muon_largest": muon_largest,
            **{f"module:{k}": v for k, v in sorted(by_module.items())}}


