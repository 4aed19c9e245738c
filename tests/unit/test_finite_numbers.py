"""A NaN or an infinity never turns into a draft quietly: settings (tests/unit/test_settings.py), training steps
(integration/test_train.py), and here a finetune source, a checkpoint to export or evaluate, and the verifier's head."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.draft_layouts import train_config, write_ours, write_speculators

from eagle3_train import cli
from eagle3_train.train.finetune import finetune_model
from eagle3_train.utils.io import Eagle3InputError


def _poison(weights, key_part: str, value: float = float("nan")) -> str:
    tensors = load_file(str(weights))
    key = next(k for k in sorted(tensors) if key_part in k and tensors[k].is_floating_point())
    tensors[key].view(-1)[3] = value
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return key


def test_a_finetune_source_with_one_nan_is_refused_naming_the_tensor(ref, inputs, tmp_path):
    draft = write_speculators(ref, tmp_path / "spec")
    key = _poison(draft / "model.safetensors", "mlp.down_proj")
    with pytest.raises(Eagle3InputError, match=rf"finetune source .*tensor '{key}' holds 1 NaN/inf"):
        finetune_model(train_config(draft), inputs)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_export_and_evaluate_refuse_a_checkpoint_of_non_finite_weights(ref, tmp_path, capsys, value):
    run = write_ours(ref, tmp_path / "run")
    key = _poison(run / "final" / "model.safetensors", "fc.", value)
    assert cli.main(["export", str(run), "--out", str(tmp_path / "draft"), "--format", "eagle"]) == 2
    assert f"tensor '{key}' holds 1 NaN/inf" in capsys.readouterr().err
    assert not (tmp_path / "draft").exists()
    assert cli.main(["evaluate", "offline", "--draft", str(run), "--verifier", "smollm2-135m-instruct",
                     "--num-prompts", "1"]) == 2
    assert f"tensor '{key}' holds 1 NaN/inf" in capsys.readouterr().err


def test_a_verifier_head_with_an_infinity_is_refused(tiny_llama_dir, tmp_path):
    from eagle3_train.train.inputs import _verifier_head

    verifier = tiny_llama_dir(initializer_range=0.5)
    weights = verifier / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.embed_tokens.weight"][5, 0] = torch.inf
    copy = tmp_path / "verifier"
    copy.mkdir()
    for f in verifier.iterdir():
        if f.name != "model.safetensors":
            (copy / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Eagle3InputError, match="tensor 'embed_tokens' holds 1 NaN/inf"):
        _verifier_head(copy, False)
