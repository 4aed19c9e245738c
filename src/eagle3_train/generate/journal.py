"""The crash-safe output files: append-only JSONL, one write + fsync per record, so a crash or kill -9 loses at
most the records in flight, and a torn last line is cut away before a rerun resumes."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)


def _cut_torn_tail(path: Path) -> int:
    """Truncate the file after its last newline (a record is complete only with its newline); bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep, pos = 0, size
        while pos > 0:  # scan backwards: outputs can be gigabytes
            start = max(0, pos - (1 << 16))
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("%s: removed a torn last line (%d bytes) left by an interrupted run", path, size - keep)
    return size - keep


def recover_jsonl(path: Path, what: str = "output", ids_only: bool = False) -> tuple[list[dict], int]:
    """Read an append-only JSONL file, cutting away a torn last line (no trailing newline) in place.

    Returns (records, bytes removed); with `ids_only` each record is reduced to its `id` (and `reason`).
    A broken line in the middle was not written by us: error.
    """
    if not path.exists():
        return [], 0
    cut = _cut_torn_tail(path)
    records = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise Eagle3InputError(f"{what} file {path}, line {n} is not valid JSON ({e.msg}); the file was "
                                       f"modified outside `generate`: fix or remove that line, or use --overwrite"
                                       ) from None
            if not isinstance(rec, dict) or "id" not in rec:
                raise Eagle3InputError(f"{what} file {path}, line {n}: expected an object with field 'id'")
            records.append({k: rec[k] for k in ("id", "reason") if k in rec} if ids_only else rec)
    return records, cut


class AppendLog:
    """Append one JSON record per call with a single write, then flush and fsync."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop only guards against a short write
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
