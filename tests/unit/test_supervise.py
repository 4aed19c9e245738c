"""`train.supervise: all`: training fits the verifier's distribution at every token of a row, validation still scores
the assistant tokens only."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support.stage_helpers import train_config

from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.build import build_model
from eagle3_train.train.data import TrainingSamples
from eagle3_train.train.inputs import resolve_inputs
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.trainer import train
from eagle3_train.train.ttt import supervised_counts, ttt_forward
from eagle3_train.utils.config import to_dataclass
from eagle3_train.utils.io import Eagle3InputError


def test_every_real_token_is_supervised_and_padding_is_not(tiny_stages):
    root, _ = tiny_stages
    data = TrainingSamples(root / "prepared", root / "hidden", "train")
    batch = data.batch([0, 1, 2])
    every = batch.supervising_every_token()
    assert not bool(batch.loss_mask.all()), "the fixture needs prompt tokens outside the loss mask"
    for b, n in enumerate(batch.lengths.tolist()):
        assert bool(every.loss_mask[b, :n].all()) and not bool(every.loss_mask[b, n:].any())
    # the assistant mask is a subset, and nothing else changes
    assert bool((every.loss_mask | ~batch.loss_mask).all())
    assert every.aux is batch.aux and every.input_ids is batch.input_ids and every.final is batch.final
    data.close()


def test_metrics_still_count_the_assistant_tokens(tiny_stages):
    """The same draft on the same batch: training on every token changes the loss, not one metric sum."""
    root, _ = tiny_stages
    torch.manual_seed(0)
    data = TrainingSamples(root / "prepared", root / "hidden", "train")
    cfg = train_config(root, root / "unused")
    inputs = resolve_inputs(cfg)
    model = build_model(cfg, inputs).eval()
    out = {}
    for name, batch in (("assistant", data.batch([0, 1, 2])), ("all", data.batch([0, 1, 2]).supervising_every_token())):
        targets = verifier_targets(batch.final, batch.loss_mask, inputs.lm_head, model.draft_token_ids(), model.t2d)
        denominators = supervised_counts(batch.loss_mask, 3)
        with torch.no_grad():
            out[name] = ttt_forward(model, batch, targets, Objective(3, (1.0, 0.8, 0.64), checkpoint_loss=False,
                                                                     checkpoint_mlp=False), denominators)
    assert not torch.allclose(out["all"][0], out["assistant"][0])
    torch.testing.assert_close(out["all"][1], out["assistant"][1])
    data.close()


def test_training_on_every_token_changes_the_draft(tiny_stages, tmp_path):
    root, _ = tiny_stages
    runs = {s: tmp_path / s for s in ("assistant", "assistant-again", "all")}
    for s, out in runs.items():
        train(train_config(root, out, max_steps=3, supervise=s.removesuffix("-again")))
    w = {s: load_file(out / "final" / "model.safetensors") for s, out in runs.items()}
    assert torch.equal(w["assistant"]["fc.weight"], w["assistant-again"]["fc.weight"])  # deterministic
    assert not torch.equal(w["assistant"]["fc.weight"], w["all"]["fc.weight"])  # the prompt positions taught it
    with pytest.raises(Eagle3InputError, match="'supervise' must be one of"):
        to_dataclass(TrainConfig, {"supervise": "prompt"}, "train")
