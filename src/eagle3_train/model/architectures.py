"""Each draft layer kind's torch side, one entry per `model/layer_kinds.py` entry: its attention module, its RoPE, the
names and shapes of its attention tensors, the layer fields an exported config.json carries and the activations its
attention keeps (the memory planner's model). The model, the exporter, the format readers and the planner read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3_train.model.attention import DraftAttention, TTTAttention, llama_config
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.layer_kinds import LAYER_KINDS, LayerKind
from eagle3_train.model.mla import MLAAttention, mla_rotary

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class DraftArchitecture:
    kind: LayerKind  # what it is without torch: names, engines, checks
    attention: Callable[[DraftConfig, int], TTTAttention]  # (config, input width) -> the layer's attention
    rotary: Callable[[DraftConfig], nn.Module]
    attention_shapes: Callable[[DraftConfig, int], Shapes]  # names under `self_attn.`, for an input width
    config_fields: Callable[[DraftConfig], dict[str, Any]]  # the layer's own fields of an exported config.json
    # per token and layer, the elements attention keeps for backward (the memory planner's model): q, k, v and the
    # SDPA output as SDPA sees them, o_proj's input, and the layer kind's own intermediates ("extra")
    attention_widths: Callable[[DraftConfig], dict[str, int]]


def _llama_rotary(cfg: DraftConfig) -> nn.Module:
    return LlamaRotaryEmbedding(llama_config(cfg))


def _llama_shapes(cfg: DraftConfig, width: int) -> Shapes:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj.weight": (q, width), "k_proj.weight": (kv, width), "v_proj.weight": (kv, width),
            "o_proj.weight": (cfg.hidden_size, q)}


def _llama_fields(cfg: DraftConfig) -> dict[str, Any]:
    return {"num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "mlp_bias": False}


def _mla_shapes(cfg: DraftConfig, width: int) -> Shapes:
    heads, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes: Shapes = {}
    if cfg.q_lora_rank:
        shapes.update({"q_a_proj.weight": (cfg.q_lora_rank, width), "q_a_layernorm.weight": (cfg.q_lora_rank,),
                       "q_b_proj.weight": (heads * qk, cfg.q_lora_rank)})
    else:
        shapes["q_proj.weight"] = (heads * qk, width)
    shapes.update({"kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, width),
                   "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                   "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                   "o_proj.weight": (cfg.hidden_size, heads * cfg.v_head_dim)})
    return shapes


def _mla_fields(cfg: DraftConfig) -> dict[str, Any]:
    # head_dim: the rotary width, as transformers' DeepseekV3Config reads it (hidden / heads would build a rotary
    # wider than the rope part for any HF-based reader; vLLM passes qk_rope_head_dim itself); num_key_value_heads:
    # unused by MLA, written so the config reads back as it was trained
    return {"num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.qk_rope_head_dim,
            "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
            "rope_interleave": True}


def _llama_widths(cfg: DraftConfig) -> dict[str, int]:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q": q, "k": kv, "v": kv, "out": q, "o_in": q, "extra": 0}


def _mla_widths(cfg: DraftConfig) -> dict[str, int]:
    """Training expands the latent into every head and pads the values to the query width (model/mla.py); the
    extras: the query LoRA's output and norm, the latent and its norm, and q_b's output (RoPE reads its slices)
    (checked in tests/unit/test_plan.py against what autograd keeps)."""
    heads = cfg.num_attention_heads
    qk = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q_lora = 3 * cfg.q_lora_rank if cfg.q_lora_rank else 0
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim + 2 * cfg.kv_lora_rank
    extra = q_lora + latent + qk
    return {"q": qk, "k": qk, "v": qk, "out": qk, "o_in": heads * cfg.v_head_dim, "extra": extra}


ARCHITECTURES: dict[str, DraftArchitecture] = {
    "llama": DraftArchitecture(LAYER_KINDS["llama"], DraftAttention, _llama_rotary, _llama_shapes, _llama_fields,
                               attention_widths=_llama_widths),
    "mla": DraftArchitecture(LAYER_KINDS["mla"], MLAAttention, mla_rotary, _mla_shapes, _mla_fields,
                             attention_widths=_mla_widths),
}


def architecture_of(cfg: DraftConfig) -> DraftArchitecture:
    return ARCHITECTURES[cfg.architecture]
