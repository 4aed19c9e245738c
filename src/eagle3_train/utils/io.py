"""Small I/O helpers shared by every stage: atomic writes, hashing, JSON manifests."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Eagle3InputError(ValueError):
    """Bad user input (file, key or field). The CLI prints the message without a traceback."""


def check_at_least(name: str, value: float | None, minimum: float) -> None:
    """Raise Eagle3InputError "NAME must be >= MINIMUM, got VALUE"; None passes (an optional setting left unset)."""
    if value is not None and value < minimum:
        raise Eagle3InputError(f"{name} must be >= {minimum}, got {value}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it over `path` only if the block succeeds.

    A crash or kill leaves either the old file or the new one, never a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide outputs from other users (e.g. a serving account)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


LOCK_NAME = ".eagle3-train.lock"


def holds_files(path: Path) -> bool:
    """`path` is a directory with something in it besides an `output_lock` file."""
    return path.is_dir() and any(f.name != LOCK_NAME for f in path.iterdir())


@contextmanager
def output_lock(out_dir: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `out_dir` (created) while a job writes into it: a second job into the same directory
    stops with an error instead of deleting the first one's temporary files. The kernel drops the lock when the
    holder exits, even by kill -9, so no stale lock is ever left to clear by hand."""
    import fcntl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise Eagle3InputError(f"{what} {out_dir} is being written by another process (pid {holder}): wait for "
                                   f"it to finish, or write to another directory") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def make_temp_dir(target: Path) -> Path:
    """A temporary sibling directory of `target` (same filesystem, so a rename publishes it atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(tmp, 0o755)
    return tmp


def stage_manifest(stage: str) -> Callable[[Path], bool]:
    """Ownership test for `claim_output_dir`: the directory holds a manifest.json written by `stage`."""
    def ours(path: Path) -> bool:
        try:
            return json.loads((path / "manifest.json").read_text()).get("stage") == stage
        except (OSError, ValueError, AttributeError):
            return False
    return ours


def has_file(*names: str) -> Callable[[Path], bool]:
    """Ownership test for `claim_output_dir`: the directory holds one of these files (our own markers)."""
    return lambda path: any((path / n).exists() for n in names)


def claim_output_dir(path: str | os.PathLike, what: str, ours: Callable[[Path], bool]) -> Path:
    """Refuse an output directory that is neither absent, empty, nor an earlier output of the same stage.

    No command may overwrite or delete files it did not write: `--out ~/models` must not replace a folder of
    unrelated files.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise Eagle3InputError(f"{what} {path} exists and is not a directory")
    if holds_files(path) and not ours(path):
        raise Eagle3InputError(f"{what} {path} is not empty and is not an earlier output of this command; "
                               f"refusing to write into it (its files could be overwritten): choose a new or "
                               f"empty directory")
    return path


def set_aside(path: Path) -> Path:
    """Rename `path` to a free `NAME.previous-TIME[-N]` beside it (never deleted); return the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.previous-{stamp}"), 1
    while aside.exists():  # two set-asides within one second
        n += 1
        aside = path.with_name(f"{path.name}.previous-{stamp}-{n}")
    path.rename(aside)
    return aside


def _backups(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{glob.escape(target.name)}.replaced-*"))


def recover_replaced_dir(target: Path) -> None:
    """Finish a swap that a kill interrupted: restore the backup if `target` is gone, else drop old backups."""
    backups = _backups(target)
    if backups and not target.exists():
        log.warning("restoring %s from %s (a replacement was interrupted)", target, backups[-1].name)
        backups.pop().rename(target)
    for b in backups:
        shutil.rmtree(b, ignore_errors=True)


def replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory `new` to `target`, swapping an existing target out through a backup name.

    A kill at any point leaves the old directory or the new one at `target`, or the old one under its backup name
    (restored by `recover_replaced_dir`); never neither.
    """
    recover_replaced_dir(target)
    if not target.exists():
        new.rename(target)
        return
    backup = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    target.rename(backup)
    new.rename(target)
    shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_dir(target: str | os.PathLike, ours: Callable[[Path], bool] | None = None,
               what: str = "output directory") -> Iterator[Path]:
    """Yield a temporary directory; it replaces `target` only if the block succeeds (a kill leaves no half dir).

    With `ours`, a non-empty `target` that fails that ownership test is refused before any work is done.
    """
    target = Path(target)
    recover_replaced_dir(target)
    if ours is not None:
        claim_output_dir(target, what, ours)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*"):  # temp dirs of writes a kill interrupted
        if stale.is_dir() and ".replaced-" not in stale.name:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = make_temp_dir(target)
    try:
        yield tmp
        replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, with an I/O failure (disk full, read-only) raised as an OSError naming the file.

    safetensors reports those as a SafetensorError whose text holds the OS error number; the CLI turns OSError into a
    clear message (see cli.py).
    """
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        m = re.search(r"os error (\d+)", str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def write_json(path: str | os.PathLike, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise Eagle3InputError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3InputError(f"{what} {path} is not valid JSON: {e}") from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(data: Any) -> str:
    """Hash of a JSON-serialisable object, independent of key order."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
