"""Conversations from a `datasets` dataset, a Hugging Face Hub id or a local dataset directory (a README.md with
`configs:`, or data files `datasets` finds by their names), written once as JSON Lines in the tool's data cache.

Both are read through `datasets.load_dataset_builder` with the same arguments (config, split). The first N rows
(`:N`) and a local directory are streamed: only what is read is fetched, and a local directory leaves no copy that
could go stale. A whole Hub split is downloaded into `datasets`' cache and read from there. Each row keeps the fields
its shape reads (`record_shapes.py`: the conversation, id, system prompt, tools); a row of no known shape stops the
fetch with its columns named. The file is written atomically beside a `.source.json` recording the dataset id,
config, split, revision (the Hub commit; for a local directory a fingerprint of its files: names, sizes, times) and
rows, and every later read of that source is that file.

Caches: ours in `$EAGLE3_TRAIN_DATA_CACHE`, default `$EAGLE3_TRAIN_CACHE/data` (utils/paths.py); `datasets`' own in
`$HF_DATASETS_CACHE` when set, else `$EAGLE3_TRAIN_CACHE/datasets`. A Hub source once written is read without the Hub
(delete its file to fetch it again; `NAME-firstN` files are cut from a whole split already fetched); a local
directory's file is named by its fingerprint, so an edited directory is read again. `$EAGLE3_TRAIN_HUB_MIRROR` names
a folder of local copies of Hub dataset repositories (`ORG/NAME/`, e.g. git clones), read instead of the Hub.

This module is the one reader of Hub datasets: the evaluation prompt sets (evaluate/prompt_sets.py) are read through
the same `hub_location` (mirror or Hub), `datasets_cache_dir`, `open_split` (config, split choice, revision, rows
streamed) and `unreachable` (the error without the Hub), with their own cache of prompts. `fetch(..., cached_only=True)`
answers from the data cache alone and raises `NotFetched` for the rest (`run --dry-run` downloads and writes nothing).

Python API: `HubSource`, `fetch(source, spec_text, cached_only=False) -> (path, record)`, `NotFetched`,
`hub_location(dataset)`, `open_split(...) -> HubSplit`, `unreachable(...)`, `data_cache_dir()`,
`datasets_cache_dir()`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_train.assets.record_shapes import SHAPES_TEXT, kept_fields, shape_of
from eagle3_train.utils.io import Eagle3InputError, atomic_path, read_json, write_json
from eagle3_train.utils.paths import cache_dir as tool_cache_dir

log = logging.getLogger(__name__)

CACHE_ENV = "EAGLE3_TRAIN_DATA_CACHE"
MIRROR_ENV = "EAGLE3_TRAIN_HUB_MIRROR"
KINDS = ("preset", "hub", "dataset-dir")
_COMMIT = re.compile(r"@([0-9a-f]{40})/")  # the Hub revision in a resolved data file URL


class NotFetched(Eagle3InputError):
    """A source the data cache does not hold yet, met where nothing may be downloaded or written (a dry run)."""


def data_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or tool_cache_dir() / "data").expanduser()


def datasets_cache_dir() -> str:
    """`datasets`' cache: the user's `HF_DATASETS_CACHE` (read now, not when `datasets` was imported), else under the
    tool's cache."""
    return os.environ.get("HF_DATASETS_CACHE") or str(tool_cache_dir() / "datasets")


@dataclass(frozen=True)
class HubSource:
    dataset: str  # Hub id ORG/NAME, or a local dataset directory
    config: str | None  # None: the dataset's default (or only) config
    split: str | None  # None: `train`, else the dataset's only split
    limit: int | None  # the first N rows (streamed)
    label: str  # rows without an id of their own get LABEL-INDEX
    kind: str = "hub"  # one of KINDS: what the manifest says it was
    id_field: str | None = None  # the column holding the row's own id (default: `id`)
    whole_name: str | None = None  # the cache name of the whole split (a preset's own name), when it has one

    def cache_name(self, limit: int | None) -> str:
        if limit is None and self.whole_name:
            return self.whole_name
        if self.kind == "dataset-dir":
            p = Path(self.dataset).expanduser().resolve()
            base = f"{p.name}-{hashlib.sha256(str(p).encode()).hexdigest()[:8]}"
        else:
            base = self.dataset.replace("/", "~")  # no id has a "~": names stay distinct
        return (base + (f".{self.config}" if self.config else "") + (f"@{self.split}" if self.split else "")
                + (f"-first{limit}" if limit else ""))


def _source_file(path: Path) -> Path:
    return path.with_suffix(".source.json")


def _cached_record(path: Path, src: HubSource) -> dict[str, Any]:
    """What the cache file's `.source.json` says; a file written by hand (or by an older version) says less."""
    side = _source_file(path)
    if side.is_file():
        return read_json(side, "data cache record")
    return {"kind": src.kind, "dataset": src.dataset, "config": src.config, "split": src.split, "revision": None,
            "rows": None, "limit": src.limit}


def fetch(src: HubSource, spec: str, cached_only: bool = False) -> tuple[Path, dict[str, Any]]:
    """The source's JSON Lines file in the data cache (written once) and its record (dataset, config, split,
    revision, rows). `spec` is the `--data` value it came from, for messages. With `cached_only`, nothing is read
    with `datasets` or written: a source the cache does not hold yet raises NotFetched saying what a run would do."""
    cache = data_cache_dir()
    if src.kind != "dataset-dir":
        path = cache / f"{src.cache_name(src.limit)}.jsonl"
        if path.is_file():
            return path, _cached_record(path, src)
        whole = cache / f"{src.cache_name(None)}.jsonl"
        if src.limit is not None and whole.is_file():  # the first N rows of a split already fetched whole
            if cached_only:
                raise NotFetched(f"--data {spec}: not cut yet: would take the first {src.limit} rows of {whole}")
            return path, _cut(whole, path, src)
    if cached_only:  # a local directory's file is named by a fingerprint only `datasets` can take (it writes locks)
        verb = "read the dataset directory" if src.kind == "dataset-dir" else "fetch"
        raise NotFetched(f"--data {spec}: not fetched yet: would {verb} {_described(src)}")
    read_from = _read_from(src)
    try:
        return _fetch(src, spec, read_from, cache)
    except Eagle3InputError:
        raise
    except Exception as e:  # noqa: BLE001 - no network, no such dataset, auth, a broken file: one clear message
        raise _unreadable(src, spec, read_from, e) from None


def _described(src: HubSource) -> str:
    return f"{src.dataset} (config {src.config or 'default'}, split {src.split or 'default'})"


def hub_location(dataset: str) -> str:
    """Where `datasets` reads the Hub dataset ORG/NAME: its local copy under $EAGLE3_TRAIN_HUB_MIRROR when there is
    one, else the Hub id."""
    mirror = os.environ.get(MIRROR_ENV)
    local = Path(mirror).expanduser() / dataset if mirror else None
    return str(local) if local is not None and local.is_dir() else dataset


def _read_from(src: HubSource) -> str:
    """Where `datasets` reads the source: the local directory, else `hub_location`."""
    if src.kind == "dataset-dir":
        return str(Path(src.dataset).expanduser().resolve())
    return hub_location(src.dataset)


def _cut(whole: Path, path: Path, src: HubSource) -> dict[str, Any]:
    rows = 0
    with open(whole, encoding="utf-8") as f, atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for line in f:
            if rows >= (src.limit or 0):
                break
            if line.strip():
                out.write(line if line.endswith("\n") else line + "\n")
                rows += 1
    record = {**_cached_record(whole, src), "rows": rows, "limit": src.limit, "cut_from": whole.name}
    write_json(_source_file(path), record)
    return record


def _fetch(src: HubSource, spec: str, read_from: str, cache: Path) -> tuple[Path, dict[str, Any]]:
    try:
        opened = open_split(f"--data {spec}", src.dataset, read_from, src.config, src.split)
    except FileNotFoundError as e:
        if src.kind != "dataset-dir":
            raise
        raise Eagle3InputError(f"data directory {read_from} has no conversations.jsonl (a `generate` output) and no "
                               f"data files `datasets` reads ({str(e)[:200]}); expected one of those, or a "
                               f"README.md with `configs:` naming its files (docs/DATA.md)") from None
    split = opened.split
    revision = _fingerprint(opened.builder, split) if src.kind == "dataset-dir" else opened.revision
    path = cache / (f"local/{src.cache_name(src.limit)}-{(revision or '')[:12]}.jsonl" if src.kind == "dataset-dir"
                    else f"{src.cache_name(src.limit)}.jsonl")
    if path.is_file():
        return path, _cached_record(path, src)
    # a local directory is streamed too: a prepared copy in datasets' cache would go stale when it is edited
    streamed = src.limit is not None or Path(read_from).is_dir()
    log.info("reading %s (config %s, split %s%s) with datasets into %s", src.dataset, opened.config, split,
             f", first {src.limit} rows" if src.limit else "", path)
    if streamed:
        rows: Iterable[dict[str, Any]] = opened.rows()
        if src.limit is not None:  # not `.take(N)`: after its N rows it still opens the split's next file
            rows = itertools.islice(rows, src.limit)
    else:
        opened.builder.download_and_prepare()
        rows = opened.builder.as_dataset(split=split)
    where = f"--data {spec}: {src.dataset} (config {opened.config}, split {split})"
    n = _write_rows(rows, path, src, where)
    record = {"kind": src.kind, "dataset": src.dataset, "config": opened.config, "split": split,
              "revision": revision, "rows": n, "limit": src.limit, "streamed": streamed, "read_from": read_from}
    write_json(_source_file(path), record)
    return path, record


def _write_rows(rows: Iterable[dict[str, Any]], path: Path, src: HubSource, where: str) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(_row_record(row, i, src, where), ensure_ascii=False, default=str) + "\n")
            n += 1
        if n == 0:
            raise Eagle3InputError(f"{where}: no rows")
    return n


def _row_record(row: dict[str, Any], index: int, src: HubSource, where: str) -> dict[str, Any]:
    """One dataset row as a conversation record (`conversation_records.parse_record` reads it): its shape's fields,
    system prompt and tools, and an id (its own, else LABEL-INDEX)."""
    shape = shape_of(row)
    if shape is None:
        raise Eagle3InputError(f"{where}, row {index}: no conversation in its columns {sorted(row)}; expected "
                               f"{SHAPES_TEXT} (docs/DATA.md)")
    kept = kept_fields(row, shape)
    own = row.get(src.id_field or "id")
    kept.pop("id", None)
    return {"id": str(own) if own not in (None, "") else f"{src.label}-{index}", **kept}


@dataclass(frozen=True)
class HubSplit:
    """One split of a dataset, opened with `datasets` (no row read yet)."""
    builder: Any  # the `datasets` builder: streamed by `rows`, or downloaded and prepared whole by the caller
    config: str  # the config read: the one asked for, else the dataset's default (or only) one
    split: str
    revision: str | None  # the Hub commit the data files are read at; None for a local copy (it has none)

    def rows(self) -> Iterable[dict[str, Any]]:
        """The split's rows, streamed: only the files (and the parts of them) that are iterated over are read."""
        return self.builder.as_streaming_dataset(split=self.split)


def open_split(label: str, dataset: str, read_from: str, config: str | None, split: str | None,
               revision: str | None = None) -> HubSplit:
    """`dataset`'s split, read from `read_from` (`hub_location`, or a local dataset directory): `split` (checked),
    else `train`, else its only split; `revision` pins a Hub commit. A config or split the dataset lacks is an
    Eagle3InputError that starts with `label` (what asked for it: `--data SPEC`) and lists the ones it has; anything
    else (no network, gated, a broken copy) is raised as `datasets` raised it, for the caller's `unreachable`."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(read_from, config, revision=revision, cache_dir=datasets_cache_dir())
    except ValueError as e:  # a config that is not there, or none given where there are several
        raise Eagle3InputError(f"{label}: {_configs_problem(dataset, read_from, config, e)}") from None
    return HubSplit(builder, builder.config.name, _split(label, dataset, builder, split), _commit(builder, read_from))


def unreachable(label: str, dataset: str, config: str | None, split: str | None, read_from: str, error: Exception,
                hint: str) -> Eagle3InputError:
    """The error for a Hub dataset that could not be read (no network, offline, gated, no such dataset, a broken
    copy): `label` says what asked for it, `hint` is the caller's own way around it (which command writes which
    cache file, which option takes a file instead); the mirror is offered after it. One line."""
    where = f"{dataset} (config {config or 'default'}, split {split or 'default'})"
    place = "here" if read_from == dataset else f"from its copy at {read_from}"
    said = " ".join(str(error).split())[:300]  # one line, whatever `datasets` wrapped
    gated = any(w in said.lower() for w in ("gated", "401", "403", "unauthorized"))
    login = (" If the dataset is gated, accept its terms on its Hub page and log in (hf auth login, or HF_TOKEN)."
             if gated else "")
    return Eagle3InputError(f"{label}: {where} is on the Hugging Face Hub, which could not be read {place} "
                            f"({type(error).__name__}: {said}).{login} {hint}; or put a copy of the dataset "
                            f"repository at ${MIRROR_ENV}/{dataset}")


def _configs_problem(dataset: str, read_from: str, config: str | None, e: ValueError) -> str:
    import datasets

    try:
        names = datasets.get_dataset_config_names(read_from, cache_dir=datasets_cache_dir())
    except Exception:  # noqa: BLE001 - `datasets`' own message stands without the list
        names = []
    if names and config is not None and config not in names:
        return f"{dataset} has no config {config!r}; its configs: {', '.join(names)}"
    if config is None and len(names) > 1:
        return f"{dataset} has several configs: pick one with :CONFIG ({', '.join(names)})"
    return f"{dataset}: {str(e).splitlines()[0][:300]}"


def _split(label: str, dataset: str, builder: Any, split: str | None) -> str:
    """The split to read: the one asked for (checked), else `train`, else the only one."""
    names = list(builder.info.splits or {}) or list(builder.config.data_files or {})
    where = f"{dataset} (config {builder.config.name})"
    if split is None:
        if "train" in names or not names:
            return "train"
        if len(names) == 1:
            return names[0]
        raise Eagle3InputError(f"{label}: {where} has no split 'train': pick one with @SPLIT ({', '.join(names)})")
    if names and split not in names:
        raise Eagle3InputError(f"{label}: {where} has no split {split!r}; its splits: {', '.join(names)}")
    return split


def _commit(builder: Any, read_from: str) -> str | None:
    """The Hub commit the data files are read at (the builder's hash, which is the commit for a Hub dataset, where
    the files do not say); None for a local directory, a mirror's copy included: it has no Hub commit."""
    if Path(read_from).is_dir():
        return None
    files = [str(f) for fs in (builder.config.data_files or {}).values() for f in fs]
    return next((m.group(1) for f in files if (m := _COMMIT.search(f))), None) or builder.hash


def _fingerprint(builder: Any, split: str) -> str:
    """A local split's files by name, size and modification time: an edited directory is read again."""
    data_files = builder.config.data_files or {}
    files = sorted(str(f) for f in data_files.get(split, [f for fs in data_files.values() for f in fs]))
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _unreadable(src: HubSource, spec: str, read_from: str, e: Exception) -> Eagle3InputError:
    if src.kind == "dataset-dir":
        return Eagle3InputError(f"--data {spec}: the dataset directory {_described(src)} could not be read with "
                                f"`datasets` ({type(e).__name__}: {' '.join(str(e).split())[:300]})")
    path = data_cache_dir() / f"{src.cache_name(src.limit)}.jsonl"
    return unreachable(f"--data {spec}", src.dataset, src.config, src.split, read_from, e,
                       f"Where the Hub is reachable, run `eagle3-train prepare --data {spec} ...` once (it writes "
                       f"{path}) and copy that file to {path} on this machine ({CACHE_ENV} moves the cache); or pass "
                       f"a JSON Lines file of conversations with --data FILE")
