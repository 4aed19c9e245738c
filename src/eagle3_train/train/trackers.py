"""Experiment trackers a run's metrics also go to (`train.report_to`): one entry per tracker behind one interface,
in the table TRACKERS. A tracker's package is imported only when it is chosen; a missing one is one error naming the
install command. Rank 0 alone holds trackers (MetricsLog). The project (MLflow: experiment) and the run are named after
the run directory (`run_name`); WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME, the libraries' own variables, name the
project instead where set.

Where each keeps its files, and what a resume does:
- tensorboard: event files in OUT/tensorboard; a resume purges the events logged after its checkpoint's step.
- wandb: the mode W&B's own settings pick (WANDB_MODE=offline: no account, no network); files under OUT/wandb, or
  WANDB_DIR/wandb where that is set. A resume continues the same run (its id kept in OUT/trackers.json,
  resume="allow"): offline, each invocation writes its own offline-run-*-ID* directory and `wandb sync` joins them.
- mlflow: a file store in OUT/mlruns, or MLFLOW_TRACKING_URI where that is set. A resume continues the same run
  (its id kept in OUT/trackers.json); the settings are logged as params once, when the run starts.
- trackio: its local database, TRACKIO_DIR/PROJECT.db (trackio's default: ~/.cache/huggingface/trackio). A resume
  continues the same run (by its name; resume="allow").
Metrics the interrupted invocation logged after its last checkpoint stay in W&B, MLflow and trackio beside the values
logged again (metrics.jsonl and TensorBoard drop them).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

from eagle3_train.utils.io import Eagle3InputError

INSTALL = "pip install -r requirements-trackers.txt (or pip install 'eagle3-train[trackers]')"


def _import(module: str, tracker: str, package: str, install: str = INSTALL) -> Any:
    """The tracker's package, or one error saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Eagle3InputError(f"train.report_to lists {tracker}, but its package {package} cannot be imported "
                               f"({e}): {install}") from None


def run_name(out: Path) -> str:
    """The run's name in the trackers: --out's, or, for the pipeline's RUN/train, the run directory's."""
    out = Path(os.path.abspath(out))
    return out.parent.name if out.name == "train" and out.parent.name else out.name


def _flat(values: dict[str, float], split: str) -> dict[str, float]:
    """Metric names as TensorBoard shows them: train/loss, validation/acc_0."""
    return {f"{split}/{k}": float(v) for k, v in values.items()}


class Tracker:
    """One tracker of one run in OUT. `saved`: the state (`self.state`) it kept in the invocation a resume continues,
    {} on a fresh start. The package is imported on construction, so a missing one stops the run before any starts."""

    PROJECT_ENV: ClassVar[str] = ""  # the library's own variable naming the project, where it has one

    def __init__(self, out: Path, saved: dict[str, Any]):
        self.out, self.saved = out, saved
        self.project = os.environ.get(self.PROJECT_ENV) if self.PROJECT_ENV else None
        self.project = self.project or run_name(out)
        self.state: dict[str, Any] = {}  # what a resume needs to continue this tracker's run (OUT/trackers.json)

    def writes(self) -> list[str]:
        """Top-level names it writes in OUT: registered as the run's own, so --overwrite sets them aside."""
        return []

    def start(self, name: str, config: dict[str, Any], step: int) -> None:
        """Training starts (step 0) or resumes (step > 0); `config`: the run's settings."""
        raise NotImplementedError

    def log(self, split: str, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, ok: bool = True) -> None:
        """The invocation ends: flush and close (`ok`: False when it ends with an error)."""
        raise NotImplementedError

    def where(self) -> str:
        """One line: where its files are and the command that opens them."""
        raise NotImplementedError


class TensorBoard(Tracker):
    def __init__(self, out: Path, saved: dict[str, Any]):
        super().__init__(out, saved)
        self.tb = _import("torch.utils.tensorboard", "tensorboard", "tensorboard",
                          "pip install -r requirements.txt, which pins it")
        self.dir = out / "tensorboard"

    def writes(self) -> list[str]:
        return ["tensorboard"]

    def start(self, name: str, config: dict[str, Any], step: int) -> None:
        # A checkpoint at step S is saved after step S's metrics were logged: the events an interrupted invocation
        # logged after S go (they are logged again), S's stay, as in metrics.jsonl.
        self.writer = self.tb.SummaryWriter(str(self.dir), purge_step=step + 1)

    def log(self, split: str, values: dict[str, float], step: int) -> None:
        for k, v in _flat(values, split).items():
            self.writer.add_scalar(k, v, step)

    def finish(self, ok: bool = True) -> None:
        self.writer.close()

    def where(self) -> str:
        return f"tensorboard: {self.dir}  (open: tensorboard --logdir {shlex.quote(str(self.dir))})"


class WandB(Tracker):
    PROJECT_ENV = "WANDB_PROJECT"

    def __init__(self, out: Path, saved: dict[str, Any]):
        super().__init__(out, saved)
        self.wandb = _import("wandb", "wandb", "wandb")

    def writes(self) -> list[str]:
        return [] if os.environ.get("WANDB_DIR") else ["wandb"]

    def start(self, name: str, config: dict[str, Any], step: int) -> None:
        resumed = step > 0 and "id" in self.saved
        run_id = self.saved["id"] if resumed else uuid.uuid4().hex[:12]
        self.run = self.wandb.init(project=self.project, name=name, id=run_id, resume="allow",
                                   dir=None if os.environ.get("WANDB_DIR") else str(self.out),
                                   config=None if resumed else config)
        self.state = {"id": run_id}

    def log(self, split: str, values: dict[str, float], step: int) -> None:
        self.run.log(_flat(values, split), step=step)

    def finish(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)

    def where(self) -> str:
        if not self.run.offline:
            return f"wandb: {self.run.url}"
        # one directory per invocation (a second one started within the same second ends in -1)
        runs = Path(self.run.settings.sync_dir).parent / f"offline-run-*-{self.state['id']}*"
        return f"wandb: {runs.parent}  (upload and view: wandb sync {shlex.quote(str(runs.parent))}/{runs.name})"


class MLflow(Tracker):
    PROJECT_ENV = "MLFLOW_EXPERIMENT_NAME"
    PARAMS_PER_CALL: ClassVar[int] = 100  # MLflow's limit on params in one log_batch

    def __init__(self, out: Path, saved: dict[str, Any]):
        super().__init__(out, saved)
        self.mlflow = _import("mlflow", "mlflow", "mlflow-skinny")
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").absolute().as_uri()
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses its file store unless this is set; a file store needs no server and no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

    def writes(self) -> list[str]:
        return [] if os.environ.get("MLFLOW_TRACKING_URI") else ["mlruns"]

    def start(self, name: str, config: dict[str, Any], step: int) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if step > 0 and "run_id" in self.saved:
            self.run_id = self.saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(self.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(self.project)
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            params = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in config.items()]
            for i in range(0, len(params), self.PARAMS_PER_CALL):  # params are immutable: logged once per run
                self.client.log_batch(self.run_id, params=params[i:i + self.PARAMS_PER_CALL])
        self.state = {"run_id": self.run_id}

    def log(self, split: str, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in _flat(values, split).items()])

    def finish(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")

    def where(self) -> str:
        run = f"experiment {self.project!r}, run {self.run_id}"
        if self.uri.startswith("file:"):
            return (f"mlflow: {self.out / 'mlruns'} ({run})  (open: MLFLOW_ALLOW_FILE_STORE=true mlflow ui "
                    f"--backend-store-uri {shlex.quote(self.uri)}; the UI comes with `pip install mlflow`)")
        return f"mlflow: {self.uri} ({run})"


class Trackio(Tracker):
    def __init__(self, out: Path, saved: dict[str, Any]):
        super().__init__(out, saved)
        self.trackio = _import("trackio", "trackio", "trackio")

    def start(self, name: str, config: dict[str, Any], step: int) -> None:
        resumed = step > 0 and "name" in self.saved
        with self._quiet():
            self.run = self.trackio.init(project=self.project, name=self.saved["name"] if resumed else name,
                                         config=None if resumed else config, resume="allow" if resumed else "never",
                                         embed=False)
        self.state = {"name": self.run.name, "id": self.run.id}

    def log(self, split: str, values: dict[str, float], step: int) -> None:
        self.run.log(_flat(values, split), step=step)

    def finish(self, ok: bool = True) -> None:
        with self._quiet():
            self.trackio.finish()  # also forgets the run, which trackio would otherwise finish again at exit

    def where(self) -> str:
        from trackio.sqlite_storage import SQLiteStorage

        db = SQLiteStorage.get_project_db_path(self.project)
        env = f"TRACKIO_DIR={shlex.quote(os.environ['TRACKIO_DIR'])} " if os.environ.get("TRACKIO_DIR") else ""
        return f"trackio: {db} (run {self.run.name})  (open: {env}trackio show --project {shlex.quote(self.project)})"

    @staticmethod
    def _quiet() -> contextlib.AbstractContextManager:
        """trackio prints its progress on stdout, where `eagle3-train train` prints its result: send it to stderr."""
        return contextlib.redirect_stdout(sys.stderr)


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow,
                                      "trackio": Trackio}
