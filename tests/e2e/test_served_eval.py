"""Served evaluation against real vLLM servers: SmolLM2 with a RANDOM EAGLE-3 draft vs. SmolLM2 alone."""

from __future__ import annotations

import argparse
import json

import pytest
from support.vllm_helpers import require_vllm, shared_server

from eagle3_train.evaluate.prompts import EvalPrompt
from eagle3_train.evaluate.served import add_served_arguments, evaluate_served, run_served
from eagle3_train.serving.metrics import root_url
from eagle3_train.settings import ServedEvalSettings
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import settings_from_args

PROMPTS = [EvalPrompt("p0", "mini", ["What is the capital of France?", "And of Italy?"]),
           EvalPrompt("p1", "mini", ["List two colours."]),
           EvalPrompt("p2", "mini", ["Say hello in Spanish."])]


def test_a_reasoning_pass_reply_is_classed_by_how_it_ended():
    """Where the answer pass continues from: the prompt, the reasoning and `</think>` (id 9 here), whether the server
    returned `</think>` among the ids or only as the stop reason; no continuation for a reply cut inside its
    reasoning or ended without closing it; a server that returns no ids cannot be split."""
    from eagle3_train.evaluate.served_regions import _reasoning_ids
    from eagle3_train.serving.client import ChatReply

    def reply(ids, finish="stop", stop_reason=None, prompt=(1, 2)):
        return ChatReply("", None, finish, {}, 0, 0.0, prompt_token_ids=list(prompt) if prompt else None,
                         token_ids=ids, stop_reason=stop_reason)

    assert _reasoning_ids(reply([5, 6, 9]), 9) == ("closed", [1, 2, 5, 6, 9])
    assert _reasoning_ids(reply([5, 6], stop_reason=9), 9) == ("closed", [1, 2, 5, 6, 9])
    assert _reasoning_ids(reply([5, 6], finish="length"), 9) == ("cut_in_reasoning", None)
    assert _reasoning_ids(reply([5, 6, 2]), 9) == ("without_closing", None)
    with pytest.raises(Eagle3InputError, match="return_token_ids"):
        _reasoning_ids(reply(None, prompt=None), 9)


def test_root_url_and_cli_options():
    assert root_url("http://h:1/v1/") == "http://h:1" and root_url("http://h:1") == "http://h:1"
    p = argparse.ArgumentParser()
    add_served_arguments(p)
    a = p.parse_args(["--endpoint", "http://x/v1", "--prompts", "humaneval", "-k", "2", "--out", "d",
                      "--temperature", "1", "--seed", "3"])
    assert (a.endpoint, a.benchmark, a.k, a.out, a.max_tokens) == (["http://x/v1"], "humaneval", 2, "d",
                                                                   ServedEvalSettings.max_tokens)
    assert (a.temperature, a.seed) == (1.0, 3)
    with pytest.raises(Eagle3InputError, match="--endpoint URL.*--draft DIR"):
        run_served(settings_from_args(ServedEvalSettings, p.parse_args(["--prompts", "mt-bench", "--limit", "1"])))
    with pytest.raises(Eagle3InputError, match="no prompts"):
        evaluate_served("http://127.0.0.1:9/v1", "m", [])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    return shared_server("plain", root), shared_server("eagle3", root)


@pytest.mark.slow
@pytest.mark.vllm
def test_served_acceptance_with_random_draft_and_identical_greedy_output(servers):
    plain, spec = servers
    r = evaluate_served([spec.base_url], spec.model_name, PROMPTS, max_tokens=16, concurrency=2,
                        baseline_url=plain.base_url, baseline_model=plain.model_name)
    k = spec.speculative["num_speculative_tokens"]
    acc = r["acceptance"]
    assert r["speculative"] and acc is not None
    assert acc["num_drafts"] > 0 and acc["num_draft_tokens"] == k * acc["num_drafts"]
    assert len(acc["per_position_acceptance"]) == k
    # A random draft almost never guesses the verifier's token: acceptance length ~1.
    assert 1.0 <= acc["mean_acceptance_length"] < 1.3
    assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
    assert r["requests"] == sum(len(p.turns) for p in PROMPTS) and r["errors"] == 0
    gen = sum(sum(c["completion_tokens"]) for c in r["completions"])
    assert r["generated_tokens"] == gen > 0 and r["tokens_per_s"] > 0
    # The server counts every generated token once.
    assert acc["server_generation_tokens"] == gen

    # Speculation must not change greedy output; the second turn saw the model's own first answer.
    assert r["greedy_identical"] == {"identical": 3, "compared": 3, "differing_ids": []}
    assert [len(c["outputs"]) for c in r["completions"]] == [2, 1, 1]
    assert r["baseline"]["speculative"] is False and r["speedup"] > 0
    # SmolLM2 does not think (`</think>` is several tokens): no reasoning split unless asked, and asking is refused
    # before a prompt is sent
    assert "by_region" not in acc and "region_split" not in acc
    with pytest.raises(Eagle3InputError, match="not one token"):
        evaluate_served([spec.base_url], spec.model_name, PROMPTS, max_tokens=16, reasoning_split=True)


@pytest.mark.slow
@pytest.mark.vllm
def test_sampled_acceptance_reaches_the_server_and_skips_the_greedy_check(servers):
    plain, spec = servers
    greedy = evaluate_served([spec.base_url], spec.model_name, PROMPTS, max_tokens=16, concurrency=2)
    r = evaluate_served([spec.base_url], spec.model_name, PROMPTS, max_tokens=16, concurrency=2,
                        baseline_url=plain.base_url, temperature=1.0, seed=7)
    assert (r["temperature"], r["seed"]) == (1.0, 7) and greedy["temperature"] == 0.0 and "seed" not in greedy
    assert r["acceptance"]["num_drafts"] > 0 and r["errors"] == 0
    assert r["greedy_identical"] is None  # sampled outputs legitimately differ from a baseline
    # The temperature reached the server: SmolLM2 sampled at 1 leaves its greedy answers within 16 tokens.
    assert [c["outputs"] for c in r["completions"]] != [c["outputs"] for c in greedy["completions"]]
    with pytest.raises(Eagle3InputError, match="temperature"):
        evaluate_served([spec.base_url], spec.model_name, PROMPTS, temperature=-1.0)


@pytest.mark.slow
@pytest.mark.vllm
def test_run_served_writes_results(servers, tmp_path):
    plain, spec = servers
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "turns": p.turns}) + "\n" for p in PROMPTS[1:]))
    p = argparse.ArgumentParser()
    add_served_arguments(p)
    args = p.parse_args(["--endpoint", spec.base_url, "--baseline-endpoint", plain.base_url, "--prompts",
                         str(prompts), "--max-tokens", "8", "--concurrency", "2", "--out", str(tmp_path / "ev")])
    result = run_served(settings_from_args(ServedEvalSettings, args))
    saved = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert saved["acceptance"] == result["acceptance"] and saved["acceptance"]["num_drafts"] > 0
    assert saved["model"] == spec.model_name and saved["n_prompts"] == 2
    lines = (tmp_path / "ev" / "served_completions.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["p1", "p2"]
    assert all(json.loads(x)["outputs"] == json.loads(x)["baseline_outputs"] for x in lines)


@pytest.mark.slow
@pytest.mark.vllm
def test_evaluate_served_cli_with_out_writes_results_and_chart(servers, tmp_path, capsys):
    """`eagle3-train evaluate served --endpoint URL --prompts FILE --turns 1 --out DIR` as the README runs it."""
    from eagle3_train.cli import main

    _, spec = servers
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "turns": p.turns}) + "\n" for p in PROMPTS))
    out = tmp_path / "ev"
    assert main(["evaluate", "served", "--endpoint", spec.base_url, "--prompts", str(prompts), "--turns", "1",
                 "--max-tokens", "8", "--concurrency", "2", "--out", str(out)]) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["n_prompts"] == 3 and saved["acceptance"]["num_drafts"] > 0
    assert (out / "acceptance_by_position.png").read_bytes()[:4] == b"\x89PNG"
    assert "served" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.vllm
def test_held_out_prompts_at_two_temperatures(servers, smollm2_dir, tmp_path, capsys):
    """A draft judged on what it will serve: the validation split of the prepared data as prompts (held out from
    training), long answers, at temperature 0 and at a sampling temperature, on the same server, one table."""
    from eagle3_train.cli import main
    from eagle3_train.data.prepare import load_prepared, prepare

    _, spec = servers
    data = tmp_path / "chats.jsonl"
    topics = ["rivers", "owls", "copper", "jazz", "glaciers", "chess", "ferns", "comets"]
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Tell me about {t}."}, {"role": "assistant", "content": f"{t} are fine."}]}) + "\n"
        for i, t in enumerate(topics)))
    prepare(data, smollm2_dir, tmp_path / "prepared", val_count=3, seed=0)
    held = sorted(load_prepared(tmp_path / "prepared")[0]["validation"]["id"])
    out = tmp_path / "ev"
    assert main(["evaluate", "served", "--endpoint", spec.base_url, "--prompts", str(tmp_path / "prepared"),
                 "--max-tokens", "48", "--concurrency", "2", "--also-temperature", "1.0", "--out", str(out)]) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["benchmarks"] == ["held-out:prepared"] and saved["n_prompts"] == len(held) == 3
    ids = sorted(json.loads(x)["id"] for x in (out / "served_completions.jsonl").read_text().splitlines())
    assert ids == held
    at = saved["at_temperature"]
    assert sorted(at) == ["0.0", "1.0"] and all(at[t]["num_drafts"] > 0 for t in at)
    assert at["0.0"]["mean_acceptance_length"] == saved["acceptance"]["mean_acceptance_length"]
    assert len(at["1.0"]["per_position_acceptance"]) == spec.speculative["num_speculative_tokens"]
    table = capsys.readouterr().out
    assert "served T=0.0" in table and "served T=1.0" in table


def test_tokens_accepted_past_the_stop_are_taken_out_of_a_regions_figure():
    """vLLM counts a round's accepted tokens before the stop cuts the reply: every returned token is a prefill's
    (one per reply) or a round's (accepted + 1), so the counters' excess over the returned tokens was accepted past
    `</think>`. The numbers are those measured on the taught simulated Kimi (6 MT-bench replies, k 3): the answer
    pass and the whole replies (ended at EOS) have no excess; the reasoning pass counted 8 of its 29 past `</think>`."""
    from eagle3_train.evaluate.served_regions import _region, accepted_past_stop
    from eagle3_train.serving.metrics import SpecDecodeCounters

    def counters(drafts, per_pos):
        return SpecDecodeCounters(num_drafts=drafts, num_draft_tokens=3 * drafts, num_accepted_tokens=sum(per_pos),
                                  accepted_per_pos=dict(enumerate(per_pos)), present=True)

    assert accepted_past_stop(replies=6, tokens=132, drafts=71, counted=55) == 0  # whole replies
    answer = _region(counters(56, [17, 8, 3]), replies=6, tokens=90)
    assert answer["num_accepted_past_stop"] == 0 and answer["mean_acceptance_length"] == 1.5
    reasoning = _region(counters(15, [13, 10, 6]), replies=6, tokens=42)
    assert reasoning["num_accepted_counted_by_vllm"] == 29 and reasoning["num_accepted_past_stop"] == 8
    assert reasoning["num_accepted_tokens"] == 21 and reasoning["mean_acceptance_length"] == pytest.approx(1 + 21 / 15)
    # the cut tokens end their rounds: taken from the highest positions first, and the positions add up again
    assert reasoning["per_position_acceptance"] == pytest.approx([13 / 15, 8 / 15, 0.0])
    assert 1 + sum(reasoning["per_position_acceptance"]) == pytest.approx(reasoning["mean_acceptance_length"])
    # a reply with rounds that drafted nothing only lowers the estimate: it never goes below zero
    assert accepted_past_stop(replies=2, tokens=50, drafts=10, counted=20) == 0
