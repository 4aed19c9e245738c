"""Against memorising a small pool over several epochs: `train.feature_noise` (noise relative to each aux feature's
scale) and `train.final_norm_init: verifier` (the draft's head starts as the verifier's)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from stage_helpers import train_config

from eagle3_train.model.verifier_head import load_final_norm
from eagle3_train.train.build import build_model
from eagle3_train.train.config import TrainConfig
from eagle3_train.train.data import TrainingSamples, feature_std
from eagle3_train.train.inputs import resolve_inputs
from eagle3_train.train.objective import FeatureNoise, Objective, add_feature_noise
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.trainer import train
from eagle3_train.train.ttt import supervised_counts, ttt_forward
from eagle3_train.utils.config import to_dataclass
from eagle3_train.utils.io import Eagle3InputError


def test_feature_std_counts_real_tokens_only():
    torch.manual_seed(0)
    aux = torch.randn(2, 6, 4)
    aux[1, 3:] = 1e4  # padding of the second row
    lengths = torch.tensor([6, 3])
    real = torch.cat([aux[0], aux[1, :3]])
    torch.testing.assert_close(feature_std(aux, lengths), real.std(dim=0, correction=0))


def test_feature_noise_follows_each_features_scale():
    """Features of std 0.01 and 100 get noise of 0.2x their own std each."""
    torch.manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 100.0])
    aux = torch.randn(4, 5000, 3) * scales
    lengths = torch.full((4,), 5000)
    noise = add_feature_noise(aux, lengths, 0.2) - aux
    ratio = noise.reshape(-1, 3).std(dim=0) / (0.2 * aux.reshape(-1, 3).std(dim=0))
    torch.testing.assert_close(ratio, torch.ones(3), atol=0.03, rtol=0)


def _forward(model, inputs, batch, feature_noise):
    targets = verifier_targets(batch.final, batch.loss_mask, inputs.lm_head, model.draft_token_ids(), model.t2d)
    if model.training:  # the trainer perturbs training batches only
        batch = FeatureNoise(relative=feature_noise)(batch)
    return ttt_forward(model, batch, targets, Objective(3, (1.0, 0.8, 0.64), checkpoint_loss=False,
                                                        checkpoint_mlp=False), supervised_counts(batch.loss_mask, 3))[0]


def test_feature_noise_only_in_training(tiny_stages):
    root, _ = tiny_stages
    data = TrainingSamples(root / "prepared", root / "hidden", "train")
    cfg = train_config(root, root / "unused")
    inputs = resolve_inputs(cfg)
    model = build_model(cfg, inputs)
    batch = data.batch([0, 1, 2])
    with torch.no_grad():
        clean = _forward(model.eval(), inputs, batch, 0.0)
        torch.testing.assert_close(_forward(model, inputs, batch, 0.5), clean)  # eval: no noise
        assert not torch.allclose(_forward(model.train(), inputs, batch, 0.5), clean)
    data.close()


def test_feature_noise_changes_the_trained_draft(tiny_stages, tmp_path):
    root, _ = tiny_stages
    runs = {"clean": 0.0, "noisy": 0.3, "noisy-again": 0.3}
    for name, scale in runs.items():
        train(train_config(root, tmp_path / name, max_steps=3, feature_noise=scale))
    w = {name: load_file(tmp_path / name / "final" / "model.safetensors")["fc.weight"] for name in runs}
    assert torch.equal(w["noisy"], w["noisy-again"])  # seeded: a run repeats
    assert not torch.equal(w["clean"], w["noisy"])


def test_final_norm_starts_from_the_verifier(tiny_stages, tmp_path):
    root, verifier = tiny_stages
    # a copy of the verifier whose final norm is not the ones of a fresh init
    shutil.copytree(verifier, tmp_path / "verifier")
    weights = load_file(tmp_path / "verifier" / "model.safetensors")
    weights["model.norm.weight"] = torch.rand_like(weights["model.norm.weight"]) + 0.5
    save_file(weights, tmp_path / "verifier" / "model.safetensors", metadata={"format": "pt"})
    cfg = train_config(root, root / "unused", final_norm_init="verifier")
    inputs = dataclasses.replace(resolve_inputs(cfg), verifier_dir=tmp_path / "verifier")
    want = load_final_norm(inputs.verifier_dir)[0]
    torch.testing.assert_close(build_model(cfg, inputs).norm.weight.detach(), want.float())
    ones = build_model(train_config(root, root / "unused"), inputs).norm.weight.detach()
    assert torch.equal(ones, torch.ones_like(ones))
    with pytest.raises(Eagle3InputError, match="'final_norm_init' must be one of"):
        to_dataclass(TrainConfig, {"final_norm_init": "zeros"}, "train")
