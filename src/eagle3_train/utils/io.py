"""Small I/O helpers shared by every stage: atomic file writes, hashing, JSON manifests (output directories:
utils/outputs.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
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


def plain_name(name: Any) -> bool:
    """`name` is one entry of a directory: a non-empty string, not `.` or `..`, without separators or NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def file_in(directory: Path, name: Any, what: str) -> Path:
    """`directory / name` for a file name read from a file we did not write (an index's shard, a manifest entry):
    a plain name of an entry of `directory`, never `..`, an absolute path or a link leading out of it (except the
    hub cache's own links from a snapshot into its `blobs/`)."""
    if not plain_name(name):
        raise Eagle3InputError(f"{what} names {name!r}, which is not a plain file name inside {directory}: refusing "
                               f"to read it")
    path = directory / name
    if path.is_symlink():
        target, root = path.resolve(), directory.resolve()
        blobs = directory.parent.parent / "blobs"  # HF cache: REPO/snapshots/REV/NAME -> REPO/blobs/HASH
        if not (target.is_relative_to(root) or (directory.parent.name == "snapshots"
                                                 and target.is_relative_to(blobs.resolve()))):
            raise Eagle3InputError(f"{what} names {name!r}, a link from {directory} to {target}, outside it: "
                                   f"refusing to read it")
    return path


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a `*.safetensors.index.json` (tensor name -> weight file), each file a plain name beside
    the index (`file_in`)."""
    wm = read_json(index, "safetensors index").get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise Eagle3InputError(f"{index}: no 'weight_map' (tensor name -> shard file)")
    for name in set(wm.values()):
        file_in(index.parent, name, f"{index} (weight_map)")
    return wm


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


def load_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """`safetensors.torch.load_file`, a damaged or cut-off file being one clear error naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, ValueError, RuntimeError) as e:
        raise Eagle3InputError(f"weight file {path} cannot be read (corrupt or truncated?): {e}") from None
    except Exception as e:  # safetensors' own SafetensorError (a header cut short) is no subclass of these
        if type(e).__name__ != "SafetensorError":
            raise
        raise Eagle3InputError(f"weight file {path} cannot be read (corrupt or truncated?): {e}") from None


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, with an I/O failure (disk full, read-only) raised as an OSError naming the file.

    safetensors reports those as a SafetensorError whose text holds the OS error number; the CLI turns OSError into a
    clear message (see cli.py).
    """
    from safetensors.torch import save_file

    with write_errors_as_os_errors(path):
        save_file(tensors, str(path), metadata=metadata)


@contextmanager
def write_errors_as_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """A writer's I/O failure (disk full, read-only) that safetensors (also inside transformers' save_pretrained)
    reports as its own error, with the OS error number in its text, raised as the OSError it is, naming `path`
    (so is shutil.copytree's collected shutil.Error, whose errno is None)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        m = re.search(r"os error (\d+)|\[Errno (\d+)\]", str(e))
        if m is None:
            raise
        code = int(m.group(1) or m.group(2))
        raise OSError(code, os.strerror(code), str(path)) from None


def write_json(path: str | os.PathLike, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_jsonl(path: Path, fix: str = "") -> list[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON Lines file (gzipped when it ends in .gz); a line that is
    not JSON is one error naming the file and line, and `fix`, what to do about it."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise Eagle3InputError(f"{path}, line {n}: invalid JSON ({e.msg}){f'; {fix}' if fix else ''}") from None
    return rows


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """A JSON object file (configs, manifests, indexes, metadata): anything else is one clear error naming it."""
    path = Path(path)
    if not path.is_file():
        raise Eagle3InputError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Eagle3InputError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise Eagle3InputError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


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
