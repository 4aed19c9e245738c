"""A thinking model's data regenerated through a real vLLM server, killed and resumed: the simulated Kimi (Kimi-K2's
architecture, a Kimi-style tiktoken tokenizer) taught to think before it answers (`families.teach_thinking`), served
with vLLM's `kimi_k2` reasoning parser as Kimi is served. Every turn of the multi-turn conversations comes back with
its reasoning apart from its answer, a `kill -9` mid-run loses and duplicates nothing, and `prepare` supervises every
turn's reasoning as the template renders it (Kimi's template drops earlier turns' thinking, so each turn becomes its
own sample)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from families import ANSWER, THOUGHT, build_simulated_kimi, teach_thinking
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
        answers = [m for m in r["messages"] if m["role"] == "assistant"]
        assert len(answers) == 2 and not r.get("truncated"), r
        for m in answers:  # vLLM's kimi_k2 parser split the reasoning off the answer
            assert (m.get("reasoning_content"), m["content"]) == (THOUGHT, ANSWER), m
        assert [t["finish_reason"] for t in r["turns"]] == ["stop", "stop"]
    assert manifest["this_run"]["reasoning_tokens_est"] > 0 and manifest["this_run"]["answer_tokens_est"] > 0


def test_prepare_supervises_every_turns_reasoning_as_the_template_renders_it(regenerated):
    tok = load_tokenizer(regenerated["verifier"], trust_remote_code=True)
    rows = load_prepared(regenerated["root"] / "prepared")[0]["train"]
    by_id = {r["id"]: r for r in rows}
    # Kimi's template keeps thinking only after the last user turn: one sample per turn, each supervising its own
    assert sorted(by_id) == sorted(f"{c['id']}#turn{t}" for c in CONVERSATIONS for t in (1, 2))
    reply = tok(f"<think>{THOUGHT}</think>{ANSWER}", add_special_tokens=False)["input_ids"]
    for name, row in by_id.items():
        ids, mask = row["input_ids"], row["loss_mask"]
        supervised = [t for t, m in zip(ids, mask) if m]
        # the turn as the template renders it: its reasoning and answer, then the end of turn
        assert supervised[:len(reply)] == reply and tok.decode(supervised[len(reply):]) == "<|im_end|>", name
        # the rest (system, user turns, an earlier answer rendered without its thinking) is not supervised
        rest = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert THOUGHT not in rest, name
        assert rest.count(ANSWER) == (1 if name.endswith("#turn2") else 0), name
