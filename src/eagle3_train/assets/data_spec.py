"""One `--data` value, parsed: `SOURCE[:CONFIG][@SPLIT][:N][%W]` (docs/DATA.md).

SOURCE is `sharegpt`, a preset name, a Hugging Face Hub dataset id `ORG/NAME` (`hub:ORG/NAME` forces the Hub where a
path of that name exists), a local dataset directory, a .json/.jsonl file or a `generate` output directory. `:CONFIG`
and `@SPLIT` pick the dataset's config and split; `:N` keeps the first N rows; `%W` is the source's weight in a mixture
(several `--data`). Before `@`, a part made only of digits is N (`gsm8k:500`), anything else a config; after `@SPLIT`,
`:N` is always N. None of the separators needs quoting in bash. A value that names an existing file or directory as a
whole is that path, whatever characters it holds.

Python API: `parse_spec(text) -> DataSpec`, `data_items(data) -> list[str]`, `describe(data) -> str`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.utils.io import Eagle3InputError

# What `--data` (and `prepare.data` in a run config) holds: one value, or several to mix.
DataSource = str | Path | Sequence[str | Path]

HUB_PREFIX = "hub:"
SYNTAX = "SOURCE[:CONFIG][@SPLIT][:N][%W]"
_NAME = re.compile(r"[\w.+-]+")  # a config or split name (datasets' own `train[:10%]` slicing is not read)


@dataclass(frozen=True)
class DataSpec:
    text: str  # as given
    source: str  # sharegpt, a preset, ORG/NAME, or a path
    config: str | None = None
    split: str | None = None
    limit: int | None = None  # the first N rows
    weight: float | None = None  # share in a mixture, relative to the other sources' weights
    hub: bool = False  # written `hub:ORG/NAME`


def data_items(data: DataSource) -> list[str]:
    """The values of a `--data` setting: one string or path, or a list of them."""
    items = [str(data)] if isinstance(data, str | Path) else [str(d) for d in data]
    if not items:
        raise Eagle3InputError("--data is empty: give at least one source (e.g. --data sharegpt)")
    return items


def describe(data: DataSource) -> str:
    """The sources as one line (manifests, messages): `sharegpt + gsm8k:500%30`."""
    return " + ".join(data_items(data))


def _error(text: str, what: str) -> Eagle3InputError:
    return Eagle3InputError(f"--data {text!r}: {what} (expected {SYNTAX}, e.g. sharegpt:2000, "
                            f"openai/gsm8k:main@train:500, ultrachat%70; docs/DATA.md)")


def _slice(text: str, n: str) -> int:
    if not n.isdigit() or int(n) < 1:
        raise _error(text, f"bad slice ':{n}': N is the number of rows to keep from the start, a whole number >= 1")
    return int(n)


def _name(text: str, value: str, what: str) -> str:
    if not _NAME.fullmatch(value):
        raise _error(text, f"bad {what} {value!r}: letters, digits and . _ + - only")
    return value


def _weight(text: str, body: str) -> tuple[str, float | None]:
    if "%" not in body:
        return body, None
    body, _, w = body.rpartition("%")
    try:
        weight = float(w)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight) or weight <= 0:
        raise _error(text, f"bad weight '%{w}': W is a number > 0, the source's share relative to the other --data "
                           f"weights")
    return body, weight


def parse_spec(text: str) -> DataSpec:
    """One `--data` value as a DataSpec (its parts checked, the source not looked up yet)."""
    raw = str(text).strip()
    if not raw:
        raise _error(str(text), "empty value")
    if Path(raw).expanduser().exists():  # an existing path is itself, even with ':', '@' or '%' in its name
        return DataSpec(raw, raw)
    hub = raw.lower().startswith(HUB_PREFIX)
    body, weight = _weight(raw, raw[len(HUB_PREFIX):] if hub else raw)
    config = split = limit = None
    if "@" in body:
        left, _, right = body.rpartition("@")
        split_name, sep, n = right.partition(":")
        if not split_name:
            raise _error(raw, "no split name after '@'")
        split = _name(raw, split_name, "split")
        limit = _slice(raw, n) if sep else None
        source, sep, config_name = left.partition(":")
        if sep:
            config = _name(raw, config_name, "config")
    else:
        source, *rest = body.split(":")
        if len(rest) > 2:
            raise _error(raw, "too many ':' (one for the config, one for N)")
        if rest and rest[-1].isdigit():
            limit = _slice(raw, rest.pop())
        if len(rest) == 2:  # SOURCE:CONFIG:N with N not a number
            raise _error(raw, f"bad slice ':{rest[1]}': N is the number of rows to keep from the start, a whole "
                              f"number >= 1")
        if rest:
            config = _name(raw, rest[0], "config")
    if not source:
        raise _error(raw, "no source before ':', '@' or '%'")
    return DataSpec(raw, source, config, split, limit, weight, hub)
