"""Read EAGLE-3 drafts in every layout the field uses, and map them onto our module's names.

Layouts: ours (`draft_config.json`), EAGLE/SpecForge/SGLang (`midlayer.*`, Llama config with `draft_vocab_size`),
speculators (`layers.N.*` + `speculators_config`). Weights: `model.safetensors`, a sharded
`model.safetensors.index.json`, `pytorch_model.bin`, or a single `.safetensors` file with a `config.json` beside it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle3_train.model.config import DraftConfig, default_aux_layer_ids
from eagle3_train.utils.io import Eagle3InputError, read_json, sha256_file

log = logging.getLogger(__name__)

OURS, EAGLE, SPECULATORS = "eagle3-train", "eagle", "speculators"


@dataclass
class LoadedDraft:
    """A draft read from disk: its config (ours), tensors under our names, and what happened on the way."""
    path: Path
    format: str
    config: DraftConfig
    tensors: dict[str, torch.Tensor]
    weight_files: dict[str, str]  # file name -> sha256
    source_config: dict[str, Any]
    renamed: dict[str, str] = field(default_factory=dict)  # source key -> our key
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors we use only for checks (embed_tokens)
    unknown: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metadata: dict[str, Any] | None = None  # the source's own training_metadata.json, if any


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index, "safetensors index")["weight_map"]
        return [path / f for f in sorted(set(wm.values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise Eagle3InputError(f"{path}: no weights found (expected model.safetensors, model.safetensors.index.json, "
                           f"pytorch_model.bin or one .safetensors file)")


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise Eagle3InputError(f"weight file {f} listed by the index is missing")
        try:
            if f.suffix == ".safetensors":
                part = load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except (SafetensorError, RuntimeError, EOFError, OSError, ValueError) as e:
            raise Eagle3InputError(f"weight file {f} cannot be read (corrupt or truncated?): {e}") from None
        if not isinstance(part, dict):
            raise Eagle3InputError(f"weight file {f} does not hold a name->tensor mapping")
        tensors.update(part)
    return tensors


def detect_format(config: dict[str, Any], directory: Path) -> str:
    if (directory / "draft_config.json").is_file():
        return OURS
    if "speculators_config" in config or "speculators_model_type" in config:
        return SPECULATORS
    return EAGLE


def _pick(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def _rope(c: dict[str, Any]) -> tuple[float, dict | None]:
    rp = c.get("rope_parameters") or {}
    theta = _pick(c, "rope_theta", default=rp.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling")
    if scaling is None and rp and rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    return float(theta), scaling


def config_from_external(cfg: dict[str, Any], fmt: str, tensors: dict[str, torch.Tensor],
                         notes: list[str]) -> DraftConfig:
    """Translate an EAGLE- or speculators-format config.json into our DraftConfig."""
    if fmt == SPECULATORS:
        layer = dict(cfg.get("transformer_layer_config") or {})
        top = cfg
        default_nbr = True  # vLLM: a speculators config without the key means norm_before_residual=True
    else:
        layer, top = cfg, cfg
        default_nbr = False
    eagle_cfg = cfg.get("eagle_config") or {}
    H = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    theta, scaling = _rope(layer)
    lm = tensors.get("lm_head.weight")
    vd = _pick(top, "draft_vocab_size", default=lm.shape[0] if lm is not None else layer.get("vocab_size"))
    ids = top.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and eagle_cfg.get("eagle_aux_hidden_state_layer_ids"):
        nested = list(eagle_cfg["eagle_aux_hidden_state_layer_ids"])
        ids = [i + 1 for i in nested]
        notes.append(f"aux layer ids only in eagle_config {nested}: read in SGLang's convention (output of layer i) "
                     f"as vLLM ids {ids}; vLLM itself would read them unshifted — check the source's intent")
    if "norm_before_residual" not in top:
        notes.append(f"source config has no norm_before_residual; using {default_nbr} as vLLM would for this format")
    return DraftConfig(
        hidden_size=H, num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or H // heads, intermediate_size=layer["intermediate_size"],
        vocab_size=layer["vocab_size"], draft_vocab_size=int(vd), rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=layer.get("max_position_embeddings", 4096),
        hidden_act=layer.get("hidden_act", "silu"), target_hidden_size=top.get("target_hidden_size"),
        num_layers=layer.get("num_hidden_layers", 1),
        aux_layer_ids=tuple(ids) if ids else (0, 0, 0),  # (0,0,0) = "the verifier's default", filled in by caller
        norm_before_residual=bool(top.get("norm_before_residual", default_nbr)),
        norm_before_fc=bool(_pick(top, "norm_before_fc", default=eagle_cfg.get("norm_before_fc", False))),
        fc_norm=bool(top.get("fc_norm", False)), norm_output=bool(top.get("norm_output", False)),
        verifier=_verifier_of(cfg),
    )


def _verifier_of(cfg: dict[str, Any]) -> dict[str, Any]:
    v = (cfg.get("speculators_config") or {}).get("verifier") or {}
    return {k: v[k] for k in ("name_or_path", "architectures") if k in v}


def rename_key(key: str) -> str | None:
    """Source tensor name -> our name; None for names we do not know."""
    k = key[len("model."):] if key.startswith("model.") else key
    if k.startswith("midlayer."):
        k = "layers.0." + k[len("midlayer."):]
    known_prefixes = ("layers.", "fc.", "norm.", "lm_head.", "input_norm.", "fc_norm.")
    if k in ("d2t", "t2d", "embed_tokens.weight") or k.startswith(known_prefixes):
        return k
    return None


def load_draft_source(source: str | Path) -> LoadedDraft:
    """Read a draft directory or weight file in any supported layout (no model is built here)."""
    path = Path(source).expanduser()
    if not path.exists():
        if "/" in str(source) and not str(source).startswith((".", "/")):
            path = _download(str(source))
        else:
            raise Eagle3InputError(f"draft checkpoint not found: {source}")
    directory = path if path.is_dir() else path.parent
    files = _weight_files(path)
    cfg_path = directory / "config.json"
    ours = (directory / "draft_config.json").is_file()
    if not ours and not cfg_path.is_file():
        raise Eagle3InputError(f"{directory}: no config.json beside the weights (needed to know the draft's shape)")
    source_config = read_json(directory / "draft_config.json" if ours else cfg_path, "draft config")
    fmt = detect_format(source_config, directory)
    raw = read_tensors(files)
    notes: list[str] = []
    renamed: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for k, v in raw.items():
        new = rename_key(k)
        if new is None:
            unknown.append(k)
            continue
        if new != k:
            renamed[k] = new
        (extra if new == "embed_tokens.weight" else tensors)[new] = v
    if fmt == OURS:
        config = DraftConfig.from_dict(source_config)
    else:
        try:
            config = config_from_external(source_config, fmt, tensors, notes)
        except KeyError as e:
            raise Eagle3InputError(f"{cfg_path}: missing field {e} needed to build the draft") from None
    if "d2t" in tensors and "t2d" not in tensors:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(tensors["d2t"].shape[0]) + tensors["d2t"]] = True
        tensors["t2d"] = t2d
        notes.append("t2d rebuilt from d2t (t2d[i + d2t[i]] = True)")
    meta_path = directory / "training_metadata.json"
    metadata = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    return LoadedDraft(path, fmt, config, tensors, {f.name: sha256_file(f) for f in files}, source_config, renamed,
                       extra, unknown, notes, metadata)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise Eagle3InputError(f"could not download draft '{repo_id}' from the hub: {e}") from None


def fill_default_aux_ids(config: DraftConfig, verifier_num_layers: int) -> DraftConfig:
    if tuple(config.aux_layer_ids) == (0, 0, 0):
        config.aux_layer_ids = default_aux_layer_ids(verifier_num_layers)
    config.verifier_num_layers = config.verifier_num_layers or verifier_num_layers
    return config
