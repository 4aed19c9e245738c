"""The first N user turns of each conversation, written as messages JSON Lines: what `generate.max_turns` regenerates
(the run's generate stage writes the cut beside its output; the generate command, which owns no directory beside its
output, into the tool's data cache)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eagle3_train.assets.data_spec import DataSource
from eagle3_train.utils.io import atomic_path

log = logging.getLogger(__name__)


def jsonl_record(conv, messages: list[dict[str, Any]]) -> str:
    """One conversation as a messages-JSONL line, with its tools."""
    return json.dumps({"id": conv.id, "messages": messages, **({"tools": conv.tools} if conv.tools else {})}) + "\n"


def cut_turns(source: DataSource, out_file: Path, limit: int | None, max_turns: int, skip_bad_records: bool = False
              ) -> Path:
    """Write the source's conversations, cut after `max_turns` user turns, as messages JSONL."""
    from eagle3_train.assets.conversations import load_conversations

    conversations, info = load_conversations(source, limit=limit, skip_bad_records=skip_bad_records)
    with atomic_path(out_file) as tmp, open(tmp, "w") as f:
        for conv in conversations:
            kept, users = [], 0
            for m in conv.messages:
                if m["role"] == "user":
                    users += 1
                    if users > max_turns:
                        break
                kept.append(m)
            f.write(jsonl_record(conv, kept))
    if info.bad_records:
        log.warning("%s: skipped bad records %s (first: %s)", source, info.bad_records, info.bad_record_examples)
    return out_file


def cut_turns_cached(source: DataSource, limit: int | None, max_turns: int, skip_bad_records: bool = False) -> Path:
    """`cut_turns` for the generate command, which owns no directory beside its output: the cut conversations go in
    the tool's data cache, named by the source file's hash and the cut (the same cut is written once, so a resumed
    run reads the same source)."""
    import hashlib

    from eagle3_train.assets.conversations import resolve_source
    from eagle3_train.assets.hub_datasets import data_cache_dir
    from eagle3_train.utils.io import sha256_file

    resolved = resolve_source(source)
    key = hashlib.sha256(f"{sha256_file(resolved)}:{limit}:{max_turns}".encode()).hexdigest()[:16]
    out = data_cache_dir() / "first-turns" / f"{key}.jsonl"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        cut_turns(str(resolved), out, limit, max_turns, skip_bad_records)
    return out
