"""Training targets are the verifier's real next-token distribution: softcapping (Gemma 2), logit scales (Cohere,
Granite), lm_head bias (Phi) applied as transformers applies them, checked against the HF model's own logits on tiny
random models; unknown transforms are refused; the teacher softmax stays float32 under bf16 autocast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3_train.model.verifier_head import load_verifier_head, logit_transform
from eagle3_train.train.targets import verifier_targets
from eagle3_train.utils.io import Eagle3InputError

TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=256)


def save_tiny(out: Path, config_cls, bias: bool = False, **kw) -> Path:
    """A tiny random model of a transformers family; large weights give large logits, where transforms matter."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**{**TINY, "initializer_range": 0.3, **kw})).eval()
    if bias:
        with torch.no_grad():
            model.lm_head.bias.normal_(0, 3.0)  # initialised to zeros
    model.save_pretrained(out)
    return out


def drop_field(verifier: Path, field: str) -> None:
    """Leave a field to transformers' class default, as a hand-written config.json may."""
    config = json.loads((verifier / "config.json").read_text())
    del config[field]
    (verifier / "config.json").write_text(json.dumps(config))


def targets_and_hf(verifier: Path, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(our soft targets, the HF model's softmax, our targets without the transform) at every position."""
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state
        hf = torch.softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1).reshape(-1, TINY["vocab_size"])
    _, lm_head, _ = load_verifier_head(verifier)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    every = torch.arange(TINY["vocab_size"])
    t2d = torch.ones(TINY["vocab_size"], dtype=torch.bool)
    args = (final, mask, lm_head, every, t2d)
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = verifier_targets(*args, transform=logit_transform(verifier))
    else:
        ours = verifier_targets(*args, transform=logit_transform(verifier))
    return ours.probs, hf, verifier_targets(*args).probs


@pytest.mark.parametrize("family", ["gemma2", "gemma2-cap5", "cohere", "granite", "phi-bias"])
def test_targets_equal_the_hf_models_distribution(family, tmp_path):
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, PhiConfig

    out = tmp_path / family
    if family == "gemma2":  # default final_logit_softcapping (30.0), absent from config.json
        drop_field(save_tiny(out, Gemma2Config, initializer_range=1.0), "final_logit_softcapping")
    elif family == "gemma2-cap5":
        save_tiny(out, Gemma2Config, final_logit_softcapping=5.0)
    elif family == "cohere":  # default logit_scale (0.0625), absent from config.json
        drop_field(save_tiny(out, CohereConfig), "logit_scale")
    elif family == "granite":
        save_tiny(out, GraniteConfig, logits_scaling=0.25)
    else:
        save_tiny(out, PhiConfig, bias=True, partial_rotary_factor=0.5)
    ours, hf, plain = targets_and_hf(out)
    torch.testing.assert_close(ours, hf, rtol=1e-4, atol=1e-6)
    assert (plain - hf).abs().max() > 1e-3  # the transform matters for these weights


def test_llama_targets_are_unchanged_and_float32_under_bf16_autocast(tiny_llama_dir):
    verifier = tiny_llama_dir(vocab_size=TINY["vocab_size"], initializer_range=0.3)
    assert logit_transform(verifier).describe() == {"scale": 1.0, "softcap": None, "bias": False}
    ours, hf, plain = targets_and_hf(verifier, autocast=True)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf, rtol=1e-4, atol=1e-6)
    assert torch.equal(ours, plain)


def test_a_logit_transform_we_cannot_reproduce_is_refused(tiny_llama_dir, tmp_path):
    src = tiny_llama_dir(vocab_size=TINY["vocab_size"])
    out = tmp_path / "odd-llama"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    with pytest.raises(Eagle3InputError, match=r"odd-llama.*'llama'.*final_logit_softcapping=30\.0"):
        logit_transform(out)


def test_a_bf16_lm_head_keeps_float32_soft_targets():
    """Under bf16 training the trainer keeps the lm_head in bf16: only the full-vocab pass (in-vocab flag, mass
    metric) runs in bf16; the distribution over the draft vocab is the float32 one of the same weights."""
    from eagle3_train.train.targets import verifier_targets

    g = torch.Generator().manual_seed(0)
    V, Vd, H = 512, 64, 32
    lm_head = torch.randn(V, H, generator=g).bfloat16()
    final = torch.randn(2, 9, H, generator=g) * 3
    mask = torch.ones(2, 9, dtype=torch.long)
    draft_ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    half = verifier_targets(final, mask, lm_head, draft_ids, t2d)
    full = verifier_targets(final, mask, lm_head.float(), draft_ids, t2d)
    assert half.probs.dtype == torch.float32 and torch.equal(half.probs, full.probs)
    assert torch.equal(half.argmax, full.argmax)
    # the mass metric moves only by the bf16 rounding of the full logits (relative 2^-9 each: lse within 2^-8 of max)
    max_logit = (final.reshape(-1, H) @ lm_head.float().T).abs().max()
    assert (half.in_mass <= 1).all()
    assert ((half.in_mass.log() - full.in_mass.log()).abs() <= max_logit * 2 ** -7).all()
    assert (half.in_vocab == full.in_vocab).float().mean() > 0.9  # bf16 may flip near-ties only


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next", "cohere"])
def test_the_final_norm_is_applied_as_the_model_computes_it(family, tmp_path):
    """The vLLM hidden-state backend reads the final norm as multiplier * x / rms(x): Gemma and Qwen3-Next/3.5 store
    w - 1 (applied as 1 + w), Cohere ends in a LayerNorm (refused, by name)."""
    import transformers as tf

    from eagle3_train.hidden_states.vllm_backend import rms_norm
    from eagle3_train.model.verifier_head import load_final_norm

    config_cls = {"llama": tf.LlamaConfig, "gemma3_text": tf.Gemma3TextConfig, "qwen3_next": tf.Qwen3NextConfig,
                  "cohere": tf.CohereConfig}[family]
    extra = {"layer_types": ["full_attention"] * 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
             "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32} if family == "qwen3_next" else {}
    verifier = save_tiny(tmp_path / family, config_cls, **extra)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.5)  # a trained norm is not the init's ones (or zeros for w - 1)
    model.save_pretrained(verifier)
    if family == "cohere":
        with pytest.raises(Eagle3InputError, match="LayerNorm"):
            load_final_norm(verifier)
        return
    x = torch.randn(5, TINY["hidden_size"])
    weight, eps = load_final_norm(verifier)
    with torch.no_grad():
        expected = model.model.norm(x)
    torch.testing.assert_close(rms_norm(x, weight, eps), expected, rtol=1e-5, atol=1e-5)


def test_an_unlisted_model_types_final_norm_is_not_guessed(tmp_path):
    """A model type no family lists (here a Llama checkpoint relabelled): its final norm could be w*x/rms, (1+w)*x/rms
    or a LayerNorm, so the vLLM backend refuses to apply one, naming the HF backend and the family table."""
    import json

    import transformers as tf

    from eagle3_train.model.verifier_head import load_final_norm

    verifier = save_tiny(tmp_path / "unlisted", tf.LlamaConfig)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "model_type": "brand_new_lm"}))
    with pytest.raises(Eagle3InputError, match=r"'brand_new_lm' is not a listed family.*--backend hf"):
        load_final_norm(verifier)
