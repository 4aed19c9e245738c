"""A run's metric log: OUT/metrics.jsonl (one JSON line per logged training window or validation), and the same
values sent to the experiment trackers the run reports to (train/trackers.py: TensorBoard, W&B, MLflow, trackio).
Rank 0 writes; the other ranks hold an inactive log."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_train.train.metadata import OUTPUT
from eagle3_train.train.trackers import TRACKERS, Tracker, run_name
from eagle3_train.utils.io import atomic_path, write_json
from eagle3_train.utils.outputs import own

log = logging.getLogger(__name__)
TRACKER_STATE = "trackers.json"  # what a resume needs to continue each tracker's run (W&B id, MLflow run id, ...)


class MetricsLog:
    def __init__(self, out: Path, active: bool):
        self.out = out
        self.path = out / "metrics.jsonl"
        self.active = active
        self.lines = 0  # lines in metrics.jsonl: a checkpoint records them, a resume keeps exactly those
        self.trackers: dict[str, Tracker] = {}  # the ones started, by name
        self.open: list[Tracker] = []  # ...and not yet finished

    def start(self, step: int, report_to: Sequence[str] = (), config: dict[str, Any] | None = None) -> None:
        """Training starts (or resumes) at `step`: a fresh start drops what a run killed before its first checkpoint
        logged; each tracker of `report_to` starts its run (a fresh one at step 0, else the one the last invocation
        kept in OUT/trackers.json) and receives `config` there once."""
        state_path = self.out / TRACKER_STATE
        if step == 0:
            self.keep_until(0, 0)
            if self.active:  # the tracker runs of a run killed before its first checkpoint are not continued
                state_path.unlink(missing_ok=True)
        if not (self.active and report_to):
            return
        saved = json.loads(state_path.read_text()) if step > 0 and state_path.is_file() else {}
        name = run_name(self.out)
        chosen = {n: TRACKERS[n](self.out, saved.get(n, {})) for n in dict.fromkeys(report_to)}
        self.out.mkdir(parents=True, exist_ok=True)
        own(self.out, OUTPUT[0], [w for t in chosen.values() for w in t.writes()])  # --overwrite moves them
        try:
            for n, tracker in chosen.items():
                tracker.start(name, config or {}, step)
                self.trackers[n] = tracker
                self.open.append(tracker)
        except BaseException:
            self.close(ok=False)
            raise
        state = {**saved, **{n: t.state for n, t in self.trackers.items() if t.state}}
        if state:  # TensorBoard alone keeps none
            own(self.out, OUTPUT[0], [TRACKER_STATE])
            write_json(state_path, state)

    def write(self, split: str, values: dict[str, float], *, step: int, epoch: int, tokens_seen: int) -> None:
        if not self.active:
            return
        rec = {"step": step, "epoch": epoch, "split": split, "time": time.time(), "tokens_seen": tokens_seen,
               **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.lines += 1
        for tracker in self.open:
            tracker.log(split, values, step)

    def keep_until(self, step: int, lines: int | None) -> None:
        """Before training starts: keep the lines written before the checkpoint it resumes from (later ones will be
        logged again), the count that checkpoint recorded, or for older checkpoints the lines up to its step; none
        on a fresh start (step 0, lines 0: what a run killed before its first checkpoint logged). Atomic: a kill
        here leaves the old log or the new one."""
        if not (self.active and self.path.is_file()):
            return
        rows = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = rows[:lines] if lines is not None else [ln for ln in rows if json.loads(ln)["step"] <= step]
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(x + "\n" for x in keep))
        self.lines = len(keep)

    def close(self, ok: bool = True) -> None:
        """End every tracker's run for this invocation (`ok`: False when it ends with an error); again: nothing."""
        trackers, self.open = self.open, []
        failed: list[BaseException] = []
        for tracker in trackers:  # each gets closed even when one fails
            try:
                tracker.finish(ok)
            except Exception as e:
                failed.append(e)
                log.warning("closing the %s run failed: %s", type(tracker).__name__, e)
        if failed and ok:  # on the way out of an error, that error is the one to see
            raise failed[0]

    def where(self) -> list[str]:
        """Lines naming the run's logs and plots that exist, and the command that opens each."""
        lines = [f"{what}: {path}" for what, path in (("metrics", self.path), ("plot", self.out / "metrics.png"))
                 if path.is_file()]
        return lines + [tracker.where() for tracker in self.trackers.values()]
