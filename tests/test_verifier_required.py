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
