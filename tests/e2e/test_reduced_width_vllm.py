"""A draft narrower than its verifier, trained sharded (torchrun, 2 processes, FSDP2) and served by real vLLM: trained
at half the tiny Qwen3 verifier's width (its own embedding, fc reading the verifier's width), exported with
`target_hidden_size` and its embedding; vLLM keeps the draft's embedding (the widths differ), greedy output is
identical with and without it, and the offline evaluator reproduces vLLM draft for draft."""

from __future__ import annotations

import json

import pytest
import torch
from support.torchrun_helpers import torchrun as run_torchrun
from support.vllm_helpers import require_vllm
from test_verifier_families import MAX_TOKENS, K, assert_draft_for_draft, complete, family_stages

from eagle3_train.evaluate.offline import evaluate_offline
from eagle3_train.export.exporter import export
from eagle3_train.serving.vllm_options import speculative_config
from eagle3_train.serving.vllm_server import VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_dir) -> dict:
    require_vllm()
    # the tiny Qwen3's stages, shared with test_verifier_families.py (built once per test process)
    st = family_stages("qwen3", tmp_path_factory, smollm2_dir)
    root, verifier, prompts, prompt_ids, plain = (st[k] for k in ("root", "verifier", "prompts", "prompt_ids",
                                                                  "plain"))
    # trained sharded: torchrun, 2 processes, FSDP2 (the draft's own embedding is one of its trainable units)
    proc = run_torchrun(
        ["-m", "eagle3_train.cli", "train", "--prepared", str(root / "prepared"), "--hidden-states", str(root / "hf"),
         "--vocab", str(root / "vocab"), "--out", str(root / "train-narrow"), "--ttt-steps", str(K), "--epochs", "4",
         "--token-budget", "1024", "--lr", "2e-3", "--set", "train.warmup_ratio=0.05", "--set",
         "train.tensorboard=false", "--set", "train.hidden_size=32", "--set", "train.parallel=fsdp"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    export(root / "train-narrow", root / "draft-narrow", fmt="eagle")
    with VLLMServer(verifier, speculative=speculative_config(root / "draft-narrow", K), startup_matters=True,
                    log_path=root / "vllm-narrow.log") as spec:
        served = [complete(spec.base_url, spec.model_name, ids) for ids in prompt_ids]
    offline = evaluate_offline(root / "draft-narrow", verifier, prompts, k=K, max_new_tokens=MAX_TOKENS,
                               dtype=torch.float32, record_rounds=True)
    return {"root": root, "plain": plain, "served": served, "offline": offline}


def test_vllm_serves_the_narrow_draft_with_its_own_embedding(run):
    config = json.loads((run["root"] / "draft-narrow" / "config.json").read_text())
    meta = json.loads((run["root"] / "train-narrow" / "training_metadata.json").read_text())
    assert (meta["run"]["world_size"], meta["run"]["parallel"]) == (2, "fsdp")
    assert (config["hidden_size"], config["target_hidden_size"]) == (32, 64)
    log = (run["root"] / "vllm-narrow.log").read_text()
    assert "Keeping separate embedding weights" in log  # vLLM kept the draft's own embedding
    assert [t for t, _ in run["served"]] == run["plain"]  # greedy output unchanged by speculation
    assert sum(a["num_accepted_tokens"] for _, a in run["served"]) > 0  # a trained draft, not a random one
    assert_draft_for_draft(run["served"], run["offline"], "narrow draft")
