"""The draft methods after EAGLE-3 judged by real vLLM beside SmolLM2 (float32 on the CPU, so both sides compute
alike), each trained on the data and hidden states the EAGLE-3 tests train on and exported.

P-EAGLE (train.method peagle), served with parallel drafting (one draft forward per round):

- vLLM's greedy output is identical with and without the P-EAGLE draft;
- the offline evaluator reproduces vLLM draft for draft (its proposal is one forward laid out as vLLM's);
- the speculators-format export serves exactly as the EAGLE-format one;
- the same P-EAGLE weights served without `parallel_drafting` fall back to sequential drafting with only a warning
  in vLLM's log; our speculative configs never do.

A real language model, not a tiny random one: a random verifier's token two ahead is a function of the token between,
which a mask slot never sees, so its slots past the first learn nothing there (measured: no second slot accepted on 6
prompts).

DFlash (train.method dflash), served as vLLM's `dflash` method (the z-lab layout, one non-causal block per round):
greedy output identical, the offline evaluator = vLLM draft for draft, its layer ids written as vLLM reads them.

The side-by-side with EAGLE-3 at equal data is benchmarks/recipe_variants.py (benchmarks/README.md)."""

from __future__ import annotations

import json

import pytest
import torch
from support.vllm_helpers import require_vllm
from test_verifier_families import assert_draft_for_draft, complete
from transformers import AutoTokenizer

from eagle3_train.evaluate.chat_render import render_prompt
from eagle3_train.evaluate.offline import evaluate_offline
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.export.exporter import export
from eagle3_train.serving.vllm_options import speculative_config
from eagle3_train.serving.vllm_server import VLLMServer
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
FALLBACK_WARNING = "mask_hidden found in weights but model is not configured for parallel drafting"
PROMPTS, MAX_TOKENS, K = 8, 48, 3


def served(st: dict, draft, label: str, spec: dict | None = None) -> list[tuple[list[int], dict]]:
    spec = spec or (speculative_config(draft, K) if draft else None)
    with VLLMServer(st["verifier"], speculative=spec, startup_matters=True, dtype="float32",
                    log_path=st["root"] / f"vllm-{label}.log") as server:
        return [complete(server.base_url, server.model_name, ids, MAX_TOKENS) for ids in st["prompt_ids"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir, smollm2_stages) -> dict:
    require_vllm()
    root, stages = tmp_path_factory.mktemp("peagle"), smollm2_stages
    prompts = load_prompts("mt_bench", limit=PROMPTS, turns=1)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    st = {"root": root, "verifier": smollm2_dir, "prompts": prompts,
          "prompt_ids": [render_prompt(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]}
    out: dict = {"stages": st, "plain": [tokens for tokens, _ in served(st, None, "plain")]}
    for method in ("peagle", "dflash"):  # the same data, settings and seed; each served and judged offline
        result = train(TrainConfig(prepared=str(stages / "prepared"), hidden_states=str(stages / "hidden"),
                                   vocab=str(stages / "vocab"), out=str(root / f"train-{method}"), ttt_steps=K,
                                   epochs=2, token_budget=2048, lr=5e-4, warmup_ratio=0.05, tensorboard=False,
                                   optimizer="adamw", seed=0, method=method))
        export(root / f"train-{method}", root / f"{method}-eagle", fmt="eagle")
        out[method] = {"result": result, "served": served(st, root / f"{method}-eagle", method),
                       "offline": evaluate_offline(root / f"{method}-eagle", smollm2_dir, prompts, k=K,
                                                   max_new_tokens=MAX_TOKENS, dtype=torch.float32,
                                                   record_rounds=True)}
    export(root / "train-peagle", root / "peagle-speculators", fmt="speculators", verifier=str(smollm2_dir))
    out["speculators"] = served(st, root / "peagle-speculators", "peagle-speculators")
    sequential = {**speculative_config(root / "peagle-eagle", K)}
    del sequential["parallel_drafting"]
    out["sequential"] = served(st, root / "peagle-eagle", "peagle-sequential", sequential)
    return out


def test_the_export_carries_the_mask_and_the_serve_line_parallel_drafting(runs):
    root = runs["stages"]["root"]
    cfg = json.loads((root / "peagle-eagle" / "config.json").read_text())
    mask = cfg["mask_token_id"]
    assert isinstance(mask, int) and 0 <= mask < cfg["vocab_size"]
    spec = json.loads((root / "peagle-speculators" / "config.json").read_text())
    assert (spec["speculators_model_type"], spec["mask_token_id"]) == ("peagle", mask)
    assert speculative_config(root / "peagle-speculators", K)["parallel_drafting"] is True
    meta = json.loads((root / "peagle-eagle" / "training_metadata.json").read_text())
    assert meta["export"]["engines"]["vllm"]["serves_as_trained"]
    assert not meta["export"]["engines"]["sglang"]["serves_as_trained"]


@pytest.mark.parametrize("method", ["peagle", "dflash"])
def test_greedy_output_is_identical_with_the_draft(runs, method):
    assert [tokens for tokens, _ in runs[method]["served"]] == runs["plain"]
    assert runs[method]["offline"]["greedy_check"]["passed"] is True


@pytest.mark.parametrize("method", ["peagle", "dflash"])
def test_offline_equals_vllm_draft_for_draft(runs, method):
    assert_draft_for_draft(runs[method]["served"], runs[method]["offline"], method)
    accepted = [sum(acc["num_accepted_tokens_per_pos"][i] for _, acc in runs[method]["served"]) for i in range(K)]
    drafts = sum(acc["num_drafts"] for _, acc in runs[method]["served"])
    print(f"\n[{method}, SmolLM2, k={K}] vLLM accepted per position {accepted} of {drafts} drafts; estimate "
          f"{runs[method]['result']['validation'][f'accept_len_k{K}']:.3f}")
    assert accepted[0] > 0  # its drafts are accepted


def test_the_dflash_export_is_what_vllm_loads(runs):
    root = runs["stages"]["root"]
    cfg = json.loads((root / "dflash-eagle" / "config.json").read_text())
    meta = json.loads((root / "dflash-eagle" / "training_metadata.json").read_text())
    aux = meta["draft_config"]["aux_layer_ids"]
    assert (cfg["architectures"], cfg["model_type"], cfg["block_size"]) == (["DFlashDraftModel"], "qwen3", K + 1)
    assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in aux]  # vLLM adds 1
    assert cfg["dflash_config"]["causal"] is False and "eagle_config" not in cfg
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert speculative_config(root / "dflash-eagle", K)["method"] == "dflash"
    with pytest.raises(Eagle3InputError, match=f"serve it with num_speculative_tokens {K}"):
        speculative_config(root / "dflash-eagle", K + 2)
    with pytest.raises(Eagle3InputError, match="not exported in the speculators format"):
        export(root / "train-dflash", root / "dflash-speculators", fmt="speculators", verifier="smollm2")


def test_both_formats_serve_alike_and_only_a_config_without_parallel_drafting_falls_back(runs):
    root = runs["stages"]["root"]
    parallel = [(tokens, acc["num_accepted_tokens_per_pos"]) for tokens, acc in runs["peagle"]["served"]]
    assert [(tokens, acc["num_accepted_tokens_per_pos"]) for tokens, acc in runs["speculators"]] == parallel
    print(f"\n[peagle, SmolLM2, k={K}] accepted per position, parallel: "
          f"{[sum(a[i] for _, a in parallel) for i in range(K)]}; sequential fallback: "
          f"{[sum(acc['num_accepted_tokens_per_pos'][i] for _, acc in runs['sequential']) for i in range(K)]}")
    assert FALLBACK_WARNING in (root / "vllm-peagle-sequential.log").read_text()
    for label in ("peagle", "peagle-speculators"):
        assert FALLBACK_WARNING not in (root / f"vllm-{label}.log").read_text()
