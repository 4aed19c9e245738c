"""A full-size Kimi-K2 rehearsal without the gigabytes: the verifier's config, the AQ-MedAI EAGLE-3 draft's exact keys,
shapes, dtypes and config, and a tiny dataset with hidden states at Kimi's width.

Big tensors are written as zeros in sparse files (`write_sparse_safetensors`): a 2.4 GB draft costs a few kB of disk
and no RAM; d2t/t2d and the hidden states are real. Shapes follow SpecForge's `configs/kimi-k2-eagle3.json`, which
the published draft was trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_train.settings.train import TrainConfig
from eagle3_train.utils.io import write_json
from support.draft_layouts import random_token_ids, vocab_from_ids, write_sparse_safetensors
from support.named_layouts import write_stage_outputs

H, V, VD, L = 7168, 163840, 32000, 61
HEADS, HEAD_DIM, INTER = 64, 128, 18432
SGLANG_IDS = [2, 30, 58]  # the draft's eagle_config ids: outputs of these layers
LAYERS = (3, 31, 59)  # the same layers as vLLM ids (inputs of these layers): what the run must extract
DEFAULT = (2, 30, 58)  # the engines' default taps of a 61-layer verifier (inputs): one layer off

# Kimi-K2-Instruct's config.json (DeepSeek-V3 architecture; MoE fields as published).
KIMI_K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 163584,
    "eos_token_id": 163585, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": H,
    "initializer_range": 0.02, "intermediate_size": INTER, "kv_lora_rank": 512, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": HEADS, "num_experts_per_tok": 8, "num_hidden_layers": L,
    "num_key_value_heads": HEADS, "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": V}

# The draft's config.json (SpecForge's kimi-k2-eagle3.json).
AQ_MEDAI_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": 1,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "intermediate_size": INTER,
    "vocab_size": V, "draft_vocab_size": VD, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False, "pretraining_tp": 1, "bos_token_id": 163584, "eos_token_id": 163585,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS, "use_aux_hidden_state": True}}


def aq_medai_shapes(with_embed: bool) -> dict[str, tuple[int, ...]]:
    q = HEADS * HEAD_DIM
    shapes = {"midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (q, 2 * H),
              "midlayer.self_attn.v_proj.weight": (q, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
              "midlayer.mlp.gate_proj.weight": (INTER, H), "midlayer.mlp.up_proj.weight": (INTER, H),
              "midlayer.mlp.down_proj.weight": (H, INTER), "midlayer.input_layernorm.weight": (H,),
              "midlayer.hidden_norm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
              "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H)}
    if with_embed:
        shapes["embed_tokens.weight"] = (V, H)
    return shapes


def write_aq_medai_draft(d: Path, with_embed: bool = False, config: dict | None = None) -> Path:
    """`AQ-MedAI/Kimi-K2-Instruct-eagle3` as published: bf16 `midlayer.*`, d2t/t2d, training_state.pt beside it."""
    d.mkdir(parents=True, exist_ok=True)
    d2t, t2d = vocab_from_ids(random_token_ids(VD, seed=11, vocab_size=V), V)
    write_sparse_safetensors(d / "model.safetensors", aq_medai_shapes(with_embed), {"d2t": d2t, "t2d": t2d})
    (d / "config.json").write_text(json.dumps(config or AQ_MEDAI_CONFIG, indent=2))
    torch.save({"epoch": 9, "global_step": 12345}, d / "training_state.pt")  # SpecForge leaves one; not weights
    return d


def write_aq_medai_layout(d: Path, config: dict, sglang_ids: list[int], seed: int = 0) -> Path:
    """The AQ-MedAI layout (bf16 `midlayer.*`, d2t/t2d, nested-only aux ids, training_state.pt) at another verifier's
    dimensions (`config`: a Llama config dict) with real random weights, e.g. SmolLM2's for a vLLM test."""
    Hs, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter, vocab, vd = config["head_dim"], config["intermediate_size"], config["vocab_size"], VD // 8
    g = torch.Generator().manual_seed(seed)
    shapes = {"midlayer.self_attn.q_proj.weight": (heads * hd, 2 * Hs), "midlayer.self_attn.k_proj.weight":
              (kv * hd, 2 * Hs), "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * Hs),
              "midlayer.self_attn.o_proj.weight": (Hs, heads * hd), "midlayer.mlp.gate_proj.weight": (inter, Hs),
              "midlayer.mlp.up_proj.weight": (inter, Hs), "midlayer.mlp.down_proj.weight": (Hs, inter),
              "fc.weight": (Hs, 3 * Hs), "lm_head.weight": (vd, Hs)}
    tensors = {k: (0.02 * torch.randn(s, generator=g)).to(torch.bfloat16) for k, s in shapes.items()}
    for k in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
              "midlayer.post_attention_layernorm.weight", "norm.weight"):
        tensors[k] = torch.ones(Hs, dtype=torch.bfloat16)
    tensors["d2t"], tensors["t2d"] = vocab_from_ids(random_token_ids(vd, seed=seed + 1, vocab_size=vocab), vocab)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    cfg = {**AQ_MEDAI_CONFIG, "hidden_size": Hs, "num_attention_heads": heads, "num_key_value_heads": kv,
           "head_dim": hd, "intermediate_size": inter, "vocab_size": vocab, "draft_vocab_size": vd,
           "rope_theta": config["rope_theta"], "max_position_embeddings": config["max_position_embeddings"],
           "rms_norm_eps": config["rms_norm_eps"], "bos_token_id": None, "eos_token_id": None,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(sglang_ids), "use_aux_hidden_state": True}}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.save({"epoch": 1}, d / "training_state.pt")
    return d


def write_kimi_verifier(d: Path, with_weights: bool = True, hidden: int = H, real_head: bool = False) -> Path:
    """config.json, and (with_weights) a safetensors holding just the embedding and lm_head [163840, hidden]: zeros
    in a sparse file, or random bf16 values (`real_head`, for a real forward/backward at reduced width). A `hidden`
    below 7168 gives a width-reduced copy (heads of 128, the MLP scaled alike) with Kimi's 61 layers and vocabulary."""
    d.mkdir(parents=True, exist_ok=True)
    config = dict(KIMI_K2_CONFIG)
    if hidden != H:
        config.update(hidden_size=hidden, num_attention_heads=hidden // HEAD_DIM,
                      num_key_value_heads=hidden // HEAD_DIM, intermediate_size=INTER * hidden // H // 256 * 256)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    if with_weights and real_head:
        g = torch.Generator().manual_seed(1)
        save_file({k: (0.02 * torch.randn(V, hidden, generator=g)).to(torch.bfloat16)
                   for k in ("model.embed_tokens.weight", "lm_head.weight")}, str(d / "model.safetensors"))
    elif with_weights:
        write_sparse_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": (V, hidden),
                                                          "lm_head.weight": (V, hidden)}, {})
    return d


def write_run_inputs(root: Path, verifier: Path, layer_ids=LAYERS, samples: int = 6, length: int = 24) -> dict:
    """prepared/, vocab/vocab.safetensors (32000 tokens) and hidden/ (real bf16 hidden states at the verifier's width,
    7168 for Kimi) for `verifier`. Returns the paths."""
    return write_stage_outputs(root, verifier, tuple(layer_ids), draft_vocab=VD, samples=samples, length=length,
                               hidden_dir="hidden", record_done=False, source="simulated Kimi-K2.5 regenerated data")


def kimi_train_config(paths: dict, out: Path, **kw) -> TrainConfig:
    base = dict(prepared=str(paths["prepared"]), hidden_states=str(paths["hidden"]), vocab=str(paths["vocab"]),
                out=str(out), ttt_steps=7, token_budget=4096, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def write_kimi_k25_verifier(d: Path, final_norm: torch.Tensor | None = None) -> Path:
    """Kimi-K2.5's checkpoint layout, header-only: the multimodal wrapper `KimiK25ForConditionalGeneration` with the
    DeepSeek-V3 language model in `text_config`, `language_model.`-prefixed names, INT4 compressed-tensors experts
    (`weight_packed` int32, `weight_scale`, `weight_shape`), a vision tower, and three shards named by an index (the
    final norm alone in the last one, as in a real checkpoint where a stage must fetch just that file)."""
    from eagle3_train.train.dry_run import write_header_only_safetensors

    d.mkdir(parents=True, exist_ok=True)
    text = {**KIMI_K2_CONFIG, "model_type": "deepseek_v3", "architectures": None,
            "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"],
                                                                  "weights": {"num_bits": 4, "group_size": 32}}},
                                    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}}
    text.pop("auto_map")
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                           "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
              "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 1152,
                                                     "num_hidden_layers": 27},
              "media_placeholder_token_id": 163605, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(config, indent=2))
    lm = "language_model.model"
    bf16, i32 = torch.bfloat16, torch.int32
    shards = {
        "model-00001-of-00003.safetensors": {
            f"{lm}.embed_tokens.weight": ((V, H), bf16), "vision_tower.encoder.blocks.0.attn.qkv.weight":
            ((3 * 1152, 1152), bf16), "mm_projector.proj.0.weight": ((H, 4 * 1152), bf16)},
        "model-00002-of-00003.safetensors": {
            f"{lm}.layers.1.mlp.experts.0.gate_proj.weight_packed": ((2048, H // 8), i32),
            f"{lm}.layers.1.mlp.experts.0.gate_proj.weight_scale": ((2048, H // 32), bf16),
            f"{lm}.layers.1.mlp.experts.0.gate_proj.weight_shape": ((2,), i32),
            f"{lm}.layers.1.self_attn.kv_a_proj_with_mqa.weight": ((576, H), bf16),
            "language_model.lm_head.weight": ((V, H), bf16)},
        "model-00003-of-00003.safetensors": {f"{lm}.norm.weight": ((H,), bf16)}}
    real = {f"{lm}.norm.weight": final_norm} if final_norm is not None else {}
    weight_map = {}
    for name, specs in shards.items():
        write_header_only_safetensors(d / name, specs, {k: v for k, v in real.items() if k in specs})
        weight_map.update(dict.fromkeys(specs, name))
    write_json(d / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    return d


# An MLA EAGLE-3 draft for Kimi-K2.5 as published (k-l-lambda/Kimi-K2.5-Eagle3's config: kimi_k2 model type, the
# verifier's MLA dims, a dense MLP, SGLang-style nested aux ids; lightseekorg's kimi-k2.5-eagle3-mla is the same
# layer): HF DeepseekV3Attention's tensor names under `midlayer.`.
MLA_Q_LORA, MLA_KV_LORA, MLA_NOPE, MLA_ROPE, MLA_V = 1536, 512, 128, 64, 128
KIMI_MLA_DRAFT_CONFIG = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": H,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "intermediate_size": INTER,
    "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "q_lora_rank": MLA_Q_LORA, "kv_lora_rank": MLA_KV_LORA, "qk_nope_head_dim": MLA_NOPE,
    "qk_rope_head_dim": MLA_ROPE, "v_head_dim": MLA_V, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS, "use_aux_hidden_state": True}}


def kimi_mla_draft_shapes() -> dict[str, tuple[int, ...]]:
    qk = MLA_NOPE + MLA_ROPE
    a = "midlayer.self_attn."
    return {a + "q_a_proj.weight": (MLA_Q_LORA, 2 * H), a + "q_a_layernorm.weight": (MLA_Q_LORA,),
            a + "q_b_proj.weight": (HEADS * qk, MLA_Q_LORA), a + "kv_a_proj_with_mqa.weight": (MLA_KV_LORA + MLA_ROPE,
                                                                                                2 * H),
            a + "kv_a_layernorm.weight": (MLA_KV_LORA,), a + "kv_b_proj.weight": (HEADS * (MLA_NOPE + MLA_V),
                                                                                  MLA_KV_LORA),
            a + "o_proj.weight": (H, HEADS * MLA_V),
            "midlayer.mlp.gate_proj.weight": (INTER, H), "midlayer.mlp.up_proj.weight": (INTER, H),
            "midlayer.mlp.down_proj.weight": (H, INTER), "midlayer.input_layernorm.weight": (H,),
            "midlayer.hidden_norm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
            "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H)}


def write_kimi_mla_draft(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    d2t, t2d = vocab_from_ids(random_token_ids(VD, seed=13, vocab_size=V), V)
    write_sparse_safetensors(d / "model.safetensors", kimi_mla_draft_shapes(), {"d2t": d2t, "t2d": t2d})
    (d / "config.json").write_text(json.dumps(KIMI_MLA_DRAFT_CONFIG, indent=2))
    return d
