"""`train.report_to` and the tracker table: which trackers a run reports to (the tensorboard shorthand included),
the names refused, and the one error for a tracker whose package is missing."""

from __future__ import annotations

import argparse
import sys
from typing import get_args

import pytest

from eagle3_train.settings.train import ReportTo, TrainConfig
from eagle3_train.train.metrics_log import MetricsLog
from eagle3_train.train.trackers import TRACKERS, run_name
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import add_settings_arguments, build_settings, settings_from_args


def test_every_tracker_name_has_an_entry():
    assert set(TRACKERS) == set(get_args(ReportTo)) - {"none"}


@pytest.mark.parametrize(("settings", "trackers"), [
    ({}, ["tensorboard"]),  # today's behaviour
    ({"tensorboard": False}, []),
    ({"report_to": ["none"]}, []),
    ({"report_to": []}, []),
    ({"report_to": ["wandb", "mlflow", "wandb"]}, ["wandb", "mlflow"]),
    ({"report_to": ["wandb"], "tensorboard": True}, ["tensorboard", "wandb"]),
    ({"report_to": ["trackio", "tensorboard"], "tensorboard": False}, ["trackio"]),
])
def test_report_to_with_the_tensorboard_shorthand(settings, trackers):
    assert TrainConfig(**settings).trackers() == trackers


def test_report_to_from_yaml_and_flags():
    assert build_settings(TrainConfig, {"report_to": "none"}, "section 'train'").trackers() == []
    assert build_settings(TrainConfig, {"report_to": "wandb,mlflow"}, "section 'train'").trackers() == ["wandb",
                                                                                                        "mlflow"]
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, TrainConfig)
    args = parser.parse_args(["--report-to", "mlflow", "--report-to", "trackio", "--no-tensorboard"])
    assert settings_from_args(TrainConfig, args).trackers() == ["mlflow", "trackio"]
    args = parser.parse_args(["--set", "train.report_to=[wandb]", "--tensorboard"])
    assert settings_from_args(TrainConfig, args).trackers() == ["tensorboard", "wandb"]


@pytest.mark.parametrize(("report_to", "message"), [
    (["wandb", "comet"], r"train.report_to must list some of .*got \['comet'\]"),
    (["none", "wandb"], r"'none' means no tracker"),
])
def test_bad_report_to_is_refused(report_to, message):
    with pytest.raises(Eagle3InputError, match=message):
        TrainConfig(report_to=report_to)
    with pytest.raises(Eagle3InputError, match="report_to"):
        build_settings(TrainConfig, {"report_to": report_to}, "section 'train'")


def test_the_run_is_named_after_its_directory(tmp_path):
    assert run_name(tmp_path / "runs" / "l8b-sharegpt") == "l8b-sharegpt"
    assert run_name(tmp_path / "runs" / "smollm2-sharegpt" / "train") == "smollm2-sharegpt"  # the pipeline's


def test_a_missing_tracker_package_is_one_error_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a package that is not installed
    log = MetricsLog(tmp_path / "run", active=True)
    with pytest.raises(Eagle3InputError, match=r"lists wandb.*pip install -r requirements-trackers.txt"):
        log.start(0, ["tensorboard", "wandb"], {})
    assert not log.open and not (tmp_path / "run" / "tensorboard").exists()  # none started


def test_an_inactive_log_starts_no_tracker(tmp_path):
    log = MetricsLog(tmp_path / "run", active=False)  # ranks other than 0
    log.start(3, ["tensorboard"], {})
    assert not log.open and not (tmp_path / "run").exists()


def test_tensorboard_alone_keeps_no_tracker_state_and_a_fresh_start_forgets_an_old_one(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text('{"wandb": {"id": "of-a-run-killed-before-its-first-checkpoint"}}')
    log = MetricsLog(out, active=True)
    log.start(0, ["tensorboard"], {})
    log.write("train", {"loss": 2.0}, step=1, epoch=0, tokens_seen=10)
    log.close()
    assert not (out / "trackers.json").exists()
    assert list((out / "tensorboard").iterdir())
    assert log.where() == [f"metrics: {out / 'metrics.jsonl'}",
                           f"tensorboard: {out / 'tensorboard'}  (open: tensorboard --logdir {out / 'tensorboard'})"]


def test_turning_a_tracker_on_keeps_a_finished_runs_training_key(tiny_llama_dir, tmp_path):
    """Where metrics are reported is not what the draft learns: `run` must not train again for it."""
    from eagle3_train.pipeline import Pipeline
    from eagle3_train.pipeline.stages import STAGES

    train = next(st for st in STAGES if st.name == "train")
    base = {"run_dir": str(tmp_path / "run"), "verifier": str(tiny_llama_dir()), "train": {"ttt_steps": 2}}
    keys = []
    for extra in ({}, {"report_to": ["wandb", "mlflow"], "tensorboard": False}, {"ttt_steps": 3}):
        ctx = Pipeline({**base, "train": {**base["train"], **extra}})._context(need="tokenizer")
        ctx.keys.update({"prepare": {"p": 1}, "extract": {"e": 1}, "vocab": {"v": 1}})
        keys.append(train.key(ctx, None))
    assert keys[0] == keys[1] and keys[0] != keys[2]
