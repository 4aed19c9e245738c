"""One `--data` value, parsed: `SOURCE[:CONFIG][@SPLIT][:N][%W]` (docs/DATA.md).

SOURCE is `sharegpt`, a preset name, a Hugging Face Hub dataset id `ORG/NAME` (`hub:ORG/NAME` forces the Hub where a
path of that name exists), a local dataset directory, a .json/.jsonl file or a `generate` output directory. `:CONFIG`
and `@SPLIT` pick the dataset's config and split; `:N` keeps the first N rows; `%W` is the source's weight in a mixture
(several `--data`). Before `@`, a part made only of digits is N (`gsm8k:500`), anything else a config; after `@SPLIT`,
`:N` is always N. None of the separators needs quoting in bash. A value that names an existing file or directory as a
whole is that path, whatever characters it holds.

The same grammar names a Hub dataset wherever the tool reads one: `parse_hub_spec(text, grammar)` reads
`hub:ORG/NAME[:CONFIG][@SPLIT]` alone (no path, preset, N or weight) for settings that take only Hub datasets, as
`--prompts` does (evaluate/prompt_sets.py adds its `#FIELD` after it); `grammar` names the setting in messages.

Python API: `parse_spec(text) -> DataSpec`, `parse_hub_spec(text, grammar, shown=None) -> DataSpec`,
`is_hub_id(source) -> bool`, `Grammar`, `check_name(grammar, text, value, what)`, `data_items(data) -> list[str]`,
`describe(data) -> str`.
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
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME as the Hub spells dataset ids


@dataclass(frozen=True)
class Grammar:
    """The setting a spec was given to, for its messages: the flag, the syntax it takes and examples of it."""
    flag: str
    syntax: str
    examples: str

    def error(self, text: str, what: str) -> Eagle3InputError:
        return Eagle3InputError(f"{self.flag} {text!r}: {what} (expected {self.syntax}, e.g. {self.examples})")


DATA_GRAMMAR = Grammar("--data", SYNTAX, "sharegpt:2000, openai/gsm8k:main@train:500, ultrachat%70; docs/DATA.md")


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


def is_hub_id(source: str) -> bool:
    """Whether SOURCE is spelled as a Hub dataset id ORG/NAME (a missing .json/.jsonl file's path is not one)."""
    return bool(_HUB_ID.fullmatch(source)) and not source.lower().endswith((".json", ".jsonl"))


def _slice(g: Grammar, text: str, n: str) -> int:
    if not n.isdigit() or int(n) < 1:
        raise g.error(text, f"bad slice ':{n}': N is the number of rows to keep from the start, a whole number >= 1")
    return int(n)


def check_name(g: Grammar, text: str, value: str, what: str) -> str:
    """A config, split or field name as the grammar takes it."""
    if not _NAME.fullmatch(value):
        raise g.error(text, f"bad {what} {value!r}: letters, digits and . _ + - only")
    return value


def _weight(g: Grammar, text: str, body: str) -> tuple[str, float | None]:
    if "%" not in body:
        return body, None
    body, _, w = body.rpartition("%")
    try:
        weight = float(w)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight) or weight <= 0:
        raise g.error(text, f"bad weight '%{w}': W is a number > 0, the source's share relative to the other --data "
                            f"weights")
    return body, weight


def parse_spec(text: str) -> DataSpec:
    """One `--data` value as a DataSpec (its parts checked, the source not looked up yet)."""
    raw = str(text).strip()
    if not raw:
        raise DATA_GRAMMAR.error(str(text), "empty value")
    if Path(raw).expanduser().exists():  # an existing path is itself, even with ':', '@' or '%' in its name
        return DataSpec(raw, raw)
    hub = raw.lower().startswith(HUB_PREFIX)
    return _parse(DATA_GRAMMAR, raw, raw[len(HUB_PREFIX):] if hub else raw, hub)


def parse_hub_spec(text: str, grammar: Grammar, shown: str | None = None) -> DataSpec:
    """`hub:ORG/NAME[:CONFIG][@SPLIT]` for a setting that takes only Hub datasets: the same grammar as `--data`, less
    `:N` and `%W` (such a setting has its own limit). `shown` is the whole value as given, for messages, where the
    setting adds a suffix of its own (`--prompts`: `#FIELD`)."""
    raw, shown = str(text).strip(), shown or str(text)
    if not raw.lower().startswith(HUB_PREFIX):
        raise grammar.error(shown, f"no {HUB_PREFIX!r} before the dataset id")
    spec = _parse(grammar, shown, raw[len(HUB_PREFIX):], hub=True)
    if not is_hub_id(spec.source):
        raise grammar.error(shown, f"{spec.source!r} is not a Hub dataset id ORG/NAME")
    if spec.limit is not None:
        raise grammar.error(shown, f"{grammar.flag} takes no :N (a number after ':' is read as N, not as a config; "
                                   f"--limit sets how many are read)")
    if spec.weight is not None:
        raise grammar.error(shown, f"{grammar.flag} takes no %W (a weight in a mixture of --data sources)")
    return spec


def _parse(g: Grammar, raw: str, body: str, hub: bool) -> DataSpec:
    """SOURCE[:CONFIG][@SPLIT][:N][%W] of `body`; `raw`, the value as given, names it in messages."""
    body, weight = _weight(g, raw, body)
    config = split = limit = None
    if "@" in body:
        left, _, right = body.rpartition("@")
        split_name, sep, n = right.partition(":")
        if not split_name:
            raise g.error(raw, "no split name after '@'")
        split = check_name(g, raw, split_name, "split")
        limit = _slice(g, raw, n) if sep else None
        source, sep, config_name = left.partition(":")
        if sep:
            config = check_name(g, raw, config_name, "config")
    else:
        source, *rest = body.split(":")
        if len(rest) > 2:
            raise g.error(raw, "too many ':' (one for the config, one for N)")
        if rest and rest[-1].isdigit():
            limit = _slice(g, raw, rest.pop())
        if len(rest) == 2:  # SOURCE:CONFIG:N with N not a number
            raise g.error(raw, f"bad slice ':{rest[1]}': N is the number of rows to keep from the start, a whole "
                               f"number >= 1")
        if rest:
            config = check_name(g, raw, rest[0], "config")
    if not source:
        raise g.error(raw, "no source before ':', '@' or '%'")
    return DataSpec(raw, source, config, split, limit, weight, hub)
