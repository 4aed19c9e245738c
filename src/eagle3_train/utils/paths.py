"""Where cached assets live (XDG convention, overridable with EAGLE3_TRAIN_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("EAGLE3_TRAIN_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "eagle3-train"
