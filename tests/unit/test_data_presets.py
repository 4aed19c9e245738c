"""Dataset presets (`--data ultrachat`, `--data gsm8k:500`, ...): named Hub specs fetched once with `datasets` into the
tool's data cache and read like any file; without the Hub a clear error says what to fetch and where to put it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from eagle3_train.assets import data_presets
from eagle3_train.assets.conversations import load_conversations


@pytest.fixture(autouse=True)
def tool_cache(tmp_path, monkeypatch):
    """`datasets`' own files (and any other cache) under tmp_path."""
    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(tmp_path / "tool-cache"))
    for env in ("HF_DATASETS_CACHE", "EAGLE3_TRAIN_HUB_MIRROR"):
        monkeypatch.delenv(env, raising=False)


# One row of each preset in its dataset's own schema (the Hub dataset cards' columns).
ULTRACHAT_ROW = {"prompt": "How do tides work?", "prompt_id": "a1b2",
                 "messages": [{"role": "user", "content": "How do tides work?"},
                              {"role": "assistant", "content": "The moon pulls the sea."},
                              {"role": "user", "content": "And the sun?"},
                              {"role": "assistant", "content": "It pulls too, less."}]}
OPENTHOUGHTS_ROW = {"system": "Think step by step before answering.",
                    "conversations": [{"from": "user", "value": "What is 2 + 3?"},
                                      {"from": "assistant", "value": "<|begin_of_thought|>2+3=5<|end_of_thought|> 5"}]}


def test_a_preset_is_fetched_once_with_datasets_then_read_from_the_cache(tmp_path, monkeypatch):
    """The real fetch path on a local dataset directory (what `datasets.load_dataset` reads from the Hub)."""
    local = tmp_path / "hub-copy"
    local.mkdir()
    second = {**ULTRACHAT_ROW, "prompt_id": "", "messages": ULTRACHAT_ROW["messages"][2:]}
    (local / "train.jsonl").write_text(json.dumps(ULTRACHAT_ROW) + "\n" + json.dumps(second) + "\n")
    monkeypatch.setenv(data_presets.CACHE_ENV, str(tmp_path / "cache"))
    preset = data_presets.Preset("ultrachat", str(local), "train", "test copy", id_field="prompt_id")
    path = data_presets.fetch(preset)
    assert path == tmp_path / "cache" / "ultrachat.jsonl"
    conversations, info = load_conversations(path)
    got = list(conversations)
    assert [c.id for c in got] == ["a1b2", "ultrachat-1"]  # its own id, else one by position
    assert got[0].messages == ULTRACHAT_ROW["messages"]
    (local / "train.jsonl").unlink()  # the cache is read from now on
    assert data_presets.fetch(preset) == path


def test_a_top_level_system_prompt_is_kept(tmp_path, monkeypatch):
    local = tmp_path / "hub-copy"
    local.mkdir()
    (local / "train.jsonl").write_text(json.dumps(OPENTHOUGHTS_ROW) + "\n")
    monkeypatch.setenv(data_presets.CACHE_ENV, str(tmp_path / "cache"))
    preset = data_presets.Preset("openthoughts", str(local), "train", "test copy")
    assert data_presets.fetch(preset) == data_presets.cached_path(data_presets.preset("openthoughts"))
    (conv,) = list(load_conversations("openthoughts")[0])  # the preset's name reads the cached file
    assert conv.id == "openthoughts-0"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    assert conv.messages[0]["content"] == OPENTHOUGHTS_ROW["system"]


def test_without_the_hub_the_error_names_the_dataset_and_the_cache_file(tmp_path, smollm2_dir):
    env = {**os.environ, data_presets.CACHE_ENV: str(tmp_path / "cache"), "EAGLE3_TRAIN_CACHE": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "eagle3_train.cli", "prepare", "--data", "ultrachat", "--verifier",
                        str(smollm2_dir), "--out", str(tmp_path / "prepared")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "HuggingFaceH4/ultrachat_200k" in r.stderr and "train_sft" in r.stderr
    assert str(tmp_path / "cache" / "ultrachat.jsonl") in r.stderr
    assert not (tmp_path / "cache" / "ultrachat.jsonl").exists()


def test_the_docs_table_is_current():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "DATA.md").read_text()
    assert data_presets.markdown_table() in doc, "docs/DATA.md is stale: python -m eagle3_train.assets.data_presets " \
                                                 "--markdown"


@pytest.mark.parametrize("name", ["ultrachat", "openthoughts"])
def test_a_file_named_like_a_preset_wins(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(json.dumps({"id": "mine", "messages": ULTRACHAT_ROW["messages"][:2]}) + "\n")
    assert [c.id for c in load_conversations(name)[0]] == ["mine"]


def test_a_presets_first_rows_are_cut_from_its_whole_split(tmp_path, monkeypatch):
    local = tmp_path / "hub-copy"
    local.mkdir()
    rows = [{"prompt_id": f"id{i}", "messages": [{"role": "user", "content": f"Count to {i}."},
                                                  {"role": "assistant", "content": str(list(range(i)))}]}
            for i in range(3)]
    (local / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv(data_presets.CACHE_ENV, str(tmp_path / "cache"))
    data_presets.fetch(data_presets.Preset("ultrachat", str(local), "train", "test copy", id_field="prompt_id"))
    shutil.rmtree(local)  # the Hub is out of reach from here on: the whole split in the cache serves `:N`
    conversations, info = load_conversations("ultrachat:2")
    assert [c.id for c in conversations] == ["id0", "id1"]
    assert info.sources[0]["cut_from"] == "ultrachat.jsonl" and info.sources[0]["rows"] == 2


@pytest.mark.parametrize("p", data_presets.PRESETS, ids=lambda p: p.name)
def test_a_preset_is_a_named_hub_spec(p):
    src = data_presets.hub_source(p)
    assert (src.dataset, src.config, src.split, src.limit, src.id_field) == (p.repo, p.config, p.split, None,
                                                                              p.id_field)
    assert src.cache_name(None) == p.name  # its whole default split: NAME.jsonl
    other = data_presets.hub_source(p, split="other", limit=5)
    assert (other.split, other.limit) == ("other", 5) and other.cache_name(5).endswith("@other-first5")
    assert p.name in data_presets.markdown_table() and p.repo in data_presets.markdown_table()
