"""The seed's run in miniature, on a simulated Kimi verifier served by real vLLM: Kimi-K2's architecture (the tiny
DeepSeek-V3 of testing/tiny_verifiers.py: MLA, MoE, YaRN) with a Kimi-style remote-code tiktoken tokenizer
(testing/kimi_tokenizer.py), run with --trust-remote-code through generate (vLLM regenerates the answers), prepare,
vocab, extract --backend vllm, train, export, evaluate offline and EAGLE-3 serving.

The token ids our prepare writes are the ones vLLM itself renders and tokenizes for the same messages (`/tokenize`,
with reasoning and tool calls): the converted fast tokenizer and the chat template agree with the serving engine."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from support.vllm_helpers import draft_beside_mla, require_vllm
from test_kimi_tokenizer import CONVERSATION

from eagle3_train import cli
from eagle3_train.assets.conversation_records import REGENERATED
from eagle3_train.data.prepare import load_prepared, prepare
from eagle3_train.evaluate.offline import evaluate_offline
from eagle3_train.evaluate.pipeline_eval import served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.export.exporter import export
from eagle3_train.generate.journal import recover_jsonl
from eagle3_train.generate.regenerate import regenerate
from eagle3_train.serving.vllm_server import VLLMServer, hidden_states_server
from eagle3_train.settings.train import TrainConfig
from eagle3_train.testing.tiny_verifiers import build_simulated_kimi
from eagle3_train.train.trainer import train
from eagle3_train.vocab.build import build_vocab

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def as_vllm_message(m: dict) -> dict:
    """vLLM 0.32 takes an assistant turn's reasoning as `reasoning` (and gives it to the template as
    reasoning_content)."""
    out = {k: v for k, v in m.items() if k != "reasoning_content"}
    return {**out, "reasoning": m["reasoning_content"]} if m.get("reasoning_content") else out


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, smollm2_dir):
    require_vllm()
    root = tmp_path_factory.mktemp("kimi-run")
    verifier = build_simulated_kimi(root / "Kimi-sim", smollm2_dir)
    data = root / "agentic.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    with VLLMServer(verifier, trust_remote_code=True, startup_matters=True, log_path=root / "vllm.log") as srv:
        rendered = {}
        for name, messages in (("k1#turn1", CONVERSATION["messages"][:5]), ("k1#turn2", CONVERSATION["messages"])):
            rendered[name] = post(srv.root_url, "/tokenize", {"model": srv.model_name, "add_generation_prompt": False,
                                                              "messages": [as_vllm_message(m) for m in messages]})
        assert cli.main(["generate", "--data", "sharegpt", "--out", str(root / "generated"), "--endpoint",
                         srv.base_url, "--limit", "120", "--set", "max_turns=1", "--max-tokens", "96",
                         "--concurrency", "8"]) == 0
        thinking = thinking_runs(srv.base_url, srv.model_name, root)
    prepare(data, verifier, root / "agentic", max_length=1024, val_count=0, trust_remote_code=True)
    prepare(root / "generated", verifier, root / "prepared", max_length=192, val_count=2, trust_remote_code=True)
    build_vocab(root / "prepared", root / "vocab", size=4096)
    with hidden_states_server(verifier, storage_dir=root / "hs", trust_remote_code=True,
                              log_path=root / "vllm-hs.log") as srv:
        assert cli.main(["extract", "--backend", "vllm", "--endpoint", srv.base_url, "--prepared",
                         str(root / "prepared"), "--verifier", str(verifier), "--out", str(root / "hidden"),
                         "--dtype", "bfloat16", "--hidden-states-dir", str(srv.hidden_states_dir),
                         "--trust-remote-code"]) == 0
    train(TrainConfig(prepared=str(root / "prepared"), hidden_states=str(root / "hidden"),
                      vocab=str(root / "vocab"), out=str(root / "train"), ttt_steps=3, epochs=4, token_budget=1024,
                      lr=2e-3, warmup_ratio=0.05, tensorboard=False, trust_remote_code=True,
                      # a few dozen steps, where AdamW learns more than Muon (benchmarks/LOG.md, "Muon on a
                      # budget of 46 steps"); the bound below was measured under AdamW
                      optimizer="adamw",
                      architecture=draft_beside_mla()))  # the Llama layer of the seed's draft where vLLM serves it
    export(root / "train", root / "draft", fmt="eagle")
    return {"root": root, "verifier": verifier, "rendered": rendered, "thinking": thinking}


MULTI_TURN = [{"id": f"mt{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {t}?"},
                                            {"role": "assistant", "content": "-"},
                                            {"role": "user", "content": "And why?"},
                                            {"role": "assistant", "content": "-"}]}
              for i, t in enumerate(["rain", "tea", "a clock", "bees", "winter", "bread"])]


def thinking_runs(url: str, model: str, root) -> dict:
    """Regenerate multi-turn conversations as a thinking model's 25K-sample run would: first only the first wave
    (the ETA), then resumed to the end, with turns cut at max_tokens; and the same with thinking switched off."""
    source = root / "multi_turn.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in MULTI_TURN))
    kw = dict(max_tokens=12, concurrency=2, seed=0)
    first = regenerate(source, root / "thinking", [url], model, estimate_only=True, **kw)
    resumed = regenerate(source, root / "thinking", [url], model, **kw)
    off = regenerate(source, root / "instant", [url], model, reasoning="disable", **kw)
    agentic = regenerate(root / "agentic.jsonl", root / "agentic-regenerated", [url], model, max_tokens=48, seed=0)
    return {"first": first, "resumed": resumed, "off": off, "agentic": agentic}


def test_prepared_ids_are_what_vllm_renders_and_tokenizes(kimi):
    rows = {r["id"]: r for r in load_prepared(kimi["root"] / "agentic")[0]["train"]}
    assert sorted(rows) == sorted(kimi["rendered"])
    for name, tokenized in kimi["rendered"].items():
        assert rows[name]["input_ids"] == tokenized["tokens"], name


def test_served_and_offline_acceptance_of_the_trained_draft(kimi):
    prompts = load_prompts("mt_bench", limit=4, turns=1)
    served = served_acceptance(kimi["verifier"], kimi["root"] / "draft", prompts, k=3, max_tokens=32,
                               concurrency=1, baseline=True, log_dir=kimi["root"], trust_remote_code=True)
    offline = evaluate_offline(kimi["root"] / "draft", kimi["verifier"], prompts, k=3, max_new_tokens=32,
                               dtype=torch.bfloat16, trust_remote_code=True)
    tau_served = served["acceptance"]["mean_acceptance_length"]
    tau_offline = offline["overall"]["mean_acceptance_length"]
    print(f"\n[kimi-sim] acceptance length: vLLM {tau_served:.3f}, offline {tau_offline:.3f}")
    greedy = served["greedy_identical"]
    assert greedy["identical"] == greedy["compared"] == len(prompts), greedy
    # a random draft scores 1.00. Measured here 1.107 served and offline (2026-12-05, 4 prompts, bf16 near-ties on
    # both sides) since `generate --set max_turns=1` cuts the data to first turns as intended (1.27 / 1.26 while
    # the command ignored it and the draft trained on every turn)
    assert tau_served > 1.05 and abs(tau_served - tau_offline) < 0.1


def test_thinking_run_estimates_resumes_counts_cut_turns_and_switches_thinking_kimi_style(kimi):
    t, root = kimi["thinking"], kimi["root"]
    first, resumed, off = t["first"], t["resumed"], t["off"]
    assert first["thinking"]["style"] == "kimi" and first["thinking"]["found_by"] == "chat template and model name"
    assert first["thinking"]["recommended_sampling"] == {"temperature": 1.0, "top_p": 0.95}
    # the first wave (one conversation per request in flight) measured the rest's ETA, then the run stopped (the
    # conversations in flight by then are finished and kept)
    assert first["status"] == "estimated" and 2 <= first["counts"]["done"] < 2 + 2
    assert first["eta"]["remaining_conversations"] == 4 and first["eta"]["estimated_remaining_s"] > 0
    print(f"\n[kimi-sim] ETA after the first wave: {first['eta']}; the rest took {resumed['this_run']['wall_s']} s")
    assert resumed["status"] == "complete" and resumed["counts"]["done"] == len(MULTI_TURN)
    records = recover_jsonl(root / "thinking" / "conversations.jsonl")[0]
    assert sorted(r["id"] for r in records) == sorted(c["id"] for c in MULTI_TURN)  # no duplicate, no gap
    # a turn cut at max_tokens ends its conversation there, kept and counted
    cut = [r for r in records if r["turns"][-1]["finish_reason"] == "length"]
    assert all(r.get("truncated") == "max_tokens" and len(r["turns"]) == 1 for r in cut)
    assert resumed["counts"]["cut_at_max_tokens_kept"] == len(cut) > 0
    assert all(len(r["turns"]) == 2 for r in records if r not in cut)
    # thinking off the Kimi way: the template's generation prompt gains <think></think>, two special tokens
    instant = {r["id"]: r for r in recover_jsonl(root / "instant" / "conversations.jsonl")[0]}
    assert off["thinking"]["request_extra"] == {"chat_template_kwargs": {"thinking": False}}
    for r in records:
        assert instant[r["id"]]["turns"][0]["usage"]["prompt_tokens"] == r["turns"][0]["usage"]["prompt_tokens"] + 2
    # prepare keeps the cut turns: what the model generated is on-policy text
    prepare(root / "thinking", kimi["verifier"], root / "thinking-prepared", max_length=256, val_count=0,
            trust_remote_code=True)
    assert len(load_prepared(root / "thinking-prepared")[0]["train"]) >= len(MULTI_TURN)


def test_an_agentic_trace_is_regenerated_around_its_recorded_tool_calls(kimi):
    root = kimi["root"]
    assert kimi["thinking"]["agentic"]["this_run"]["tool_call_turns_kept"] == 1
    (record,) = recover_jsonl(root / "agentic-regenerated" / "conversations.jsonl")[0]
    source = CONVERSATION["messages"]
    # the call (with its reasoning) and its result, as recorded; the call marked as not the verifier's own
    assert [{k: v for k, v in m.items() if k != REGENERATED} for m in record["messages"][:4]] == source[:4]
    assert [m.get(REGENERATED) for m in record["messages"][:4]] == [None, None, False, None]
    assert record["turns"][0] == {"kept": "tool_calls"} and "usage" in record["turns"][1]  # the answer: regenerated
    assert record["messages"][4]["role"] == "assistant" and "tool_calls" not in record["messages"][4]
    prepare(root / "agentic-regenerated", kimi["verifier"], root / "agentic-regenerated-prepared", max_length=512,
            val_count=0, trust_remote_code=True)
    assert load_prepared(root / "agentic-regenerated-prepared")[0]["train"]
    manifest = json.loads((root / "agentic-regenerated-prepared" / "manifest.json").read_text())
    assert manifest["counts"]["kept_turns_unsupervised"] == 1  # the recorded call: context, not a target
