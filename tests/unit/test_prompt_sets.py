"""Named prompt sets on the Hub (`--prompts gsm8k`, `math500`, `speed-bench[:CATEGORY]`, `hub:ORG/NAME...`): read
with the real `datasets` library from local copies of the datasets' repositories (their README `configs:` and data
files, laid out as on the Hub) through $EAGLE3_TRAIN_HUB_MIRROR, the same code that reads the Hub id; cached once as
JSON Lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_train.assets.hub_datasets import MIRROR_ENV
from eagle3_train.evaluate import prompt_sets as S
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.utils.io import Eagle3InputError

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: test
    path: socratic/test-*
---
"""
MATH500_README = """---
configs:
- config_name: default
  data_files:
  - split: test
    path: test.jsonl
---
"""
SPEED_README = """---
configs:
- config_name: qualitative
  data_files:
  - split: test
    path: qualitative/test-*
- config_name: throughput_1k
  data_files:
  - split: test
    path: throughput_1k/test-*
---
"""


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Path:
    """An empty Hub mirror and cache under tmp_path (the user's own caches untouched)."""
    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirror"))
    return tmp_path / "mirror"


def write_repo(mirror: Path, repo: str, readme: str, files: dict[str, list[dict] | bytes]) -> Path:
    root = mirror / repo
    root.mkdir(parents=True)
    (root / "README.md").write_text(readme + f"# {repo} (test copy)\n")
    for rel, rows in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(rows, bytes):
            path.write_bytes(rows)
        elif path.suffix == ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            pq.write_table(pa.Table.from_pylist(rows), path)
    return root


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i + 3} more. How many now?", "answer": f"#### {2 * i + 3}"}
            for i in range(start, start + n)]


def test_a_limit_streams_only_the_rows_it_needs(mirror):
    # the split's second shard is not a parquet file: any read of the whole split fails on it
    rows = gsm8k_rows(6)
    write_repo(mirror, "openai/gsm8k", GSM8K_README, {
        "main/train-00000-of-00001.parquet": gsm8k_rows(3, start=100),
        "main/test-00000-of-00002.parquet": rows,
        "main/test-00001-of-00002.parquet": b"not a parquet file",
        "socratic/test-00000-of-00001.parquet": gsm8k_rows(2, start=200)})
    got = load_prompts("gsm8k", limit=4)
    assert [p.id for p in got] == ["gsm8k/0", "gsm8k/1", "gsm8k/2", "gsm8k/3"]
    assert [p.turns for p in got] == [[S.MATH_TEMPLATE.replace("{question}", r["question"])] for r in rows[:4]]
    assert {p.benchmark for p in got} == {"gsm8k"}
    cache = S.cached_path(S.lookup("gsm8k")[0], complete=False)
    assert cache.read_text().count("\n") == 4 and not S.cached_path(S.lookup("gsm8k")[0]).exists()
    source = json.loads(cache.with_suffix(".source.json").read_text())
    assert (source["dataset"], source["config"], source["split"]) == ("openai/gsm8k", "main", "test")
    assert source["read_from"] == str(mirror / "openai/gsm8k") and source["complete"] is False
    assert source["revision"] is None  # a local copy has no Hub commit
    assert not list((mirror.parent / "cache").rglob("*.arrow"))  # streamed: no copy of the dataset was prepared

    with pytest.raises(Eagle3InputError, match=r"openai/gsm8k \(config main, split test\).*gsm8k\.jsonl"):
        load_prompts("gsm8k")  # all of it: the broken shard is read now
    shutil.rmtree(mirror)
    assert [p.turns for p in load_prompts("GSM8K", limit=3)] == [p.turns for p in got[:3]]  # from the cache


def test_a_whole_set_is_fetched_once_then_read_from_the_cache(mirror):
    rows = [{"problem": f"Find $x$ if $x^2 = {k * k}$ and $x > 0$.", "solution": "...", "answer": str(k),
             "subject": "Algebra", "level": 1, "unique_id": f"test/algebra/{k}.json"} for k in (7, 3, 12)]
    write_repo(mirror, "HuggingFaceH4/MATH-500", MATH500_README, {"test.jsonl": rows})
    math500 = S.lookup("math500")[0]
    assert len(load_prompts("math-500", limit=1)) == 1 and S.cached_path(math500, complete=False).is_file()
    got = load_prompts("math-500")
    assert [p.id for p in got] == [f"math500/{r['unique_id']}" for r in rows]  # the rows' own ids
    assert all(p.turns[0].startswith(r["problem"]) and "\\boxed{}" in p.turns[0] for p, r in zip(got, rows))
    path = S.cached_path(math500)
    assert path.is_file() and json.loads(path.with_suffix(".source.json").read_text())["complete"] is True
    assert not S.cached_path(math500, complete=False).exists()  # superseded by the whole set
    shutil.rmtree(mirror)
    assert load_prompts("math500") == got
    assert load_prompts("math_500", limit=2) == got[:2]


def test_speed_bench_categories_multi_turn_rows_and_placeholders(mirror, caplog):
    def row(qid, category, turns):
        return {"question_id": qid, "category": category, "sub_category": "", "turns": turns, "source": "x",
                "src_id": "", "difficulty": "", "multiturn": len(turns) > 1}

    rows = [row("a" * 32, "coding", ["Write a function that reverses a list."]),
            row("b" * 32, "math", ["What is 17 * 23?", "Now divide it by 3."]),
            row("c" * 32, "rag", [f"{S.PLACEHOLDER} USING SPECDEC_BENCH"]),
            row("d" * 32, "coding", ["Explain recursion with an example."]),
            row("e" * 32, "math", ["Is 91 prime?"])]
    write_repo(mirror, "nvidia/SPEED-Bench", SPEED_README, {
        "qualitative/test-00000-of-00001.parquet": rows,
        "throughput_1k/test-00000-of-00001.parquet": [row("f" * 32, "low_entropy", ["long prompt"])]})
    with caplog.at_level("WARNING"):
        got = load_prompts("speed-bench")
    assert [p.id for p in got] == [f"speed-bench/{r['question_id']}" for r in rows if r["category"] != "rag"]
    assert "skipped 1 row" in caplog.text  # the placeholder is not measured
    assert [p.benchmark for p in got] == ["speed-bench:coding", "speed-bench:math", "speed-bench:coding",
                                          "speed-bench:math"]
    assert got[1].turns == rows[1]["turns"]  # multi-turn rows keep their turns; --turns 1 keeps the first
    assert load_prompts("speed-bench", turns=1)[1].turns == rows[1]["turns"][:1]
    assert [p.turns[0] for p in load_prompts("speed-bench:math")] == ["What is 17 * 23?", "Is 91 prime?"]
    assert [p.id for p in load_prompts("speedbench:coding", limit=1)] == [f"speed-bench/{'a' * 32}"]
    with pytest.raises(Eagle3InputError, match="no category 'nope'; its categories: coding, math"):
        load_prompts("speed-bench:nope")


def test_any_hub_dataset_by_spec(mirror):
    rows = [{"uid": 5, "instruction": "Summarise the text.", "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]},
            {"uid": 6, "instruction": "Translate 'chat' to English.", "messages": [
                {"role": "user", "content": "Only one"}]}]
    readme = "---\nconfigs:\n- config_name: cfg\n  data_files:\n  - split: validation\n    path: cfg/val.jsonl\n---\n"
    write_repo(mirror, "some-org/my.set", readme, {"cfg/val.jsonl": rows})
    named = load_prompts("hub:some-org/my.set:cfg@validation#instruction")
    assert [p.turns for p in named] == [[r["instruction"]] for r in rows]
    assert named[0].id == "hub:some-org/my.set:cfg@validation#instruction/0"
    found = load_prompts("hub:some-org/my.set:cfg@validation")  # no field named: the chat messages' user turns
    assert [p.turns for p in found] == [["Hi", "Bye"], ["Only one"]]
    with pytest.raises(Eagle3InputError, match="no split 'test'; its splits: validation"):
        load_prompts("hub:some-org/my.set:cfg")
    with pytest.raises(Eagle3InputError, match=r"row 0: expected a field 'answer'.*found \['instruction'"):
        load_prompts("hub:some-org/my.set:cfg@validation#answer")
    with pytest.raises(Eagle3InputError, match=r"expected hub:ORG/NAME\[:CONFIG\]"):
        load_prompts("hub:not a dataset")


def test_a_hub_spec_is_read_by_the_data_grammar():
    """`hub:` takes what `--data` takes of a Hub dataset (data_spec.py), then `#FIELD`; not `:N` or `%W`."""
    from eagle3_train.assets.data_spec import parse_spec

    for text in ("hub:Org-1/my.set_2:cfg@val#field", "hub:org/name@train", "HUB:org/name:main"):
        found, spec = S.lookup(text)[0], parse_spec(text.partition("#")[0])
        assert (found.repo, found.config, found.split) == (spec.source, spec.config, spec.split or "test")
    assert S.lookup("hub:Org-1/my.set_2:cfg@val#field")[0].fields == ("field",)
    for text, pattern in [("hub:org/name:500", r"takes no :N .*--limit"), ("hub:org/name@test%3", "takes no %W"),
                          ("hub:org/name@test#a b", "bad field 'a b'"), ("hub:org/name@", "no split name after '@'"),
                          ("hub:org/na me", "'org/na me' is not a Hub dataset id ORG/NAME")]:
        with pytest.raises(Eagle3InputError, match=pattern) as e:
            S.lookup(text)
        assert str(e.value).startswith(f"--prompts {text!r}: ") and "expected hub:ORG/NAME" in str(e.value)


def test_names_aliases_and_errors(mirror):
    for s in S.SETS:
        for name in (s.name, *s.aliases, s.name.upper()):
            assert S.lookup(name) == (s, None)
    assert S.lookup("speed-bench:coding") == (S.lookup("speed-bench")[0], "coding")
    assert S.lookup("no-such-set") is None and S.lookup("mine.jsonl") is None
    with pytest.raises(Eagle3InputError, match="gsm8k has no categories"):
        S.lookup("gsm8k:algebra")
    with pytest.raises(Eagle3InputError, match="limit must be >= 1"):
        load_prompts("gsm8k", limit=0)
    cache = S.cached_path(S.lookup("gsm8k")[0])
    cache.parent.mkdir(parents=True)
    cache.write_text('{"id": "x", "question": "no turns"}\n')  # not a file this tool writes
    with pytest.raises(Eagle3InputError, match=r"gsm8k\.jsonl, line 1: expected an object with 'turns'"):
        load_prompts("gsm8k")


def test_without_the_hub_the_error_says_what_to_fetch_and_where_to_put_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (MIRROR_ENV, "HF_DATASETS_CACHE")}
    env.update(EAGLE3_TRAIN_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "eagle3_train.evaluate.prompt_sets", "--fetch", "gsm8k"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "openai/gsm8k (config main, split test)" in r.stderr
    assert f"copy that file to {tmp_path / 'cache' / 'prompts' / 'gsm8k.jsonl'}" in r.stderr
    assert f"${MIRROR_ENV}/openai/gsm8k" in r.stderr
    assert not (tmp_path / "cache" / "prompts" / "gsm8k.jsonl").exists()


def test_the_guide_lists_every_named_prompt_set():
    assert S.markdown_table() in (Path(__file__).resolve().parents[2] / "docs" / "GUIDE.md").read_text()
