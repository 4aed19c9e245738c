"""Read EAGLE-3 drafts in every layout the field uses, and map them onto our module's names.

Layouts: ours (`draft_config.json`), EAGLE/SpecForge/SGLang (`midlayer.*`, Llama config with `draft_vocab_size`),
speculators (`layers.N.*` + `speculators_config`). Weights: `model.safetensors`, a sharded
`model.safetensors.index.json`, `pytorch_model.bin`, or a single `.safetensors` file with a `config.json` beside it.
A training run directory resolves to its `final/` checkpoint (else the latest one; `native.resolve_checkpoint`); a
`owner/name` that is not a local path is downloaded from the hub where the network allows.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eagle3_train.checkpoints.native import is_run_dir, read_metadata, resolve_checkpoint
from eagle3_train.model.config import DraftConfig, default_aux_layer_ids
from eagle3_train.model.draft_methods import method_of_config
from eagle3_train.model.layer_kinds import MLA_DIMS, architecture_from_config, layer_kind
from eagle3_train.utils.io import Eagle3InputError, read_json, read_weight_map, sha256_file

log = logging.getLogger(__name__)

OURS, EAGLE, SPECULATORS = "eagle3-train", "eagle", "speculators"
# Where the aux-layer ids came from: our draft_config.json, the top-level key (vLLM, "input of layer i"), only the
# nested eagle_config key (SGLang, "output of layer i", shifted +1), or nowhere (the engines' default for the verifier).
AUX_OURS, AUX_TOP, AUX_NESTED, AUX_DEFAULT = "ours", "top-level", "nested", "default"
AUX_DFLASH = "dflash_config (output of layer i)"  # a DFlash draft's target_layer_ids, read as inputs of layer i+1
# nested ids that a producer already wrote in vLLM's convention: TorchSpec's exporter, exporting a kimi_k2 draft for
# vLLM (keys `layers.0.*`), adds 1 to every id, the nested ones too (tools/convert_to_hf.py, _fixup_export_config)
AUX_NESTED_VLLM = "nested (vLLM convention: TorchSpec's vLLM export)"


# How a finetune source's eagle_config ids are meant: "auto" decides by producer (`nested_convention`), the others
# are the user's word for a source whose producer cannot be told (`--source-aux-convention`).
AUX_CONVENTIONS = ("auto", "sglang", "vllm")
AMBIGUOUS = "ambiguous"


class AmbiguousAuxIds(Eagle3InputError):
    """A source whose aux ids mean different layers in the two conventions, and whose producer cannot be told."""


def nested_convention(config: dict[str, Any], raw_names: Any, choice: str = "auto") -> str:
    """How a source's eagle_config ids are meant, by producer: "vllm" for a TorchSpec export made for vLLM of a
    kimi_k2 draft (`_torchspec_version` in its config, `layers.0.` tensor names, `model_type: kimi_k2`: the only case
    its exporter shifts the ids); "sglang" (output of layer i) for SpecForge/SGLang's `midlayer.` drafts and any
    other TorchSpec export; "ambiguous" for a kimi_k2 draft with `layers.0.` names and no `_torchspec_version` (a
    TorchSpec vLLM export with its version key lost reads one layer earlier than an SGLang-convention draft).
    `choice` other than "auto" is the user's decision and wins."""
    if choice not in AUX_CONVENTIONS:
        raise Eagle3InputError(f"source_aux_convention must be one of {', '.join(AUX_CONVENTIONS)}, got {choice!r}")
    if choice != "auto":
        return choice
    kimi_vllm_names = config.get("model_type") == "kimi_k2" and not any(
        str(k).startswith("midlayer.") for k in raw_names)
    if not kimi_vllm_names:
        return "sglang"
    return "vllm" if "_torchspec_version" in config else AMBIGUOUS
_SMALL = ("d2t", "t2d")  # read for real even when only shapes are asked for
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass
class LoadedDraft:
    """A draft read from disk: its config (ours), tensors under our names, and what happened on the way."""
    path: Path
    format: str
    config: DraftConfig
    tensors: dict[str, torch.Tensor]
    weight_files: dict[str, str]  # file name -> sha256 (empty until the data is read: see shapes_only)
    source_config: dict[str, Any]
    renamed: dict[str, str] = field(default_factory=dict)  # source key -> our key
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors we use only for checks (embed_tokens)
    unknown: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metadata: dict[str, Any] | None = None  # the source's own training_metadata.json, if any
    aux_ids_origin: str = AUX_DEFAULT
    files: list[Path] = field(default_factory=list)  # the weight files read
    derived: list[str] = field(default_factory=list)  # tensors (our names) made here, not stored in the files

    def source_name(self, our_key: str) -> str:
        """The key as the source file spells it (for messages)."""
        return next((k for k, v in self.renamed.items() if v == our_key), our_key)


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(read_weight_map(index).values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise Eagle3InputError(f"{path}: no weights found (expected model.safetensors, model.safetensors.index.json, "
                           f"pytorch_model.bin or one .safetensors file)")


def _read_safetensors(f: Path, shapes_only: bool) -> dict[str, torch.Tensor]:
    if not shapes_only:
        return load_file(str(f))
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(f), "pt") as g:
        for k in g.keys():
            if k.split(".")[-1] in _SMALL:
                out[k] = g.get_tensor(k)
                continue
            sl = g.get_slice(k)
            out[k] = torch.empty(sl.get_shape(), dtype=_ST_DTYPES.get(sl.get_dtype(), torch.float32), device="meta")
    return out


def read_tensors(files: list[Path], shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of the weight files; with `shapes_only`, big tensors come back on the meta device (no data)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise Eagle3InputError(f"weight file {f} listed by the index is missing")
        try:
            if f.suffix == ".safetensors":
                part = _read_safetensors(f, shapes_only)
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except (SafetensorError, RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
            raise Eagle3InputError(f"weight file {f} cannot be read (corrupt or truncated?): {e}") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise Eagle3InputError(f"weight file {f} does not hold a name->tensor mapping")
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise Eagle3InputError(f"weight file {f} repeats tensors already read from another file: {twice[:5]}")
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


def _aux_list(value: Any, key: str, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(isinstance(i, int) for i in value):
        raise Eagle3InputError(f"{where}: {key} must list 3 verifier layer ids, got {value!r}")
    return [int(i) for i in value]


def read_aux_ids(cfg: dict[str, Any], fmt: str, where: str = "draft config",
                 nested: str = "sglang") -> tuple[list[int] | None, str]:
    """The verifier layers a draft's features come from, in vLLM's convention (input of layer i), and their origin.

    Top-level ids are vLLM's (input of layer i); ids only in `eagle_config` are SGLang's (output of layer i = input of
    i+1), shifted here, unless the producer wrote them in vLLM's convention (`nested="vllm"`: TorchSpec's vLLM
    export, see `nested_convention`); both present must name the same layers; neither = the engines' default.
    """
    if fmt == OURS:
        return list(cfg.get("aux_layer_ids") or []) or None, AUX_OURS
    dflash = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if dflash is not None and not cfg.get("eagle_aux_hidden_state_layer_ids"):
        ids = _aux_list(dflash, "dflash_config.target_layer_ids", where)
        return [i + 1 for i in ids], AUX_DFLASH
    top = _aux_list(cfg.get("eagle_aux_hidden_state_layer_ids") or None, "eagle_aux_hidden_state_layer_ids", where)
    nested_ids = _aux_list((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or None,
                           "eagle_config.eagle_aux_hidden_state_layer_ids", where)
    if nested == AMBIGUOUS and nested_ids and not top:
        raise AmbiguousAuxIds(
            f"{where}: its aux layer ids {nested_ids} are only in eagle_config, and its producer cannot be told "
            f"(model_type kimi_k2, `layers.0.*` tensor names, no `_torchspec_version`): read as SGLang's "
            f"output-of-layer ids (SpecForge, SGLang) the draft was trained on inputs of layers "
            f"{[i + 1 for i in nested_ids]}; read as vLLM's input-of-layer ids (TorchSpec's vLLM export) on inputs "
            f"of layers {nested_ids}. Say which with --source-aux-convention sglang or --source-aux-convention "
            f"vllm (train, extract and plan; train.source_aux_convention in a run config)")
    shift = 0 if nested == "vllm" else 1
    if top and nested_ids and [i + shift for i in nested_ids] != top:
        raise Eagle3InputError(
            f"{where}: eagle_aux_hidden_state_layer_ids {top} (vLLM: inputs of layers {top}) and "
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested_ids} (SGLang: outputs of layers {nested_ids} = "
            f"inputs of {[i + 1 for i in nested_ids]}; as vLLM reads them: inputs of {nested_ids}) name different "
            f"verifier layers: vLLM and SGLang would feed this draft "
            f"different features, and nobody can tell which ones it was trained on. Fix the config (nested = "
            f"top-level - 1) with the layers the draft was trained on.")
    if top:
        return top, AUX_TOP
    if nested_ids and nested == "vllm":
        return nested_ids, AUX_NESTED_VLLM
    if nested_ids:
        return [i + 1 for i in nested_ids], AUX_NESTED
    return None, AUX_DEFAULT


def aux_ids_origin(cfg: dict[str, Any], fmt: str, nested: str = "sglang") -> str:
    return read_aux_ids(cfg, fmt, nested=nested)[1]


def config_from_external(cfg: dict[str, Any], fmt: str, tensors: dict[str, torch.Tensor],
                         notes: list[str], where: str = "draft config", nested: str = "sglang") -> DraftConfig:
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
    ids, origin = read_aux_ids(top, fmt, where, nested)
    if origin == AUX_NESTED_VLLM:
        notes.append(f"aux layer ids only in eagle_config {ids}: a TorchSpec export for vLLM, whose exporter writes "
                     f"them as vLLM ids (inputs of layers {ids}); read unshifted. Read as SGLang's output-of-layer ids "
                     f"they would be inputs of {[i + 1 for i in ids]}")
    if origin == AUX_NESTED:
        notes.append(f"aux layer ids only in eagle_config {[i - 1 for i in ids]}: read in SGLang's convention "
                     f"(output of layer i) as vLLM ids {ids}; vLLM itself would read them unshifted - check the "
                     f"source's intent")
    if ids and list(ids) != sorted(ids) and len(set(ids)) == len(ids):
        notes.append(f"aux layer ids {list(ids)} are not in layer order; read as {sorted(ids)}, the order in which "
                     f"vLLM and SGLang concatenate the taps when serving this config")
        ids = sorted(ids)
    # a draft with a learned mask_hidden drafts in parallel (P-EAGLE): vLLM reads its mask token from either key;
    # a DFlash draft keeps its own in dflash_config
    dflash = method_of_config(top).name == "dflash"
    parallel = "mask_hidden" in tensors or top.get("speculators_model_type") == "peagle"
    mask_token = _pick(top, "mask_token_id", "pard_token", default=layer.get("mask_token_id"))
    if dflash:
        mask_token = (top.get("dflash_config") or {}).get("mask_token_id")
    if "norm_before_residual" not in top and not dflash:
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
        verifier=_verifier_of(cfg), architecture="llama" if dflash else architecture_from_config(cfg),
        method="dflash" if dflash else "peagle" if parallel else "eagle3",
        mask_token_id=mask_token if parallel or dflash else None,
        block_size=top.get("block_size") if dflash else None,
        verifier_num_layers=top.get("num_target_layers") if dflash else None,
        **{k: layer.get(k) for k in MLA_DIMS if layer.get(k) is not None},
    )


def _reconcile_with_tensors(config: DraftConfig, tensors: dict[str, torch.Tensor], notes: list[str]) -> DraftConfig:
    """The weights are the truth about structure: a config that omits a flag its tensors need is corrected (noted)."""
    changes: dict[str, Any] = {}
    if "input_norm.weight" in tensors and not config.norm_before_fc:
        changes["norm_before_fc"] = True
    if any(k.startswith("fc_norm.") for k in tensors) and not config.fc_norm:
        changes["fc_norm"] = True
    layer_ids = {int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))}
    if layer_ids and max(layer_ids) + 1 != config.num_layers:
        changes["num_layers"] = max(layer_ids) + 1
    if not changes:
        return config
    notes.append(f"config.json disagrees with the weights; following the weights: {changes}")
    return dataclasses.replace(config, **changes)


def _verifier_of(cfg: dict[str, Any]) -> dict[str, Any]:
    v = (cfg.get("speculators_config") or {}).get("verifier") or {}
    return {k: v[k] for k in ("name_or_path", "architectures") if k in v}


def rename_key(key: str) -> str | None:
    """Source tensor name -> our name; None for names we do not know."""
    k = key[len("model."):] if key.startswith("model.") else key
    if k.startswith("midlayer."):
        k = "layers.0." + k[len("midlayer."):]
    known_prefixes = ("layers.", "fc.", "norm.", "lm_head.", "input_norm.", "fc_norm.", "hidden_norm.")
    if k in ("d2t", "t2d", "embed_tokens.weight", "mask_hidden") or k.startswith(known_prefixes):
        return k
    return None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source_path(source: str | Path, notes: list[str] | None = None) -> Path:
    """A local draft directory/file, a training run directory (-> its final or latest checkpoint), or a hub id."""
    notes = notes if notes is not None else []
    path = Path(source).expanduser()
    if not path.exists():
        if _HUB_ID.match(str(source)):
            return _download(str(source))
        raise Eagle3InputError(f"draft checkpoint not found: {source}")
    if path.is_file() and path.name.endswith(".index.json"):
        return path.parent
    if path.is_dir() and not (path / "config.json").is_file() and is_run_dir(path):
        return resolve_checkpoint(path, notes)
    return path


def _rename_all(raw: dict[str, torch.Tensor], path: Path):
    """-> (tensors under our names, extra (embed_tokens), unknown source keys, renamed source->ours)."""
    renamed: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    origin_of: dict[str, str] = {}
    for k, v in raw.items():
        new = rename_key(k)
        if new is None:
            unknown.append(k)
            continue
        if new in origin_of:
            raise Eagle3InputError(f"{path}: tensors '{origin_of[new]}' and '{k}' both map to '{new}' - which one "
                                   f"is the draft's?")
        origin_of[new] = k
        if new == "mask_hidden":  # speculators and SpecForge store [1, 1, 3*Ht], vLLM reads any as [1, 3*Ht]
            v = v.reshape(1, -1)
        if new != k:
            renamed[k] = new
        (extra if new == "embed_tokens.weight" else tensors)[new] = v
    return tensors, extra, unknown, renamed


def load_tensor_data(loaded: LoadedDraft) -> LoadedDraft:
    """The same draft with its tensors' data and file hashes, for one read with `shapes_only` (check, then read)."""
    files = loaded.files or _weight_files(loaded.path)
    hashes = loaded.weight_files or {f.name: sha256_file(f) for f in files}
    if not any(t.is_meta for t in (*loaded.tensors.values(), *loaded.extra.values())):
        return dataclasses.replace(loaded, weight_files=hashes)
    tensors, extra, _, _ = _rename_all(read_tensors(files), loaded.path)
    for k in ("d2t", "t2d"):  # already real (t2d may have been rebuilt from d2t)
        if k in loaded.tensors:
            tensors[k] = loaded.tensors[k]
    return dataclasses.replace(loaded, tensors=tensors, extra=extra, weight_files=hashes)


def load_draft_source(source: str | Path, shapes_only: bool = False, aux_convention: str = "auto") -> LoadedDraft:
    """Read a draft directory or weight file in any supported layout (no model is built here).

    `shapes_only` reads tensor shapes and dtypes without their data (meta tensors), except the small d2t/t2d, and
    does not hash the files; `load_tensor_data` completes such a draft. `aux_convention`: how its eagle_config aux
    ids are meant (`AUX_CONVENTIONS`; "auto": by producer, an undecidable source refused).
    """
    notes: list[str] = []
    path = resolve_source_path(source, notes)
    directory = path if path.is_dir() else path.parent
    files = _weight_files(path)
    cfg_path = directory / "config.json"
    ours = (directory / "draft_config.json").is_file()
    if not ours and not cfg_path.is_file():
        raise Eagle3InputError(f"{directory}: no config.json beside the weights (needed to know the draft's shape)")
    source_config = read_json(directory / "draft_config.json" if ours else cfg_path, "draft config")
    fmt = detect_format(source_config, directory)
    raw = read_tensors(files, shapes_only)
    index = directory / "model.safetensors.index.json"
    if path.is_dir() and index.is_file():
        absent = sorted(set(read_weight_map(index)) - set(raw))
        if absent:
            raise Eagle3InputError(f"{index} lists tensors that no shard holds (incomplete download?): {absent[:5]}")
    tensors, extra, unknown, renamed = _rename_all(raw, path)
    nested = nested_convention(source_config, raw, aux_convention)  # how its eagle_config ids are meant
    config_file = directory / "draft_config.json" if ours else cfg_path
    if fmt == OURS:
        try:
            config = DraftConfig.from_dict(source_config)
        except Eagle3InputError as e:
            raise Eagle3InputError(f"{config_file}: {e}") from None
    else:
        try:
            config = config_from_external(source_config, fmt, tensors, notes, str(cfg_path), nested)
        except KeyError as e:
            raise Eagle3InputError(f"{cfg_path}: missing field {e} needed to build the draft") from None
        except AmbiguousAuxIds:
            raise  # already names the file
        except Eagle3InputError as e:
            raise Eagle3InputError(f"{cfg_path}: {e}") from None
        config = _reconcile_with_tensors(config, tensors, notes)
    derived: list[str] = []
    if "d2t" in tensors and "t2d" not in tensors:
        d2t = tensors["d2t"].long()
        targets = torch.arange(d2t.shape[0]) + d2t
        if d2t.ndim != 1 or (len(targets) and (targets.min() < 0 or targets.max() >= config.vocab_size)):
            raise Eagle3InputError(f"{path}: d2t maps draft rows outside the vocabulary [0, {config.vocab_size})")
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
        derived.append("t2d")
        notes.append("t2d rebuilt from d2t (t2d[i + d2t[i]] = True)")
    if "d2t" not in tensors and "t2d" not in tensors and config.draft_vocab_size == config.vocab_size:
        # the whole vocabulary, rows in token order (as vLLM reads such a draft): the identity map
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
        derived += ["d2t", "t2d"]
        notes.append("no d2t/t2d: the draft vocabulary is the whole vocabulary, in token order")
    metadata = read_metadata(directory)
    hashes = {} if shapes_only else {f.name: sha256_file(f) for f in files}
    return LoadedDraft(path, fmt, config, tensors, hashes, source_config, renamed, extra, unknown, notes, metadata,
                       aux_ids_origin(source_config, fmt, nested), files, derived)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise Eagle3InputError(f"draft checkpoint '{repo_id}' is not a local path, and downloading it from the hub "
                               f"failed: {e}") from None


def fill_default_aux_ids(config: DraftConfig, verifier_num_layers: int) -> DraftConfig:
    if tuple(config.aux_layer_ids) == (0, 0, 0):
        config.aux_layer_ids = default_aux_layer_ids(verifier_num_layers)
    config.verifier_num_layers = config.verifier_num_layers or verifier_num_layers
    return config


def draft_architecture(source: str | Path, verifier_num_layers: int, aux_convention: str = "auto"
                       ) -> tuple[DraftConfig, str]:
    """A published or earlier draft's architecture (its aux layers as vLLM's input-of-layer ids, read in its
    producer's convention by `read_aux_ids`) and where its aux ids came from; headers only, no weights."""
    loaded = load_draft_source(source, shapes_only=True, aux_convention=aux_convention)
    fill_default_aux_ids(loaded.config, verifier_num_layers)
    return loaded.config, loaded.aux_ids_origin


def draft_layer_ids(source: str | Path, verifier_num_layers: int, aux_convention: str = "auto"
                    ) -> tuple[tuple[int, ...], str]:
    """The verifier layers a draft was trained on, and where they came from (see `draft_architecture`)."""
    config, origin = draft_architecture(source, verifier_num_layers, aux_convention)
    return tuple(config.aux_layer_ids), origin


def _attention_summary(c: DraftConfig) -> dict[str, Any]:
    """The attention fields that describe this layer kind: MLA's ranks and head dims, or Llama's heads x head_dim
    (an MLA draft's `head_dim` is not a width any of its projections has)."""
    return {f: getattr(c, f) for f in layer_kind(c.architecture).summary_fields}


def source_summary(loaded: LoadedDraft) -> dict[str, Any]:
    """What a draft is, in a few JSON fields (training metadata and `eagle3-train inspect`)."""
    c, sc = loaded.config, loaded.source_config
    every = {**loaded.tensors, **loaded.extra}
    float_like = [t for k, t in every.items() if k not in _SMALL]
    ids = None if tuple(c.aux_layer_ids) == (0, 0, 0) else list(c.aux_layer_ids)
    return {
        "format": loaded.format,
        "architectures": sc.get("architectures"),
        "speculators_version": sc.get("speculators_version"),
        "architecture": c.architecture,
        "hidden_size": c.hidden_size, "target_hidden_size": c.target_hidden_size, "num_layers": c.num_layers,
        "intermediate_size": c.intermediate_size, **_attention_summary(c),
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "aux_layer_ids": ids, "aux_ids_origin": loaded.aux_ids_origin, "verifier_num_layers": c.verifier_num_layers,
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm,
        "norm_output": c.norm_output, "method": c.method, "mask_token_id": c.mask_token_id,
        "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "dtypes": dict(Counter(str(t.dtype).replace("torch.", "") for t in float_like)),
        "parameters": sum(t.numel() for t in float_like),
        # what the files hold (d2t/t2d made here from the other, or for a whole-vocabulary draft, are not)
        "stores_d2t": "d2t" in loaded.tensors and "d2t" not in loaded.derived,
        "stores_t2d": "t2d" in loaded.tensors and "t2d" not in loaded.derived,
        "has_embed_tokens": "embed_tokens.weight" in loaded.extra,
        "verifier": c.verifier,
    }
