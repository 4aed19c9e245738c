"""config.json and tensor names of the two formats the engines read (see docs/ARCHITECTURE.md).

- "eagle": original EAGLE / SpecForge / SGLang (`LlamaForCausalLMEagle3`, `midlayer.*`); vLLM loads it too. An MLA
  draft is `Eagle3DeepseekV2ForCausalLM` with `model_type: kimi_k2` (`model/architectures.py`).
- "speculators": vLLM's speculators format (`Eagle3Speculator`, `layers.N.*`); `vllm serve DIR` works alone.
"""

from __future__ import annotations

from typing import Any

from eagle3_train.model.architectures import architecture_of
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.layer_kinds import layer_kind
from eagle3_train.utils.io import Eagle3InputError

SPECULATORS_VERSION = "0.9.0"  # the speculators format version whose config layout we write


def _layer_fields(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    """The decoder layer's config.json fields: the common ones and its kind's own (`model/architectures.py`)."""
    rope_parameters = cfg.rope_parameters()
    # Legacy readers take rope_scaling's "type", newer ones "rope_type": write both, naming the same type.
    rope_scaling = {**cfg.rope_scaling, "rope_type": rope_parameters["rope_type"]} if cfg.rope_scaling else None
    arch = architecture_of(cfg)
    return {
        "model_type": arch.kind.model_type,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        **arch.config_fields(cfg),
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        # Both spellings: transformers 4 (SGLang) reads rope_theta/rope_scaling, transformers 5 rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "tie_word_embeddings": False,  # SGLang would tie lm_head to the embedding otherwise
        "torch_dtype": dtype,
    }


def _aux_ids(cfg: DraftConfig) -> list[int] | None:
    """None when the taps are the engines' default (then no key is written and both engines agree)."""
    return None if cfg.uses_default_aux_layers() else list(cfg.aux_layer_ids)


def dflash_config_json(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    """z-lab's DFlash layout, as vLLM 0.32 loads it (`DFlashDraftModel`, a Qwen3 layer config): dflash_config's
    target_layer_ids are outputs of layer i (vLLM adds 1), so ours (inputs of layer i) less one; no eagle_config and no
    top-level aux ids, which vLLM would prefer over them."""
    c: dict[str, Any] = {"architectures": ["DFlashDraftModel"], **_layer_fields(cfg, dtype), "model_type": "qwen3"}
    c.update({"layer_types": ["full_attention"] * cfg.num_layers, "block_size": cfg.block_size,
              "dflash_config": {"mask_token_id": cfg.mask_token_id,
                                "target_layer_ids": [i - 1 for i in cfg.aux_layer_ids], "causal": False},
              "num_target_layers": cfg.verifier_num_layers, "draft_vocab_size": cfg.draft_vocab_size})
    c.pop("mlp_bias", None)
    return c


def eagle_config_json(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    """The `--format eagle` config.json: the EAGLE-3 layout, or a method's own (DFlash's)."""
    if draft_method(cfg.method).layout == "dflash":
        return dflash_config_json(cfg, dtype)
    c: dict[str, Any] = {"architectures": [layer_kind(cfg.architecture).eagle_class], **_layer_fields(cfg, dtype)}
    c["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.target_hidden_size and cfg.target_hidden_size != cfg.hidden_size:
        c["target_hidden_size"] = cfg.target_hidden_size
    c["norm_before_residual"] = cfg.norm_before_residual  # explicit: engines disagree on its default
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if getattr(cfg, flag):
            c[flag] = True
    c.update(draft_method(cfg.method).config_fields(cfg))  # P-EAGLE: its mask token
    eagle_cfg: dict[str, Any] = {"use_aux_hidden_state": True}
    ids = _aux_ids(cfg)
    if ids is not None:
        c["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM: input of layer i
        eagle_cfg["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]  # SGLang: output of layer i
    c["eagle_config"] = eagle_cfg
    return c


def speculators_config_json(cfg: DraftConfig, dtype: str, speculative_tokens: int,
                            verifier_name_or_path: str) -> dict[str, Any]:
    refusal = draft_method(cfg.method).speculators_refusal
    if refusal:
        raise Eagle3InputError(f"a {cfg.method} draft is not exported in the speculators format: {refusal}")
    if not layer_kind(cfg.architecture).speculators_format:
        raise Eagle3InputError(f"the speculators format describes Llama-layer drafts only; this draft's layer is "
                               f"{cfg.architecture!r}: export it with --format eagle (vLLM loads it)")
    layer = _layer_fields(cfg, dtype)
    layer["architectures"] = ["LlamaForCausalLM"]
    method = draft_method(cfg.method)
    return {
        "architectures": [method.speculators_class],
        "speculators_model_type": method.speculators_type,
        "speculators_version": SPECULATORS_VERSION,
        **method.config_fields(cfg),
        "speculators_config": {
            "algorithm": method.speculators_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": cfg.verifier.get("architectures") or ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
        "eagle_aux_hidden_state_layer_ids": _aux_ids(cfg),
        "torch_dtype": dtype,
    }


def export_key(our_key: str, fmt: str, layout: str = "eagle3") -> str:
    """A tensor's name in an export: the EAGLE format's first layer is `midlayer.` (a method's own layout, DFlash's,
    keeps `layers.N.`)."""
    if fmt == "eagle" and layout == "eagle3" and our_key.startswith("layers.0."):
        return "midlayer." + our_key[len("layers.0."):]
    return our_key


def stored_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """What an export's weight file holds: every expected tensor, less d2t/t2d for a whole-vocabulary draft (vLLM
    keeps no map for one and fails to load it: `export/exporter.full_vocabulary_layout`)."""
    shapes = expected_shapes(cfg)
    if cfg.draft_vocab_size == cfg.vocab_size:
        del shapes["d2t"], shapes["t2d"]
    return shapes


def dflash_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """A DFlash draft's tensors (`model/dflash.py`; the names vLLM loads)."""
    H, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, 3 * cfg.aux_hidden_size), "hidden_norm.weight": (H,),
                                          "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
                                          "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                       p + "mlp.down_proj.weight": (H, inter)})
    return shapes


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (our names) an exported draft must carry, with its shape."""
    if draft_method(cfg.method).layout == "dflash":
        return dflash_shapes(cfg)
    H, Ht, inter = cfg.hidden_size, cfg.aux_hidden_size, cfg.intermediate_size
    attention = architecture_of(cfg).attention_shapes
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, 3 * Ht), "norm.weight": (H,),
                                          "lm_head.weight": (cfg.draft_vocab_size, H),
                                          "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    if cfg.own_embedding:  # a draft of another width ships its own
        shapes["embed_tokens.weight"] = (cfg.vocab_size, H)
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (3 * Ht,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (Ht,) for i in range(3)})
    shapes.update(draft_method(cfg.method).shapes(cfg))  # P-EAGLE's mask_hidden
    for n in range(cfg.num_layers):
        width = 2 * H if n == 0 else H
        p = f"layers.{n}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                       p + "mlp.down_proj.weight": (H, inter)})
        shapes.update({p + "self_attn." + k: v for k, v in attention(cfg, width).items()})
        if n == 0:
            shapes[p + "hidden_norm.weight"] = (H,)
    return shapes
