"""Remote code, explicitly: a verifier whose tokenizer is a class in its own directory loads only with
--trust-remote-code (off by default), and the choice is recorded in every manifest and the training metadata."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from eagle3_train.data.prepare import prepare
from eagle3_train.hidden_states.extract import extract
from eagle3_train.serving.vllm_server import VLLMServer
from eagle3_train.train import cli as train_cli
from eagle3_train.utils.io import Eagle3InputError

TOKENIZER_CODE = '''
from transformers import PreTrainedTokenizerFast


class ShippedTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class that exists only in this checkpoint directory (as Kimi's TikTokenTokenizer does)."""
    shipped_with_the_checkpoint = True
'''


@pytest.fixture
def remote_code_verifier(tiny_llama_dir, tmp_path):
    d = tmp_path / "verifier-with-code"
    shutil.copytree(tiny_llama_dir(), d)
    (d / "shipped_tokenizer.py").write_text(TOKENIZER_CODE)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "ShippedTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["shipped_tokenizer.ShippedTokenizer", None]}
    cfg_path.write_text(json.dumps(cfg))
    return d


def test_prepare_refuses_remote_code_unless_trusted_and_records_it(remote_code_verifier, tmp_path):
    with pytest.raises(Eagle3InputError, match="--trust-remote-code"):
        prepare("sharegpt", remote_code_verifier, tmp_path / "refused", max_length=128, limit=6, val_count=1)
    m = prepare("sharegpt", remote_code_verifier, tmp_path / "prepared", max_length=128, limit=6, val_count=1,
                trust_remote_code=True)
    assert m["tokenizer"]["class"] == "ShippedTokenizer" and m["trust_remote_code"] is True
    e = extract(tmp_path / "prepared", remote_code_verifier, tmp_path / "hidden", dtype="float32",
                trust_remote_code=True)
    assert e["trust_remote_code"] is True


def test_train_and_serve_take_the_flag(tmp_path):
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    assert train_cli.config_from_args(p.parse_args(["--trust-remote-code"])).trust_remote_code is True
    assert train_cli.config_from_args(p.parse_args([])).trust_remote_code is False  # off by default
    assert "--trust-remote-code" in VLLMServer("m", port=1, trust_remote_code=True).command()
    assert "--trust-remote-code" not in VLLMServer("m", port=1).command()


def test_pipeline_accepts_the_yaml_key(tmp_path, capsys):
    from eagle3_train.cli import main
    from eagle3_train.pipeline.config import merged_config

    assert merged_config({})["trust_remote_code"] is False
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\ntrust_remote_code: true\n")
    assert main(["run", "--config", str(config), "--dry-run"]) == 0


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran as code",))


def test_a_verifier_whose_pickled_weights_hold_code_is_refused_clearly(tiny_llama_dir, tmp_path, capsys):
    """torch.load(weights_only=True) refuses the pickle; the stages say why instead of a traceback."""
    import shutil

    import torch
    from safetensors.torch import load_file


    src = tiny_llama_dir()
    verifier = tmp_path / "verifier"
    shutil.copytree(src, verifier, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    torch.save({**tensors, "extra": _RunsCode()}, verifier / "pytorch_model.bin")
    from transformers import AutoModelForCausalLM

    from eagle3_train.assets.verifier import from_pretrained
    from eagle3_train.utils.io import Eagle3InputError

    with pytest.raises(Eagle3InputError, match="hold objects other than tensors"):
        from_pretrained(AutoModelForCausalLM, verifier, False)
    assert "this ran as code" not in capsys.readouterr().out
