"""The MLA draft layer (model/mla.py): its attention is transformers' DeepseekV3Attention on the same weights (YaRN
RoPE over the rope part only, DeepSeek's interleaved layout, mscale in the softmax scale; with and without a query
LoRA), and training-time test over it reads exactly what KV-cache chain decoding reads, as for the Llama layer."""

from __future__ import annotations

import pytest
import torch
from support.tiny_ttt import VD, V, forward_and_reference, peaked
from test_ttt import reference_sums
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.mla import MLAAttention, deepseek_config
from eagle3_train.utils.io import Eagle3InputError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_config(H: int = 32, q_lora_rank: int | None = 16, **kw) -> DraftConfig:
    return DraftConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                       vocab_size=V, draft_vocab_size=VD, aux_layer_ids=(1, 2, 3), verifier_num_layers=6,
                       architecture="mla", q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=12, rope_scaling=YARN, max_position_embeddings=64, **kw)


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_attention_is_deepseek_v3_attention_on_the_same_weights(q_lora_rank):
    torch.manual_seed(0)
    cfg = mla_config(q_lora_rank=q_lora_rank)
    ours = MLAAttention(cfg, cfg.hidden_size)  # a layer whose input is H wide (HF's attention reads H)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    hf_cfg = deepseek_config(cfg)
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    keys = hf.load_state_dict(ours.state_dict(), strict=True)  # the same names and shapes (strict raises otherwise)
    assert not keys.missing_keys and not keys.unexpected_keys
    assert ours.scale == hf.scaling and ours.scale != (8 + 8) ** -0.5  # YaRN's mscale is in the scale
    rotary = Eagle3Draft(cfg).rotary
    x = torch.randn(2, 11, cfg.hidden_size)
    positions = torch.arange(5, 16)[None].expand(2, -1)  # past the original context: YaRN's ramp matters
    cos, sin = rotary(x, positions)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = hf(x, (cos, sin), causal)
        got, _ = ours.cached(x, cos, sin, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_ttt_over_mla_reads_what_chain_decoding_reads():
    torch.manual_seed(1)
    model = peaked(Eagle3Draft(mla_config())).eval()
    expected, loss, sums, denominators = forward_and_reference(model, reference_sums, 3)
    assert expected[3].sum() > 0  # the draft is right somewhere: the correct counts are compared, not zeros
    torch.testing.assert_close(sums[1:5], expected[1:5], rtol=0, atol=0)
    torch.testing.assert_close(sums[0], expected[0], rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(float((expected[0] / denominators).sum()), rel=1e-5)


def test_mla_needs_its_latent_dims():
    with pytest.raises(Eagle3InputError, match="an mla draft needs kv_lora_rank"):
        DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                    vocab_size=V, draft_vocab_size=VD, aux_layer_ids=(1, 2, 3), architecture="mla")
    verifier = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 8, "intermediate_size": 512,
                "vocab_size": 1000, "q_lora_rank": 96, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 64, "v_head_dim": 32, "model_type": "deepseek_v3"}
    cfg = DraftConfig.from_verifier(verifier, 100, architecture="mla")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (96, 512, 64)


@pytest.mark.slow
def test_finetune_from_an_exported_mla_draft_is_bit_exact_at_lr_0(tmp_path_factory, smollm2_dir):
    """Train an MLA draft on a tiny DeepSeek-V3 verifier, export it (Eagle3DeepseekV2ForCausalLM, midlayer.*), and
    finetune from the export: one step at lr 0 leaves every weight bit-identical, the run is an MLA draft (never
    rebuilt as a Llama one, even with --allow-missing), and inspect says so."""
    import json

    from safetensors.torch import load_file
    from support.stage_helpers import build_stages, train_config

    from eagle3_train.export.exporter import export
    from eagle3_train.export.inspect import inspect_checkpoint
    from eagle3_train.testing.tiny_verifiers import build_tiny_verifier
    from eagle3_train.train.trainer import train

    tmp = tmp_path_factory.mktemp("mla-finetune")
    verifier = build_tiny_verifier("deepseek_v3", tmp / "verifier", smollm2_dir)
    root = build_stages(tmp / "stages", verifier)
    source = train(train_config(root, tmp / "a", max_steps=4, architecture="mla"))
    export(tmp / "a", tmp / "export", fmt="eagle", dtype="float32")
    assert json.loads((tmp / "export" / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    for name, kw in (("b", {}), ("c", {"allow_missing": True})):
        again = train(train_config(root, tmp / name, max_steps=1, lr=0.0, finetune_from=str(tmp / "export"), **kw))
        assert again["validation"] == pytest.approx(source["validation"], rel=1e-6, abs=1e-6)
        a = load_file(str(tmp / "a" / "final" / "model.safetensors"))
        b = load_file(str(tmp / name / "final" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        meta = json.loads((tmp / name / "training_metadata.json").read_text())
        assert meta["draft_config"]["architecture"] == "mla" and meta["init"]["keys"]["missing"] == []
    summary = inspect_checkpoint(tmp / "export")
    assert "Eagle3DeepseekV2ForCausalLM" in json.dumps(summary)


def test_an_mla_export_reads_in_transformers_with_the_rope_width_and_the_name_both_engines_register(tmp_path):
    """HF-based readers (a SpecForge or TorchSpec finetune, an HF evaluation) build DeepseekV3Config from the
    export: its rotary must span qk_rope_head_dim (head_dim hidden/heads built a rotary wider than the rope part),
    and the class is Eagle3DeepseekV2ForCausalLM, which SGLang's kimi_k25_eagle3.py registers (vLLM maps both)."""
    import json

    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from eagle3_train.checkpoints.layouts import eagle_config_json
    from eagle3_train.model.layer_kinds import architecture_from_config

    cfg = mla_config()
    config = eagle_config_json(cfg, "bfloat16")
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["head_dim"] == cfg.qk_rope_head_dim
    hf = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures",)})
    rotary = DeepseekV3RotaryEmbedding(hf)
    assert rotary.inv_freq.numel() * 2 == cfg.qk_rope_head_dim
    # a published draft under the V3 name is still read as an MLA layer
    assert architecture_from_config({**config, "architectures": ["Eagle3DeepseekV3ForCausalLM"]}) == "mla"
    assert json.loads(json.dumps(config)) == config
