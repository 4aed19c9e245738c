"""A thinking model's data regenerated through a real vLLM server, killed and resumed: the simulated Kimi (Kimi-K2's
architecture, a Kimi-style tiktoken tokenizer) taught to think before it answers (`families.teach_thinking`), served
with vLLM's `kimi_k2` reasoning parser as Kimi is served. Every turn of the multi-turn conversations comes back with
its reasoning apart from its answer, an agentic trace keeps its recorded tool call and result, a conversation that
offers a function gets a new call that vLLM's `kimi_k2` tool parser returns as `tool_calls`, a `kill -9` mid-run
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
from support.proxies import GatedProxy
from support.vllm_helpers import draft_beside_mla, require_vllm

from eagle3_train.assets.conversation_records import REGENERATED, TOKEN_IDS
from eagle3_train.assets.tokenizer import load_tokenizer
from eagle3_train.data.prepare import load_prepared, prepare
from eagle3_train.evaluate.offline import evaluate_offline
from eagle3_train.evaluate.pipeline_eval import served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.evaluate.report import format_table
from eagle3_train.export.exporter import export
from eagle3_train.generate.journal import recover_jsonl
from eagle3_train.hidden_states.extract import extract
from eagle3_train.serving.vllm_server import VLLMServer
from eagle3_train.settings.train import TrainConfig
from eagle3_train.testing.tiny_verifiers import (
    ANSWER,
    LOOKUP,
    NEW_CALL,
    THOUGHT,
    TOOL_THOUGHT,
    build_simulated_kimi,
    teach_thinking,
)
from eagle3_train.train.trainer import train
from eagle3_train.vocab.build import build_vocab


def _avx512() -> bool:
    try:
        return " avx512f" in open("/proc/cpuinfo").read()
    except OSError:
        return True


# The taught simulated Kimi answers exactly as taught where vLLM's CPU kernels round like the torch it was taught in;
# on an AVX2-only host they do not (measured 2026-12-03, at this change's parent too: "Here.Here....." served for
# the taught "Here is my reply."), so its exact-text checks cannot hold there. Open: teach it in the served precision.
AVX2_ONLY = pytest.mark.skipif(not _avx512(), reason="AVX2-only CPU: vLLM's kernels do not reproduce the taught "
                                                     "model's greedy text (see the comment above)")
pytestmark = [pytest.mark.slow, pytest.mark.vllm, AVX2_ONLY]


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
# offered a function, the verifier calls it: vLLM's kimi_k2 tool parser returns the new call as `tool_calls`, and the
# trace ends there (a new call has no recorded result). The question is worded as those it was taught on: the tiny
# model's choice to call does not carry over to other wordings (measured: "Question 9: what about tides?" answers)
CALLING = {"id": "calls", "tools": [LOOKUP], "messages": [{"role": "user", "content": "how river stone road?"},
                                                          {"role": "assistant", "content": "-"},
                                                          {"role": "user", "content": "And why so?"},
                                                          {"role": "assistant", "content": "-"}]}
CONVERSATIONS.append(CALLING)
# the samples prepare makes: one per regenerated turn (Kimi's template drops earlier turns' thinking)
SAMPLES = sorted([f"{c['id']}#turn{t}" for c in CONVERSATIONS if c is not CALLING for t in (1, 2)] + [CALLING["id"]])
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
    with VLLMServer(verifier, trust_remote_code=True, vllm_args=["--reasoning-parser", "kimi_k2",
                                                                 "--enable-auto-tool-choice", "--tool-call-parser",
                                                                 "kimi_k2"],
                    log_path=root / "vllm.log") as srv:
        cmd = [sys.executable, "-m", "eagle3_train.cli", "generate", "--data", str(source), "--out", str(out),
               "--concurrency", "1", "--max-tokens", "64", "--seed", "0"]
        env = {**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"}
        # the killed run goes through a proxy that answers 4 turns (two conversations at least) and holds the next
        gate = GatedProxy(srv.root_url, allow=4)
        try:
            proc = subprocess.Popen(cmd + ["--endpoint", gate.url], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            written = out / "conversations.jsonl"
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                if gate.held and written.is_file() and written.read_bytes().count(b"\n") >= 2:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, "generate ended before it was killed: " + proc.stderr.read().decode()[-2000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
        finally:
            gate.close()
        at_kill = written.read_bytes().count(b"\n")
        rerun = subprocess.run(cmd + ["--endpoint", srv.base_url], env=env, capture_output=True, text=True,
                               timeout=900)
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
        if r["id"] == CALLING["id"]:  # a new call, parsed by vLLM into tool_calls: the trace ends with it
            assert r["truncated"] == "tool_call_without_result" and r["tools"] == [LOOKUP], r
            question, call = r["messages"]
            assert question == source[0] and call["role"] == "assistant" and not call["content"], r
            assert call["reasoning_content"] == TOOL_THOUGHT and call[TOKEN_IDS], call
            (tc,) = call["tool_calls"]
            assert (tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) == (
                "functions.lookup:0", "lookup", {"q": "tides"}), tc
            assert [t["finish_reason"] for t in r["turns"]] == ["tool_calls"]
            continue
        assert not r.get("truncated") and len(r["messages"]) == len(source), r
        for m, given in zip(r["messages"], source):
            if m["role"] != "assistant" or m.get("tool_calls"):
                # questions, the recorded tool call and its result stay as given; the call is marked as not the
                # verifier's own
                assert {k: v for k, v in m.items() if k != REGENERATED} == given
                assert m.get(REGENERATED) is (False if m["role"] == "assistant" else None)
            else:  # regenerated; vLLM's kimi_k2 parser split the reasoning off the answer
                assert (m.get("reasoning_content"), m["content"]) == (THOUGHT, ANSWER), m
                assert m[TOKEN_IDS], m  # the ids vLLM generated, for prepare to compare
        assert [t.get("finish_reason", t.get("kept")) for t in r["turns"]] == (
            ["tool_calls", "stop", "stop"] if r["id"] == AGENTIC["id"] else ["stop", "stop"])
    assert manifest["this_run"]["reasoning_tokens_est"] > 0 and manifest["this_run"]["answer_tokens_est"] > 0


def test_prepare_supervises_every_turns_reasoning_as_the_template_renders_it(regenerated):
    tok = load_tokenizer(regenerated["verifier"], trust_remote_code=True)
    rows = load_prepared(regenerated["root"] / "prepared")[0]["train"]
    by_id = {r["id"]: r for r in rows}
    # Kimi's template keeps thinking only after the last user turn: one sample per turn, each supervising its own
    assert sorted(by_id) == SAMPLES
    reply = f"<think>{THOUGHT}</think>{ANSWER}<|im_end|>"
    for name, row in by_id.items():
        ids, mask = row["input_ids"], row["loss_mask"]
        supervised = [t for t, m in zip(ids, mask) if m]
        if name == CALLING["id"]:  # the verifier's own new call is supervised, as it generated it
            assert supervised == tok(f"<think>{TOOL_THOUGHT}</think>{NEW_CALL}<|im_end|>",
                                     add_special_tokens=False)["input_ids"], tok.decode(supervised)
            continue
        # each regenerated turn as the template renders it, token for token: its reasoning and answer, then the end
        # of turn; the tool call kept from the source is context (the verifier did not write it)
        assert supervised == tok(reply, add_special_tokens=False)["input_ids"], (name, tok.decode(supervised))
        # the rest (system, user turns, the kept call, the tool's result, earlier turns rendered without their
        # thinking) is not
        rest = tok.decode([t for t, m in zip(ids, mask) if not m])
        kept_call = name == f"{AGENTIC['id']}#turn1"
        assert THOUGHT not in rest and (TOOL_THOUGHT in rest) == kept_call, name
        assert (f"<think>{TOOL_THOUGHT}</think>{TOOL_SECTION}<|im_end|>" in rest) == kept_call, name
        assert rest.count(ANSWER) == (1 if name.endswith("#turn2") else 0), name
    # what prepare supervises is what vLLM generated, token for token (its ids were kept by generate); on an
    # AVX2-only host the model's stray special tokens there made all 18 differ (the text drops them): counted
    manifest = json.loads((regenerated["root"] / "prepared" / "manifest.json").read_text())
    ids = manifest["counts"]["generated_ids"]
    assert ids["turns"] == len(SAMPLES) and ids["mismatched"] == 0, ids
    assert manifest["counts"]["kept_turns_unsupervised"] == 1


def test_every_turn_was_generated_from_the_prompt_prepare_renders_for_it(regenerated):
    """On-policy context: the prompt vLLM rendered for each regenerated turn is, token for token, the prefix before
    that turn's supervised span in its prepared sample (for the answer after a tool result that includes the tool
    call's reasoning, which Kimi's template keeps after the last user turn: sent in the request's history)."""
    rows = {r["id"]: r for r in load_prepared(regenerated["root"] / "prepared")[0]["train"]}
    records = {r["id"]: r for r in recover_jsonl(regenerated["out"] / "conversations.jsonl")[0]}
    checked = 0
    for cid, record in records.items():
        starts = []  # where each assistant turn's supervised span starts, in turn order across the samples
        for name in sorted(n for n in rows if n == cid or n.startswith(f"{cid}#")):
            mask = rows[name]["loss_mask"]
            starts += [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
        regenerated = [t for t in record["turns"] if "kept" not in t]  # kept turns are context, not supervised
        assert len(starts) == len(regenerated), cid
        for turn, start in zip(regenerated, starts):
            if "usage" in turn:
                assert turn["usage"]["prompt_tokens"] == start, (cid, turn)
                checked += 1
    assert checked == len(SAMPLES)


@pytest.fixture(scope="module")
def judged(regenerated):
    """A draft trained on the regenerated conversations, served beside the thinking verifier and judged on
    MT-bench questions at temperature 0 and 1, with acceptance measured apart in the reasoning and in the answer."""
    root, verifier = regenerated["root"], regenerated["verifier"]
    build_vocab(root / "prepared", root / "vocab", size=1024)
    extract(root / "prepared", verifier, root / "hidden", trust_remote_code=True)
    train(TrainConfig(prepared=str(root / "prepared"), hidden_states=str(root / "hidden"), vocab=str(root / "vocab"),
                      out=str(root / "train"), ttt_steps=3, epochs=20, token_budget=512, lr=3e-3, warmup_ratio=0.05,
                      tensorboard=False, trust_remote_code=True, architecture=draft_beside_mla(),
                      optimizer="adamw"))  # the bounds below were measured under AdamW, on a tiny budget
    export(root / "train", root / "draft", fmt="eagle")
    prompts = load_prompts("mt_bench", limit=6, turns=1)
    served = served_acceptance(verifier, root / "draft", prompts, k=3, max_tokens=48, concurrency=2,
                               log_dir=root, trust_remote_code=True, also_temperature=(1.0,))
    offline = evaluate_offline(root / "draft", verifier, prompts, k=3, max_new_tokens=48, trust_remote_code=True)
    return {"prompts": prompts, "served": served, "offline": offline}


def test_served_acceptance_is_measured_in_the_reasoning_and_in_the_answer_at_two_temperatures(judged):
    served, n = judged["served"], len(judged["prompts"])
    whole = served["acceptance"]
    # greedy, the taught verifier closes its reasoning in every reply; sampled, some replies wander off and end
    # without closing it (named in the results)
    assert whole["region_split"]["replies"] == {"closed": n, "cut_in_reasoning": 0, "without_closing": 0,
                                                "error": 0}, whole["region_split"]
    for t in ("0.0", "1.0"):
        at = served["at_temperature"][t]
        replies = at["region_split"]["replies"]
        assert sum(replies.values()) == n and replies["error"] == 0 and replies["closed"] > 0, (t, replies)
        for name, count in (("reasoning", n), ("answer", replies["closed"])):
            r = at["by_region"][name]
            print(f"[thinking] T {t} {name}: {r['mean_acceptance_length']:.3f} over {r['num_drafts']} drafts, "
                  f"{r['replies']} replies")
            assert r["replies"] == count and r["num_drafts"] > 0 and r["generated_tokens"] > 0, (t, name, r)
            # over the returned tokens only: the accepted tokens vLLM counted past `</think>` are out
            assert r["replies"] + r["num_drafts"] + r["num_accepted_tokens"] <= r["generated_tokens"], (t, name, r)
            assert r["num_accepted_tokens"] + r["num_accepted_past_stop"] == r["num_accepted_counted_by_vllm"]
            assert len(r["per_position_acceptance"]) == 3
    regions = whole["by_region"]
    # greedy: the reasoning pass repeats the whole replies' rounds up to </think>, the answer pass starts a round
    # at </think>, so the two passes' drafts add up to the whole replies' within one round per reply
    drafts = regions["reasoning"]["num_drafts"] + regions["answer"]["num_drafts"]
    assert abs(drafts - whole["num_drafts"]) <= n, (drafts, whole["num_drafts"])
    # the draft learned the verifier's one thought and one answer: greedy, both regions are well above a random
    # draft's 1.0 (measured 2.50 and 3.00 here)
    assert regions["reasoning"]["mean_acceptance_length"] > 1.5 and regions["answer"]["mean_acceptance_length"] > 1.5
    offline = judged["offline"]["overall"]  # for the record: the offline evaluator's regions (rounds by their start)
    by_region = {k: round(v["mean_acceptance_length"], 3) for k, v in offline["by_region"].items()}
    print(f"[thinking] whole replies: vLLM {whole['mean_acceptance_length']:.3f}, offline "
          f"{offline['mean_acceptance_length']:.3f}; offline by region {by_region}")
    table = format_table(served)
    assert table.count("in reasoning") == 2 and table.count("in answer") == 2, table
