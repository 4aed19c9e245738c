"""No silent demo verifier: a stage takes the verifier from what it reads (manifest, draft metadata) or requires it."""

from __future__ import annotations

import json

import pytest

from eagle3_train import cli
from eagle3_train.hidden_states.extract import extract


def test_prepare_requires_a_verifier(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["prepare", "--data", "sharegpt", "--out", str(tmp_path / "p")])
    assert e.value.code == 2 and "--verifier" in capsys.readouterr().err


def test_serve_and_served_evaluation_require_a_verifier_without_a_recorded_one(tmp_path, capsys):
    assert cli.main(["serve"]) == 2
    assert "pass --verifier" in capsys.readouterr().err
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert cli.main(["evaluate", "served", "--draft", str(draft)]) == 2
    assert "pass --verifier" in capsys.readouterr().err


@pytest.mark.slow
def test_extract_reads_the_verifier_from_the_prepared_manifest(tiny_stages, tmp_path):
    root, verifier = tiny_stages
    m = extract(root / "prepared", None, tmp_path / "hidden", dtype="float32", max_samples=2, splits=["validation"])
    assert m["verifier"]["path"] == str(verifier)


@pytest.mark.slow
def test_a_verifier_named_by_hub_id_is_recorded_by_that_name_through_export(tiny_llama_dir, tmp_path):
    """A hub id resolves to this machine's cache directory; every stage after prepare takes the verifier from what it
    reads, and the speculators export must still name the hub id (vLLM on another machine loads it by that name)."""
    from support.stage_helpers import train_config

    from eagle3_train.assets.verifier import Verifier
    from eagle3_train.data.prepare import prepare
    from eagle3_train.export.exporter import export
    from eagle3_train.train.trainer import train
    from eagle3_train.vocab.build import build_vocab

    local = tiny_llama_dir(initializer_range=0.5)
    hub_id = "example-org/tiny-verifier"  # what Verifier.resolve returns for a hub id: its name and snapshot dir
    verifier = Verifier(hub_id, local, json.loads((local / "config.json").read_text()))
    prepare("sharegpt", verifier, tmp_path / "prepared", max_length=128, limit=6, val_count=2, seed=0)
    build_vocab(tmp_path / "prepared", tmp_path / "vocab", size=256)
    m = extract(tmp_path / "prepared", None, tmp_path / "hidden", dtype="float32")
    assert m["verifier"]["name"] == hub_id and m["verifier"]["path"] == str(local)
    train(train_config(tmp_path, tmp_path / "run", max_steps=1, verifier=None))
    export(tmp_path / "run", tmp_path / "spec", fmt="speculators")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == hub_id
    meta = json.loads((tmp_path / "spec" / "training_metadata.json").read_text())
    assert meta["verifier"]["name"] == hub_id


def test_a_recorded_verifier_loads_from_its_directory_under_the_name_the_user_gave(tmp_path):
    from eagle3_train.assets.verifier import Verifier, as_verifier
    from eagle3_train.utils.io import Eagle3InputError

    local = tmp_path / "snapshot"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8}))
    (local / "model.safetensors").write_bytes(b"0" * 16)
    v = Verifier.from_record({"name": "org/model", "path": str(local)}, "the test manifest")
    assert (v.name, v.path, v.config["vocab_size"]) == ("org/model", local, 8)
    assert v.identity()["name"] == "org/model" and v.identity()["weights"] == {"model.safetensors": {"bytes": 16}}
    assert set(v.stage_key()) == {"name", "config_sha256", "weights", "mtimes"}
    assert v.servable() == "org/model" and as_verifier(v) is v
    assert Verifier.resolve(local).name == str(local)  # a path given is the name recorded
    with pytest.raises(Eagle3InputError, match="no verifier recorded with the test manifest: pass --verifier"):
        Verifier.from_record({}, "the test manifest")
