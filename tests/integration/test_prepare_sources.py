"""`prepare --data` by name and mixed, on a tiny random Llama with the SmolLM2 tokenizer: a dataset's split and first
rows (a local dataset repository layout standing in for ORG/NAME on the Hub), a two-set mixture, and speculators'
and SpecForge's `conversations` with role/content preparing to the same tokens as their `messages` twin."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from eagle3_train.cli import main as cli_main
from eagle3_train.data.prepare import prepare


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(tmp_path / "cache"))
    for env in ("EAGLE3_TRAIN_DATA_CACHE", "HF_DATASETS_CACHE", "EAGLE3_TRAIN_HUB_MIRROR"):
        monkeypatch.delenv(env, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def verifier(tiny_llama_dir) -> Path:
    return tiny_llama_dir()


def qa(i: int) -> dict:
    return {"question": f"What is {i} times three?", "answer": f"It is {3 * i}."}


def dataset_repo(root: Path, splits: dict[str, list[dict]]) -> Path:
    """ORG/NAME as on the Hub: parquet files per split, named in README.md's `configs:`."""
    lines = ["---", "configs:", "- config_name: main", "  data_files:"]
    for split, rows in splits.items():
        (root / "data").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
        lines += [f"  - split: {split}", f"    path: data/{split}-*"]
    (root / "README.md").write_text("\n".join([*lines, "---", ""]))
    return root


def prepared_rows(out: Path) -> dict[str, dict]:
    dd = datasets.load_from_disk(str(out / "dataset"))
    return {r["id"]: r for s in dd for r in dd[s]}


def test_prepare_reads_a_datasets_split_and_first_rows_by_name(tmp_path, verifier, monkeypatch, capsys):
    rows = {"train": [qa(i) for i in range(8)], "validation": [qa(100 + i) for i in range(5)]}
    dataset_repo(tmp_path / "org" / "name", rows)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "prepared"
    rc = cli_main(["prepare", "--data", "org/name@validation:3", "--verifier", str(verifier), "--out", str(out),
                   "--val-fraction", "0"])
    assert rc == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["conversations_read"] == 3 and m["counts"]["kept"]["train"] == 3
    (src,) = m["source"]["sources"]
    assert (src["spec"], src["dataset"], src["config"], src["split"], src["rows"]) == (
        "org/name@validation:3", str(tmp_path / "org" / "name"), "main", "validation", 3)
    assert src["revision"] and m["source"]["format"] == "question/answer"
    assert sorted(prepared_rows(out)) == ["name-0", "name-1", "name-2"]  # rows without an id: NAME-INDEX


def test_prepare_a_two_set_mixture(tmp_path, verifier, capsys):
    repo = dataset_repo(tmp_path / "org" / "name", {"train": [qa(i) for i in range(10)]})
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me fact {i}."}, {"from": "gpt", "value": f"Fact {i} is true."}]}) + "\n"
        for i in range(12)))
    out = tmp_path / "prepared"
    data = [f"{repo}@train:4%1", f"{chats}%2"]
    rc = cli_main(["prepare", "--data", data[0], "--data", data[1], "--verifier", str(verifier), "--out", str(out),
                   "--val-fraction", "0"])
    assert rc == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    sources = m["source"]["sources"]
    assert [(s["spec"], s["weight"], s["available"]) for s in sources] == [(data[0], 1.0, 4), (data[1], 2.0, 12)]
    # shares 1/3 and 2/3: the 4 rows of the dataset set the total at 12
    assert [s["rows"] for s in sources] == [4, 8]
    assert m["counts"]["conversations_read"] == 12 and m["source"]["formats"] == {"messages": 12}
    ids = set(prepared_rows(out))
    assert ids == {f"name-{i}" for i in range(4)} | {f"c{i}" for i in range(8)}


def test_conversations_with_role_content_prepare_to_the_same_tokens_as_messages(tmp_path, verifier):
    """The files speculators and SpecForge write (`conversations`, role/content) are prepared as they are."""
    chats = [{"id": f"x{i}", "turns": [
        {"role": "system", "content": "Answer in one line."}, {"role": "user", "content": f"Name a prime above {i}."},
        {"role": "assistant", "content": f"{[2, 3, 5, 7, 11, 13][i]} will do."},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "17."}]} for i in range(5)]
    outs = {}
    for key in ("conversations", "messages"):
        f = tmp_path / f"{key}.jsonl"
        f.write_text("".join(json.dumps({"id": c["id"], key: c["turns"]}) + "\n" for c in chats))
        prepare(f, verifier, tmp_path / key, max_length=256, val_fraction=0.0)
        outs[key] = prepared_rows(tmp_path / key)
    assert set(outs["conversations"]) == {c["id"] for c in chats}
    for cid, row in outs["messages"].items():
        twin = outs["conversations"][cid]
        assert (twin["input_ids"], twin["loss_mask"]) == (row["input_ids"], row["loss_mask"])
        assert sum(row["loss_mask"]) > 0
