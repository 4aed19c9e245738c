"""DeepSeek-V3's multi-head latent attention as an EAGLE-3 draft layer: what vLLM's `deepseek_eagle3.py`
(`DeepseekV2Eagle3DecoderLayer`) runs, and what the MLA drafts vLLM recommends for Kimi-K2.5 are
(`lightseekorg/kimi-k2.5-eagle3-mla`).

Queries: `q_a_proj -> q_a_layernorm -> q_b_proj` (or one `q_proj` without `q_lora_rank`), per head a no-RoPE part and
a RoPE part. Keys and values: `kv_a_proj_with_mqa` gives the latent (`kv_lora_rank`, normed by `kv_a_layernorm`, then
`kv_b_proj` expands it to each head's no-RoPE key and value) and one RoPE key part shared by all heads. RoPE is
DeepSeek's (interleaved pairs, YaRN scaling), and the softmax scale carries YaRN's mscale squared. Training computes
the expanded form (vLLM absorbs `kv_b_proj` into the query/output at decode; the same function). The draft's first
layer reads 2H (embedding and hidden), like the Llama layer.

The parameter names are those of transformers' `DeepseekV3Attention`, whose components (RMSNorm, rotary embedding,
interleaved RoPE, mscale) are reused so the math is theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
    yarn_apply_mscale,
)

from eagle3_train.model.attention import TTTAttention
from eagle3_train.model.config import DraftConfig


def deepseek_config(cfg: DraftConfig) -> DeepseekV3Config:
    """A transformers DeepseekV3Config for the components reused here (RoPE with YaRN, norms)."""
    return DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=cfg.rope_parameters(), vocab_size=cfg.vocab_size, rope_interleave=True)


def mla_rotary(cfg: DraftConfig) -> nn.Module:
    return DeepseekV3RotaryEmbedding(deepseek_config(cfg))


class MLAAttention(TTTAttention):
    def __init__(self, cfg: DraftConfig, in_features: int):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        qk = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(in_features, self.q_lora_rank, bias=False)
            self.q_a_layernorm = DeepseekV3RMSNorm(self.q_lora_rank, eps=cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_features, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, cfg.hidden_size, bias=False)
        self.scale = yarn_apply_mscale(cfg.rope_parameters(), qk ** -0.5)

    def ttt_shape(self) -> tuple[int, int, int]:
        return self.heads, self.heads, self.nope + self.rope  # keys expanded per head, values padded to the width

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, L, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_rot = q.view(B, L, self.heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, L, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(B, 1, L, self.rope), cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.heads, -1, -1)], dim=-1)
        # values padded with zeros to the query/key width: SDPA's flash kernels need equal head dims, and without
        # them it falls back to the math path, which keeps the L x L probabilities of every head for backward
        return q, k, F.pad(v, (0, self.nope + self.rope - self.v_dim))

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, L, _ = o.shape
        return self.o_proj(o[..., : self.v_dim].transpose(1, 2).reshape(B, L, self.heads * self.v_dim))
