"""Progress reports for long jobs: a tqdm bar on a terminal; on a pipe or a log file, one log line every
`EAGLE3_TRAIN_PROGRESS_INTERVAL` seconds (default 30) with done/total, rate, elapsed time and ETA.

The lines go through the `eagle3_train.progress` logger (the CLI logs INFO to stderr). `EAGLE3_TRAIN_NO_PROGRESS=1`
silences both the bar and the lines.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm as tqdm_std
from tqdm.auto import tqdm

from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger("eagle3_train.progress")
INTERVAL_ENV = "EAGLE3_TRAIN_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


class _NoOutput:
    def write(self, s: str) -> None:
        pass

    def flush(self) -> None:
        pass


class LogProgress(tqdm_std):
    """A tqdm that draws no bar: it logs one line at start, then at most one per `mininterval` seconds when the count
    has moved, and the last count on close. Same API as tqdm (update, set_postfix, close, context manager)."""

    monitor_interval = 0  # no monitor thread: lines come from update()/set_postfix()/close() only

    def __init__(self, *args, **kw):
        self._logged_t: float | None = None  # set before tqdm's __init__, which displays once
        self._logged_n: float | None = None
        super().__init__(*args, file=_NoOutput(), leave=False, dynamic_ncols=False, **kw)

    def line(self) -> str:
        """`desc n/total unit (p%) | rate | elapsed | ETA | postfix`; rate and ETA from the average since start."""
        d = self.format_dict
        n, total, elapsed = d["n"], d["total"], d["elapsed"]

        def num(x: float) -> str:  # 999 -> "999", 12345 -> "12.3k"
            return str(int(x)) if x == int(x) and (abs(x) < 1000 or not self.unit_scale) else self.format_sizeof(x)

        done = f"{num(n)}/{num(total)} {self.unit} ({100 * n / total:.0f}%)" if total else f"{num(n)} {self.unit}"
        parts = [f"{self.desc.rstrip(': ') or 'progress'} {done}"]
        rate = (n - self.initial) / elapsed if elapsed > 0 else 0.0
        if rate >= 1:
            parts.append(f"{self.format_sizeof(rate)} {self.unit}/s")
        elif rate > 0:
            parts.append(f"{1 / rate:.2f} s/{self.unit}")
        parts.append(f"elapsed {self.format_interval(elapsed)}")
        if total and rate > 0:
            parts.append(f"ETA {self.format_interval(max(0.0, total - n) / rate)}")
        if self.postfix:
            parts.append(str(self.postfix))
        return " | ".join(parts)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing its bar
            return True
        now = self._time()
        if self._logged_t is not None and (now - self._logged_t < self.mininterval or self.n == self._logged_n):
            return True  # set_postfix() refreshes on every call: one line per interval, and only for a new count
        self._logged_t, self._logged_n = now, self.n
        log.info("%s", self.line())
        return True

    def close(self) -> None:
        if not self.disable and self.n != self._logged_n:
            self._logged_t = None  # the last count is always written
            self.display()
        super().close()


def progress_interval() -> float:
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or raw == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise Eagle3InputError(f"{INTERVAL_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


def progress(total: int | None = None, desc: str = "", unit: str = "it", disable: bool = False, **kw) -> tqdm:
    """A tqdm bar on a terminal, a `LogProgress` (log lines) when stderr is a pipe or a file."""
    disable = bool(disable) or os.environ.get("EAGLE3_TRAIN_NO_PROGRESS") == "1"
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, mininterval=0.5,
                    disable=disable, **kw)
    return LogProgress(total=total, desc=desc, unit=unit, unit_scale=True, mininterval=progress_interval(),
                       disable=disable, **kw)
