"""Kimi-K2.5's multimodal wrapper at full size, header-only (support/kimi_layouts.write_kimi_k25_verifier): everything
our side reads of a verifier handles `KimiK25ForConditionalGeneration` with the DeepSeek-V3 language model in
`text_config`, `language_model.`-prefixed names, INT4 expert tensors and a vision tower — the family table, the
verifier head lookups, the final norm read from its one shard (what a hub client fetches), the draft's shape and aux
layers, identity, plan and the finetune dry run. vLLM's Kimi-K2.5 class needs CUDA: its serving is in
scripts/gpu_check.sh."""

from __future__ import annotations

import json

import pytest
import torch
from support.kimi_layouts import (
    HEAD_DIM,
    LAYERS,
    SGLANG_IDS,
    VD,
    H,
    L,
    V,
    kimi_train_config,
    write_aq_medai_draft,
    write_kimi_k25_verifier,
    write_run_inputs,
)

from eagle3_train.assets.families import family_of, text_config
from eagle3_train.assets.verifier import verifier_identity
from eagle3_train.hidden_states.vllm_backend import final_norm_file
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.verifier_head import load_final_norm, verifier_head_shapes
from eagle3_train.plan import PlanSettings, plan
from eagle3_train.serving.vllm_options import server_options
from eagle3_train.train.dry_run import METADATA_FILE, dry_run

NORM = torch.linspace(0.5, 1.5, H)


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    return write_kimi_k25_verifier(tmp_path_factory.mktemp("k25") / "Kimi-K2.5", final_norm=NORM)


def test_family_text_config_and_server_dtype(k25):
    config = json.loads((k25 / "config.json").read_text())
    assert family_of(config).name == "kimi_k25" and family_of(config).attention == "mla"
    assert text_config(config)["num_hidden_layers"] == L
    assert server_options("cpu", model_config=config)["dtype"] == "bfloat16"  # vLLM's CPU MLA kernels
    assert server_options("cuda", model_config=config)["dtype"] == "bfloat16"


def test_verifier_head_and_final_norm_from_prefixed_sharded_weights(k25):
    embed, head, _, origin = verifier_head_shapes(k25)
    assert tuple(embed.shape) == tuple(head.shape) == (V, H) and "headers" in origin
    weight, eps = load_final_norm(k25)
    assert torch.equal(weight, NORM.to(torch.bfloat16)) and eps == 1e-6
    # the vLLM backend's client fetches this one shard of a hub snapshot, never the 1 TB of experts
    assert final_norm_file(k25) == "model-00003-of-00003.safetensors"
    identity = verifier_identity(k25, hash_weights=False)
    assert identity["architectures"] == ["KimiK25ForConditionalGeneration"]


def test_draft_shape_and_plan_read_the_language_model(k25):
    config = json.loads((k25 / "config.json").read_text())
    draft = DraftConfig.from_verifier(config, VD, aux_layer_ids=LAYERS, head_dim=HEAD_DIM)
    assert (draft.hidden_size, draft.vocab_size, draft.verifier_num_layers) == (H, V, L)
    assert draft.verifier["architectures"] == ["KimiK25ForConditionalGeneration"]
    p = plan(PlanSettings(verifier=str(k25), samples=25000, tokens_per_sample=4000, draft_vocab=VD, head_dim=128,
                          gpus=8, gpu_memory_gb=141, disk_tb=4))
    assert p.hidden_states["bytes_per_token"] == 57344 and p.parameters["frozen"] == V * H
    assert p.verifier["moe"]["n_routed_experts"] == 384


def test_finetune_dry_run_with_the_wrapper_as_verifier(k25, tmp_path):
    paths = write_run_inputs(tmp_path / "inputs", k25, layer_ids=LAYERS)
    source = write_aq_medai_draft(tmp_path / "Kimi-K2-Instruct-eagle3")
    out = tmp_path / "train"
    report = dry_run(kimi_train_config(paths, out, finetune_from=str(source), finetune_vocab="keep",
                                       verifier=str(k25)))
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["init"]["aux_layers"]["source_config_keys"]["eagle_config.eagle_aux_hidden_state_layer_ids"] == \
        SGLANG_IDS and meta["init"]["aux_layers"]["match"] is True
    assert meta["draft_config"]["verifier"]["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert report["memory"]["frozen_parameters"] == V * H
