"""A run's metric log: OUT/metrics.jsonl (one JSON line per logged training window or validation) and, optionally,
TensorBoard event files. Rank 0 writes; the other ranks hold an inactive log."""

from __future__ import annotations

import json
import time
from pathlib import Path

from eagle3_train.utils.io import atomic_path


class MetricsLog:
    def __init__(self, out: Path, active: bool):
        self.out = out
        self.path = out / "metrics.jsonl"
        self.active = active
        self.lines = 0  # lines in metrics.jsonl: a checkpoint records them, a resume keeps exactly those
        self.writer = None

    def start(self, step: int, tensorboard: bool) -> None:
        """Training starts (or resumes) at `step`: a fresh start drops what a run killed before its first checkpoint
        logged; TensorBoard drops the events a killed run logged at or after `step` (they are logged again)."""
        if step == 0:
            self.keep_until(0, 0)
        if self.active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=step)

    def write(self, split: str, values: dict[str, float], *, step: int, epoch: int, tokens_seen: int) -> None:
        if not self.active:
            return
        rec = {"step": step, "epoch": epoch, "split": split, "time": time.time(), "tokens_seen": tokens_seen,
               **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.lines += 1
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(f"{split}/{k}", v, step)

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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
