"""The EAGLE-3 draft network: fc over three verifier hidden states, one (or more) decoder layer(s) whose first
attention reads cat(norm(embedding), norm(hidden)), a final norm and an lm_head over the draft vocabulary. The layer's
attention is Llama's (`DraftAttention`) or DeepSeek's MLA (`model/mla.py`), chosen by `DraftConfig.architecture`;
both share the TTT and KV-cache paths of `TTTAttention`.

Parameter names follow the speculators layout (`layers.0.*`); the exporter renames to `midlayer.*` for the EAGLE/SGLang
format. Two forward paths share the weights:
- `ttt_step` for training-time test: step j attends to the step-0 causal prefix plus its own position in steps 1..j.
- `forward_cached` for decoding with a KV cache (offline evaluation), exactly what vLLM runs.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
)

from eagle3_train.model.architectures import architecture_of
from eagle3_train.model.attention import LayerTTTCache, llama_config
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.utils.io import Eagle3InputError


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        if first:
            self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = architecture_of(cfg).attention(cfg, 2 * H if first else H)
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


class DraftVocabulary:
    """The draft-to-verifier vocabulary map every draft network carries (buffers `d2t` [Vd], `t2d` [V])."""

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_token_ids(self) -> torch.Tensor:
        """Target (verifier) token id of each draft-vocab row: i + d2t[i]."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t


class Eagle3Draft(DraftVocabulary, nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H, Ht = cfg.hidden_size, cfg.aux_hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        # the verifier's embedding, frozen; a draft of another width trains (and ships) its own
        self.embed_tokens.weight.requires_grad_(cfg.own_embedding)
        if cfg.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * Ht, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(Ht, eps=cfg.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg, first=(i == 0)) for i in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = architecture_of(cfg).rotary(cfg)
        self.method = draft_method(cfg.method)
        for name, shape in self.method.shapes(cfg).items():  # its own parameters (P-EAGLE's mask_hidden)
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        own = {name: init for name, (_, init) in self.method.parameters.items()}
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("norm."):
                p.fill_(1.0)
            elif p.requires_grad:
                p.normal_(0.0, own.get(name, std))

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
        """Everything but the frozen verifier embedding (and non-persistent RoPE buffers); a draft's own embedding
        is kept."""
        return {k: v for k, v in self.state_dict().items()
                if self.config.own_embedding or not k.startswith("embed_tokens.")}

    @torch.no_grad()
    def use_embedding(self, verifier_embed: torch.Tensor | None, own: torch.Tensor | None = None,
                      where: str = "draft") -> None:
        """Set the token embedding: the verifier's (frozen), or for a draft of another width its own `own` (from
        its checkpoint or export; an error naming `where` when missing)."""
        if self.config.own_embedding:
            if own is None:
                raise Eagle3InputError(f"{where}: a draft of width {self.config.hidden_size} under a verifier of "
                                       f"width {self.config.aux_hidden_size} needs its own embed_tokens.weight, "
                                       f"which it does not carry")
            self.embed_tokens.weight.copy_(own)
        elif verifier_embed is not None:
            self.embed_tokens.weight.copy_(verifier_embed)
