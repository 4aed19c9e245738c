"""Test helpers: one random reference draft at SmolLM2's dimensions, written in every layout the field publishes.

Weights are rounded to bfloat16 so that a layout stored in bf16 holds exactly the reference's values: every layout
must then load to the same network, bit for bit. Nothing here imports the code under test except the draft module
(the reference network) and our own checkpoint writer (for "ours").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_train.assets.verifier import Verifier
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.inputs import RunInputs
from support.numerics import fixed_threads

# SmolLM2-135M-Instruct's shape (its config.json, abridged).
SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "num_hidden_layers": 30, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "hidden_act": "silu", "tie_word_embeddings": True}
H, V, L = 576, 49152, 30
VD = 2048
LAYER_IDS = (2, 15, 27)  # the default taps of a 30-layer verifier


def bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def vocab_from_ids(ids: torch.Tensor, vocab_size: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.sort(ids).values
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def random_token_ids(n: int, seed: int, vocab_size: int = V) -> torch.Tensor:
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:n]


def verifier_head(seed: int = 123) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (embedding, lm_head) pair standing in for the verifier's, bf16-exact."""
    g = torch.Generator().manual_seed(seed)
    return bf16_exact(0.05 * torch.randn(V, H, generator=g)), bf16_exact(0.05 * torch.randn(V, H, generator=g))


def reference_draft(embed: torch.Tensor, vocab: tuple[torch.Tensor, torch.Tensor], seed: int = 0,
                    **flags) -> Eagle3Draft:
    """A random draft for the SmolLM2-shaped verifier; norm weights are random too, so a lost norm shows."""
    cfg = DraftConfig.from_verifier(SMOL, vocab[0].shape[0], aux_layer_ids=LAYER_IDS, **flags)
    model = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                p.copy_(embed)
            elif "norm" in name:
                p.copy_(bf16_exact(1 + 0.2 * torch.randn(p.shape, generator=g)))
            else:
                p.copy_(bf16_exact(0.05 * torch.randn(p.shape, generator=g)))
        model.set_vocab(*vocab)
    return model.eval()


@torch.no_grad()
def probe_logits(model: Eagle3Draft, seed: int = 7, length: int = 12) -> torch.Tensor:
    """Draft-vocab logits of a KV-cached forward over random verifier features and tokens."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, 3 * model.config.aux_hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
    with fixed_threads(1):  # compared bit for bit with logits computed in other tests (tests/support/numerics.py)
        logits, _, _ = model.eval().forward_cached(model.fuse(aux), ids, torch.arange(length)[None], None)
    return logits[0]


def make_inputs(tmp: Path, embed: torch.Tensor, lm_head: torch.Tensor, vocab: tuple[torch.Tensor, torch.Tensor],
                layer_ids: tuple[int, ...] = LAYER_IDS, verifier_config: dict | None = None) -> RunInputs:
    """RunInputs as resolve_inputs would return them for a SmolLM2-shaped verifier (no data files needed)."""
    return RunInputs(tmp / "prepared", {}, "0" * 64, tmp / "hidden", {"layer_ids": list(layer_ids)}, "0" * 64,
                     tmp / "vocab.safetensors", "0" * 64, vocab[0], vocab[1],
                     Verifier("smollm2-test", tmp / "verifier", dict(verifier_config or SMOL)),
                     {"name": "smollm2-test"}, embed, lm_head, tuple(layer_ids))


def train_config(source: str | Path, **kw) -> TrainConfig:
    return TrainConfig(finetune_from=str(source), **kw)


# --- writers, one per layout ---------------------------------------------------------------------------------------
def _draft_tensors(ref: Eagle3Draft, layer0: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in ref.trainable_state_dict().items():
        if k.startswith("layers.0."):
            k = layer0 + k[len("layers.0."):]
        out[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().clone().contiguous()
    return out


def llama_fields(cfg: DraftConfig) -> dict:
    return {"model_type": "llama", "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act,
            "tie_word_embeddings": False}


def _write_config(d: Path, config: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


def write_eagle_original(ref: Eagle3Draft, d: Path) -> Path:
    """The original EAGLE release: pytorch_model.bin (fp16-era layout, here bf16), `midlayer.*`, no t2d,
    architectures LlamaForCausalLM, no norm_before_residual and no aux-layer keys."""
    tensors = _draft_tensors(ref, "midlayer.", torch.bfloat16)
    del tensors["t2d"]
    _write_config(d, {"architectures": ["LlamaForCausalLM"], **llama_fields(ref.config),
                      "draft_vocab_size": ref.config.draft_vocab_size, "torch_dtype": "bfloat16",
                      "bos_token_id": 1, "eos_token_id": 2})
    torch.save(tensors, d / "pytorch_model.bin")
    return d


def write_specforge(ref: Eagle3Draft, d: Path, embed: torch.Tensor) -> Path:
    """SpecForge/SGLang: LlamaForCausalLMEagle3, safetensors with embed_tokens, aux ids only in eagle_config
    (SGLang's 'output of layer i' convention)."""
    tensors = _draft_tensors(ref, "midlayer.", torch.bfloat16)
    tensors["embed_tokens.weight"] = embed.to(torch.bfloat16).contiguous()
    _write_config(d, {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(ref.config),
                      "draft_vocab_size": ref.config.draft_vocab_size, "torch_dtype": "bfloat16",
                      "eagle_config": {"use_aux_hidden_state": True,
                                       "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ref.config.aux_layer_ids]}})
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def write_eagle_aux_keys(ref: Eagle3Draft, d: Path, top: list[int] | None, nested: list[int] | None) -> Path:
    """A SpecForge-style draft (no embed_tokens) whose config carries exactly the aux-layer keys given:
    `top` as top-level eagle_aux_hidden_state_layer_ids, `nested` inside eagle_config (None = key absent)."""
    tensors = _draft_tensors(ref, "midlayer.", torch.bfloat16)
    eagle_config: dict = {"use_aux_hidden_state": True}
    if nested is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(nested)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(ref.config),
              "draft_vocab_size": ref.config.draft_vocab_size, "torch_dtype": "bfloat16", "eagle_config": eagle_config}
    if top is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(top)
    _write_config(d, config)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def speculators_config(ref: Eagle3Draft, with_nbr_key: bool = True, aux_ids: list[int] | None = None) -> dict:
    c = ref.config
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                            "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_fields(c)},
        "draft_vocab_size": c.draft_vocab_size, "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm,
        "norm_output": c.norm_output, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids or c.aux_layer_ids), "torch_dtype": "bfloat16"}
    if with_nbr_key:
        config["norm_before_residual"] = c.norm_before_residual
    return config


def write_speculators(ref: Eagle3Draft, d: Path, with_nbr_key: bool = True, aux_ids: list[int] | None = None,
                      extra: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """vLLM speculators: `layers.0.*`, speculators_config, transformer_layer_config, explicit flags."""
    tensors = _draft_tensors(ref, "layers.0.", torch.bfloat16)
    tensors.update(extra or {})
    for k in drop:
        del tensors[k]
    _write_config(d, speculators_config(ref, with_nbr_key, aux_ids))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def write_sharded(ref: Eagle3Draft, d: Path, shards: int = 3) -> Path:
    """Sharded safetensors with model.safetensors.index.json (float32 shards), EAGLE-format config."""
    tensors = _draft_tensors(ref, "midlayer.")
    names = sorted(tensors)
    weight_map, total = {}, 0
    d.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(d / fname))
        weight_map.update({k: fname for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    _write_config(d, {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(ref.config),
                      "draft_vocab_size": ref.config.draft_vocab_size, "norm_before_residual": False,
                      "eagle_aux_hidden_state_layer_ids": list(ref.config.aux_layer_ids)})
    return d


def write_ours(ref: Eagle3Draft, run_dir: Path, metadata: dict | None = None) -> Path:
    """One of our training runs: RUN/final/{model.safetensors, draft_config.json, training_metadata.json}."""
    from eagle3_train.checkpoints.native import save_checkpoint

    save_checkpoint(run_dir / "final", ref, None, metadata or {"init": {"method": "random", "seed": 0}})
    return run_dir


# --- a header-only safetensors file: the shapes of a huge draft without its gigabytes ------------------------------


def write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], real: dict[str, torch.Tensor]) -> None:
    """bf16 tensors of `shapes` as a sparse file (header only: no data written), plus the `real` tensors."""
    from eagle3_train.train.dry_run import write_header_only_safetensors

    specs = {**{k: (tuple(v), torch.bfloat16) for k, v in shapes.items()},
             **{k: (tuple(t.shape), t.dtype) for k, t in real.items()}}
    write_header_only_safetensors(path, specs, real)


def write_big_eagle_draft(d: Path, hidden: int, heads: int, inter: int, vocab: int, draft_vocab: int) -> Path:
    """An EAGLE-format draft made for another (large) verifier, e.g. Kimi-K2's draft: H 7168, V 163840, Vd 32000."""
    hd = hidden // heads
    shapes = {"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden),
              "embed_tokens.weight": (vocab, hidden), "midlayer.input_layernorm.weight": (hidden,),
              "midlayer.hidden_norm.weight": (hidden,), "midlayer.post_attention_layernorm.weight": (hidden,),
              "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": (heads * hd, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (heads * hd, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": (hidden, heads * hd),
              "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
              "midlayer.mlp.down_proj.weight": (hidden, inter)}
    d2t, t2d = vocab_from_ids(random_token_ids(draft_vocab, 5, vocab), vocab)
    _write_config(d, {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
                      "num_attention_heads": heads, "num_key_value_heads": heads, "intermediate_size": inter,
                      "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
                      "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 131072,
                      "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"})
    write_sparse_safetensors(d / "model.safetensors", shapes, {"d2t": d2t, "t2d": t2d})
    return d
