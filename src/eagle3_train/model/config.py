"""The draft's configuration, derived from the verifier's config; serialised as JSON beside every checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.assets.families import text_config
from eagle3_train.model.aux_layers import check_layer_order, default_layer_ids
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.layer_kinds import layer_kind
from eagle3_train.utils.io import Eagle3InputError


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The taps vLLM and SGLang assume when a draft's config names none: the residual stream entering layers 2, L//2
    and L-3 (= HF hidden_states[i]), whatever L (they collide below 7 layers). What extract and train tap by default
    is `default_layer_ids`, the same from 7 layers on; exports write the ids whenever the two differ."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the verifier's vocabulary V
    draft_vocab_size: int  # Vd
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    target_hidden_size: int | None = None  # verifier H when it differs from the draft's
    num_layers: int = 1
    aux_layer_ids: tuple[int, ...] = (2, 15, 27)  # vLLM convention: input of verifier layer i
    verifier_num_layers: int | None = None
    # Layer wiring options (see docs/ARCHITECTURE.md and the engines' llama_eagle3):
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states (input_norm)
    fc_norm: bool = False  # one RMSNorm per aux state (fc_norm.{i})
    norm_output: bool = False  # next step receives the post-norm hidden state
    verifier: dict[str, Any] = field(default_factory=dict)  # name_or_path, architectures, model_type
    # The decoder layer: "llama" (grouped-query attention) or "mla" (DeepSeek-V3's multi-head latent attention, as
    # vLLM's deepseek_eagle3.py runs it; the five dims below, q_lora_rank None = a plain q_proj).
    architecture: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # How the draft proposes (model/draft_methods.py): eagle3 (sequential), peagle (parallel drafting from the
    # verifier-vocabulary token `mask_token_id`) or dflash (a non-causal block of them).
    method: str = "eagle3"
    mask_token_id: int | None = None
    block_size: int | None = None  # dflash: the verified token and block_size-1 mask slots per forward

    @property
    def aux_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def own_embedding(self) -> bool:
        """A draft narrower (or wider) than its verifier embeds tokens with its own trained table, which it ships:
        the verifier's embedding has the verifier's width."""
        return self.aux_hidden_size != self.hidden_size

    def __post_init__(self) -> None:
        _check_field_types(self)
        self.aux_layer_ids = tuple(self.aux_layer_ids)
        if len(self.aux_layer_ids) != 3:
            raise Eagle3InputError(f"aux_layer_ids must name 3 verifier layers, got {list(self.aux_layer_ids)}")
        if self.aux_layer_ids != (0, 0, 0):  # (0, 0, 0): "the verifier's default", filled in once it is known
            check_layer_order(self.aux_layer_ids, "draft config")
        if self.norm_before_fc and self.fc_norm:
            raise Eagle3InputError("norm_before_fc and fc_norm are mutually exclusive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise Eagle3InputError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_key_value_heads}")
        layer_kind(self.architecture).check(self)
        draft_method(self.method).check(self)
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise Eagle3InputError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size}")

    @classmethod
    def from_verifier(cls, verifier_config: dict[str, Any], draft_vocab_size: int,
                      aux_layer_ids: tuple[int, ...] | None = None, verifier_name: str = "the verifier",
                      **overrides: Any) -> DraftConfig:
        """Build the draft config from a verifier's HF config.json dict; without `aux_layer_ids`, on the layers
        extract taps by default (`verifier_name` names the verifier if it has too few layers for them)."""
        c = text_config(verifier_config)  # multimodal wrappers keep the LM in text_config
        H, heads = c["hidden_size"], c["num_attention_heads"]
        L = c["num_hidden_layers"]
        width = _width(c, overrides.pop("hidden_size", None), overrides.get("architecture"))
        rope = c.get("rope_parameters") or {}
        rope_theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = c.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        kw: dict[str, Any] = dict(
            hidden_size=H,
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or H // heads,
            intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            draft_vocab_size=min(draft_vocab_size, c["vocab_size"]),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            hidden_act=c.get("hidden_act", "silu"),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_layer_ids(L, verifier_name),
            verifier_num_layers=L,
            verifier={"architectures": verifier_config.get("architectures"),
                      "model_type": verifier_config.get("model_type")},
        )
        # a kind's own dims (MLA's latent ranks) default to the verifier's
        kind = layer_kind(overrides.get("architecture") or "llama")
        kw.update({k: c.get(k) for k in kind.dims if c.get(k) is not None})
        kw.update(width)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise Eagle3InputError(f"unknown draft config keys: {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        from eagle3_train.utils.io import write_json

        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> DraftConfig:
        from eagle3_train.utils.io import read_json

        try:
            return cls.from_dict(read_json(path, "draft config"))
        except Eagle3InputError as e:
            raise Eagle3InputError(f"{path}: {e}") from None

    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5's `rope_parameters`; a legacy `rope_scaling: {"type": ...}` names the rope type."""
        rope = dict(self.rope_scaling or {})
        kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        return {"rope_type": kind, **rope, "rope_theta": self.rope_theta}

    def uses_default_aux_layers(self) -> bool:
        return self.verifier_num_layers is not None and \
            tuple(self.aux_layer_ids) == default_aux_layer_ids(self.verifier_num_layers)


_COUNTS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
           "vocab_size", "draft_vocab_size", "max_position_embeddings", "num_layers")
_OPTIONAL_COUNTS = ("target_hidden_size", "verifier_num_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                    "v_head_dim")
_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_field_types(cfg: DraftConfig) -> None:
    """Every field of the type it must have (a published config is a file we did not write: `"heads": "2"` or 0
    heads must be one clear error, not a division by zero deep inside a layer)."""
    def bad(name: str, want: str) -> Eagle3InputError:
        v = getattr(cfg, name)
        return Eagle3InputError(f"{name} must be {want}, got {v!r} ({type(v).__name__})")

    for name in _COUNTS:
        if not _is_int(getattr(cfg, name)) or getattr(cfg, name) < 1:
            raise bad(name, "a whole number >= 1")
    for name in _OPTIONAL_COUNTS:
        v = getattr(cfg, name)
        if v is not None and (not _is_int(v) or v < 1):
            raise bad(name, "a whole number >= 1 (or null)")
    if cfg.qk_nope_head_dim is not None and (not _is_int(cfg.qk_nope_head_dim) or cfg.qk_nope_head_dim < 0):
        raise bad("qk_nope_head_dim", "a whole number >= 0 (or null)")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(cfg, name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise bad(name, "a finite number > 0")
    for name in _FLAGS:
        if not isinstance(getattr(cfg, name), bool):
            raise bad(name, "true or false")
    for name in ("hidden_act", "architecture", "method"):
        if not isinstance(getattr(cfg, name), str):
            raise bad(name, "a string")
    if not isinstance(cfg.aux_layer_ids, list | tuple) or not all(_is_int(i) for i in cfg.aux_layer_ids):
        raise bad("aux_layer_ids", "a list of 3 layer numbers")
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, dict):
        raise bad("rope_scaling", "an object (or null)")
    if not isinstance(cfg.verifier, dict):
        raise bad("verifier", "an object")


def _width(c: dict[str, Any], hidden_size: int | None, architecture: str | None) -> dict[str, Any]:
    """The fields a draft of another width than its verifier (`hidden_size`) changes: the verifier's width becomes
    `target_hidden_size` (what fc reads), a Llama layer keeps the verifier's head_dim with hidden_size / head_dim
    heads (key-value heads: the most that divide them, at most the verifier's), and the MLP scales with the width;
    an MLA layer keeps the verifier's heads and latent dims. Empty at the verifier's own width."""
    H = c["hidden_size"]
    if not hidden_size or hidden_size == H:
        return {}
    out: dict[str, Any] = {"hidden_size": hidden_size, "target_hidden_size": H,
                           "intermediate_size": max(1, round(c["intermediate_size"] * hidden_size / H))}
    if not layer_kind(architecture or "llama").keeps_verifier_heads:
        head_dim = c.get("head_dim") or H // c["num_attention_heads"]
        if hidden_size % head_dim:
            raise Eagle3InputError(f"draft hidden_size {hidden_size} must be a multiple of the verifier's head_dim "
                                   f"{head_dim} (its attention heads keep that size)")
        heads = hidden_size // head_dim
        kv = min(c.get("num_key_value_heads", c["num_attention_heads"]), heads)
        while heads % kv:
            kv -= 1
        out.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
    return out


def dump_config(cfg: DraftConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2)


def default_ttt_query_block(seq_len: int) -> int:
    """Queries per SDPA call at TTT steps j > 0 (`model.ttt_attention.masked_ttt_attention`): four
    blocks, at least 128 queries each."""
    return max(128, -(-seq_len // 4))
