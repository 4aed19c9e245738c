"""Several `--data` sources (or one cut to its first N conversations) as one JSON Lines file in the data cache, so
that every stage still reads one file (path + SHA-256).

The rule (docs/DATA.md): `:N` caps what a source gives, its first N rows; weights (`%W`, relative numbers) set each
source's share. Without weights every conversation of every source is used. With weights the mixture is the largest
that keeps the shares without repeating a conversation: the source that runs out first at its share sets the total,
and each source gives its first `total x share` conversations. Give every source a weight or none. The sources are
interleaved in an order shuffled with the fixed seed `SEED`, so the same sources always make the same file and any
first part of it (`--limit`) holds them in their shares.

Each source is read with the usual reader (`conversation_files.py`: duplicates dropped, bad records counted) and
written as `messages` records that read back to the same conversations. The file is keyed by the sources' SHA-256,
N and weights, and written atomically beside a `.source.json` with each source's counts; its bad records are kept
there, and a reader without `--skip-bad-records` is refused them (`refuse_bad_records`). With `cached_only` (a dry
run) that key is computed from the parts alone and nothing is written: the file found in the cache is used, else
`NotFetched` says which file a run would write.

Python API: `Part`, `Resolved`, `check_weights(specs)`, `mix(parts, cached_only=False) -> Resolved`,
`refuse_bad_records(sources)`.
"""

from __future__ import annotations

import json
import math
import random
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_train.assets.conversation_files import SourceInfo, iter_file
from eagle3_train.assets.conversation_records import messages_record
from eagle3_train.assets.data_spec import DataSpec
from eagle3_train.assets.hub_datasets import NotFetched, data_cache_dir
from eagle3_train.utils.io import Eagle3InputError, atomic_path, read_json, sha256_file, sha256_json, write_json

SEED = 0
_VERSION = 1  # of the mixture file's layout: a change writes new files instead of reading old ones
TOLERATED = ("cut_off_tail",)  # counted, but read past without --skip-bad-records (as a single file's cut-off tail)


@dataclass
class Part:
    spec: DataSpec
    path: Path  # the file its conversations are read from
    record: dict[str, Any]  # what it is: kind, dataset (id or path), config, split, revision, rows
    read_limit: int | None = None  # first N conversations, where `:N` was not applied when the file was written


@dataclass
class Resolved:
    path: Path  # the one file every stage reads
    sources: list[dict[str, Any]]  # one record per `--data` value
    regeneration: dict[str, Any] | None = None  # how a `generate` output among them was regenerated


def _shares(available: list[int], weights: list[float | None]) -> list[int]:
    if weights[0] is None:
        return list(available)
    total = sum(w or 0.0 for w in weights)
    shares = [(w or 0.0) / total for w in weights]
    scale = min(n / s for n, s in zip(available, shares))  # the first source to run out sets the size
    return [min(n, math.floor(scale * s + 0.5)) for n, s in zip(available, shares)]


def _read(part: Part) -> tuple[Any, SourceInfo]:
    info = SourceInfo(source=part.spec.text, path=str(part.path), sha256="", limit=part.read_limit,
                      skip_bad_records=True)
    return iter_file(part.path, info, part.read_limit), info


def _write(parts: list[Part], path: Path) -> list[dict[str, Any]]:
    stats = []
    for part in parts:  # first pass: how many conversations each has (nothing kept in memory)
        conversations, info = _read(part)
        n = sum(1 for _ in conversations)
        if n == 0:
            raise Eagle3InputError(f"--data {part.spec.text}: no conversations in {part.path} (bad records: "
                                   f"{info.bad_records or 'none'})")
        stats.append({"available": n, "bad_records": info.bad_records, "bad_record_examples":
                      info.bad_record_examples, "broken_tail": info.broken_tail, "formats": info.formats,
                      "duplicates_dropped": info.duplicates_dropped})
    takes = _shares([s["available"] for s in stats], [p.spec.weight for p in parts])
    order = array("l", (i for i, k in enumerate(takes) for _ in range(k)))
    random.Random(SEED).shuffle(order)
    readers = [_read(p)[0] for p in parts]
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i in order:
            f.write(json.dumps(messages_record(next(readers[i])), ensure_ascii=False) + "\n")
    for s, k in zip(stats, takes):
        s["rows"] = k
    return stats


def check_weights(specs: list[DataSpec]) -> None:
    """Every source has a weight, or none has (checked before any is fetched)."""
    weighted = [s.text for s in specs if s.weight is not None]
    if weighted and len(weighted) < len(specs):
        bare = next(s.text for s in specs if s.weight is None)
        raise Eagle3InputError(f"--data {bare} has no weight while --data {weighted[0]} has one: give every --data "
                               f"a weight (%W) or none (without weights every conversation of every source is used)")


def _mixture_path(parts: list[Part], shas: list[str]) -> Path:
    """The mixture's file in the data cache, named by what makes it (known before it is written): each part's
    SHA-256, N and weight, in the order given (the order sets the interleaving), the seed and the layout version."""
    key = sha256_json({"v": _VERSION, "seed": SEED,
                       "parts": [[sha, p.read_limit, p.spec.weight] for sha, p in zip(shas, parts)]})
    return data_cache_dir() / "mixtures" / f"{key[:16]}.jsonl"


def mix(parts: list[Part], cached_only: bool = False) -> Resolved:
    """The parts as one file in the data cache (written once), and a record of each source. With `cached_only`
    (a dry run), a mixture the cache does not hold yet raises NotFetched naming the file a run would write."""
    check_weights([p.spec for p in parts])
    shas = [sha256_file(p.path) for p in parts]
    path = _mixture_path(parts, shas)
    side = path.with_suffix(".source.json")
    if path.is_file() and side.is_file():
        stats = read_json(side, "data mixture record")["parts"]
    elif cached_only:
        specs = " ".join(f"--data {p.spec.text}" for p in parts)
        raise NotFetched(f"{specs}: mixture not built yet: would write {path}")
    else:
        stats = _write(parts, path)
        write_json(side, {"seed": SEED, "parts": stats})
    sources = [{"spec": p.spec.text, **p.record, "weight": p.spec.weight, "sha256": sha, **stat}
               for p, sha, stat in zip(parts, shas, stats)]
    return Resolved(path, sources)


def refuse_bad_records(sources: list[dict[str, Any]]) -> None:
    """A source's bad records, skipped when the mixture was written, stop a reader that does not skip them."""
    for s in sources:
        bad = {r: n for r, n in (s.get("bad_records") or {}).items() if r not in TOLERATED}
        if bad:
            first = next((e for e in s.get("bad_record_examples") or [] if e.get("reason") not in TOLERATED), {})
            raise Eagle3InputError(f"{first.get('file', s.get('spec'))}, line {first.get('line', '?')}: "
                                   f"{first.get('reason', 'bad record')}: {first.get('detail', '')} (--data "
                                   f"{s.get('spec')}: {bad}); fix the file or pass --skip-bad-records to skip such "
                                   f"records")
