"""A run's metric log: OUT/metrics.jsonl (one JSON line per logged training window or validation) and, optionally,
TensorBoard event files. Rank 0 writes; the other ranks hold an inactive log."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, out: Path, active: bool):
        self.out = out
        self.path = out / "metrics.jsonl"
        self.active = active
        self.lines = 0  # lines in metrics.jsonl: a checkpoint records them, a resume keeps exactly those
        self.writer = None

    def open_tensorboard(self) -> None:
        if self.active:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tensorboard"))

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
        """On resume: keep the lines written before the checkpoint (later ones will be logged again), the count it
        recorded, or for older checkpoints the lines up to its step."""
        if not (self.active and self.path.is_file()):
            return
        rows = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = rows[:lines] if lines is not None else [ln for ln in rows if json.loads(ln)["step"] <= step]
        self.path.write_text("".join(x + "\n" for x in keep))
        self.lines = len(keep)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
