"""Output directories: the one rule that this tool never deletes or overwrites what it did not write.

A directory is ours only for the entries its marker file (`MARKER`) lists: top-level names, each a file or a
directory this tool wrote whole. Everything else in it is the user's, whatever it looks like (a `manifest.json`
proves nothing: a copy made without dot files has one and no marker). The rule, in this module alone:

- `claim_output_dir`: a stage writes into a directory that is absent, empty, or marked by the same stage; a stage
  that replaces its directory wholesale (`replaces`) also needs every entry in it listed. A directory with entries
  and no listing marker (an older version's output, a copy without its dot files) is refused, naming
  `eagle3-train adopt`, which lists its entries explicitly. A stage that writes in place registers the names it
  writes (`writes`, or `own` as they appear) before writing them, so a kill leaves them listed for the resume.
- `remove_owned` is the only deletion of a directory: it removes the listed entries and leaves anything else (and
  the directory then) in place. Temporary directories (`make_temp_dir`) are created empty under a unique name and
  are wholly ours.
- `set_aside` moves only listed entries. A symlinked output directory is written through: the link stays.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle3_train.utils.io import Eagle3InputError, plain_name

log = logging.getLogger(__name__)

MARKER = ".eagle3-train.json"
LOCK_NAME = ".eagle3-train.lock"
_OWN = (MARKER, LOCK_NAME)
_MARKER_TMP = f"{MARKER}.tmp-"
_TEMP = ".eagle3-tmp-"  # `.NAME.eagle3-tmp-XXXX`: the directory being written, renamed to NAME when complete
_BACKUP = ".eagle3-replaced-"  # `.NAME.eagle3-replaced-PID`: the old NAME while the new one takes its place
# The stages whose outputs carry a marker: what `eagle3-train adopt --stage` takes.
OUTPUT_WRITERS = ("prepare", "generate", "vocab", "extract", "train", "checkpoint", "export", "evaluate",
          "convert-verifier", "run")

Ownership = Callable[[Path], bool]


# --- the marker -------------------------------------------------------------------------------------------------

def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of directory `path`, or None when it has none (or an unreadable one, or one whose file list names
    anything but plain entries of `path`: not ours)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("tool") != "eagle3-train":
        return None
    files = marker.get("files")
    if files is not None and not (isinstance(files, list) and all(plain_name(f) for f in files)):
        return None
    return marker


def listed(marker: dict[str, Any] | None) -> set[str] | None:
    """The entries a marker owns; None for no marker, or one from before markers listed their files."""
    files = (marker or {}).get("files")
    return set(files) if isinstance(files, list) else None


def write_marker(path: Path, stage: str, files: Iterable[str], temp: bool = False) -> None:
    """Mark `path` as written by `stage`, owning the top-level entries `files`; `temp`: a directory this tool
    created empty under a unique name (`make_temp_dir`), wholly ours."""
    names = sorted(set(files))
    if not all(plain_name(n) for n in names):
        raise ValueError(f"marker entries must be plain names, got {names}")
    record: dict[str, Any] = {"tool": "eagle3-train", "stage": stage, "files": names}
    if temp:
        record["temp"] = True
    tmp = path / f"{_MARKER_TMP}{os.getpid()}"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path / MARKER)


def own(path: Path, stage: str, names: Iterable[str]) -> None:
    """Register `names` (top-level entries about to be written in place) in `path`'s marker, before writing them:
    a kill after the write leaves them listed, so the resume, --overwrite and set-aside may touch them."""
    marker = read_marker(path)
    have = (listed(marker) or set()) if (marker or {}).get("stage") == stage else set()
    new = have | set(names)
    if marker is None or marker.get("stage") != stage or new != have:
        write_marker(path, stage, new)


def owned(path: Path) -> set[str]:
    """The entries of `path` that this tool wrote (nothing for an unmarked directory)."""
    return listed(read_marker(path)) or set()


def marked_by(path: Path, stage: str) -> bool:
    return (read_marker(path) or {}).get("stage") == stage


def entries(path: Path) -> list[str]:
    """The names in directory `path` besides our marker and lock files."""
    if not path.is_dir():
        return []
    return sorted(f.name for f in path.iterdir() if f.name not in _OWN and not f.name.startswith(_MARKER_TMP))


def holds_files(path: Path) -> bool:
    """`path` is a directory with something in it besides our marker and lock files."""
    return bool(entries(path))


# --- recognising an output that carries no file list --------------------------------------------------------------

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


def adopt_command(path: Path, stage: str) -> str:
    return f"eagle3-train adopt {path} --stage {stage}"


def _unlisted(path: Path, stage: str, what: str, recognise: Ownership | None) -> Eagle3InputError:
    if recognise is not None and recognise(path):
        return Eagle3InputError(
            f"{what} {path} looks like an output of eagle3-train {stage}, but it has no {MARKER} listing the files "
            f"eagle3-train wrote there (an earlier version wrote it, or it was copied without its dot files), so "
            f"nothing in it is taken as ours, even with --overwrite. If every entry in it is that output, take it "
            f"over with `{adopt_command(path, stage)}` (it prints the entries it lists); otherwise move your own "
            f"files out first, or choose a new or empty directory")
    return Eagle3InputError(f"{what} {path} is not empty and is not an earlier output of eagle3-train {stage}; "
                            f"refusing to write into it, even with --overwrite (its files could be overwritten or "
                            f"deleted): choose a new or empty directory")


# --- claiming -----------------------------------------------------------------------------------------------------

def _resolve(path: str | os.PathLike) -> Path:
    """`path` with a symlinked last component followed (the link is kept, its target written); a parent that is a
    regular file, or a link that leads nowhere or in a loop, is a clear error."""
    path = Path(path).expanduser()
    if path.is_symlink():
        try:
            path = path.resolve()
        except (OSError, RuntimeError) as e:  # a loop of links
            raise Eagle3InputError(f"{path} is a symbolic link that leads in a loop ({e}); remove it or choose "
                                   f"another directory") from None
    for parent in path.parents:
        if parent.is_symlink() and not parent.exists():
            try:
                parent.resolve()
            except (OSError, RuntimeError):
                raise Eagle3InputError(f"cannot create {path}: {parent} is a symbolic link that leads in a "
                                       f"loop") from None
        if parent.exists():
            if not parent.is_dir():
                raise Eagle3InputError(f"cannot create {path}: {parent} is a file, not a directory")
            break
    return path


def foreign_entries(path: Path) -> list[str]:
    """Entries of `path` that its marker does not list (all of them in an unmarked directory)."""
    have = owned(path)
    return [n for n in entries(path) if n not in have]


def claim_output_dir(path: str | os.PathLike, stage: str, what: str, recognise: Ownership | None = None,
                     replaces: bool = False, create: bool = True, writes: Iterable[str] = ()) -> Path:
    """Check that `stage` may write into `path`; returns the path to write (symlinks followed).

    Allowed: an absent or empty directory, or one marked by `stage` with its file list. Refused, with or without
    --overwrite: a file, a directory of someone else's files (`recognise`: it looks like this stage's output, so the
    message names `eagle3-train adopt`), another stage's output, and with `replaces` (the stage swaps the whole
    directory) one that holds entries its marker does not list. A stage writing in place (`create`: the directory
    is made now) registers `writes`, the names it will write; a replacing stage writes no marker here (its finished
    directory carries one), so a failed run leaves none behind.
    """
    path = _resolve(path)
    if path.exists() and not path.is_dir():
        raise Eagle3InputError(f"{what} {path} exists and is not a directory")
    marker = read_marker(path) if path.is_dir() else None
    if holds_files(path):
        if marker is not None and marker.get("stage") != stage:
            raise Eagle3InputError(f"{what} {path} is the output of eagle3-train {marker.get('stage')}, not of "
                                   f"{stage}; choose another directory")
        if listed(marker) is None:
            raise _unlisted(path, stage, what, recognise)
        if replaces and (foreign := foreign_entries(path)):
            raise Eagle3InputError(f"{what} {path} holds {', '.join(foreign[:5])}, which eagle3-train did not "
                                   f"write; replacing the directory would delete it: move it out, or choose "
                                   f"another directory")
    if not replaces and (path.is_dir() or create):
        path.mkdir(parents=True, exist_ok=True)
        own(path, stage, writes)
    return path


def adopt(path: str | os.PathLike, stage: str) -> list[str]:
    """Take an unmarked directory (an older version's output, a copy without its dot files) as `stage`'s output:
    list every entry it holds in a marker. The user's explicit word; returns the entries listed."""
    if stage not in OUTPUT_WRITERS:
        raise Eagle3InputError(f"--stage must be one of {', '.join(OUTPUT_WRITERS)}, got {stage!r}")
    path = _resolve(path)
    if not path.is_dir():
        raise Eagle3InputError(f"{path} is not a directory")
    marker = read_marker(path)
    if marker is not None and marker.get("stage") != stage and holds_files(path):
        raise Eagle3InputError(f"{path} is already the output of eagle3-train {marker.get('stage')}, not of "
                               f"{stage}")
    names = entries(path)
    write_marker(path, stage, names)
    return names


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
def claimed_output(path: str | os.PathLike, stage: str, what: str, recognise: Ownership | None = None,
                   writes: Iterable[str] = ()) -> Iterator[Path]:
    """`claim_output_dir` and `output_lock` together: the directory a stage writes in place, held while it does."""
    path = claim_output_dir(path, stage, what, recognise, writes=writes)
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


# --- moving and removing what is ours ----------------------------------------------------------------------------

def remove_owned(path: Path) -> list[str]:
    """Delete what `path`'s marker lists (a temporary directory whole), then `path` itself if nothing is left;
    anything unlisted stays, and is returned. The only way this tool deletes a directory."""
    if path.is_symlink() or not path.is_dir():
        return []
    marker = read_marker(path)
    if (marker or {}).get("temp"):
        shutil.rmtree(path, ignore_errors=True)
        return []
    for name in sorted(listed(marker) or ()):
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            if read_marker(entry) is not None:
                remove_owned(entry)
            else:
                shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    left = entries(path)
    if left:
        log.warning("left %s in place: it holds %s, which eagle3-train did not write", path, ", ".join(left[:5]))
        return left
    for name in [f.name for f in path.iterdir()]:  # our marker, lock and marker temp files
        (path / name).unlink(missing_ok=True)
    path.rmdir()
    return []


def set_aside(path: Path) -> Path:
    """Move what `path`'s marker lists into a free `NAME.previous-TIME[-N]` beside it (never deleted; the user's
    own files stay where they are); return that path.

    The directory itself stays, with its marker and lock file: a writer holding the lock keeps holding it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.previous-{stamp}"), 1
    while aside.exists():  # two set-asides within one second
        n += 1
        aside = path.with_name(f"{path.name}.previous-{stamp}-{n}")
    aside.mkdir()
    marker = read_marker(path) or {}
    stage = marker.get("stage", "unknown")
    moved = [name for name in sorted(listed(marker) or ()) if (path / name).exists() or (path / name).is_symlink()]
    write_marker(aside, stage, moved)
    for name in moved:
        (path / name).rename(aside / name)
    write_marker(path, stage, [])
    if read_marker(path.parent) is not None:  # a run directory's train/: the set-aside run is the run's too
        own(path.parent, read_marker(path.parent)["stage"], [aside.name])
    return aside


# --- replacing a directory atomically ---------------------------------------------------------------------------

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
        remove_owned(b)


def replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory `new` to `target`, swapping an existing target out through a backup name.

    A kill at any point leaves the old directory or the new one at `target`, or the old one under its backup name
    (restored by `recover_replaced_dir`); never neither. The old directory loses only what its marker lists
    (`remove_owned`): the claim refused one holding anything else, and a file put there since stays.
    """
    recover_replaced_dir(target)
    if not target.exists():
        new.rename(target)
        return
    backup = target.with_name(f".{target.name}{_BACKUP}{os.getpid()}")
    target.rename(backup)
    new.rename(target)
    if remove_owned(backup):
        log.warning("the earlier %s is kept as %s", target, backup)


def make_temp_dir(target: Path, stage: str) -> Path:
    """A marked temporary sibling directory of `target` (same filesystem, so a rename publishes it atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{_TEMP}", dir=target.parent))
    os.chmod(tmp, 0o755)
    write_marker(tmp, stage, [], temp=True)
    return tmp


@contextmanager
def atomic_dir(target: str | os.PathLike, stage: str, what: str = "output directory",
               recognise: Ownership | None = None) -> Iterator[Path]:
    """Yield a temporary directory; it replaces `target` only if the block succeeds (a kill leaves no half dir).

    `target` is claimed for `stage` before the block runs; the marker, listing what the block wrote, is written at
    the end. Temporary directories that a killed writer left are removed; one that another live writer holds stops
    this one with a clear error.
    """
    target = _resolve(target)
    recover_replaced_dir(target)
    claim_output_dir(target, stage, what, recognise, replaces=True, create=False)
    for stale in _ours_beside(target, _TEMP):
        with _locked(stale / LOCK_NAME) as holder:
            if holder is not None:
                raise _busy(what, target, holder)
        remove_owned(stale)
    tmp = make_temp_dir(target, stage)
    try:
        with _locked(tmp / LOCK_NAME):
            yield tmp
            (tmp / LOCK_NAME).unlink()
            write_marker(tmp, stage, entries(tmp))
            replace_dir(tmp, target)
    finally:
        if tmp.exists():
            remove_owned(tmp)
