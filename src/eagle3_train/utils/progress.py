"""Progress bars with rates and ETA for long jobs (tqdm), quiet when not attached to a terminal in CI."""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def progress(total: int | None = None, desc: str = "", unit: str = "it", disable: bool | None = False, **kw) -> tqdm:
    if os.environ.get("EAGLE3_TRAIN_NO_PROGRESS") == "1":
        disable = True
    # On a pipe (CI, logs) print fewer, longer-spaced updates instead of carriage-return spam.
    mininterval = 0.5 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True,
                mininterval=mininterval, disable=disable, **kw)
