"""Conversation sources: embedded ShareGPT, local ShareGPT/OpenAI files, generate output, cut-off files, bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from eagle3_train.assets.conversation_records import normalize_turns
from eagle3_train.assets.conversations import load_conversations, sharegpt_path
from eagle3_train.utils.io import Eagle3InputError

SHAREGPT_RECORDS = [
    {"id": "a1", "conversations": [{"from": "human", "value": "Héllo ✓ wörld"},
                                   {"from": "gpt", "value": "Hi there — ünïcode"}]},
    {"id": "b2", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "2+2?"},
                                   {"from": "chatgpt", "value": "4"}]},
    {"id": "c3", "conversations": [{"from": "human", "value": "q"}, {"from": "bard", "value": "r"},
                                   {"from": "human", "value": "q2"}, {"from": "bing", "value": "r2"}]},
]


def write_json_array(path: Path, records: list) -> str:
    text = json.dumps(records, indent=2, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return text


def collect(source, limit=None):
    it, info = load_conversations(source, limit=limit)
    return list(it), info


def test_sharegpt_json_array(tmp_path):
    f = tmp_path / "data.json"
    write_json_array(f, SHAREGPT_RECORDS)
    convs, info = collect(f)
    assert [c.id for c in convs] == ["a1", "b2", "c3"]
    assert convs[0].messages == [{"role": "user", "content": "Héllo ✓ wörld"},
                                 {"role": "assistant", "content": "Hi there — ünïcode"}]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant"]
    assert [m["role"] for m in convs[2].messages] == ["user", "assistant", "user", "assistant"]
    assert info.container == "json-array" and info.formats == {"sharegpt": 3} and info.format == "sharegpt"
    assert info.records == 3 and info.conversations == 3 and info.complete and info.broken_tail is None
    assert info.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    assert info.path == str(f)


def test_limit_stops_early(tmp_path):
    f = tmp_path / "data.json"
    write_json_array(f, SHAREGPT_RECORDS)
    convs, info = collect(f, limit=2)
    assert [c.id for c in convs] == ["a1", "b2"]
    assert not info.complete and info.limit == 2


def test_cut_off_array_reports_broken_tail(tmp_path):
    full = json.dumps(SHAREGPT_RECORDS, indent=2, ensure_ascii=False)
    # cut inside the value of the last record, as in the embedded ShareGPT file
    third_start = full.index('{\n    "id": "c3"')
    cut = full[: full.index('"r2"') + 2]
    f = tmp_path / "cut.json"
    f.write_text(cut, encoding="utf-8")
    convs, info = collect(f)
    assert [c.id for c in convs] == ["a1", "b2"]
    expected_offset = len(full[:third_start].encode("utf-8"))  # bytes, not characters (non-ASCII before it)
    assert expected_offset != third_start
    assert info.broken_tail == {"byte_offset": expected_offset, "bytes": len(cut.encode("utf-8")) - expected_offset}
    assert info.complete


def test_array_cut_between_records(tmp_path):
    full = json.dumps(SHAREGPT_RECORDS[:2])
    f = tmp_path / "cut.json"
    f.write_text(full[:-1] + ",")  # closing bracket lost
    convs, info = collect(f)
    assert len(convs) == 2
    assert info.broken_tail["bytes"] == 0


def test_cut_off_jsonl_last_line(tmp_path):
    lines = [json.dumps({"id": str(k), "messages": [{"role": "user", "content": "u"},
                                                    {"role": "assistant", "content": f"a{k}"}]}) for k in range(3)]
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    convs, info = collect(f)
    assert [c.id for c in convs] == ["0", "1"]
    assert info.container == "json-lines" and info.formats == {"messages": 2}
    assert info.broken_tail["byte_offset"] == len(("\n".join(lines[:2]) + "\n").encode())
    assert info.bad_records == {"cut_off_tail": 1}  # counted in the manifest, not only logged
    assert [(e["line"], e["reason"]) for e in info.bad_record_examples] == [(3, "cut_off_tail")]


def test_byte_order_mark_and_mixed_formats(tmp_path):
    rows = [SHAREGPT_RECORDS[0], {"id": "m", "messages": [{"role": "user", "content": "u"},
                                                         {"role": "assistant", "content": "a"}]}]
    body = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"
    f = tmp_path / "bom.jsonl"
    cut = '{"id": "z", "conversations": [{"from": "human", "value": "cut'
    f.write_bytes(b"\xef\xbb\xbf" + (body + cut).encode("utf-8"))
    convs, info = collect(f)
    assert [c.id for c in convs] == ["a1", "m"]
    assert info.format == "mixed" and info.formats == {"sharegpt": 1, "messages": 1} and info.bom_bytes == 3
    assert info.broken_tail == {"byte_offset": 3 + len(body.encode()), "bytes": len(cut.encode())}


def test_openai_messages_and_content_parts(tmp_path):
    f = tmp_path / "chat.jsonl"
    rows = [
        {"id": "x", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                                 {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                                   {"type": "text", "text": "B"}]}]},
        {"messages": [{"role": "user", "content": "no id"}, {"role": "assistant", "content": "ok"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs, _ = collect(f)
    assert convs[0].messages[2] == {"role": "assistant", "content": "AB"}
    # without an id: a content hash, the same on every load, different for different content
    again, _ = collect(f)
    assert convs[1].id == again[1].id and len(convs[1].id) == 16
    rows[1]["messages"][1]["content"] = "other"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    changed, _ = collect(f)
    assert changed[1].id != convs[1].id


def test_generate_output_directory(tmp_path):
    d = tmp_path / "generated"
    d.mkdir()
    row = {"id": "g1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (d / "conversations.jsonl").write_text(json.dumps(row) + "\n")
    convs, info = collect(d)
    assert convs[0].id == "g1" and info.path == str(d / "conversations.jsonl")


def test_duplicate_ids_renamed(tmp_path):
    f = tmp_path / "dup.json"
    rec = SHAREGPT_RECORDS[0]
    other = {**rec, "conversations": rec["conversations"][:1]}
    write_json_array(f, [rec, other, rec, {**rec, "id": "b7"}])
    convs, info = collect(f)
    # another conversation under the same id is kept, renamed; a repeat, word for word (any id), is kept once:
    # twice, it would weigh double, and could land in both the train and the validation split
    assert [c.id for c in convs] == ["a1", "a1#2"]
    assert info.renamed_duplicate_ids == 1 and info.duplicates_dropped == 2


def test_ids_are_unique_even_when_a_source_id_looks_like_a_renamed_one(tmp_path):
    """`a, a, a#2`: the second `a` becomes a#2, so the third (the source's own a#2) must not be a second a#2."""
    f = tmp_path / "ids.jsonl"
    f.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"q{n}"},
                                                           {"role": "assistant", "content": "x"}]}) + "\n"
                         for n, i in enumerate(["a", "a", "a#2", "a", "a#2"])))
    convs, info = collect(f)
    ids = [c.id for c in convs]
    assert len(set(ids)) == 5 and ids[:2] == ["a", "a#2"], ids
    assert info.renamed_duplicate_ids == 4  # every id after its first use


# ---- bad input -------------------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(Eagle3InputError, match="not found.*nope.json"):
        load_conversations(tmp_path / "nope.json")


def test_directory_without_conversations(tmp_path):
    with pytest.raises(Eagle3InputError, match="conversations.jsonl"):
        load_conversations(tmp_path)


@pytest.mark.parametrize("text, pattern", [
    ("", "is empty"),
    ("  \n", "is empty"),
    ("[]", "no conversation records"),
    ('[{"id": "a", "conversations": []} {"id": "b"}]', "expected ',' or ']'"),
    ('{"messages": []}\n{"messages": [}\n{"messages": []}\n', r"record 2 \(line 2, column \d+\): invalid JSON"),
    ('[{"id": 1, "conversations": []}] trailing', "unexpected text after the JSON array"),
])
def test_invalid_json(tmp_path, text, pattern):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(Eagle3InputError, match=pattern) as e:
        collect(f)
    assert str(f) in str(e.value)


def test_not_utf8(tmp_path):
    f = tmp_path / "latin1.json"
    f.write_bytes('[{"conversations": [{"from": "human", "value": "caf\xe9"}]}]'.encode("latin-1"))
    with pytest.raises(Eagle3InputError, match="not UTF-8"):
        collect(f)


@pytest.mark.parametrize("record, pattern", [
    ([1, 2], "expected a JSON object"),
    ({"id": "x", "turns": []}, "missing field 'conversations'.*or 'messages'"),
    ({"id": "x", "conversations": "hello"}, "field 'conversations' must be a list"),
    ({"id": "x", "conversations": [{"from": "human"}]}, r"conversations\[0\]: expected an object with fields 'from' "
                                                        "and 'value'"),
    ({"id": "x", "messages": [{"role": "user", "text": "t"}]}, "fields 'role' and 'content'"),
    ({"id": "x", "conversations": [{"from": "robot", "value": "v"}]}, "unknown role 'robot'.*expected one of"),
    ({"id": "x", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     r"tool_calls\[0\] must be"),
    ({"id": "x", "conversations": [{"from": "function_call", "value": "not json"}]}, "must be JSON with 'name'"),
    ({"id": "x", "messages": [{"role": "user", "content": 5}]}, "field 'content' must be a string"),
    ({"id": "x", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "non-text content part"),
])
def test_bad_records_name_file_record_and_field(tmp_path, record, pattern):
    f = tmp_path / "bad.jsonl"
    good = {"id": "ok", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(Eagle3InputError, match=pattern) as e:
        collect(f)
    assert str(f) in str(e.value) and "record 2 (line 2)" in str(e.value)


def _mixed_file(path: Path) -> bytes:
    """JSON Lines with good records 1, 3, 6, 8 and broken ones: invalid JSON, non-UTF-8 bytes, an unknown role."""
    def good(i):
        return json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                       {"role": "assistant", "content": f"a{i}"}]}).encode()
    lines = [good(1), b'{"id": "j2", "messages": [}', good(3),
             b'{"id": "u4", "messages": [{"role": "user", "content": "caf\xe9"}]}',
             b'{"id": "r5", "messages": [{"role": "robot", "content": "beep"}]}', good(6), b"not json at all",
             good(8)]
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(data)
    return data


def test_bad_records_stop_by_default_naming_file_and_line(tmp_path):
    f = tmp_path / "dump.jsonl"
    _mixed_file(f)
    with pytest.raises(Eagle3InputError, match=r"line 4: not UTF-8.*--skip-bad-records") as e:
        collect(f)  # the whole file is decoded first
    assert str(f) in str(e.value)
    f.write_bytes(f.read_bytes().replace(b"caf\xe9", b"cafe"))
    with pytest.raises(Eagle3InputError, match=r"line 2, column \d+\): invalid JSON.*--skip-bad-records"):
        collect(f)


def test_a_file_that_is_not_json_at_all_is_named_as_such_not_skipped(tmp_path):
    """A table (CSV) or any file whose first record is not JSON is a format mistake: the error says what is read and
    how to convert, instead of --skip-bad-records (which would skip every row)."""
    table = tmp_path / "chats.csv"
    table.write_text("prompt,response\nhi,hello\n")
    with pytest.raises(Eagle3InputError, match=r"chats.csv is a CSV file.*load_dataset\('csv'") as e:
        collect(table)
    assert "--skip-bad-records to skip" not in str(e.value)
    text = tmp_path / "notes.jsonl"
    text.write_text("just some text\n")
    with pytest.raises(Eagle3InputError, match=r"record 1 .*first record is not JSON; check the file's format"):
        collect(text)


def test_skip_bad_records_counts_reasons_and_names_first_lines(tmp_path):
    f = tmp_path / "dump.jsonl"
    data = _mixed_file(f)
    it, info = load_conversations(f, skip_bad_records=True)
    convs = list(it)
    assert [c.id for c in convs] == ["g1", "g3", "g6", "g8"]
    assert info.bad_records == {"invalid_json": 2, "invalid_utf8": 1, "invalid_record": 1}
    assert [(e["line"], e["reason"]) for e in info.bad_record_examples] == [
        (2, "invalid_json"), (4, "invalid_utf8"), (5, "invalid_record"), (7, "invalid_json")]
    assert all(e["file"] == str(f) for e in info.bad_record_examples)
    assert "unknown role 'robot'" in info.bad_record_examples[2]["detail"]
    assert info.records == 4 and info.conversations == 4 and info.complete
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    # The good records are the same as in a clean file; a clean file gives no bad-record entries.
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"".join(line + b"\n" for line in data.splitlines() if line.startswith(b'{"id": "g')))
    it2, info2 = load_conversations(clean, skip_bad_records=True)
    assert [c.messages for c in it2] == [c.messages for c in convs] and info2.bad_records == {}
    # A limit counts conversations, not skipped records.
    it3, _ = load_conversations(f, limit=2, skip_bad_records=True)
    assert [c.id for c in it3] == ["g1", "g3"]


def test_a_line_cut_between_tokens_skips_that_line_only(tmp_path):
    """A JSON Lines record cut after a comma: the decoder reads on into the next line; that next, valid record must
    be kept, and one bad record counted."""
    f = tmp_path / "cut.jsonl"
    good = [json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]}) for i in range(3)]
    f.write_text(good[0] + "\n" + '{"id": "cut", "messages": [{"role": "user", ' + "\n" + good[1] + "\n" + good[2]
                 + "\n")
    it, info = load_conversations(f, skip_bad_records=True)
    assert [c.id for c in it] == ["g0", "g1", "g2"]
    assert info.bad_records == {"invalid_json": 1}
    assert [e["line"] for e in info.bad_record_examples] == [2]


def test_skip_bad_records_in_a_json_array_and_all_bad(tmp_path):
    f = tmp_path / "dump.json"
    f.write_bytes(b'[\n{"id": "a", "messages": [{"role": "user", "content": "q"}]},\n{"id": "b", "mess\n'
                  b'{"id": "c", "messages": [{"role": "user", "content": "q\xff"}]},\n'
                  b'{"id": "d", "messages": [{"role": "user", "content": "q4"}]}\n]\n')
    it, info = load_conversations(f, skip_bad_records=True)
    assert [c.id for c in it] == ["a", "d"]
    assert info.bad_records == {"invalid_json": 1, "invalid_utf8": 1}
    assert [e["line"] for e in info.bad_record_examples] == [3, 4]
    g = tmp_path / "allbad.jsonl"
    g.write_bytes(b"{x\n{y\n")
    with pytest.raises(Eagle3InputError, match=r"no conversation records.*invalid_json': 2"):
        collect_skip = load_conversations(g, skip_bad_records=True)[0]
        list(collect_skip)


# ---- turn structure --------------------------------------------------------------------------------------------

def _msgs(*roles):
    return [{"role": r, "content": f"{r} {k}"} for k, r in enumerate(roles)]


@pytest.mark.parametrize("roles, expected_roles, reason", [
    (("user", "assistant"), ("user", "assistant"), None),
    (("system", "user", "assistant", "user", "assistant"), ("system", "user", "assistant", "user", "assistant"),
     None),
    (("user", "assistant", "user"), ("user", "assistant"), None),  # unanswered last question dropped
    (("assistant", "user", "assistant"), ("user", "assistant"), None),  # ShareGPT continuation part
    (("system", "assistant", "user", "assistant"), ("system", "user", "assistant"), None),
    ((), None, "empty_conversation"),
    (("user",), None, "no_assistant_turn"),
    (("assistant",), None, "no_assistant_turn"),
    (("user", "user", "assistant"), None, "broken_alternation"),
    (("user", "assistant", "assistant"), None, "broken_alternation"),
    (("user", "system", "assistant"), None, "system_not_first"),
])
def test_normalize_turns(roles, expected_roles, reason):
    messages, got = normalize_turns(_msgs(*roles))
    assert got == reason
    if expected_roles is None:
        assert messages is None
    else:
        assert tuple(m["role"] for m in messages) == expected_roles


def test_normalize_turns_skip_leading_assistant_and_empty_turns():
    assert normalize_turns(_msgs("assistant", "user", "assistant"), "skip") == (None, "assistant_first")
    msgs = _msgs("user", "assistant")
    msgs[1]["content"] = "  \n"
    assert normalize_turns(msgs) == (None, "empty_turn")


# ---- the embedded ShareGPT file ----------------------------------------------------------------------------------

def test_embedded_sharegpt_first_records():
    convs, info = collect("sharegpt", limit=20)
    assert len(convs) == 20 and len({c.id for c in convs}) == 20
    assert info.path == str(sharegpt_path()) and info.formats == {"sharegpt": 20}
    assert all(m["role"] in ("system", "user", "assistant") for c in convs for m in c.messages)


@pytest.mark.slow
def test_embedded_sharegpt_whole_file_reports_cut_off_tail():
    path = sharegpt_path()
    size = path.stat().st_size
    n = 0
    it, info = load_conversations("sharegpt")
    for _ in it:
        n += 1
    assert n == info.conversations == info.records - info.duplicates_dropped
    assert 0 < info.duplicates_dropped < info.records // 10  # ShareGPT repeats some conversations word for word
    assert info.broken_tail is not None
    tail = path.read_bytes()[info.broken_tail["byte_offset"]:]
    assert info.broken_tail["byte_offset"] + info.broken_tail["bytes"] == size
    assert tail.lstrip(b", \n").startswith(b"{")  # the tail is the start of a record that never ends
    with pytest.raises(json.JSONDecodeError):
        json.loads(tail.lstrip(b", \n"))


def test_limit_stops_before_a_cut_off_tail(tmp_path):
    full = json.dumps(SHAREGPT_RECORDS)
    f = tmp_path / "cut.json"
    f.write_text(full[: full.index('"r2"')])
    convs, info = collect(f, limit=2)
    assert len(convs) == 2 and info.broken_tail is None and not info.complete
    convs, info = collect(f, limit=0)
    assert convs == [] and info.records == 0


CALL = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_calls_in_openai_and_sharegpt_formats_read_alike(tmp_path):
    openai = {"id": "a", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18C"},
        {"role": "assistant", "content": "18C."}]}
    sharegpt = {"id": "b", "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "Let me look."},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "18C"},
        {"from": "gpt", "value": "18C."}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(openai) + "\n" + json.dumps(sharegpt) + "\n")
    a, b = load_conversations(path)[0]
    assert [m["role"] for m in a.messages] == [m["role"] for m in b.messages] == ["user", "assistant", "tool",
                                                                                  "assistant"]
    assert a.messages[1]["tool_calls"] == [CALL] and a.messages[2]["tool_call_id"] == "call_7"
    assert b.messages[1]["content"] == "Let me look."
    assert b.messages[1]["tool_calls"] == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    for conv in (a, b):
        assert normalize_turns(conv.messages) == (conv.messages, None)


@pytest.mark.parametrize("roles, reason", [
    (["user", "assistant+call", "tool", "tool", "assistant"], None),  # parallel calls: two results
    (["user", "assistant+call", "assistant"], "broken_alternation"),  # the results are missing
    (["user", "assistant", "tool", "assistant"], "tool_result_without_call"),
    (["user", "tool", "assistant"], "tool_result_without_call"),
    (["user", "assistant+call", "tool", "user"], None),  # trailing turns without an answer are trimmed
])
def test_normalize_turns_with_tool_calls(roles, reason):
    messages = [{"role": r.split("+")[0], "content": "" if r == "assistant+call" else "x",
                 **({"tool_calls": [CALL]} if r.endswith("+call") else {})} for r in roles]
    got, why = normalize_turns(messages)
    assert why == reason
    if reason is None:
        assert got[-1]["role"] == "assistant"
