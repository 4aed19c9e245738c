"""A thinking model's data regenerated through a real vLLM server, killed and resumed: the simulated Kimi (Kimi-K2's
architecture, a Kimi-style tiktoken tokenizer) taught to think before it answers (`families.teach_thinking`), served
with vLLM's `kimi_k2` reasoning parser as Kimi is served. Every turn of the multi-turn conversations comes back with
its reasoning apart from its answer, an agentic trace keeps its recorded tool call and result, a `kill -9` mid-run
loses and duplicates nothing, every turn is generated from the prompt `prepare` renders for it, and `prepare`
supervises every turn's reasoning and tool call as the template renders them (Kimi's template drops earlier turns'
thinking, so each user turn becomes its own sample)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from families import ANSWER, THOUGHT, TOOL_THOUGHT, build_simulated_kimi, teach_thinking
from vllm_helpers import require_vllm

from eagle3_train.assets.tokenizer import load_tokenizer
from eagle3_train.data.prepare import load_prepared, prepare
from eagle3_train.generate.regenerate import recover_jsonl
from eagle3_train.serving.vllm_server import VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CONVERSATIONS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: what about {t}?"},
                                              {"role": "assistant", "content": "-"},
                                              {"role": "user", "content": "And why so?"},
                                              {"role": "assistant", "content": "-"}]}
                 for i, t in enumerate(["rain", "tea", "a clock", "bees", "winter", "bread", "rivers", "stones"])]
CALL = {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "tides"}'}}
AGENTIC = {"id": "agent", "messages": [  # the tool call and its result are kept; both answers are regenerated
    {"role": "user", "content": "Question 8: what about tides?"},
    {"role": "assistant", "content": "", "reasoning_content": TOOL_THOUGHT, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": "moon"},
    {"role": "assistant", "content": "-"},
    {"role": "user", "content": "And why so?"},
    {"role": "assistant", "content": "-"}]}
CONVERSATIONS.insert(4, AGENTIC)
TOOL_SECTION = (f"<|tool_calls_section_begin|><|tool_call_begin|>{CALL['id']}<|tool_call_argument_begin|>"
                f"{CALL['function']['arguments']}<|tool_call_end|><|tool_calls_section_end|>")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, smollm2_dir):
    require_vllm()
    root = tmp_path_factory.mktemp("thinking")
    verifier = build_simulated_kimi(root / "Kimi-sim", smollm2_dir)
    taught = teach_thinking(verifier, steps=100)
    source = root / "multi_turn.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out = root / "generated"
    with VLLMServer(verifier, trust_remote_code=True, vllm_args=["--reasoning-parser", "kimi_k2"],
                    log_path=root / "vllm.log") as srv:
        cmd = [sys.executable, "-m", "eagle3_train.cli", "generate", "--data", str(source), "--out", str(out),
               "--endpoint", srv.base_url, "--concurrency", "1", "--max-tokens", "64", "--seed", "0"]
        env = {**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        written = out / "conversations.jsonl"
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if written.is_file() and written.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "generate ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        at_kill = written.read_bytes().count(b"\n")
        rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    prepare(out, verifier, root / "prepared", max_length=512, val_count=0, trust_remote_code=True)
    return {"root": root, "verifier": verifier, "out": out, "taught": taught, "at_kill": at_kill}


def test_a_killed_run_resumes_with_every_turn_thought_and_answered(regenerated):
    out = regenerated["out"]
    assert regenerated["taught"]["loss_last"] < 0.5, regenerated["taught"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["done"] == len(CONVERSATIONS)
    assert 2 <= regenerated["at_kill"] < len(CONVERSATIONS)
    # the resumed run asked only for what the killed one had not written
    assert manifest["this_run"]["requests"] <= 2 * (len(CONVERSATIONS) - regenerated["at_kill"])
    assert manifest["thinking"]["style"] == "kimi"
    records, torn = recover_jsonl(out / "conversations.jsonl")
    assert sorted(r["id"] for r in records) == sorted(c["id"] for c in CONVERSATIONS)  # no duplicate, no gap
    for r in records:
        source = next(c for c in CONVERSATIONS if c["id"] == r["id"])["messages"]
        assert not r.get("truncated") and len(r["messages"]) == len(source), r
        for m, given in zip(r["messages"], source):
            if m["role"] != "assistant" or m.get("tool_calls"):
                assert m == given  # questions, the recorded tool call and its result stay as given
            else:  # regenerated; vLLM's kimi_k2 parser split the reasoning off the answer
                assert (m.get("reasoning_content"), m["content"]) == (THOUGHT, ANSWER), m
        assert [t.get("finish_reason", t.get("kept")) for t in r["turns"]] == (
            ["tool_calls", "stop", "stop"] if r["id"] == AGENTIC["id"] else ["stop", "stop"])
    assert manifest["this_run"]["reasoning_tokens_est"] > 0 and manifest["this_run"]["answer_tokens_est"] > 0


def test_prepare_supervises_every_turns_reasoning_as_the_template_renders_it(regenerated):
    tok = load_tokenizer(regenerated["verifier"], trust_remote_code=True)
    rows = load_prepared(regenerated["root"] / "prepared")[0]["train"]
    by_id = {r["id"]: r for r in rows}
    # Kimi's template keeps thinking only after the last user turn: one sample per turn, each supervising its own
    assert sorted(by_id) == sorted(f"{c['id']}#turn{t}" for c in CONVERSATIONS for t in (1, 2))
    reply = f"<think>{THOUGHT}</think>{ANSWER}<|im_end|>"
    for name, row in by_id.items():
        ids, mask = row["input_ids"], row["loss_mask"]
        supervised = tok.decode([t for t, m in zip(ids, mask) if m])
        # each turn as the template renders it: its reasoning and answer (or tool call), then the end of turn
        if name == f"{AGENTIC['id']}#turn1":
            assert supervised == f"<think>{TOOL_THOUGHT}</think>{TOOL_SECTION}<|im_end|>{reply}", name
        else:
            assert supervised == reply, name
        # the rest (system, user turns, the tool's result, earlier turns rendered without their thinking) is not
        rest = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert THOUGHT not in rest and TOOL_THOUGHT not in rest, name
        assert rest.count(ANSWER) == (1 if name.endswith("#turn2") else 0), name


def test_every_turn_was_generated_from_the_prompt_prepare_renders_for_it(regenerated):
    """On-policy context: the prompt vLLM rendered for each regenerated turn is, token for token, the prefix before
    that turn's supervised span in its prepared sample (for the answer after a tool result that includes the tool
    call's reasoning, which Kimi's template keeps after the last user turn: sent in the request's history)."""
    rows = {r["id"]: r for r in load_prepared(regenerated["root"] / "prepared")[0]["train"]}
    records = {r["id"]: r for r in recover_jsonl(regenerated["out"] / "conversations.jsonl")[0]}
    checked = 0
    for cid, record in records.items():
        starts = []  # where each assistant turn's supervised span starts, in turn order across the samples
        for t in (1, 2):
            mask = rows[f"{cid}#turn{t}"]["loss_mask"]
            starts += [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
        assert len(starts) == len(record["turns"]), cid
        for turn, start in zip(record["turns"], starts):
            if "usage" in turn:
                assert turn["usage"]["prompt_tokens"] == start, (cid, turn)
                checked += 1
    assert checked == 2 * len(CONVERSATIONS)
