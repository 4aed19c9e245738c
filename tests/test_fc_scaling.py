"""`train.equalise_features`: Adam on the fc weight as if every aux feature had the median feature's std, with the
served weight W unchanged in form (train/fc_scaling.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import train_config

from eagle3_train.train.data import TrainingSamples
from eagle3_train.train.fc_scaling import EqualisedFC, feature_scale
from eagle3_train.train.trainer import train


def test_the_scale_is_each_features_std_over_the_median(tiny_stages):
    root, _ = tiny_stages
    data = TrainingSamples(root / "prepared", root / "hidden", "train")
    s = feature_scale(data)
    batch = data.batch(list(range(len(data))))
    real = torch.arange(batch.aux.shape[1]).unsqueeze(0) < batch.lengths.unsqueeze(1)
    std = batch.aux[real].float().std(dim=0, correction=0)
    assert s.shape == std.shape and float(s.median()) == 1.0
    torch.testing.assert_close(s, (std / std.median()).clamp(min=1e-2))  # the fixture has fewer rows than sampled
    data.close()


OPTIMIZERS = {"adamw": (lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1), 1e-5),
              # Muon's Newton-Schulz runs in bf16 on gradients that differ in their last float bits
              "muon": (lambda p: torch.optim.Muon([p], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                       1e-4)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_optimizer_on_w_runs_as_on_v_over_standardised_features(name):
    """W with EqualisedFC on features x, step by step, equals V = W * s trained by the plain optimizer on x / s."""
    make, rtol = OPTIMIZERS[name]
    torch.manual_seed(0)
    scale = torch.tensor([0.02, 0.5, 1.0, 1.0, 30.0, 300.0])
    x = torch.randn(64, 6) * scale
    y = torch.randn(64, 3)
    w = torch.nn.Parameter(torch.randn(3, 6) * 0.1)
    v = torch.nn.Parameter(w.detach() * scale)
    adam_w, adam_v = make(w), make(v)
    plain = torch.nn.Parameter(w.detach().clone())  # W under the plain optimizer: what the option changes
    adam_plain = make(plain)
    eq = EqualisedFC(w, scale)
    for _ in range(5):
        for p, opt, inputs in ((w, adam_w, x), (v, adam_v, x / scale), (plain, adam_plain, x)):
            opt.zero_grad()
            ((inputs @ p.T - y) ** 2).mean().backward()
            if p is w:
                eq.precondition()
                eq.step(adam_w)
            else:
                opt.step()
        torch.testing.assert_close(w.detach() * scale, v.detach(), rtol=rtol, atol=1e-6)
    assert not torch.allclose(plain.detach() * scale, v.detach(), rtol=10 * rtol, atol=1e-4)


def test_a_run_equalises_the_fc_and_resumes_exactly(tiny_stages, tmp_path):
    root, _ = tiny_stages
    for name, kw in (("plain", {}), ("straight", {"equalise_features": True})):
        train(train_config(root, tmp_path / name, max_steps=4, **kw))
    train(train_config(root, tmp_path / "resumed", max_steps=4, equalise_features=True, stop_after=2))
    train(train_config(root, tmp_path / "resumed", max_steps=4, equalise_features=True, resume=True))
    w = {n: load_file(tmp_path / n / "final" / "model.safetensors") for n in ("plain", "straight", "resumed")}
    assert not torch.equal(w["plain"]["fc.weight"], w["straight"]["fc.weight"])
    assert w["straight"].keys() == w["plain"].keys()  # the served tensors: nothing added
    for k in w["straight"]:
        assert torch.equal(w["straight"][k], w["resumed"][k]), k
