"""`train.supervise: all`: training fits the verifier's distribution at every token of a row, validation still scores
the assistant tokens only."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import train_config

from eagle3_train.train.config import TrainConfig
from eagle3_train.train.data import TrainingSamples
from eagle3_train.train.trainer import train
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


def test_training_on_every_token_changes_the_draft_but_not_what_validation_scores(tiny_stages, tmp_path):
    root, _ = tiny_stages
    # lr 0: both runs keep the same weights, so equal validation shows that validation kept the assistant mask, and a
    # different train loss shows that training scored other positions
    still = {s: train(train_config(root, tmp_path / f"still-{s}", max_steps=2, lr=0.0, supervise=s))
             for s in ("assistant", "all")}
    assert still["all"]["validation"]["loss_0"] == pytest.approx(still["assistant"]["validation"]["loss_0"])
    assert still["all"]["train"]["loss_0"] != pytest.approx(still["assistant"]["train"]["loss_0"], rel=1e-4)
    # with a learning rate, the prompt positions' gradients give other weights
    runs = {s: tmp_path / f"learn-{s}" for s in ("assistant", "all")}
    for s, out in runs.items():
        train(train_config(root, out, max_steps=3, supervise=s))
    a, b = (load_file(runs[s] / "final" / "model.safetensors") for s in ("assistant", "all"))
    assert not torch.equal(a["fc.weight"], b["fc.weight"])
    with pytest.raises(Eagle3InputError, match="'supervise' must be one of"):
        to_dataclass(TrainConfig, {"supervise": "prompt"}, "train")
