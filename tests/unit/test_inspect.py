"""`eagle3-train inspect`: summary of any draft layout, read from headers only, and the lineage of finetunes."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from support.draft_layouts import (
    VD,
    reference_draft,
    train_config,
    write_big_eagle_draft,
    write_eagle_original,
    write_ours,
    write_speculators,
)

from eagle3_train import cli
from eagle3_train.checkpoints.native import save_checkpoint
from eagle3_train.export.exporter import export
from eagle3_train.export.inspect import format_report, inspect_checkpoint
from eagle3_train.train.finetune import finetune_model
from eagle3_train.train.metadata import build_metadata
from eagle3_train.utils.io import Eagle3InputError


@pytest.fixture(scope="module")
def ref(head, vocab_a):
    """Overrides conftest's: this module's reference has every optional norm."""
    return reference_draft(head[0], vocab_a, norm_before_fc=True, norm_output=True, norm_before_residual=True)


def test_external_speculators_draft(ref, tmp_path):
    info = inspect_checkpoint(write_speculators(ref, tmp_path / "spec"))
    s = info["summary"]
    assert info["format"] == "speculators" and s["speculators_version"] == "0.9.0"
    assert (s["norm_before_fc"], s["norm_output"], s["norm_before_residual"], s["fc_norm"]) == (True, True, True, False)
    assert s["aux_layer_ids"] == [2, 15, 27] and s["aux_ids_origin"] == "top-level"
    assert info["tensors"]["input_norm.weight"] == {"shape": [3 * 576], "dtype": "bfloat16"}
    assert info["tensors"]["layers.0.self_attn.q_proj.weight"]["shape"] == [9 * 64, 2 * 576]
    assert info["tensors"]["d2t"]["dtype"] == "int64"
    ids = ref.draft_token_ids()
    assert info["vocab"]["token_id_range"] == [int(ids.min()), int(ids.max())]
    assert s["parameters"] == sum(v.numel() for k, v in ref.trainable_state_dict().items() if k not in ("d2t", "t2d"))
    assert info["lineage"] == []
    assert "no training_metadata.json" in format_report(info)


def test_original_eagle_bin_lists_its_own_names(head, vocab_a, tmp_path):
    ref = reference_draft(head[0], vocab_a)
    info = inspect_checkpoint(write_eagle_original(ref, tmp_path / "eagle"))
    assert info["format"] == "eagle"
    assert "midlayer.mlp.down_proj.weight" in info["tensors"] and "t2d" not in info["tensors"]
    assert info["summary"]["aux_ids_origin"] == "default" and info["summary"]["aux_layer_ids"] is None
    assert any("t2d rebuilt" in n for n in info["notes"])
    # what the file stores, not what the reader rebuilt
    assert info["summary"]["stores_d2t"] and not info["summary"]["stores_t2d"]
    assert "stored: d2t yes, t2d no" in format_report(info)


def test_an_mla_draft_is_described_as_mla(tmp_path):
    """An MLA source is summarised with its ranks and head dims, not Llama heads x hidden/heads (issue 33)."""
    from support.kimi_layouts import KIMI_MLA_DRAFT_CONFIG, write_kimi_mla_draft

    info = inspect_checkpoint(write_kimi_mla_draft(tmp_path / "mla"))
    s = info["summary"]
    assert s["architecture"] == "mla" and "head_dim" not in s and "num_key_value_heads" not in s
    for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert s[k] == KIMI_MLA_DRAFT_CONFIG[k]
    assert s["stores_d2t"] and s["stores_t2d"]
    text = format_report(info)
    assert "MLA 64 heads (q_lora 1536, kv_lora 512, qk 128+64, v 128)" in text and "x 112" not in text


def test_a_whole_vocabulary_draft_stores_no_map(tmp_path):
    """A draft over the whole vocabulary (as our export writes it for vLLM) holds no d2t/t2d: the reader makes the
    identity map, and the summary says they are not stored."""
    d = write_big_eagle_draft(tmp_path / "whole", hidden=64, heads=4, inter=128, vocab=512, draft_vocab=512)
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if k not in ("d2t", "t2d")}
    save_file(tensors, str(d / "model.safetensors"))
    s = inspect_checkpoint(d)["summary"]
    assert s["draft_vocab_size"] == 512 and not s["stores_d2t"] and not s["stores_t2d"]


def test_huge_draft_is_inspected_from_headers(tmp_path):
    d = write_big_eagle_draft(tmp_path / "kimi", hidden=7168, heads=64, inter=18432, vocab=163840, draft_vocab=32000)
    info = inspect_checkpoint(d)
    s = info["summary"]
    assert (s["hidden_size"], s["vocab_size"], s["draft_vocab_size"]) == (7168, 163840, 32000)
    assert info["tensors"]["fc.weight"] == {"shape": [7168, 3 * 7168], "dtype": "bfloat16"}
    expected = sum(math.prod(t["shape"]) for k, t in info["tensors"].items() if k not in ("d2t", "t2d"))
    assert s["parameters"] == expected > 1_000_000_000 and s["has_embed_tokens"] and s["architecture"] == "llama"
    assert "sha256" not in info["weight_files"]["model.safetensors"]


def test_hashes_on_request(ref, tmp_path):
    d = write_speculators(ref, tmp_path / "spec")
    info = inspect_checkpoint(d, hash_files=True)
    assert info["weight_files"]["model.safetensors"]["sha256"] == \
        hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def _metadata(cfg, inputs, model, init, step):
    return build_metadata(cfg, inputs, model.config, init, 1, started="t", status="finished",
                          progress={"step": step}, metrics={})


def test_lineage_of_an_export_back_to_the_random_start(ref, inputs, tmp_path):
    cfg_a = train_config("", seed=3, out=str(tmp_path / "run-a"))
    run_a = write_ours(ref, tmp_path / "run-a", _metadata(cfg_a, inputs, ref, {"method": "random", "seed": 3}, 100))
    model_b, init_b = finetune_model(train_config(run_a), inputs)
    cfg_b = train_config(run_a, out=str(tmp_path / "run-b"))
    save_checkpoint(tmp_path / "run-b" / "final", model_b, None, _metadata(cfg_b, inputs, model_b, init_b, 40))
    export(tmp_path / "run-b", tmp_path / "export", fmt="eagle", dtype="bfloat16")
    info = inspect_checkpoint(tmp_path / "export")
    chain = info["lineage"]
    assert [e["run"] for e in chain] == [str(tmp_path / "run-b"), str(tmp_path / "run-a")]
    assert chain[0]["from"] == str(run_a) and chain[0]["export"]["format"] == "eagle"
    assert chain[1]["from"] == "random initialisation (seed 3)" and chain[1]["step"] == 100
    text = format_report(info)
    assert f"finetuned from {run_a} (eagle3-train format, vocab keep)" in text
    assert "random initialisation (seed 3)" in text


def test_export_replaces_only_the_same_export_unless_overwrite(ref, inputs, tmp_path):
    cfg = train_config("", out=str(tmp_path / "run"))
    run = write_ours(ref, tmp_path / "run", _metadata(cfg, inputs, ref, {"method": "random", "seed": 0}, 1))
    out = tmp_path / "export"
    first = export(run, out, fmt="eagle", dtype="bfloat16")
    assert export(run, out, fmt="eagle", dtype="bfloat16")["weights_sha256"] == first["weights_sha256"]
    with pytest.raises(Eagle3InputError, match="other dtype.*--overwrite"):
        export(run, out, fmt="eagle", dtype="float16")
    assert export(run, out, fmt="eagle", dtype="float16", overwrite=True)["dtype"] == "float16"
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for overwrite in (False, True):  # --overwrite replaces our own exports only, never a foreign directory
        with pytest.raises(Eagle3InputError, match="not an earlier output"):
            export(run, foreign, fmt="eagle", overwrite=overwrite)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_lineage_ends_at_an_external_draft(ref, inputs, tmp_path):
    spec = write_speculators(ref, tmp_path / "published")
    model, init = finetune_model(train_config(spec), inputs)
    save_checkpoint(tmp_path / "run" / "final", model, None,
                    _metadata(train_config(spec, out=str(tmp_path / "run")), inputs, model, init, 10))
    chain = inspect_checkpoint(tmp_path / "run")["lineage"]
    assert chain[-1]["external"] == str(spec) and chain[-1]["format"] == "speculators"
    assert chain[-1]["weight_files"] == {"model.safetensors":
                                         hashlib.sha256((spec / "model.safetensors").read_bytes()).hexdigest()}


def test_cli(ref, tmp_path, capsys):
    d = write_speculators(ref, tmp_path / "spec")
    assert cli.main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "speculators format" in out and "norm_before_fc=True" in out and "layers.0.mlp.up_proj.weight" in out
    assert cli.main(["inspect", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["draft_vocab_size"] == VD
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    assert cli.main(["inspect", str(d)]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_cli_rejects_a_directory_without_a_draft(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["inspect", str(tmp_path / "empty")]) == 2
    assert "no weights found" in capsys.readouterr().err


def test_inspect_does_not_contradict_itself_on_nested_aux_ids(head, vocab_a, tmp_path):
    """A SpecForge/SGLang draft keeps its ids only in eagle_config (output of layer i): the note says vLLM reads them
    unshifted, and the engine verdict agrees (vLLM not as trained, SGLang as trained)."""
    from support.draft_layouts import write_specforge

    plain = reference_draft(head[0], vocab_a)  # no Eagle 3.1 options: SGLang serves it
    info = inspect_checkpoint(write_specforge(plain, tmp_path / "sf", head[0]))
    assert any("vLLM itself would read them unshifted" in n for n in info["notes"])
    vllm, sglang = info["engines"]["vllm"], info["engines"]["sglang"]
    assert not vllm["serves_as_trained"] and "one layer too early" in vllm["reasons"][0]
    assert sglang["serves_as_trained"]
    assert "vllm: NOT as trained" in format_report(info)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/hostname", "link.safetensors"])
def test_an_index_naming_a_file_outside_the_draft_is_refused(ref, inputs, tmp_path, capsys, name):
    """A published draft's index is not ours: a shard name must be a plain file of the draft's own directory."""
    draft = write_speculators(ref, tmp_path / "spec")
    (tmp_path / "outside.safetensors").write_bytes((draft / "model.safetensors").read_bytes())
    (draft / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    tensors = json.loads((draft / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (draft / "model.safetensors").read_bytes()[:8], "little")])
    (draft / "model.safetensors").rename(tmp_path / "moved.safetensors")
    (draft / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for k in tensors if k != "__metadata__"}}))
    assert cli.main(["inspect", str(draft)]) == 2
    assert "refusing to read it" in capsys.readouterr().err
    with pytest.raises(Eagle3InputError, match="refusing to read it"):
        finetune_model(train_config(draft), inputs)


@pytest.mark.parametrize("patch, message", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a whole number >= 1, got 0"),
    ({"num_key_value_heads": "3"}, "num_key_value_heads must be a whole number >= 1, got '3' (str)"),
    ({"hidden_size": [576]}, "hidden_size must be a whole number >= 1, got [576] (list)"),
    ({"aux_layer_ids": "2,15,27"}, "aux_layer_ids must be a list of 3 layer numbers"),
    ({"vocab_size": None}, "vocab_size must be a whole number >= 1, got None"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps must be a finite number > 0"),
    ({"norm_output": "yes"}, "norm_output must be true or false"),
    ([1, 2], "must hold a JSON object, got list"),
], ids=lambda p: json.dumps(p)[:30] if not isinstance(p, str) else "")
def test_a_draft_config_of_wrong_types_is_one_clear_error_in_every_reader(ref, tmp_path, capsys, patch, message):
    run = write_ours(ref, tmp_path / "run")
    cfg_path = run / "final" / "draft_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(patch if isinstance(patch, list) else {**cfg, **patch}))
    for argv in (["inspect", str(run)], ["export", str(run), "--out", str(tmp_path / "x"), "--format", "eagle"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and str(cfg_path) in err, (argv, err)


def test_a_cut_off_weight_file_is_a_clear_error_for_export(ref, tmp_path, capsys):
    run = write_ours(ref, tmp_path / "run")
    weights = run / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x"), "--format", "eagle"]) == 2
    assert f"weight file {weights} cannot be read (corrupt or truncated?)" in capsys.readouterr().err


@pytest.mark.parametrize("damage", [{"init": "x"}, {"init": {"method": "finetune", "source_metadata": "x"}},
                                    {"export": "x"}, {"settings": [1]}, {"verifier": 5}, {"run": "x"}])
def test_a_training_metadata_of_wrong_shapes_is_one_clear_error(ref, tmp_path, capsys, damage):
    run = write_ours(ref, tmp_path / "run")
    meta = run / "final" / "training_metadata.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **damage}))
    key = next(iter(damage)) if "source_metadata" not in json.dumps(damage) else "init.source_metadata"
    for argv in (["inspect", str(run)], ["export", str(run), "--out", str(tmp_path / "x"), "--format", "eagle"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"'{key}' must be an object" in err and str(meta) in err, err
