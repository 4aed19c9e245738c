"""The EAGLE-3 draft network: fc over three verifier hidden states, one (or more) Llama decoder layer(s) whose first
attention reads cat(norm(embedding), norm(hidden)), a final norm and an lm_head over the draft vocabulary.

Parameter names follow the speculators layout (`layers.0.*`); the exporter renames to `midlayer.*` for the EAGLE/SGLang
format. Two forward paths share the weights:
- `ttt_step` for training-time test: step j attends to the step-0 causal prefix plus its own position in steps 1..j.
- `forward_cached` for decoding with a KV cache (offline evaluation), exactly what vLLM runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaConfig,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eagle3_train.model.config import DraftConfig, default_ttt_query_block


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


@dataclass
class LayerTTTCache:
    """Keys/values of one layer during training-time test: the step-0 sequence and one per later step."""
    k0: torch.Tensor | None = None  # [B, kvh, L, d]
    v0: torch.Tensor | None = None
    k_diag: list[torch.Tensor] = field(default_factory=list)  # each [B, kvh, L, d]
    v_diag: list[torch.Tensor] = field(default_factory=list)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, k_diag: list[torch.Tensor],
                  v_diag: list[torch.Tensor], query_block: int | None = None) -> torch.Tensor:
    """Attention of TTT step j = len(k_diag) >= 1: queries q [B, h, L, d] see the step-0 keys k0 [B, kvh, L, d]
    causally plus, per later step, the key at their own position (k_diag[i] [B, kvh, L, d]).

    Fused SDPA calls over concatenated keys with a block mask [causal | I | ... | I]: the CPU flash kernel keeps no
    L x L probability matrix for backward, unlike an explicit softmax. A mask stops the kernel from skipping the causal
    upper triangle, and one call over all L queries scores L x L(j+1) keys, most of them masked; so the queries go in
    blocks (`query_block`, default L/4 and at least 128), each against the prefix up to its end and its own rows'
    diagonal keys: ~L^2 (5/8 + j/4) scores with 4 blocks instead of L^2 (j+1), 3x less at TTT 7. Each block keeps its
    own copy of the prefix keys for backward (~1.5 L keys more per step than one call): more blocks would save little
    more time for more memory (benchmarks/README.md, `ttt_attention_memory.py`)."""
    L = q.shape[2]
    block = query_block or default_ttt_query_block(L)
    outs = []
    for s in range(0, L, block):
        e = min(s + block, L)
        keys = torch.cat([k0[:, :, :e], *(kd[:, :, s:e] for kd in k_diag)], dim=2)
        values = torch.cat([v0[:, :, :e], *(vd[:, :, s:e] for vd in v_diag)], dim=2)
        causal = torch.ones(e - s, e, dtype=torch.bool, device=q.device).tril(diagonal=s)
        eye = torch.eye(e - s, dtype=torch.bool, device=q.device)
        mask = torch.cat([causal] + [eye] * len(k_diag), dim=1)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], keys, values, attn_mask=mask, enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class DraftAttention(nn.Module):
    ttt_query_block: int | None = None  # queries per SDPA call at TTT steps j > 0 (`ttt_attention`)

    def __init__(self, cfg: DraftConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

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

    def ttt(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerTTTCache) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        if cache.k0 is None:  # step 0: plain causal attention (right padding never leaks into valid queries)
            cache.k0, cache.v0 = k, v
            return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        cache.k_diag.append(k)
        cache.v_diag.append(v)
        return self._out(ttt_attention(q, cache.k0, cache.v0, cache.k_diag, cache.v_diag, self.ttt_query_block))

    def cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """New tokens attend to the cache and causally among themselves (batch size 1 decoding)."""
        q, k, v = self._qkv(x, cos, sin)
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        Lq, Lk = q.shape[2], k.shape[2]
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(diagonal=Lk - Lq)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self._out(o), (k, v)


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        if first:
            self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(cfg))

    def _attn_input(self, h: torch.Tensor, embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.first:
            return self.input_layernorm(h), h
        hn = self.hidden_norm(h)
        residual = hn if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(embeds), hn], dim=-1), residual  # embedding FIRST

    def _mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h))

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor, recompute_mlp: bool = False) -> torch.Tensor:
        h = residual + attn_out
        if recompute_mlp and torch.is_grad_enabled():
            # The MLP keeps four [L, intermediate] activations per TTT step for backward, the bulk of the step's
            # memory; keeping only its [L, H] input and recomputing costs two of its three matmuls again.
            return h + torch.utils.checkpoint.checkpoint(self._mlp_block, h, use_reentrant=False)
        return h + self._mlp_block(h)

    def ttt(self, h, embeds, cos, sin, cache: LayerTTTCache, recompute_mlp: bool = False) -> torch.Tensor:
        x, residual = self._attn_input(h, embeds)
        return self._finish(self.self_attn.ttt(x, cos, sin, cache), residual, recompute_mlp)

    def cached(self, h, embeds, cos, sin, kv):
        x, residual = self._attn_input(h, embeds)
        a, kv = self.self_attn.cached(x, cos, sin, kv)
        return self._finish(a, residual), kv


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H, Ht = cfg.hidden_size, cfg.aux_hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's embedding, frozen
        if cfg.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * Ht, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(Ht, eps=cfg.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg, first=(i == 0)) for i in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(llama_config(cfg))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("norm."):
                p.fill_(1.0)
            elif p.requires_grad:
                p.normal_(0.0, std)

    # --- the vocabulary mapping ---------------------------------------------------------------------------------
    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_token_ids(self) -> torch.Tensor:
        """Target (verifier) token id of each draft-vocab row: i + d2t[i]."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # --- shared pieces ------------------------------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[.., 3*Ht] aux states (low, mid, high) -> [.., H] fused feature."""
        if self.config.fc_norm:
            parts = aux.chunk(3, dim=-1)
            aux = torch.cat([n(p) for n, p in zip(self.fc_norm, parts)], dim=-1)
        elif self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (draft-vocab logits, hidden state passed to the next step)."""
        hn = self.norm(h)
        return self.lm_head(hn), (hn if self.config.norm_output else h)

    def next_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) if self.config.norm_output else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def ttt_step(self, h: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 caches: list[LayerTTTCache], recompute_mlp: bool = False) -> torch.Tensor:
        """One training-time-test step for a [B, L] batch; returns the layer output (pre-norm).

        `h` is fuse(aux) at step 0 and `next_hidden` of the previous step later. The caller applies `logits` only to the
        rows it supervises, which saves most of the lm_head cost on user/system tokens.
        """
        embeds = self.embed_tokens(input_ids).to(h.dtype)
        cos, sin = self.rotary(h, position_ids)
        for layer, cache in zip(self.layers, caches):
            h = layer.ttt(h, embeds, cos, sin, cache, recompute_mlp)
        return h

    def new_ttt_caches(self) -> list[LayerTTTCache]:
        return [LayerTTTCache() for _ in self.layers]

    def forward_cached(self, h: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       kv: list | None) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Decode with a KV cache: h is fuse(aux) for verified positions or the previous draft hidden state."""
        embeds = self.embed_tokens(input_ids).to(h.dtype)
        cos, sin = self.rotary(h, position_ids)
        kv = kv or [None] * len(self.layers)
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv):
            h, layer_kv = layer.cached(h, embeds, cos, sin, layer_kv)
            new_kv.append(layer_kv)
        logits, h_next = self.head(h)
        return logits, h_next, new_kv

    # --- weights I/O --------------------------------------------------------------------------------------------
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen verifier embedding (and non-persistent RoPE buffers)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
