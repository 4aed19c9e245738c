"""Finetuning through the real pipeline: prepare -> vocab -> extract on a tiny random Llama, train, export, finetune."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support.stage_helpers import train_config

from eagle3_train.export.exporter import export
from eagle3_train.export.inspect import inspect_checkpoint
from eagle3_train.train.trainer import train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stages(tiny_stages):
    return tiny_stages


config = train_config


def test_finetune_from_our_export_starts_where_the_source_ended(stages, tmp_path):
    root, verifier = stages
    flags = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    source = train(config(root, tmp_path / "a", max_steps=6, **flags))
    export(tmp_path / "a", tmp_path / "export", fmt="speculators", dtype="float32", verifier=str(verifier))
    # lr 0: the finetune run's only step changes nothing, so it must validate exactly like the source's last step.
    again = train(config(root, tmp_path / "b", max_steps=1, lr=0.0, finetune_from=str(tmp_path / "export")))
    assert again["validation"] == pytest.approx(source["validation"], rel=1e-6, abs=1e-6)
    a = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tmp_path / "b" / "training_metadata.json").read_text())
    assert all(meta["draft_config"][k] is v for k, v in flags.items())  # the source's wiring, not the run's defaults
    init = meta["init"]
    assert init["method"] == "finetune" and init["format"] == "speculators" and init["keys"]["missing"] == []
    assert init["source_metadata"]["init"]["method"] == "random"
    chain = inspect_checkpoint(tmp_path / "b")["lineage"]
    assert [e.get("run") for e in chain] == [str(tmp_path / "b"), str(tmp_path / "a")]


def test_finetune_with_a_rebuilt_smaller_vocabulary_trains(stages, tmp_path):
    root, _ = stages
    train(config(root, tmp_path / "a", max_steps=4))
    result = train(config(root, tmp_path / "b", max_steps=3, vocab=str(root / "vocab-small"),
                          finetune_from=str(tmp_path / "a"), finetune_vocab="rebuild"))
    assert result["step"] == 3
    meta = json.loads((tmp_path / "b" / "training_metadata.json").read_text())
    overlap = meta["init"]["vocab_overlap"]
    assert meta["draft_config"]["draft_vocab_size"] == 700 == overlap["run_draft_vocab_size"]
    # Both vocabularies are the most frequent tokens of the same data: the smaller one lies inside the larger.
    assert overlap["shared_tokens"] == 700 and overlap["source_draft_vocab_size"] == 1024


def test_finetune_keeping_the_sources_vocabulary_needs_no_vocab(stages, tmp_path):
    """finetune_vocab keep uses the source's d2t/t2d: a run vocabulary is then optional (it was required, and unused);
    rebuild still needs one, by name."""
    root, _ = stages
    train(config(root, tmp_path / "a", max_steps=2))
    result = train(config(root, tmp_path / "b", max_steps=2, vocab="", finetune_from=str(tmp_path / "a")))
    assert result["step"] == 2
    meta = json.loads((tmp_path / "b" / "training_metadata.json").read_text())
    assert meta["vocab"]["origin"].startswith("finetune source") and meta["vocab"]["run_vocab_not_used"] is None
    assert meta["init"]["vocab_overlap"]["shared_tokens"] is None
    from eagle3_train.utils.io import Eagle3InputError

    with pytest.raises(Eagle3InputError, match="train.vocab is required"):
        train(config(root, tmp_path / "c", max_steps=2, vocab="", finetune_from=str(tmp_path / "a"),
                     finetune_vocab="rebuild"))


def test_peagle_finetunes_from_eagle3_and_from_its_own_export(stages, tmp_path):
    """An EAGLE-3 draft finetunes into P-EAGLE (its weights loaded, mask_hidden fresh, said in the notes); a P-EAGLE
    export finetunes into P-EAGLE unchanged at lr 0, keeping its mask token and mask_hidden."""
    root, verifier = stages
    train(config(root, tmp_path / "eagle3", max_steps=3))
    peagle = train(config(root, tmp_path / "peagle", max_steps=3, method="peagle",
                          finetune_from=str(tmp_path / "eagle3")))
    meta = json.loads((tmp_path / "peagle" / "training_metadata.json").read_text())
    assert meta["draft_config"]["method"] == "peagle" and meta["init"]["keys"]["missing"] == []
    assert "fc.weight" in meta["init"]["keys"]["loaded"] and "mask_hidden" not in meta["init"]["keys"]["loaded"]
    assert any("eagle3 draft, trained here as peagle" in n for n in meta["init"]["notes"])
    mask = meta["draft_config"]["mask_token_id"]
    for fmt in ("eagle", "speculators"):
        export(tmp_path / "peagle", tmp_path / fmt, fmt=fmt, dtype="float32", verifier=str(verifier))
        config_json = json.loads((tmp_path / fmt / "config.json").read_text())
        assert config_json["mask_token_id"] == mask
        width = 3 * meta["draft_config"]["hidden_size"]
        assert load_file(str(tmp_path / fmt / "model.safetensors"))["mask_hidden"].shape == (1, width)
        again = train(config(root, tmp_path / f"again-{fmt}", max_steps=1, lr=0.0, method="peagle",
                             finetune_from=str(tmp_path / fmt)))
        assert again["validation"] == pytest.approx(peagle["validation"], rel=1e-6, abs=1e-6)
        a = load_file(str(tmp_path / "peagle" / "final" / "model.safetensors"))
        b = load_file(str(tmp_path / f"again-{fmt}" / "final" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and back to EAGLE-3: the mask_hidden is dropped, named
    back = train(config(root, tmp_path / "back", max_steps=1, finetune_from=str(tmp_path / "eagle")))
    back_meta = json.loads((tmp_path / "back" / "training_metadata.json").read_text())
    assert back["step"] == 1 and "mask_hidden" in back_meta["init"]["keys"]["ignored"]


def test_a_dflash_export_reads_back_as_trained(stages, tmp_path):
    """A DFlash draft exported in the z-lab layout reads back as the draft it was (its config, the taps vLLM adds 1
    to, its block) and finetunes unchanged at lr 0; the speculators format is refused with the reason."""
    root, verifier = stages
    trained = train(config(root, tmp_path / "dflash", max_steps=3, method="dflash"))
    export(tmp_path / "dflash", tmp_path / "export", fmt="eagle", dtype="float32")
    meta = json.loads((tmp_path / "dflash" / "training_metadata.json").read_text())
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["dflash_config"]["target_layer_ids"] == [i - 1 for i in meta["draft_config"]["aux_layer_ids"]]
    assert exported["block_size"] == 4 and "layers.0.self_attn.q_norm.weight" in load_file(
        str(tmp_path / "export" / "model.safetensors"))
    again = train(config(root, tmp_path / "again", max_steps=1, lr=0.0, method="dflash",
                         finetune_from=str(tmp_path / "export")))
    assert again["validation"] == pytest.approx(trained["validation"], rel=1e-6, abs=1e-6)
    again_meta = json.loads((tmp_path / "again" / "training_metadata.json").read_text())
    assert again_meta["init"]["aux_layers"]["match"] is True and not again_meta["init"]["keys"]["missing"]
    with pytest.raises(Exception, match="not exported in the speculators format"):
        export(tmp_path / "dflash", tmp_path / "spec", fmt="speculators", verifier=str(verifier))
