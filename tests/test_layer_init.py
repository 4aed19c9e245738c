"""`train.layer_init: verifier`: the draft's decoder layer starts as a copy of a verifier layer."""

from __future__ import annotations

import json

import pytest
import torch
from stage_helpers import train_config
from transformers import LlamaForCausalLM

from eagle3_train.model.attention import LayerTTTCache
from eagle3_train.train.build import build_model
from eagle3_train.train.inputs import resolve_inputs
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError


def _hf_layer(verifier, index):
    model = LlamaForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    return model.model.layers[index], model.model.rotary_emb


@pytest.mark.parametrize("index, want", [(-1, "last"), (0, 0)])
def test_draft_layer_computes_the_verifier_layer(tiny_stages, index, want):
    """With the embedding half of q/k/v silenced, the draft's layer maps its hidden state exactly as the verifier's
    layer maps its input: the hidden half, norms, o_proj, MLP and RoPE all come from that layer."""
    root, verifier = tiny_stages
    cfg = train_config(root, root / "unused", layer_init="verifier", layer_init_index=index)
    inputs = resolve_inputs(cfg)
    model = build_model(cfg, inputs).eval()
    layers = inputs.verifier_config["num_hidden_layers"]
    hf_layer, rotary = _hf_layer(verifier, layers - 1 if want == "last" else want)
    layer = model.layers[0]
    H = model.config.hidden_size
    with torch.no_grad():
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.weight[:, :H] = 0
        torch.manual_seed(0)
        h = torch.randn(2, 7, H)
        ids = torch.randint(0, model.config.vocab_size, (2, 7))
        pos = torch.arange(7).expand(2, 7)
        cos, sin = model.rotary(h, pos)
        ours = layer.ttt(h, model.embed_tokens(ids), cos, sin, LayerTTTCache())
        causal = torch.where(torch.ones(7, 7, dtype=torch.bool).tril(), 0.0, -torch.inf).expand(2, 1, 7, 7)
        theirs = hf_layer(h, position_embeddings=rotary(h, pos), attention_mask=causal, position_ids=pos)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_embedding_half_random_or_verifier(tiny_stages):
    root, _ = tiny_stages
    H = None
    halves = {}
    for embed in ("random", "verifier"):
        cfg = train_config(root, root / "unused", layer_init="verifier", layer_init_embed=embed)
        q = build_model(cfg, resolve_inputs(cfg)).layers[0].self_attn.q_proj.weight.detach()
        H = q.shape[1] // 2
        halves[embed] = q[:, :H], q[:, H:]
    assert torch.equal(halves["random"][1], halves["verifier"][1])
    assert torch.equal(halves["verifier"][0], halves["verifier"][1])
    assert not torch.equal(halves["random"][0], halves["random"][1])
    random_cfg = train_config(root, root / "unused")
    random_q = build_model(random_cfg, resolve_inputs(random_cfg)).layers[0].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(halves["random"][0], random_q[:, :H])  # the same seeded init as without the option


def test_bad_layer_init_values_are_refused(tiny_stages):
    root, _ = tiny_stages
    cfg = train_config(root, root / "unused", layer_init="verifier", layer_init_index=99)
    with pytest.raises(Eagle3InputError, match=r"layer_init_index 99: .* the verifier has 0\.\.3"):
        build_model(cfg, resolve_inputs(cfg))
    with pytest.raises(Eagle3InputError, match="layer_init verifier .*train.finetune_from"):
        train(train_config(root, root / "unused", layer_init="verifier", finetune_from=str(root / "any-draft")))
    cfg = train_config(root, root / "unused", layer_init="verifier", intermediate_size=24)
    with pytest.raises(Eagle3InputError, match=r"mlp.gate_proj.weight: shape .*train.intermediate_size"):
        build_model(cfg, resolve_inputs(cfg))


def test_run_records_and_trains_from_the_verifier_layer(tiny_stages, tmp_path):
    root, _ = tiny_stages
    train(train_config(root, tmp_path / "run", max_steps=2, layer_init="verifier"))
    meta = json.loads((tmp_path / "run" / "training_metadata.json").read_text())
    assert meta["init"]["layer_init"] == "verifier"
    assert meta["init"]["layer_init_layers"] == [3]
    assert meta["init"]["layer_init_embed"] == "random"
