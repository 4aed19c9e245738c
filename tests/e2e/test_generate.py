"""The `generate` stage: crash-safe JSONL, resume after kill -9, 4xx handling, several endpoints — against a real
vLLM server serving SmolLM2 (tests marked `vllm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.proxies import FlakyProxy, GatedProxy
from support.vllm_helpers import require_vllm, shared_server

from eagle3_train.generate.conversation import request_seed
from eagle3_train.generate.journal import AppendLog, recover_jsonl
from eagle3_train.generate.regenerate import regenerate
from eagle3_train.utils.io import Eagle3InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # reliability_campaign's FakeServer

MODEL = "smollm2"  # served name used by the shared test servers


# --- without a server -----------------------------------------------------------------------------------------
def test_append_log_and_torn_line_recovery(tmp_path):
    path = tmp_path / "out.jsonl"
    log = AppendLog(path)
    for i in range(3):
        log.append({"id": f"c{i}", "messages": [{"role": "user", "content": "é\n" * i}]})
    log.close()
    good = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"id": "c3", "messages": [{"role": "us')  # what a kill during a write could leave
    records, cut = recover_jsonl(path)
    assert [r["id"] for r in records] == ["c0", "c1", "c2"] and cut > 0
    assert path.read_bytes() == good
    assert recover_jsonl(path) == (records, 0)

    path.write_bytes(good.replace(b'"c1"', b'"c1', 1))  # damage in the middle is not ours to repair
    with pytest.raises(Eagle3InputError, match="line 2 is not valid JSON"):
        recover_jsonl(path)
    assert recover_jsonl(tmp_path / "absent.jsonl") == ([], 0)

    # A torn line longer than the backwards-scan block, and a file holding only a torn line.
    torn = b'{"id": "big", "messages": "' + b"x" * 200_000
    path.write_bytes(good + torn)
    assert recover_jsonl(path, ids_only=True) == ([{"id": "c0"}, {"id": "c1"}, {"id": "c2"}], len(torn))
    assert path.read_bytes() == good
    path.write_bytes(torn[:20])
    assert recover_jsonl(path) == ([], 20) and path.read_bytes() == b""


def test_request_seed_is_stable_per_conversation_and_turn():
    assert request_seed(None, "a", 0) is None
    assert request_seed(1, "a", 0) == request_seed(1, "a", 0)
    assert len({request_seed(1, "a", 0), request_seed(1, "a", 1), request_seed(1, "b", 0),
                request_seed(2, "a", 0)}) == 4
    assert 0 <= request_seed(123, "x", 5) < 2**31


def test_bad_settings_are_input_errors(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(Eagle3InputError, match="reasoning"):
        regenerate(src, tmp_path / "o", ["http://127.0.0.1:9/v1"], MODEL, reasoning="maybe")
    with pytest.raises(Eagle3InputError, match="no endpoint"):
        regenerate(src, tmp_path / "o", [], MODEL)
    # Nothing listens on port 9: a clear message after a few attempts, not a traceback.
    with pytest.raises(Eagle3InputError, match="cannot reach"):
        regenerate(src, tmp_path / "o", ["http://127.0.0.1:9/v1"], MODEL, max_retries=0)


# --- against a real vLLM server -------------------------------------------------------------------------------
def _source(path: Path) -> list[dict]:
    """ShareGPT- and OpenAI-style records: single and multi-turn, a system prompt, one too long for the context,
    one whose second turn does not fit, and one without any user turn."""
    long_text = "lorem ipsum dolor sit amet " * 700  # ~3500 tokens > max_model_len 2048
    rows: list[dict] = []
    topics = ["the sea", "a cat", "bread", "rain", "mountains", "a clock", "trains", "tea", "winter", "bees"]
    for i, t in enumerate(topics):
        if i % 3 == 0:
            rows.append({"id": f"sg-{i}", "conversations": [
                {"from": "human", "value": f"Write one sentence about {t}."},
                {"from": "gpt", "value": "SOURCE ANSWER"},
                {"from": "human", "value": "Now make it shorter."},
                {"from": "gpt", "value": "SOURCE ANSWER 2"}]})
        else:
            rows.append({"id": f"msg-{i}", "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": f"What is {t}?"},
                {"role": "assistant", "content": "SOURCE ANSWER"}]})
    rows.append({"id": "too-long", "messages": [{"role": "user", "content": long_text},
                                                {"role": "assistant", "content": "x"}]})
    rows.append({"id": "second-too-long", "messages": [
        {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": long_text}, {"role": "assistant", "content": "y"}]})
    rows.append({"id": "no-user", "conversations": [{"from": "gpt", "value": "orphan answer"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    return shared_server("plain", root), shared_server("eagle3", root)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
@pytest.mark.vllm
def test_generate_survives_kill_9_and_resumes_without_duplicates_or_gaps(servers, tmp_path):
    plain, spec = servers
    src = tmp_path / "source.jsonl"
    rows = _source(src)
    out = tmp_path / "gen"
    # the killed run goes through a proxy that answers 4 turns and holds the rest: it cannot finish before the kill
    gate = GatedProxy(plain.root_url, allow=4)
    cmd = [sys.executable, "-m", "eagle3_train.cli", "generate", "--data", str(src), "--endpoint", gate.url,
           "--model", MODEL, "--out", str(out), "--concurrency", "2", "--max-tokens", "24", "--temperature", "0"]
    env = {**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"}
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not gate.held or _lines(out / "conversations.jsonl") < 2:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no output after 600 s"
            time.sleep(0.1)
        proc.kill()  # SIGKILL: no cleanup at all
        proc.wait()
    finally:
        gate.close()
    before = _lines(out / "conversations.jsonl") + _lines(out / "skipped.jsonl")
    assert before < len(rows), "the run finished before it was killed: the gate let more than 4 turns through"
    with open(out / "conversations.jsonl", "ab") as f:
        f.write(b'{"id": "msg-1", "messages": [{"ro')  # a torn write, as a kill mid-write would leave

    proxy = FlakyProxy(plain.root_url)
    try:
        manifest = regenerate(src, out, [proxy.url, spec.base_url], MODEL, concurrency=3, max_tokens=24)
    finally:
        proxy.close()

    done, _ = recover_jsonl(out / "conversations.jsonl")
    skipped, _ = recover_jsonl(out / "skipped.jsonl")
    ids = [r["id"] for r in done] + [r["id"] for r in skipped]
    assert len(ids) == len(set(ids)), "duplicate ids after resume"
    assert set(ids) == {r["id"] for r in rows}, "gap after resume"
    reasons = {r["id"]: r["reason"] for r in skipped}
    assert reasons == {"too-long": "context_too_long", "no-user": "no_assistant_turn"}
    assert proxy.failed > 0 and manifest["this_run"]["retries"] >= proxy.failed

    by_id = {r["id"]: r for r in done}
    for row in rows:
        if row["id"] not in by_id:
            continue
        rec = by_id[row["id"]]
        src_msgs = row.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[t["from"]],
                                            "content": t["value"]} for t in row["conversations"]]
        if row["id"] == "second-too-long":  # its second question does not fit (unless its first answer was cut)
            assert rec["truncated"] in ("context_too_long", "max_tokens") and len(rec["turns"]) == 1
            src_msgs = src_msgs[:2]
        elif rec.get("truncated") == "max_tokens":  # a cut answer ends its conversation: no question follows it
            assert rec["turns"][-1]["finish_reason"] == "length"
            assert all(t["finish_reason"] != "length" for t in rec["turns"][:-1])
            src_msgs = src_msgs[:len(rec["messages"])]
        assert [m["role"] for m in rec["messages"]] == [m["role"] for m in src_msgs]
        for m, s in zip(rec["messages"], src_msgs):
            if m["role"] == "assistant":
                assert m["content"] and not m["content"].startswith("SOURCE ANSWER")
            else:
                assert m == s
        assert len(rec["turns"]) == sum(m["role"] == "assistant" for m in rec["messages"])
        for t in rec["turns"]:
            assert t["finish_reason"] in ("stop", "length")
            assert 0 < t["usage"]["completion_tokens"] <= 24 and t["usage"]["prompt_tokens"] > 0

    counts = manifest["counts"]
    assert manifest["status"] == "complete" and counts["done"] == len(done) and counts["remaining"] == 0
    assert counts["skipped"] == {"context_too_long": 1, "no_assistant_turn": 1}
    cut = sum(r.get("truncated") == "max_tokens" for r in done)
    assert counts["truncated"] == cut + sum(r.get("truncated") == "context_too_long" for r in done) >= 1
    assert counts["cut_at_max_tokens_kept"] == cut
    assert manifest["endpoints"] == [proxy.url, spec.base_url] and manifest["model"] == MODEL
    assert manifest["sampling"]["temperature"] == 0.0 and manifest["sampling"]["max_tokens"] == 24
    assert manifest["this_run"]["torn_bytes_removed"] > 0
    assert len(manifest["source"]["sha256"]) == 64

    # The output feeds `prepare`: it reads as a conversation source with the same ids.
    from eagle3_train.assets.conversations import load_conversations

    convs, _ = load_conversations(out)
    assert sorted(c.id for c in convs) == sorted(by_id)

    # Turn 2 was generated on the model's own turn-1 answer: replaying greedily gives the same text.
    import openai

    client = openai.OpenAI(base_url=plain.base_url, api_key="EMPTY")
    rec = by_id["sg-0"]
    history = []
    for m in rec["messages"]:
        if m["role"] == "assistant":
            r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=24, temperature=0)
            assert r.choices[0].message.content == m["content"]
        history.append(m)

    # A rerun with everything done sends no request; other sampling settings are refused.
    again = regenerate(src, out, [plain.base_url], MODEL, max_tokens=24)
    assert again["this_run"]["requests"] == 0 and again["counts"]["done"] == len(done)
    with pytest.raises(Eagle3InputError, match="other settings.*temperature"):
        regenerate(src, out, [plain.base_url], MODEL, max_tokens=24, temperature=0.7)


@pytest.mark.slow
@pytest.mark.vllm
def test_wrong_model_name_stops_the_run_clearly(servers, tmp_path):
    plain, _ = servers
    src = tmp_path / "source.jsonl"
    _source(src)
    cmd = [sys.executable, "-m", "eagle3_train.cli", "generate", "--data", str(src), "--endpoint", plain.base_url,
           "--model", "no-such-model", "--out", str(tmp_path / "gen")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"})
    assert r.returncode == 2
    assert "does not serve model 'no-such-model'" in r.stderr and MODEL in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "gen" / "conversations.jsonl").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_generate_reasoning_modes_and_sampling(servers, tmp_path):
    """Sampling with a seed is reproducible; `disable` sends enable_thinking=false, which plain templates ignore."""
    plain, _ = servers
    src = tmp_path / "source.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q},
                                                                    {"role": "assistant", "content": "-"}]}) + "\n"
                           for i, q in enumerate(["Tell me a joke.", "Name three fruits."])))
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, reasoning="disable")
    m1 = regenerate(src, tmp_path / "a", [plain.base_url], None, **kw)  # model discovered from /v1/models
    m2 = regenerate(src, tmp_path / "b", [plain.base_url], MODEL, **kw)
    assert m1["model"] == MODEL and m1["sampling"]["seed"] == 7 and m1["sampling"]["reasoning"] == "disable"
    # no --concurrency: what the server's KV cache holds at 16 new tokens + a 1,024-token prompt (vLLM's metrics)
    (server,) = m1["concurrency_from"]["endpoints"].values()
    assert server["kv_cache_tokens"] > 0
    assert m1["concurrency"] == server["in_flight"] == max(1, min(256, server["kv_cache_tokens"] // (16 + 1024)))
    a = {r["id"]: r["messages"] for r in recover_jsonl(tmp_path / "a" / "conversations.jsonl")[0]}
    b = {r["id"]: r["messages"] for r in recover_jsonl(tmp_path / "b" / "conversations.jsonl")[0]}
    assert a == b and len(a) == 2 and m2["counts"]["done"] == 2
    assert all("reasoning_content" not in m for msgs in a.values() for m in msgs)


def test_original_answers_fill_in_for_the_conversations_not_regenerated(tmp_path):
    """generate.original_answers: regenerated conversations first, then the source's others with their own answers,
    each conversation once, in the source's order."""
    from eagle3_train.assets.conversations import load_conversations
    from eagle3_train.generate.pipeline_step import mix_with_originals

    source = [c for c in load_conversations("sharegpt", limit=6)[0]]
    regenerated = [{"id": c.id, "messages": [c.messages[0], {"role": "assistant", "content": f"new answer {i}"}]}
                   for i, c in enumerate(source[1:3])]
    generated = tmp_path / "conversations.jsonl"
    generated.write_text("".join(json.dumps(r) + "\n" for r in regenerated))
    out = tmp_path / "mixed.jsonl"
    counts = mix_with_originals("sharegpt", generated, out, limit=6)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert counts == {"regenerated": 2, "original": 4}
    assert [r["id"] for r in rows] == [source[i].id for i in (1, 2, 0, 3, 4, 5)]
    assert rows[0]["messages"][1]["content"] == "new answer 0"
    assert rows[2]["messages"] == source[0].messages
    mixed, info = load_conversations(str(out))  # prepare reads it like any messages JSONL
    assert len(list(mixed)) == 6 and info.format == "messages"


@pytest.mark.parametrize("mode", ["reasoning-object", "reasoning-number", "reasoning-list", "content-number",
                                  "choices-empty", "choices-null", "usage-strings", "cut-json", "html", "huge"])
def test_a_malformed_reply_is_a_counted_skip_never_a_traceback_or_a_repr(tmp_path, mode):
    """Every reply is parsed against what we read (serving/replies.py): a wrong type, a missing field, a body far
    larger than max_tokens allows or one that is not JSON skips that conversation, its reason counted; past
    MALFORMED_STOP such replies the run stops (resumable) rather than skip the whole data set."""
    from reliability_campaign import HostileServer

    from eagle3_train.generate.regenerate import MALFORMED_STOP

    src = tmp_path / "src.jsonl"
    n = MALFORMED_STOP + 2
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                   {"role": "assistant", "content": "a"}]}) + "\n"
                           for i in range(n)))
    server = HostileServer(mode)
    try:
        with pytest.raises(Eagle3InputError, match=r"replies that are not OpenAI chat completions.*reply_"):
            regenerate(src, tmp_path / "out", [server.url], "fake", max_tokens=8, max_retries=0, concurrency=1)
    finally:
        server.close()
    skipped = [json.loads(x) for x in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert len(skipped) == MALFORMED_STOP and all(s["reason"].startswith("reply_") for s in skipped), skipped
    assert not (tmp_path / "out" / "conversations.jsonl").read_text().strip()  # nothing trained on


def test_a_server_trickling_its_reply_cannot_hold_a_request_past_the_timeout(tmp_path):
    from reliability_campaign import HostileServer

    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"id": "c0", "messages": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "a"}]}) + "\n")
    server = HostileServer("trickle")
    t0 = time.monotonic()
    try:
        with pytest.raises(Eagle3InputError, match="no complete reply within 2 s"):
            regenerate(src, tmp_path / "out", [server.url], "fake", max_tokens=8, max_retries=1, timeout_s=2.0)
    finally:
        server.close()
    assert time.monotonic() - t0 < 30  # two attempts of 2 s and a backoff, not the reply's ~150 s


def test_prepared_data_records_how_it_was_regenerated(tmp_path, tiny_llama_dir):
    """The training metadata recorded the conversations file's path and hash, not how it was made: prepare now
    carries generate's record (served model, sampling, thinking, counts) into its manifest, whence it reaches the
    training metadata and every export."""
    from reliability_campaign import FakeServer

    from eagle3_train.data.prepare import prepare

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                   {"role": "assistant", "content": "a"}]}) + "\n"
                           for i in range(4)))
    server = FakeServer(service_s=0.0)
    try:
        regenerate(src, tmp_path / "gen", [server.url], "fake", max_tokens=16, temperature=0.7, seed=3)
    finally:
        server.close()
    manifest = prepare(tmp_path / "gen", tiny_llama_dir(), tmp_path / "prep", max_length=64, val_count=1)
    record = manifest["source"]["regeneration"]
    assert record["model"] == "fake" and record["endpoints"] == [server.url]
    assert record["sampling"]["temperature"] == 0.7 and record["sampling"]["seed"] == 3
    assert record["counts"]["done"] == 4 and record["source"]["path"] == str(src)  # the data it regenerated
    plain = prepare(src, tiny_llama_dir(), tmp_path / "prep-plain", max_length=64, val_count=1)
    assert plain["source"]["regeneration"] is None  # not regenerated: nothing to record


@pytest.mark.slow
@pytest.mark.vllm
def test_regenerated_data_is_supervised_as_the_verifier_generated_it(servers, tmp_path, smollm2_dir):
    """What prepare supervises is what the verifier produced: each regenerated turn keeps vLLM's token ids, and the
    prepared supervised ids equal them; a tool-call turn kept from the source (the verifier did not write it) is
    context unless asked; tools reach a server without a tool-call parser only to stop the run, naming the flags."""
    from eagle3_train.assets.conversation_records import REGENERATED, TOKEN_IDS
    from eagle3_train.data.prepare import prepare

    plain, _ = servers
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": {"q": "pears"}}}
    records = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "-"}]}
               for i, q in enumerate(["Tell me a joke.", "Name three fruits."])]
    records.append({"id": "agent", "messages": [
        {"role": "user", "content": "How many pears are left?"},
        {"role": "assistant", "content": "Let me look that up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "12 pears"},
        {"role": "assistant", "content": "-"}]})
    src = tmp_path / "source.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    regenerate(src, tmp_path / "gen", [plain.base_url], MODEL, max_tokens=24, temperature=0.0)
    out = {r["id"]: r for r in recover_jsonl(tmp_path / "gen" / "conversations.jsonl")[0]}
    kept = out["agent"]["messages"][1]
    assert kept[REGENERATED] is False and TOKEN_IDS not in kept
    assert kept["tool_calls"][0]["function"]["name"] == "lookup"
    assert all(TOKEN_IDS in m for r in out.values() for m in r["messages"]
               if m["role"] == "assistant" and m.get(REGENERATED) is not False)

    manifest = prepare(tmp_path / "gen", smollm2_dir, tmp_path / "prep", max_length=512, val_count=0)
    ids = manifest["counts"]["generated_ids"]
    print(f"[generated ids] {ids}")
    assert ids["turns"] == 3 and ids["mismatched"] == 0 and ids["equal"] == 3, ids
    assert manifest["counts"]["kept_turns_unsupervised"] == 1
    asked = prepare(tmp_path / "gen", smollm2_dir, tmp_path / "prep-all", max_length=512, val_count=0,
                    supervise_kept_turns=True)
    assert asked["counts"]["kept_turns_unsupervised"] == 0
    assert sum(asked["counts"]["supervised_tokens"].values()) > sum(manifest["counts"]["supervised_tokens"].values())

    # the conversation's tools go with its requests: a server started without a tool-call parser refuses them all
    with_tools = tmp_path / "tools.jsonl"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools.write_text(json.dumps({**records[-1], "tools": tools}) + "\n")
    cmd = [sys.executable, "-m", "eagle3_train.cli", "generate", "--data", str(with_tools), "--endpoint",
           plain.base_url, "--model", MODEL, "--out", str(tmp_path / "gen-tools"), "--max-tokens", "8"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"})
    assert r.returncode != 0 and "--enable-auto-tool-choice --tool-call-parser" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
