"""Output directories: the one rule that this tool never deletes or overwrites what it did not write.

Every directory a stage writes carries a marker file (`MARKER`) naming that stage. A stage writes only into a
directory that is absent, empty, or marked by the same stage (`claim_output_dir`), whatever `--overwrite` says; the
temporary and backup directories that atomic replacement leaves beside an output are removed only when they carry
the marker too, so a user's own `.draft.old/` next to `--out draft` is never touched. A stage that replaces its
directory wholesale records the names it wrote in the marker and refuses to replace a directory that holds anything
else (the user's data file dropped into `--out`). A symlinked output directory is written through: the link stays.
Directories written before markers existed are recognised by a stage-specific `legacy` test and marked on claim.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

MARKER = ".eagle3-train.json"
LOCK_NAME = ".eagle3-train.lock"
_OWN = (MARKER, LOCK_NAME)
_TEMP = ".eagle3-tmp-"  # `.NAME.eagle3-tmp-XXXX`: the directory being written, renamed to NAME when complete
_BACKUP = ".eagle3-replaced-"  # `.NAME.eagle3-replaced-PID`: the old NAME while the new one takes its place

Ownership = Callable[[Path], bool]


# --- the marker -------------------------------------------------------------------------------------------------

def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of directory `path`, or None when it has none (or an unreadable one: not ours)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("tool") == "eagle3-train" else None


def write_marker(path: Path, stage: str, files: list[str] | None = None) -> None:
    """Mark `path` as written by `stage`; `files`: the top-level names a wholesale replacement may remove."""
    record: dict[str, Any] = {"tool": "eagle3-train", "stage": stage}
    if files is not None:
        record["files"] = sorted(files)
    tmp = path / f"{MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path / MARKER)


def marked_by(path: Path, stage: str) -> bool:
    return (read_marker(path) or {}).get("stage") == stage


def holds_files(path: Path) -> bool:
    """`path` is a directory with something in it besides our marker and lock files."""
    return path.is_dir() and any(f.name not in _OWN for f in path.iterdir())


# --- legacy ownership tests (outputs written before markers existed) ---------------------------------------------

def json_says(name: str, key: str, value: Any) -> Ownership:
    """The directory holds the JSON object file `name` whose `key` is `value` (e.g. manifest.json's stage)."""
    def ours(path: Path) -> bool:
        try:
            return json.loads((path / name).read_text()).get(key) == value
        except (OSError, ValueError, AttributeError):
            return False
    return ours


def stage_manifest(stage: str) -> Ownership:
    return json_says("manifest.json", "stage", stage)


def has_file(*names: str) -> Ownership:
    """The directory holds one of these files, named specifically enough to be ours (pipeline_state.json)."""
    return lambda path: any((path / n).exists() for n in names)


# --- claiming -----------------------------------------------------------------------------------------------------

def _resolve(path: str | os.PathLike) -> Path:
    """`path` with a symlinked last component followed (the link is kept, its target written); a parent that is a
    regular file is a clear error."""
    path = Path(path).expanduser()
    if path.is_symlink():
        path = path.resolve()
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise Eagle3InputError(f"cannot create {path}: {parent} is a file, not a directory")
            break
    return path


def _foreign_entries(path: Path, marker: dict[str, Any]) -> list[str]:
    listed = marker.get("files")
    if listed is None:
        return []
    return sorted(f.name for f in path.iterdir() if f.name not in _OWN and f.name not in listed)


def claim_output_dir(path: str | os.PathLike, stage: str, what: str, legacy: Ownership | None = None,
                     replaces: bool = False, create: bool = True) -> Path:
    """Check that `stage` may write into `path` and mark it; returns the path to write (symlinks followed).

    Allowed: an absent or empty directory, or one marked by `stage` (or passing `legacy`, then marked). Refused,
    with or without --overwrite: a file, a directory of someone else's files, another stage's output, and with
    `replaces` (the stage swaps the whole directory) one that holds files the marker does not list. `create`: make
    an absent directory (a stage writing in place) rather than leave it to appear when complete.
    """
    path = _resolve(path)
    if path.exists() and not path.is_dir():
        raise Eagle3InputError(f"{what} {path} exists and is not a directory")
    marker = read_marker(path)
    if holds_files(path):
        if marker is not None and marker.get("stage") != stage:
            raise Eagle3InputError(f"{what} {path} is the output of eagle3-train {marker.get('stage')}, not of "
                                   f"{stage}; choose another directory")
        if marker is None and not (legacy is not None and legacy(path)):
            raise Eagle3InputError(f"{what} {path} is not empty and is not an earlier output of eagle3-train "
                                   f"{stage}; refusing to write into it, even with --overwrite (its files could be "
                                   f"overwritten or deleted): choose a new or empty directory")
        if replaces and marker is not None and (foreign := _foreign_entries(path, marker)):
            raise Eagle3InputError(f"{what} {path} holds {', '.join(foreign[:5])}, which eagle3-train did not "
                                   f"write; replacing the directory would delete it: move it out, or choose "
                                   f"another directory")
        if marker is None:
            log.info("%s %s: an output of an earlier eagle3-train version; marking it", what, path)
    if path.is_dir() or create:
        path.mkdir(parents=True, exist_ok=True)
        if (marker or {}).get("stage") != stage:  # unmarked, or an empty directory another stage claimed
            write_marker(path, stage)
    return path


@contextmanager
def output_lock(out_dir: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `out_dir` (created) while a job writes into it: a second job into the same directory
    stops with an error instead of mixing its writes with the first one's. The kernel drops the lock when the holder
    exits, even by kill -9, so no stale lock is ever left to clear by hand."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir / LOCK_NAME) as holder:
        if holder is not None:
            raise _busy(what, out_dir, holder)
        yield


@contextmanager
def claimed_output(path: str | os.PathLike, stage: str, what: str, legacy: Ownership | None = None
                   ) -> Iterator[Path]:
    """`claim_output_dir` and `output_lock` together: the directory a stage writes in place, held while it does."""
    path = claim_output_dir(path, stage, what, legacy)
    with output_lock(path, what):
        yield path


def _busy(what: str, path: Path, holder: str) -> Eagle3InputError:
    return Eagle3InputError(f"{what} {path} is being written by another process (pid {holder}): wait for it to "
                            f"finish, or write to another directory")


@contextmanager
def _locked(lock_file: Path) -> Iterator[str | None]:
    """Try an exclusive flock on `lock_file`: yields None when held (our pid written in it), else the holder's pid."""
    import fcntl

    with open(lock_file, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            yield f.read().strip() or "unknown"
            return
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield None
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# --- replacing a directory atomically ---------------------------------------------------------------------------

def set_aside(path: Path) -> Path:
    """Move what `path` holds into a free `NAME.previous-TIME[-N]` beside it (never deleted); return that path.

    The directory itself stays, with its marker and lock file: a writer holding the lock keeps holding it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.previous-{stamp}"), 1
    while aside.exists():  # two set-asides within one second
        n += 1
        aside = path.with_name(f"{path.name}.previous-{stamp}-{n}")
    aside.mkdir()
    if (path / MARKER).is_file():
        shutil.copy2(path / MARKER, aside / MARKER)
    for entry in path.iterdir():
        if entry.name not in _OWN:
            entry.rename(aside / entry.name)
    return aside


def _ours_beside(target: Path, infix: str) -> list[Path]:
    """Our temporary or backup directories beside `target`: the right name and our marker inside."""
    prefix = f".{target.name}{infix}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir()
                  if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink() and read_marker(p) is not None)


def recover_replaced_dir(target: Path) -> None:
    """Finish a swap that a kill interrupted: restore the backup if `target` is gone, else drop old backups."""
    backups = _ours_beside(target, _BACKUP)
    if backups and not target.exists():
        log.warning("restoring %s from %s (a replacement was interrupted)", target, backups[-1].name)
        backups.pop().rename(target)
    for b in backups:
        shutil.rmtree(b, ignore_errors=True)


def replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory `new` to `target`, swapping an existing target out through a backup name.

    A kill at any point leaves the old directory or the new one at `target`, or the old one under its backup name
    (restored by `recover_replaced_dir`); never neither. The old target carries our marker (claimed), so its backup
    does too.
    """
    recover_replaced_dir(target)
    if not target.exists():
        new.rename(target)
        return
    backup = target.with_name(f".{target.name}{_BACKUP}{os.getpid()}")
    target.rename(backup)
    new.rename(target)
    shutil.rmtree(backup, ignore_errors=True)


def make_temp_dir(target: Path, stage: str) -> Path:
    """A marked temporary sibling directory of `target` (same filesystem, so a rename publishes it atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{_TEMP}", dir=target.parent))
    os.chmod(tmp, 0o755)
    write_marker(tmp, stage)
    return tmp


@contextmanager
def atomic_dir(target: str | os.PathLike, stage: str, what: str = "output directory",
               legacy: Ownership | None = None) -> Iterator[Path]:
    """Yield a temporary directory; it replaces `target` only if the block succeeds (a kill leaves no half dir).

    `target` is claimed for `stage` before the block runs. Temporary directories that a killed writer left are
    removed; one that another live writer holds stops this one with a clear error.
    """
    target = _resolve(target)
    recover_replaced_dir(target)
    claim_output_dir(target, stage, what, legacy, replaces=True, create=False)
    for stale in _ours_beside(target, _TEMP):
        with _locked(stale / LOCK_NAME) as holder:
            if holder is not None:
                raise _busy(what, target, holder)
            shutil.rmtree(stale, ignore_errors=True)
    tmp = make_temp_dir(target, stage)
    try:
        with _locked(tmp / LOCK_NAME):
            yield tmp
            (tmp / LOCK_NAME).unlink()
            write_marker(tmp, stage, [f.name for f in tmp.iterdir() if f.name not in _OWN])
            replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
