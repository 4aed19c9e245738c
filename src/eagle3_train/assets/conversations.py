"""Conversation sources: what `--data` names (the embedded ShareGPT set, presets, Hub datasets, local files and
dataset directories, `generate` output, or several mixed), read as conversations.

Every source yields `Conversation(id, messages)` with messages `{"role": "system"|"user"|"assistant", "content": str}`.
Which file a `--data` setting names is `data_sources.py` (one file for every stage, mixtures and datasets included);
reading it, torn tails and broken records included, is `conversation_files.py`, and turning each record into
messages is `conversation_records.py`.

Python API: `load_conversations(source, limit=None, skip_bad_records=False) -> (Iterator[Conversation], SourceInfo)`,
`resolve_source(source, cached_only=False) -> Path`, `sharegpt_path() -> Path`; `source` is one `--data` value or a
list of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from eagle3_train.assets.conversation_files import SourceInfo, iter_file, regeneration_record
from eagle3_train.assets.conversation_records import Conversation
from eagle3_train.assets.data_mixture import TOLERATED, refuse_bad_records
from eagle3_train.assets.data_sources import EMBEDDED_SHAREGPT, resolve, sharegpt_path
from eagle3_train.assets.data_spec import DataSource, describe
from eagle3_train.utils.io import check_at_least, sha256_file

__all__ = ["EMBEDDED_SHAREGPT", "load_conversations", "regeneration_record", "resolve_source", "sharegpt_path"]

_BAD_EXAMPLES = 5


def resolve_source(source: DataSource, cached_only: bool = False) -> Path:
    """The one file `source` names: a file as it is, a dataset's or a mixture's file in the data cache. With
    `cached_only` (a dry run), a dataset the cache lacks raises `hub_datasets.NotFetched` instead of being fetched."""
    return resolve(source, cached_only).path


def load_conversations(source: DataSource, limit: int | None = None, skip_bad_records: bool = False
                       ) -> tuple[Iterator[Conversation], SourceInfo]:
    """Open a conversation source; conversations are decoded lazily, the first `limit` records only.

    With `skip_bad_records`, broken records are skipped and counted (conversation_files.py) instead of failing; in a
    mixture they were skipped when it was written, and are counted here (or refused without `skip_bad_records`).
    """
    check_at_least("limit", limit, 0)
    resolved = resolve(source)
    if not skip_bad_records:
        refuse_bad_records(resolved.sources)
    path = resolved.path
    info = SourceInfo(source=describe(source), path=str(path), sha256=sha256_file(path), limit=limit,
                      skip_bad_records=skip_bad_records, regeneration=resolved.regeneration,
                      sources=resolved.sources)
    for s in resolved.sources:  # a mixture's: skipped when it was written, counted as the reader counts its own
        for reason, n in (s.get("bad_records") or {}).items():
            if skip_bad_records or reason in TOLERATED:
                info.bad_records[reason] = info.bad_records.get(reason, 0) + n
        room = _BAD_EXAMPLES - len(info.bad_record_examples)
        info.bad_record_examples += (s.get("bad_record_examples") or [])[:max(room, 0)]
    return iter_file(path, info, limit), info
