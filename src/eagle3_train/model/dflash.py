"""The DFlash draft (block diffusion drafting, z-lab/dflash), as vLLM 0.32's `qwen3_dflash.py` runs it.

One forward drafts a block: the verified token x_t at position t (the anchor) and block_size-1 mask tokens at
t+1.., attending to each other both ways (non-causal) and to the context. The context is never run through the
layers: every verified position p gives one feature c_p = hidden_norm(fc(aux_p)), and each layer turns it into its
keys and values directly (k_norm(k_proj(c_p)) with RoPE at p, v_proj(c_p)); a block at anchor t sees the context of
positions < t. Layers are Qwen3's (q/k RMSNorm per head, SiLU MLP) whatever the verifier; the token embedding is the
verifier's, frozen; slot k of a block predicts the token at its own position t+k.

Parameter names are the names vLLM loads (`layers.{i}.*`, `fc`, `hidden_norm`, `norm`, `lm_head`, `d2t`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from eagle3_train.model.architectures import architecture_of
from eagle3_train.model.attention import llama_config
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import DraftVocabulary
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.utils.io import Eagle3InputError


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kvh, Lc, d] of context features c [B, Lc, H] (no layer norm: c is hidden_norm'ed)."""
        return self._kv(c, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Block queries x [B, Q, H] over [context | block] keys; `mask` [B, 1, Q, Lc + Q] (None: all visible)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self._kv(x, cos, sin)
        k, v = torch.cat([ctx_k.to(k.dtype), k], dim=2), torch.cat([ctx_v.to(v.dtype), v], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(cfg))

    def forward(self, h, cos, sin, context: tuple, mask) -> torch.Tensor:
        """`context`: (features, cos, sin) whose keys/values this layer makes (inside its forward: FSDP gathers a
        unit's weights there), or (keys, values) already made (decoding's cache)."""
        ctx_k, ctx_v = self.self_attn.context_kv(*context) if len(context) == 3 else context
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(DraftVocabulary, nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.own_embedding:
            raise Eagle3InputError("a DFlash draft has the verifier's width (it embeds tokens with the verifier's "
                                   "embedding); drop train.hidden_size")
        self.config = cfg
        self.method = draft_method(cfg.method)
        H, Ht = cfg.hidden_size, cfg.aux_hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = architecture_of(cfg).rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.requires_grad:
                p.normal_(0.0, std)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[.., 3*Ht] aux states -> [.., H] context feature (the same for every layer)."""
        return self.hidden_norm(self.fc(aux))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def blocks(self, ctx: torch.Tensor, ctx_pos: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Layer outputs [B, Q, H] of block tokens `ids` [B, Q] at `pos` over context features `ctx` [B, Lc, H] at
        `ctx_pos`; `mask` [B, 1, Q, Lc + Q]: which context and block keys each query sees (None: all)."""
        h = self.embed_tokens(ids).to(ctx.dtype)
        cos, sin = self.rotary(h, pos)
        ctx_cos, ctx_sin = self.rotary(ctx, ctx_pos)
        for layer in self.layers:
            h = layer(h, cos, sin, (ctx, ctx_cos, ctx_sin), mask)
        return h

    @torch.no_grad()
    def propose_block(self, ctx_kv: list | None, new_ctx: torch.Tensor, new_pos: torch.Tensor, bonus: int,
                      k: int) -> tuple[list[torch.Tensor], list]:
        """Decoding (batch size 1), as vLLM drafts: the new verified positions' context keys/values appended to
        `ctx_kv` (per layer), then one block [bonus, mask x k] at the positions after them, non-causal. Returns the
        k draft-vocab logits and the context cache."""
        cos, sin = self.rotary(new_ctx, new_pos)
        cache = []
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.self_attn.context_kv(new_ctx, cos, sin)
            if ctx_kv is not None:
                k_new = torch.cat([ctx_kv[i][0], k_new], dim=2)
                v_new = torch.cat([ctx_kv[i][1], v_new], dim=2)
            cache.append((k_new, v_new))
        start = int(new_pos[0, -1]) + 1
        ids = torch.tensor([[bonus] + [self.config.mask_token_id] * k], device=new_ctx.device)
        pos = torch.arange(start, start + k + 1, device=new_ctx.device)[None]
        h = self.embed_tokens(ids).to(new_ctx.dtype)
        bcos, bsin = self.rotary(h, pos)
        for layer, kv in zip(self.layers, cache):
            h = layer(h, bcos, bsin, kv, None)
        logits = self.logits(h)[0, 1:]
        return list(logits), cache

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    @torch.no_grad()
    def use_embedding(self, verifier_embed: torch.Tensor | None, own: torch.Tensor | None = None,
                      where: str = "draft") -> None:
        if verifier_embed is not None:
            self.embed_tokens.weight.copy_(verifier_embed)
