"""The aux-layer trap: a finetune source's features must come from the verifier layers the run extracts.

Top-level `eagle_aux_hidden_state_layer_ids` are vLLM's ids (input of layer i); ids only in the nested `eagle_config`
are SGLang's (output of layer i = input of i+1); both present must name the same layers; neither means the engines'
default (2, L//2, L-3). A disagreement between source and run stops the finetune unless explicitly allowed.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from support.draft_layouts import (
    LAYER_IDS,
    make_inputs,
    probe_logits,
    train_config,
    write_eagle_aux_keys,
)

from eagle3_train.train.cli import add_arguments, config_from_args
from eagle3_train.train.finetune import finetune_model
from eagle3_train.train.metadata import build_metadata
from eagle3_train.utils.io import Eagle3InputError

OTHER = (3, 16, 28)  # one layer deeper than LAYER_IDS (2, 15, 27), the default taps of the 30-layer verifier
SGL = [i - 1 for i in LAYER_IDS]  # the same physical layers in SGLang's convention


# (top-level ids, nested ids) -> (source layers in vLLM's convention, origin)
CASES = {
    "nested_only": (None, SGL, list(LAYER_IDS), "nested"),
    "top_level_only": (list(LAYER_IDS), None, list(LAYER_IDS), "top-level"),
    "both_agree": (list(LAYER_IDS), SGL, list(LAYER_IDS), "top-level"),
    "neither": (None, None, list(LAYER_IDS), "default"),  # (2, 30 // 2, 30 - 3)
}


@pytest.mark.parametrize("case", list(CASES))
def test_source_layers_are_read_in_each_convention_and_recorded(case, ref, head, vocab_a, tmp_path):
    top, nested, layers, origin = CASES[case]
    source = write_eagle_aux_keys(ref, tmp_path / case, top, nested)
    model, record = finetune_model(train_config(source), make_inputs(tmp_path, *head, vocab_a))
    aux = record["aux_layers"]
    assert aux["source"] == layers and aux["source_origin"] == origin
    assert aux["run"] == list(LAYER_IDS) and aux["match"] is True and aux["allow_mismatch"] is False
    assert aux["source_config_keys"] == {"eagle_aux_hidden_state_layer_ids": top,
                                         "eagle_config.eagle_aux_hidden_state_layer_ids": nested}
    assert f"inputs of verifier layers {layers}" in aux["source_explained"]
    assert model.config.aux_layer_ids == LAYER_IDS
    assert torch.equal(probe_logits(model), probe_logits(ref))


@pytest.mark.parametrize("case", list(CASES))
def test_source_and_run_on_other_layers_are_refused(case, ref, head, vocab_a, tmp_path):
    top, nested, layers, origin = CASES[case]
    source = write_eagle_aux_keys(ref, tmp_path / case, top, nested)
    with pytest.raises(Eagle3InputError) as e:
        finetune_model(train_config(source), make_inputs(tmp_path, *head, vocab_a, layer_ids=OTHER))
    msg = str(e.value)
    assert f"inputs of verifier layers {layers}" in msg and f"inputs of verifier layers {list(OTHER)}" in msg
    assert "--allow-aux-layer-mismatch" in msg and f"--layer-ids {','.join(map(str, layers))}" in msg
    assert {"nested": "SGLang", "top-level": "vLLM", "default": "default"}[origin] in msg


def test_vllm_ids_written_into_the_nested_key_are_read_one_layer_deeper(ref, head, vocab_a, tmp_path):
    """The trap itself: [2, 15, 27] in eagle_config means outputs of those layers, i.e. inputs of [3, 16, 28]."""
    source = write_eagle_aux_keys(ref, tmp_path / "sf", None, list(LAYER_IDS))
    with pytest.raises(Eagle3InputError, match=r"inputs of verifier layers \[3, 16, 28\]"):
        finetune_model(train_config(source), make_inputs(tmp_path, *head, vocab_a))
    _, record = finetune_model(train_config(source), make_inputs(tmp_path, *head, vocab_a, layer_ids=OTHER))
    assert record["aux_layers"]["source"] == list(OTHER) and record["aux_layers"]["match"]


def test_top_level_and_nested_ids_that_disagree_are_refused(ref, head, vocab_a, tmp_path):
    source = write_eagle_aux_keys(ref, tmp_path / "both", list(LAYER_IDS), list(LAYER_IDS))
    for layer_ids in (LAYER_IDS, OTHER):  # whichever layers the run extracted
        with pytest.raises(Eagle3InputError) as e:
            finetune_model(train_config(source), make_inputs(tmp_path, *head, vocab_a, layer_ids=layer_ids))
        msg = str(e.value)
        assert "config.json" in msg and "name different verifier layers" in msg and "[3, 16, 28]" in msg
        assert "allow-aux-layer-mismatch" not in msg  # the source itself is ambiguous: no override makes it right


def test_override_finetunes_on_the_runs_layers_and_is_recorded(ref, head, vocab_a, tmp_path, caplog):
    source = write_eagle_aux_keys(ref, tmp_path / "top", list(LAYER_IDS), None)
    inputs = make_inputs(tmp_path, *head, vocab_a, layer_ids=OTHER)
    cfg = train_config(source, allow_aux_layer_mismatch=True)
    with caplog.at_level(logging.WARNING):
        model, record = finetune_model(cfg, inputs)
    assert model.config.aux_layer_ids == OTHER  # the draft now reads (and its export names) the run's layers
    aux = record["aux_layers"]
    assert aux["match"] is False and aux["allow_mismatch"] is True and aux["source"] == list(LAYER_IDS)
    assert any("allow_aux_layer_mismatch" in n for n in record["notes"])
    assert any("allow_aux_layer_mismatch" in r.getMessage() for r in caplog.records)
    meta = build_metadata(cfg, inputs, model.config, record, 1, started="now", status="running", progress={},
                          metrics={})
    assert meta["settings"]["allow_aux_layer_mismatch"] is True
    assert meta["init"]["aux_layers"]["match"] is False and meta["data"]["layer_ids"] == list(OTHER)


def test_cli_flag_sets_the_override(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--allow-aux-layer-mismatch"])).allow_aux_layer_mismatch is True
    assert config_from_args(p.parse_args([])).allow_aux_layer_mismatch is False


@pytest.mark.parametrize("model_type, want", [("llama", [2, 18, 33]), ("kimi_k2", [1, 17, 32])])
def test_a_torchspec_vllm_export_is_shifted_only_for_kimi_k2(ref, tmp_path, model_type, want):
    """TorchSpec's convert_to_hf adds 1 to the ids (the nested ones too) only for `model_type: kimi_k2` exported for
    vLLM: a Llama-layer export's nested ids stay outputs of layers (SGLang's), read +1 (nested [1, 17, 32] is
    [2, 18, 33]); a kimi_k2 one's are already vLLM's."""
    import json

    from safetensors.torch import load_file, save_file

    from eagle3_train.checkpoints.formats import load_draft_source

    d = write_eagle_aux_keys(ref, tmp_path / model_type, None, [1, 17, 32])
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": model_type, "_torchspec_version": "0.3.0"}))
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(d / "model.safetensors"))
    assert list(load_draft_source(d, shapes_only=True).config.aux_layer_ids) == want


def test_layer_0_of_a_deepseek_verifier_is_refused_where_vllm_could_never_serve_it(tmp_path):
    """vLLM's DeepSeek-V2/V3 model (Kimi's too) adds the residual to the tapped layer's input, and before layer 0
    there is none (a TypeError at serving): every stage that sets the taps refuses id 0 for that family, and keeps
    accepting it for a Llama."""
    import json

    from eagle3_train.assets.families import family_of
    from eagle3_train.model.aux_layers import validate_layer_ids
    from eagle3_train.serving.vllm_server import hidden_states_layer_ids
    from eagle3_train.testing.tiny_verifiers import _config
    from eagle3_train.utils.io import Eagle3InputError

    config = _config("deepseek_v3").to_dict()
    assert family_of(config).first_aux_layer == 1 and family_of({"model_type": "llama"}).first_aux_layer == 0
    with pytest.raises(Eagle3InputError, match="no residual stream before layer 1"):
        validate_layer_ids([0, 1, 2], 4, "verifier v", family_of(config).first_aux_layer)
    assert validate_layer_ids([0, 1, 2], 4, "verifier v") == (0, 1, 2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3InputError, match="vLLM cannot tap the input of its layer 0"):
        hidden_states_layer_ids(tmp_path, "0,1,2")
    assert hidden_states_layer_ids(tmp_path, "1,2,3") == [1, 2, 3, 4]
