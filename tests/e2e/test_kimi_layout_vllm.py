"""The Kimi finetune end to end at SmolLM2's width: a random checkpoint in AQ-MedAI's layout (bf16
`midlayer.*`, aux ids only in `eagle_config`, training_state.pt beside it) -> finetune with a rebuilt vocabulary on our
data -> export -> vLLM loads it and drafts with it. Acceptance is not the point here (the source is random)."""

from __future__ import annotations

import json

import pytest
from support.draft_layouts import SMOL
from support.kimi_layouts import write_aq_medai_layout
from support.vllm_helpers import require_vllm

from eagle3_train.data.prepare import prepare
from eagle3_train.evaluate.pipeline_eval import served_acceptance
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.export.exporter import export
from eagle3_train.hidden_states.extract import extract
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.trainer import train
from eagle3_train.vocab.build import build_vocab

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_aq_medai_layout_finetunes_with_a_rebuilt_vocab_and_drafts_in_vllm(smollm2_dir, tmp_path):
    require_vllm()
    # SGLang ids [1, 14, 26] = inputs of [2, 15, 27], the default layers extract taps on SmolLM2's 30 layers.
    source = write_aq_medai_layout(tmp_path / "aq-medai-layout", {**SMOL}, sglang_ids=[1, 14, 26])
    prepare("sharegpt", smollm2_dir, tmp_path / "prepared", max_length=256, limit=40, val_count=4, seed=0)
    build_vocab(tmp_path / "prepared", tmp_path / "vocab", size=2048)
    extract(tmp_path / "prepared", smollm2_dir, tmp_path / "hidden", dtype="bfloat16")
    result = train(TrainConfig(prepared=str(tmp_path / "prepared"), hidden_states=str(tmp_path / "hidden"),
                               vocab=str(tmp_path / "vocab"), out=str(tmp_path / "train"), ttt_steps=3, max_steps=4,
                               token_budget=2048, lr=1e-3, tensorboard=False, finetune_from=str(source),
                               finetune_vocab="rebuild"))
    meta = json.loads((tmp_path / "train" / "final" / "training_metadata.json").read_text())
    assert meta["init"]["aux_layers"]["source"] == [2, 15, 27] and meta["init"]["aux_layers"]["match"]
    assert meta["init"]["vocab_policy"] == "rebuild" and meta["draft_config"]["draft_vocab_size"] == 2048
    out = export(tmp_path / "train", tmp_path / "export", fmt="eagle")
    assert out["max_logit_error_after_reload"] < 1e-2
    r = served_acceptance(smollm2_dir, tmp_path / "export", load_prompts("mtbench", limit=4, turns=1), k=3,
                          fmt="eagle", max_tokens=32, concurrency=4, log_dir=tmp_path)
    assert r["acceptance"] is not None and r["acceptance"]["num_drafts"] > 0, "vLLM did not draft with it"
    print(json.dumps({"validation": result["validation"], "vllm": r["acceptance"]}))
