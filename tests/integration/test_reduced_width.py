"""Drafts narrower than their verifier (Kimi's 2560-wide drafts under a 7168-wide model): fc reads the verifier's
width (`target_hidden_size`), the draft trains and ships its own embedding, and a finetune from its export is
bit-exact at lr 0, for the Llama and the MLA layer. Served by vLLM in tests/e2e/test_reduced_width_vllm.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.stage_helpers import build_stages, train_config

from eagle3_train.export.exporter import export
from eagle3_train.model.config import DraftConfig
from eagle3_train.testing.tiny_verifiers import build_tiny_verifier
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("family", "architecture", "width"), [("llama", "llama", 32), ("deepseek_v3", "mla", 128)])
def test_a_narrower_draft_trains_exports_and_finetunes_bit_exact(tmp_path_factory, smollm2_dir, family,
                                                                  architecture, width):
    tmp = tmp_path_factory.mktemp(f"narrow-{family}")
    verifier = build_tiny_verifier(family, tmp / "verifier", smollm2_dir)
    H = json.loads((verifier / "config.json").read_text())["hidden_size"]
    root = build_stages(tmp / "stages", verifier)
    source = train(train_config(root, tmp / "a", max_steps=4, architecture=architecture, hidden_size=width))
    cfg = DraftConfig.load(tmp / "a" / "final" / "draft_config.json")
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.own_embedding) == (width, H, True)
    a = load_file(str(tmp / "a" / "final" / "model.safetensors"))
    assert a["fc.weight"].shape == (width, 3 * H) and a["embed_tokens.weight"].shape[1] == width
    meta = json.loads((tmp / "a" / "training_metadata.json").read_text())
    assert meta["init"]["hidden_size"] == width and meta["init"]["lm_head_init"] == "random"

    export(tmp / "a", tmp / "export", fmt="eagle", dtype="float32")  # reloads the export and compares logits
    config = json.loads((tmp / "export" / "config.json").read_text())
    assert (config["hidden_size"], config["target_hidden_size"]) == (width, H)
    with safe_open(str(tmp / "export" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), a["embed_tokens.weight"])  # the trained one ships

    again = train(train_config(root, tmp / "b", max_steps=1, lr=0.0, finetune_from=str(tmp / "export")))
    assert again["validation"] == pytest.approx(source["validation"], rel=1e-6, abs=1e-6)
    b = load_file(str(tmp / "b" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_width_the_heads_do_not_divide_is_refused(tiny_llama_dir):
    config = json.loads((tiny_llama_dir() / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    with pytest.raises(Eagle3InputError, match=f"multiple of the verifier's head_dim {head_dim}"):
        DraftConfig.from_verifier(config, draft_vocab_size=64, hidden_size=head_dim + 1)
    narrow = DraftConfig.from_verifier(config, draft_vocab_size=64, hidden_size=2 * head_dim)
    assert (narrow.num_attention_heads, narrow.head_dim) == (2, head_dim)
    assert narrow.num_attention_heads % narrow.num_key_value_heads == 0
