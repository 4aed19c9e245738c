"""Stage `prepare`: real files in tmp_path, a tiny random Llama with the SmolLM2 tokenizer as verifier."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from eagle3_train.cli import main as cli_main
from eagle3_train.data.chat_mask import supervised_runs
from eagle3_train.data.prepare import load_prepared, prepare, preview
from eagle3_train.utils.io import Eagle3InputError

EOT = "<|im_end|>"


def turn(role: str, value: str) -> dict:
    return {"from": role, "value": value}


def record(cid: str, *turns: dict) -> dict:
    return {"id": cid, "conversations": list(turns)}


GOOD = [
    record("g0", turn("human", "Hello"), turn("gpt", "Hi! How can I help?")),
    record("g1", turn("system", "Answer briefly."), turn("human", "Capital of France?"), turn("gpt", "Paris."),
           turn("human", "And of Italy?"), turn("gpt", "Rome.\nIt is also the largest city.")),
    record("lead", turn("gpt", "…continuing the earlier answer."), turn("human", "Thanks, and?"),
           turn("gpt", "That is all.")),
    record("tail", turn("human", "One?"), turn("gpt", "Two."), turn("human", "Unanswered question")),
]
BAD = {  # id -> reason it must be skipped for
    "uu": (record("uu", turn("human", "a"), turn("human", "b"), turn("gpt", "c")), "broken_alternation"),
    "aa": (record("aa", turn("human", "a"), turn("gpt", "b"), turn("gpt", "c")), "broken_alternation"),
    "noasst": (record("noasst", turn("human", "only a question")), "no_assistant_turn"),
    "empty": (record("empty"), "empty_conversation"),
    "emptyturn": (record("emptyturn", turn("human", " "), turn("gpt", "x")), "empty_turn"),
    "sysmid": (record("sysmid", turn("human", "a"), turn("system", "s"), turn("gpt", "b")), "system_not_first"),
}


def expected_replies(rec: dict) -> list[str]:
    """Assistant contents after the turn rules (leading assistant turns dropped), each with the end marker."""
    turns = [t for t in rec["conversations"] if t["from"] != "system"]
    while turns and turns[0]["from"] == "gpt":
        turns = turns[1:]
    return [t["value"] + EOT for t in turns if t["from"] == "gpt"]


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records, indent=1))
    return path


@pytest.fixture(scope="module")
def verifier(tiny_llama_dir) -> Path:
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def tokenizer(verifier):
    return AutoTokenizer.from_pretrained(verifier)


def rows(out: Path) -> dict[str, dict]:
    dd = datasets.load_from_disk(str(out / "dataset"))
    return {r["id"]: {**r, "split": s} for s in dd for r in dd[s]}


def test_prepare_masks_counts_and_manifest(tmp_path, verifier, tokenizer):
    src = write_records(tmp_path / "chats.json", GOOD + [r for r, _ in BAD.values()])
    out = tmp_path / "prepared"
    manifest = prepare(src, verifier, out, max_length=512, val_fraction=0.0)
    got = rows(out)
    assert set(got) == {r["id"] for r in GOOD}
    for rec in GOOD:
        row = got[rec["id"]]
        runs = [tokenizer.decode(r) for r in supervised_runs(row["input_ids"], row["loss_mask"])]
        assert runs == expected_replies(rec), rec["id"]
        assert row["length"] == len(row["input_ids"]) == len(row["loss_mask"])
        assert row["n_supervised"] == sum(row["loss_mask"])
        assert "Unanswered question" not in tokenizer.decode(row["input_ids"])
    c = manifest["counts"]
    expected_skips: dict[str, int] = {}
    for _, reason in BAD.values():
        expected_skips[reason] = expected_skips.get(reason, 0) + 1
    assert c["skipped"] == expected_skips and c["skipped_total"] == len(BAD)
    assert c["conversations_read"] == len(GOOD) + len(BAD)
    assert c["kept"] == {"train": len(GOOD), "validation": 0}
    assert c["trimmed_leading_assistant"] == 1 and c["truncated"] == 0
    assert c["tokens"]["train"] == sum(r["length"] for r in got.values())
    assert c["supervised_tokens"]["train"] == sum(sum(r["loss_mask"]) for r in got.values())
    assert manifest["skip_examples"]["broken_alternation"] == ["uu", "aa"]
    # provenance: file hashes computed here independently
    assert manifest["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert manifest["source"]["formats"] == {"sharegpt": len(GOOD) + len(BAD)}
    assert manifest["source"]["container"] == "json-array"
    template = (verifier / "chat_template.jinja").read_text()
    assert manifest["tokenizer"]["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert manifest["tokenizer"]["chat_template_source"] == "tokenizer"
    assert manifest["verifier"]["vocab_size"] == 49152 and manifest["verifier"]["path"] == str(verifier.resolve())
    assert manifest["settings"]["max_length"] == 512
    assert json.loads((out / "manifest.json").read_text()) == json.loads(json.dumps(manifest, default=str))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepared")]  # no temp dirs left
    dd, m = load_prepared(out)
    assert set(dd) == {"train", "validation"} and m["stage"] == "prepare"


def test_leading_assistant_skip(tmp_path, verifier):
    src = write_records(tmp_path / "chats.json", GOOD)
    manifest = prepare(src, verifier, tmp_path / "out", val_fraction=0.0, leading_assistant="skip")
    assert manifest["counts"]["skipped"] == {"assistant_first": 1}
    assert "lead" not in rows(tmp_path / "out")


def long_records(n_words: int) -> list[dict]:
    words = " ".join(f"w{k}" for k in range(n_words))
    return [
        record("short", turn("human", "hi"), turn("gpt", "hello")),
        record("long_reply", turn("human", "tell me"), turn("gpt", words)),
        record("long_question", turn("human", words), turn("gpt", "ok")),
    ]


def test_truncate_and_drop(tmp_path, verifier, tokenizer):
    recs = long_records(200)
    src = write_records(tmp_path / "long.json", recs)
    max_length = 64
    full_lengths = {}
    for rec in recs:  # lengths through the tokenizer's own chat-template path, not the stage's code
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in rec["conversations"]]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        full_lengths[rec["id"]] = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    too_long = {k for k, n in full_lengths.items() if n > max_length}
    assert too_long == {"long_reply", "long_question"}

    m = prepare(src, verifier, tmp_path / "trunc", max_length=max_length, overflow="truncate", val_fraction=0.0)
    got = rows(tmp_path / "trunc")
    assert set(got) == {"short", "long_reply"}
    assert got["long_reply"]["length"] == max_length and got["short"]["length"] == full_lengths["short"]
    assert got["long_reply"]["loss_mask"][-1] == 1  # cut inside the reply, which stays supervised
    assert m["counts"]["truncated"] == 1
    assert m["counts"]["skipped"] == {"no_supervised_after_truncation": 1}

    m = prepare(src, verifier, tmp_path / "drop", max_length=max_length, overflow="drop", val_fraction=0.0)
    assert set(rows(tmp_path / "drop")) == {"short"}
    assert m["counts"]["skipped"] == {"too_long": 2} and m["counts"]["truncated"] == 0


def many_records(n: int) -> list[dict]:
    return [record(f"c{k:03d}", turn("human", f"question {k}"), turn("gpt", f"answer {k}")) for k in range(n)]


def split_ids(out: Path) -> dict[str, set[str]]:
    dd = datasets.load_from_disk(str(out / "dataset"))
    return {s: set(dd[s]["id"]) for s in dd}


@pytest.mark.slow
def test_split_by_conversation_deterministic_and_stable(tmp_path, verifier):
    src = write_records(tmp_path / "many.json", many_records(60))
    prepare(src, verifier, tmp_path / "a", val_fraction=0.25, seed=0)
    a = split_ids(tmp_path / "a")
    prepare(src, verifier, tmp_path / "b", val_fraction=0.25, seed=0)
    b = split_ids(tmp_path / "b")
    prepare(src, verifier, tmp_path / "c", val_fraction=0.25, seed=1)
    c = split_ids(tmp_path / "c")
    prepare(src, verifier, tmp_path / "d", val_fraction=0.25, seed=0, limit=30)
    d = split_ids(tmp_path / "d")
    assert a == b
    assert a != c
    assert a["train"].isdisjoint(a["validation"]) and len(a["train"] | a["validation"]) == 60
    assert 0 < len(a["validation"]) < 60
    # growing the limit never moves a conversation to the other split
    assert d["validation"] <= a["validation"] and d["train"] <= a["train"]
    prepare(src, verifier, tmp_path / "e", val_count=7, seed=0)
    assert len(split_ids(tmp_path / "e")["validation"]) == 7


def test_tiny_set_still_has_both_splits(tmp_path, verifier):
    src = write_records(tmp_path / "two.json", many_records(2))
    m = prepare(src, verifier, tmp_path / "out", val_fraction=0.05)
    assert m["counts"]["kept"] == {"train": 1, "validation": 1}


def test_custom_chat_template_and_messages_input(tmp_path, verifier, tokenizer):
    tpl = tmp_path / "plain_chatml.jinja"
    tpl.write_text("{%- for m in messages -%}"
                   "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
                   "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    gen = tmp_path / "generated"
    gen.mkdir()
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    (gen / "conversations.jsonl").write_text(json.dumps({"id": "m1", "messages": msgs}) + "\n")
    m = prepare(gen, verifier, tmp_path / "out", chat_template=str(tpl), val_fraction=0.0)
    assert m["tokenizer"]["chat_template_source"] == str(tpl)
    assert m["tokenizer"]["chat_template_sha256"] == hashlib.sha256(tpl.read_bytes()).hexdigest()
    assert m["source"]["formats"] == {"messages": 1}
    row = rows(tmp_path / "out")["m1"]
    expected = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n"  # no default system
    assert tokenizer.decode(row["input_ids"]) == expected


def test_rerun_replaces_output_and_refuses_foreign_dirs(tmp_path, verifier):
    src = write_records(tmp_path / "chats.json", GOOD)
    out = tmp_path / "out"
    prepare(src, verifier, out, val_fraction=0.0)
    before = rows(out)
    write_records(src, GOOD[:2])
    with pytest.raises(Eagle3InputError, match="other data; pass --overwrite"):  # other inputs: only when asked
        prepare(src, verifier, out, val_fraction=0.0)
    assert rows(out) == before
    m = prepare(src, verifier, out, val_fraction=0.0, overwrite=True)
    assert m["counts"]["kept"]["train"] == 2 and len(rows(out)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.json", "out"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(Eagle3InputError, match="refusing to write into it"):
        prepare(src, verifier, foreign, val_fraction=0.0)
    assert (foreign / "precious.txt").read_text() == "keep me"


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, pattern", [
    ({"max_length": 1}, "max_length"),
    ({"overflow": "wrap"}, "overflow"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"val_count": -1}, "val_count"),
    ({"leading_assistant": "keep"}, "leading_assistant"),
    ({"chat_template": "no/such/template.jinja"}, "chat template file not found"),
])
def test_bad_settings(tmp_path, verifier, kwargs, pattern):
    src = write_records(tmp_path / "chats.json", GOOD)
    with pytest.raises(Eagle3InputError, match=pattern):
        prepare(src, verifier, tmp_path / "out", **kwargs)


def test_missing_source_and_empty_result(tmp_path, verifier):
    with pytest.raises(Eagle3InputError, match="not found"):
        prepare(tmp_path / "missing.json", verifier, tmp_path / "out")
    src = write_records(tmp_path / "bad_only.json", [r for r, _ in BAD.values()])
    with pytest.raises(Eagle3InputError, match="no usable conversations.*broken_alternation"):
        prepare(src, verifier, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_verifier_dir(tmp_path):
    src = write_records(tmp_path / "chats.json", GOOD)
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(Eagle3InputError, match="no config.json"):
        prepare(src, tmp_path / "noconfig", tmp_path / "out")


def test_load_prepared_errors(tmp_path):
    with pytest.raises(Eagle3InputError, match="manifest not found"):
        load_prepared(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "vocab"}))
    with pytest.raises(Eagle3InputError, match="not a `prepare` manifest"):
        load_prepared(tmp_path)


# ---- CLI and preview ---------------------------------------------------------------------------------------------

def test_cli_prepare_with_preview(tmp_path, verifier, capsys):
    src = write_records(tmp_path / "chats.json", GOOD + [BAD["uu"][0]])
    out = tmp_path / "out"
    rc = cli_main(["prepare", "--data", str(src), "--verifier", str(verifier), "--out", str(out),
                   "--max-length", "256", "--val-fraction", "0.3", "--seed", "3", "--preview", "2"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "kept: train" in text and "broken_alternation" in text
    assert text.count("=== train sample") == 2 and "«" in text and "\x1b[" not in text
    m = json.loads((out / "manifest.json").read_text())
    assert m["settings"]["seed"] == 3 and m["settings"]["max_length"] == 256
    assert "«Paris.<|im_end|>»" in preview(out, n=10, split="train") + preview(out, n=10, split="validation")


def test_cli_reports_bad_input(tmp_path, verifier, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "x", "conversations": [{"from": "alien", "value": "hi"}]}]')
    rc = cli_main(["prepare", "--data", str(bad), "--verifier", str(verifier), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown role 'alien'" in err and str(bad) in err


@pytest.mark.slow
def test_embedded_sharegpt_with_smollm2(tmp_path, smollm2_dir, smollm2_tokenizer):
    m = prepare("sharegpt", "smollm2-135m-instruct", tmp_path / "out", max_length=1024, limit=60, seed=0)
    c = m["counts"]
    assert c["conversations_read"] == 60 and c["kept"]["train"] > 0 and c["kept"]["validation"] > 0
    assert m["verifier"]["path"] == str(smollm2_dir) and m["source"]["formats"] == {"sharegpt": 60}
    assert m["source"]["broken_tail"] is None  # the limit stops before the cut-off end
    dd, _ = load_prepared(tmp_path / "out")
    for row in dd["train"]:
        assert row["length"] <= 1024
        for run in supervised_runs(row["input_ids"], row["loss_mask"])[:-1]:  # the last may be truncated
            assert smollm2_tokenizer.decode(run).endswith(EOT)


def test_template_failures_are_counted(tmp_path, verifier):
    tpl = tmp_path / "no_system.jinja"
    tpl.write_text("{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('no system role') }}{%- endif -%}"
                   "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' -}}"
                   "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    src = write_records(tmp_path / "chats.json", GOOD)
    m = prepare(src, verifier, tmp_path / "out", chat_template=str(tpl), val_fraction=0.0)
    assert m["counts"]["skipped"] == {"chat_template_error": 1}
    assert m["skip_examples"]["chat_template_error"] == ["g1"]
    assert m["counts"]["kept"]["train"] == len(GOOD) - 1


def test_cli_skip_bad_records_counts_them_in_the_manifest(tmp_path, verifier, capsys):
    src = tmp_path / "dump.jsonl"
    good = [json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                                    {"role": "assistant", "content": f"Answer {i}."}]}).encode()
            for i in range(6)]
    src.write_bytes(b"\n".join(good[:2] + [b'{"id": "bad", "messages": [}'] + good[2:4]
                               + [b'{"id": "u", "messages": [{"role": "user", "content": "\xff"}]}'] + good[4:])
                    + b"\n")
    out = tmp_path / "out"
    args = ["prepare", "--data", str(src), "--verifier", str(verifier), "--out", str(out), "--val-count", "1"]
    assert cli_main(args) == 2  # default: the first broken line stops it, naming file and line
    err = capsys.readouterr().err
    assert str(src) in err and "line 6: not UTF-8" in err and not out.exists()
    assert cli_main(args + ["--skip-bad-records"]) == 0
    assert "bad source records skipped" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["bad_records"] == {"invalid_json": 1, "invalid_utf8": 1}
    assert [(e["line"], e["reason"]) for e in m["source"]["bad_record_examples"]] == [(3, "invalid_json"),
                                                                                      (6, "invalid_utf8")]
    assert m["settings"]["skip_bad_records"] is True
    assert sorted(rows(out)) == [f"g{i}" for i in range(6)]


AGENT_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\ntools: ' + tools | map(attribute='function') | map(attribute='name')"
    " | join(',') + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' and (thinking is not defined or thinking) -%}"
    "{{- '<think>' + (m.get('reasoning_content') or '') + '</think>' -}}{%- endif -%}"
    "{{- m['content'] -}}{%- if m.get('tool_calls') -%}{{- ' CALL ' + m['tool_calls'][0]['function']['name'] -}}"
    "{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def _supervised_texts(tokenizer, out: Path, cid: str) -> list[str]:
    row = rows(out)[cid]
    return [tokenizer.decode(r) for r in supervised_runs(row["input_ids"], row["loss_mask"])]


def test_regenerated_data_renders_as_it_was_generated(tmp_path, verifier, tokenizer):
    """generate's conversations are rendered as the server rendered them: with the thinking switch it sent (the
    template's empty think block is not supervised) and the conversation's tools; a source tool-call turn generate
    kept as given is context unless asked."""
    tpl = tmp_path / "agent.jinja"
    tpl.write_text(AGENT_TEMPLATE)
    gen = tmp_path / "gen"
    gen.mkdir()
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "Pears?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": [call], "regenerated": False},
            {"role": "tool", "tool_call_id": "call_0", "content": "12"},
            {"role": "assistant", "content": "Twelve."}]
    tools = [{"name": "lookup", "parameters": {"type": "object"}}]  # a bare schema: read as an OpenAI function
    (gen / "conversations.jsonl").write_text(json.dumps({"id": "a", "messages": msgs, "tools": tools}) + "\n")
    (gen / "manifest.json").write_text(json.dumps({"stage": "generate", "model": "m", "thinking": {
        "style": "kimi", "request_extra": {"chat_template_kwargs": {"thinking": False}}}}))
    m = prepare(gen, verifier, tmp_path / "out", chat_template=str(tpl), val_fraction=0.0)
    assert m["settings"]["chat_template_kwargs"] == {"thinking": False}
    assert m["counts"]["kept_turns_unsupervised"] == 1 and m["counts"]["conversations_with_tools"] == 1
    assert _supervised_texts(tokenizer, tmp_path / "out", "a") == ["Twelve.<|im_end|>"]
    row = rows(tmp_path / "out")["a"]
    assert tokenizer.decode(row["input_ids"]).startswith("<|im_start|>system\ntools: lookup<|im_end|>")
    asked = prepare(gen, verifier, tmp_path / "all", chat_template=str(tpl), val_fraction=0.0,
                    supervise_kept_turns=True)
    assert asked["counts"]["kept_turns_unsupervised"] == 0
    assert _supervised_texts(tokenizer, tmp_path / "all", "a") == ["Looking. CALL lookup<|im_end|>",
                                                                   "Twelve.<|im_end|>"]
    # the same file without generate's manifest: no switch known, the template's default (thinking on) renders
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "conversations.jsonl").write_bytes((gen / "conversations.jsonl").read_bytes())
    prepare(plain, verifier, tmp_path / "out-plain", chat_template=str(tpl), val_fraction=0.0)
    assert _supervised_texts(tokenizer, tmp_path / "out-plain", "a") == ["<think></think>Twelve.<|im_end|>"]


@pytest.mark.parametrize("bad, message", [
    ({"tools": {"name": "x"}}, "field 'tools' must be a list"),
    ({"tools": "[not json"}, "field 'tools' is text but not JSON"),
    ({"tools": [{"parameters": {}}]}, r"tools\[0\] must be"),
])
def test_bad_tools_are_named(tmp_path, verifier, bad, message):
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "a"}], **bad}) + "\n")
    with pytest.raises(Eagle3InputError, match=message):
        prepare(src, verifier, tmp_path / "out", val_fraction=0.0)


def test_supervised_ids_are_compared_with_the_generated_ones():
    """Each regenerated turn's supervised run against the ids the verifier generated: equal, the template's end of
    turn added to a reply cut at max_tokens, a mismatch (named), and a run the max length cut (its prefix)."""
    from eagle3_train.data.generated_ids import GeneratedIdsCheck

    def sample(runs):  # input ids and mask: a one-token prompt before each run
        ids, mask = [], []
        for r in runs:
            ids += [1] + r
            mask += [0] + [1] * len(r)
        return ids, mask

    turn = [{"role": "user", "content": "q"}]
    check = GeneratedIdsCheck()
    check.add("equal", turn + [{"role": "assistant", "content": "", "completion_token_ids": [5, 6, 2]}],
              *sample([[5, 6, 2]]), cut=False)
    check.add("end", turn + [{"role": "assistant", "content": "", "completion_token_ids": [5, 6]}],
              *sample([[5, 6, 2]]), cut=False)
    check.add("differs", turn + [{"role": "assistant", "content": "", "completion_token_ids": [5, 7, 2]}],
              *sample([[5, 6, 2]]), cut=False)
    check.add("cut", turn + [{"role": "assistant", "content": "", "completion_token_ids": [5, 6, 7, 2]}],
              *sample([[5, 6]]), cut=True)
    check.add("plain", turn + [{"role": "assistant", "content": ""}], *sample([[5, 6, 2]]), cut=False)
    r = check.record()
    assert (r["turns"], r["equal"], r["end_added"], r["mismatched"], r["cut"]) == (4, 2, 1, 1, 1)
    assert r["examples"] == [{"id": "differs", "turn": 0, "first_difference": 1, "supervised": [5, 6, 2],
                              "generated": [5, 7, 2], "lengths": [3, 3]}]
    assert GeneratedIdsCheck().record() is None
