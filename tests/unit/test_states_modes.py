"""The tables that choose hidden-state sources (`hidden_states/modes.py`) and extract backends
(`hidden_states/backends.py`), and the one manifest writer and bytes-per-token formula both stores share."""

from __future__ import annotations

import typing
from dataclasses import replace
from pathlib import Path

import pytest
from support.stage_helpers import train_config

from eagle3_train.hidden_states import store
from eagle3_train.hidden_states.backends import BACKENDS, backend_of
from eagle3_train.hidden_states.manifest import new_manifest
from eagle3_train.hidden_states.modes import MODES, _store_manifest, open_source, states_mode
from eagle3_train.hidden_states.source import StoredSource
from eagle3_train.settings import ExtractBackend
from eagle3_train.settings.train import TrainConfig
from eagle3_train.utils.io import Eagle3InputError, read_json
from eagle3_train.utils.store_bytes import bytes_per_token as stored_bytes_per_token


def test_every_setting_value_has_an_entry():
    assert set(MODES) == set(typing.get_args(typing.get_type_hints(TrainConfig)["hidden_states_mode"]))
    assert set(BACKENDS) == set(typing.get_args(ExtractBackend))
    assert [m for m in MODES.values() if m.reads_stored] == [MODES["offline"]]
    assert [m.name for m in MODES.values() if m.served] == ["online", "hybrid"]
    assert [m.name for m in MODES.values() if m.stores] == ["hybrid"]
    assert [m.name for m in MODES.values() if m.on_disk] == ["offline", "hybrid"]
    assert backend_of("hf").runs_verifier_here and not backend_of("vllm").runs_verifier_here


def test_unknown_names_are_refused_naming_the_valid_ones():
    with pytest.raises(Eagle3InputError, match=r"train.hidden_states_mode must be one of offline, online, hybrid, "
                                               r"got 'disk'"):
        states_mode("disk")
    with pytest.raises(Eagle3InputError, match="backend must be one of hf, vllm"):
        backend_of("sglang")
    with pytest.raises(Eagle3InputError, match="hidden_states_mode"):
        states_mode(None)


def test_states_dir_of_each_mode(tmp_path):
    assert states_mode("offline").states_dir("hs", tmp_path) == Path("hs")
    assert states_mode("online").states_dir("hs", tmp_path) == Path("")
    assert states_mode("hybrid").states_dir("", tmp_path) == tmp_path / "hidden_states"
    assert states_mode("hybrid").states_dir("mine", tmp_path) == Path("mine")


def test_vllm_backend_argument_checks():
    vllm = backend_of("vllm")
    with pytest.raises(Eagle3InputError, match="without torchrun"):
        vllm.check_arguments(2, ["http://x/v1"], {"hidden_states_dir": "d"})
    with pytest.raises(Eagle3InputError, match="needs --endpoint"):
        vllm.check_arguments(1, [], {"hidden_states_dir": "d"})
    with pytest.raises(Eagle3InputError, match="needs --hidden-states-dir"):
        vllm.check_arguments(1, ["http://x/v1"], {})
    vllm.check_arguments(1, ["http://x/v1"], {"hidden_states_dir": "d"})
    backend_of("hf").check_arguments(4, [], {})
    assert backend_of("vllm").placement("cuda", "float16", {}, str) == ("vllm", None)


def test_bytes_per_token_counts_the_fp8_scales():
    assert stored_bytes_per_token(8, "bfloat16") == 4 * 8 * 2
    assert stored_bytes_per_token(8, "float32") == 4 * 8 * 4
    assert stored_bytes_per_token(8, "float8_e4m3") == 4 * 8 + 4 * 4  # 3 aux rows and the final one, a scale each


def test_new_manifest_keeps_what_a_resume_continues(tmp_path):
    settings = {"verifier": {"path": "v"}, "backend": "hf", "layer_ids": [1, 2, 3], "dtype": "float8_e4m3",
                "hidden_size": 8, "num_layers": 6, "prepared_manifest_sha256": "abc"}
    old = {"created": "then", "verifier_stats": {"vocab_size": 5}, "splits": {"train": {"a": 1}, "extra": {"b": 2}}}
    m = new_manifest(settings, verifier_name="v", prepared_dir=tmp_path, old=old, writes=("train",), device="cpu")
    assert m["format"] == store.FORMAT and m["status"] == "in_progress" and m["device"] == "cpu"
    assert m["bytes_per_token"] == 48 and m["aux_width"] == 24 and "fp8_scales" in m
    assert m["created"] == "then" and m["verifier_stats"] == {"vocab_size": 5} and m["splits"] == {"extra": {"b": 2}}
    fresh = new_manifest({**settings, "backend": "vllm", "dtype": "bfloat16"}, verifier_name="v",
                         prepared_dir=tmp_path)
    assert fresh["vllm"] is None and "verifier_stats" not in fresh and "fp8_scales" not in fresh
    assert fresh["splits"] == {} and fresh["bytes_per_token"] == 64


def test_hybrid_store_manifest_is_the_extract_one(tiny_stages):
    """The hybrid store's manifest comes from the same writer as extract's: the same identity fields and sizes."""
    from eagle3_train.train.inputs import resolve_inputs

    root, _ = tiny_stages
    cfg = train_config(root, root / "unused", hidden_states_dtype="float32")
    inputs = resolve_inputs(cfg, head_shapes_only=True)
    hybrid = _store_manifest(replace(cfg, hidden_states_mode="hybrid"), inputs)
    extracted = read_json(root / "hidden" / "manifest.json", "manifest")
    for key in ("format", "format_version", "layer_ids", "dtype", "hidden_size", "num_layers", "aux_width",
                "bytes_per_token", "prepared_manifest_sha256", "prepared_dir", "verifier_name"):
        assert hybrid[key] == extracted[key], key
    assert hybrid["backend"] == "vllm" and hybrid["written_by"] == "train (hybrid mode)"
    source = open_source(cfg, inputs, "train")
    assert isinstance(source, StoredSource) and source.sample_indices()
    source.close()
