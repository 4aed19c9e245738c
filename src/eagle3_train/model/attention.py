"""Attention over training-time test's block mask (`model/ttt_attention.py`) and with a KV cache (`TTTAttention`),
shared by the draft's layer kinds, each supplying its projections and RoPE: Llama's `DraftAttention` here, DeepSeek's
MLA in `model/mla.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaConfig, apply_rotary_pos_emb

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.ttt_attention import ttt_attention


@dataclass
class LayerTTTCache:
    """Keys/values of one layer during training-time test: the step-0 sequence and one per later step."""
    k0: torch.Tensor | None = None  # [B, kvh, L, d]
    v0: torch.Tensor | None = None
    k_diag: list[torch.Tensor] = field(default_factory=list)  # each [B, kvh, L, d]
    v_diag: list[torch.Tensor] = field(default_factory=list)


class TTTAttention(nn.Module):
    """Attention over the TTT block mask and with a KV cache; a layer kind supplies `_qkv` (queries, keys, values
    with RoPE applied), `_out` and its softmax `scale` (None: 1/sqrt(query dim))."""
    ttt_merged: bool = True  # later TTT steps: merged causal kernel + diagonal where one exists, else masked blocks
    ttt_query_block: int | None = None  # queries per masked SDPA call (`masked_ttt_attention`)
    scale: float | None = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        raise NotImplementedError

    def ttt_shape(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head width) of what `_qkv` returns: the shapes the TTT kernels see."""
        raise NotImplementedError

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def ttt(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerTTTCache) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        if torch.is_autocast_enabled(q.device.type):  # RoPE's fp32 tables promote q and k; SDPA would cast each step
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if cache.k0 is None:  # step 0: plain causal attention (right padding never leaks into valid queries)
            cache.k0, cache.v0 = k, v
            return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                            scale=self.scale))
        cache.k_diag.append(k)
        cache.v_diag.append(v)
        return self._out(ttt_attention(q, cache.k0, cache.v0, cache.k_diag, cache.v_diag, self.ttt_query_block,
                                       self.scale, self.ttt_merged))

    def cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """New tokens attend to the cache and causally among themselves (batch size 1 decoding)."""
        q, k, v = self._qkv(x, cos, sin)
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        Lq, Lk = q.shape[2], k.shape[2]
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(diagonal=Lk - Lq)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale)
        return self._out(o), (k, v)


class DraftAttention(TTTAttention):
    """Llama's grouped-query attention (q/k/v/o projections, RoPE over the whole head)."""

    def __init__(self, cfg: DraftConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def ttt_shape(self) -> tuple[int, int, int]:
        return self.heads, self.kv_heads, self.head_dim

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, L, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))


def llama_config(cfg: DraftConfig) -> LlamaConfig:
    """A transformers LlamaConfig for the components we reuse (MLP, RMSNorm, RoPE)."""
    rope = cfg.rope_parameters()
    return LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope, vocab_size=cfg.vocab_size,
        mlp_bias=False, attention_bias=False,
    )
