"""The experiment trackers (train/trackers.py) in their offline/local modes: W&B offline, an MLflow file store,
trackio's local database and TensorBoard each receive the metrics of metrics.jsonl, read back through each library's
own reader; a resume continues the same tracker runs; a real tiny training reports to all four and prints where its
logs are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.stage_helpers import train_config

from eagle3_train.train.metrics_log import TRACKER_STATE, MetricsLog
from eagle3_train.train.trainer import train

ALL = ["tensorboard", "wandb", "mlflow", "trackio"]
CONFIG = {"lr": 0.003, "ttt_steps": 3, "endpoint": [], "hidden_size": None, "report_to": ALL}


@pytest.fixture(scope="module", autouse=True)
def local_trackers(tmp_path_factory):
    """W&B offline, MLflow's default (a file store in OUT/mlruns), trackio in a temporary database. trackio reads
    TRACKIO_DIR once, when first imported: this module imports it first, after setting it."""
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        for name in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
            mp.delenv(name, raising=False)
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to the home dir
            mp.setenv(name, str(root / name.lower()))
        mp.setenv("TRACKIO_DIR", str(root / "trackio"))
        import trackio.utils

        assert trackio.utils.TRACKIO_DIR == root / "trackio", "trackio was imported before TRACKIO_DIR was set"
        yield root


def windows(log: MetricsLog, steps: range, epoch: int = 0) -> None:
    """A few training windows and a validation at the last step, values not exact in binary."""
    for step in steps:
        log.write("train", {"loss": 1 / step, "acc_0": step / 7, "lr": 3e-3 * step}, step=step, epoch=epoch,
                  tokens_seen=100 * step)
    log.write("validation", {"loss": 1 / 3, "accept_len_k3": 1.7}, step=steps[-1], epoch=epoch,
              tokens_seen=100 * steps[-1])


def jsonl(out: Path) -> dict[tuple[str, int], float]:
    """metrics.jsonl as {(split/key, step): value}, the values each tracker must hold."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skip = {"step", "epoch", "split", "time", "tokens_seen"}
    return {(f"{r['split']}/{k}", r["step"]): v for r in rows for k, v in r.items() if k not in skip}


# --- each library's own reader ------------------------------------------------------------------------------------
def wandb_records(out: Path, run_id: str) -> list[list[dict]]:
    """The records of each offline run directory of `run_id` under OUT/wandb, by `wandb leet inspect --json`."""
    dirs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}*"))  # ID-1: a second one within the second
    assert dirs, list((out / "wandb").iterdir())
    found = []
    for d in dirs:
        r = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(d)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        found.append([json.loads(x) for x in r.stdout.splitlines() if x.strip()])
    return found


def wandb_metrics(records: list[dict]) -> dict[tuple[str, int], float]:
    out = {}
    for rec in records:
        if rec["type"] == "history":
            item = rec["history"]["item"]
            out.update({(k, item["_step"]): v for k, v in item.items() if not k.startswith("_")})
    return out


def mlflow_metrics(out: Path, run_id: str) -> dict[tuple[str, int], float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").absolute().as_uri())
    return {(key, m.step): m.value for key in client.get_run(run_id).data.metrics
            for m in client.get_metric_history(run_id, key)}


def mlflow_experiment(out: Path, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").absolute().as_uri())
    return client.get_experiment(client.get_run(run_id).info.experiment_id).name


def trackio_metrics(project: str, run_id: str) -> dict[tuple[str, int], float]:
    from trackio.sqlite_storage import SQLiteStorage

    return {(k, row["step"]): v for row in SQLiteStorage.get_logs(project, run_id=run_id)
            for k, v in row.items() if k not in ("step", "timestamp")}


def tensorboard_metrics(out: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def assert_holds(got: dict[tuple[str, int], float], want: dict[tuple[str, int], float], rel: float) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel), key


# --- tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_each_tracker_receives_the_metrics_and_the_config_once(tmp_path):
    out = tmp_path / "my-run"
    log = MetricsLog(out, active=True)
    log.start(0, ALL, CONFIG)
    windows(log, range(1, 4))
    log.close()
    want = jsonl(out)
    assert len(want) == 3 * 3 + 2
    state = json.loads((out / TRACKER_STATE).read_text())

    (records,) = wandb_records(out, state["wandb"]["id"])
    assert_holds(wandb_metrics(records), want, rel=1e-12)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert (run["project"], run["display_name"]) == ("my-run", "my-run")
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == CONFIG

    from mlflow.tracking import MlflowClient

    assert_holds(mlflow_metrics(out, state["mlflow"]["run_id"]), want, rel=1e-12)
    mlrun = MlflowClient(tracking_uri=(out / "mlruns").absolute().as_uri()).get_run(state["mlflow"]["run_id"])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "my-run"
    assert mlrun.data.params == {k: v if isinstance(v, str) else json.dumps(v) for k, v in CONFIG.items()}

    import trackio

    assert_holds(trackio_metrics("my-run", state["trackio"]["id"]), want, rel=1e-12)
    (trun,) = [r for r in trackio.Api().runs("my-run") if r.id == state["trackio"]["id"]]
    assert {k: trun.config[k] for k in CONFIG} == CONFIG

    assert_holds(tensorboard_metrics(out), want, rel=1e-6)  # float32 events


@pytest.mark.slow
def test_a_resume_continues_the_same_tracker_runs_and_a_fresh_start_begins_new_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "shared")  # the libraries' own project variables are followed
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "shared")
    out = tmp_path / "resumed"
    first = MetricsLog(out, active=True)
    first.start(0, ["wandb", "mlflow", "trackio"], CONFIG)
    windows(first, range(1, 3))
    first.close()
    ids = json.loads((out / TRACKER_STATE).read_text())

    second = MetricsLog(out, active=True)  # the checkpoint at step 2: the next invocation starts there
    second.start(2, ["wandb", "mlflow", "trackio"], {**CONFIG, "resume": True})
    windows(second, range(3, 5))
    second.close()
    assert json.loads((out / TRACKER_STATE).read_text()) == ids
    want = jsonl(out)

    runs = wandb_records(out, ids["wandb"]["id"])
    assert len(runs) == 2  # one offline directory per invocation, synced into one W&B run
    assert {next(r["run"]["project"] for r in run if r["type"] == "run") for run in runs} == {"shared"}
    merged = {**wandb_metrics(runs[0]), **wandb_metrics(runs[1])}
    assert_holds(merged, want, rel=1e-12)
    resumed = next(r["run"] for r in runs[1] if r["type"] == "run")
    assert resumed["resume"] and "lr" not in resumed.get("config", {}).get("update", {})  # the config went once
    assert_holds(mlflow_metrics(out, ids["mlflow"]["run_id"]), want, rel=1e-12)
    assert mlflow_experiment(out, ids["mlflow"]["run_id"]) == "shared"
    assert_holds(trackio_metrics("resumed", ids["trackio"]["id"]), want, rel=1e-12)  # the run directory's name

    third = MetricsLog(out, active=True)  # a fresh start in the same directory (no checkpoint): new runs
    third.start(0, ["wandb", "mlflow", "trackio"], CONFIG)
    third.close()
    fresh = json.loads((out / TRACKER_STATE).read_text())
    assert all(fresh[n] != ids[n] for n in ids)
    assert not (out / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_a_tiny_training_reports_to_every_tracker_and_prints_where_they_are(tiny_stages, tmp_path, capsys):
    """Two invocations (stopped after 2 steps, then resumed): each tracker holds one run with metrics.jsonl's values."""
    root, _ = tiny_stages
    out = tmp_path / "tiny-run"
    train(train_config(root, out, max_steps=3, stop_after=2, tensorboard=None, report_to=ALL))
    first = json.loads((out / TRACKER_STATE).read_text())
    capsys.readouterr()
    train(train_config(root, out, max_steps=3, tensorboard=None, report_to=ALL, resume=True))
    want = jsonl(out)
    assert {k for k, _ in want} >= {"train/loss", "validation/loss"} and {s for _, s in want} == {1, 2, 3}
    state = json.loads((out / TRACKER_STATE).read_text())
    assert state == first
    runs = wandb_records(out, state["wandb"]["id"])
    assert len(runs) == 2
    assert_holds({**wandb_metrics(runs[0]), **wandb_metrics(runs[1])}, want, rel=1e-12)
    assert_holds(mlflow_metrics(out, state["mlflow"]["run_id"]), want, rel=1e-12)
    assert_holds(trackio_metrics("tiny-run", state["trackio"]["id"]), want, rel=1e-12)
    assert_holds(tensorboard_metrics(out), want, rel=1e-6)
    marker = json.loads((out / ".eagle3-train.json").read_text())
    assert {"trackers.json", "wandb", "mlruns", "tensorboard"} <= set(marker["files"])  # --overwrite moves them

    err = capsys.readouterr().err
    lines = err[err.index("training logs and plots:"):].splitlines()
    said = {line.split(":")[0]: line for line in lines[1:7]}
    assert said["metrics"] == f"metrics: {out / 'metrics.jsonl'}" and said["plot"] == f"plot: {out / 'metrics.png'}"
    assert (out / "metrics.png").is_file()
    assert f"tensorboard --logdir {out / 'tensorboard'}" in said["tensorboard"]
    sync = said["wandb"].split("wandb sync ")[1].rstrip(")")
    assert [str(p) for p in Path("/").glob(sync.lstrip("/"))] == [str(p) for p in
                                                                   (out / "wandb").glob("offline-run-*")]
    uri = (out / "mlruns").absolute().as_uri()
    assert f"mlflow ui --backend-store-uri {uri}" in said["mlflow"] and (out / "mlruns").is_dir()
    db = Path(os.environ["TRACKIO_DIR"]) / "tiny-run.db"
    assert said["trackio"].startswith(f"trackio: {db} ") and db.is_file()
    assert "trackio show --project tiny-run" in said["trackio"]
