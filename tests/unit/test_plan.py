"""`eagle3-train plan`: parameter counts from the real draft module, disk and memory figures, mode choice, CLI.

Expected parameter counts are derived here from the draft's layer shapes (fc, q/k/v/o, MLP, norms, lm_head), an
independent count of what `Eagle3Draft` declares; the activation model is checked against the tensors autograd really
saves for one micro-batch of the training code path.
"""

from __future__ import annotations

import dataclasses
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from eagle3_train.cli import main as cli_main
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.plan import PlanSettings, plan
from eagle3_train.plan.memory import loss_forward_bytes, ttt_saved_bytes
from eagle3_train.plan.report import format_plan
from eagle3_train.utils.io import Eagle3InputError

# Public Kimi-K2-Instruct config fields (DeepSeek-V3 architecture, MLA + MoE); no weights, and remote code is never run.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1,
    "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                                            "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "original_max_position_embeddings": 4096},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 163584, "eos_token_id": 163585,
}
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def write_config(tmp_path, name: str, config: dict):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def expected_trainable(H: int, heads: int, kv_heads: int, head_dim: int, inter: int, draft_vocab: int) -> int:
    fc = 3 * H * H
    attn = 2 * H * heads * head_dim + 2 * 2 * H * kv_heads * head_dim + heads * head_dim * H  # q, k, v read [emb|h]
    mlp = 3 * H * inter
    norms = 4 * H  # hidden_norm, input_layernorm, post_attention_layernorm, final norm
    return fc + attn + mlp + norms + draft_vocab * H


def test_smollm2_counts_match_the_real_draft(smollm2_dir):
    p = plan(PlanSettings(verifier=str(smollm2_dir), samples=200, tokens_per_sample=512, draft_vocab=8192,
                          ttt_steps=3, precision="fp32", device="cpu"))
    vcfg = json.loads((smollm2_dir / "config.json").read_text())
    real = Eagle3Draft(DraftConfig.from_verifier(vcfg, draft_vocab_size=8192))  # materialised, not meta
    assert p.parameters["trainable"] == sum(x.numel() for x in real.parameters() if x.requires_grad)
    assert p.parameters["frozen"] == vcfg["vocab_size"] * vcfg["hidden_size"]
    H = vcfg["hidden_size"]
    assert p.hidden_states["bytes_per_token"] == 4 * H * 2
    assert p.hidden_states["total_bytes"] == 200 * 512 * 4 * H * 2
    assert p.batch["batch_size"] == 2048 // 512 and p.batch["tokens"] == 2048
    assert p.memory["peak"] > p.memory["ttt_activations"] > 0
    # stored in fp32 and tied: the memory-mapped embedding is used as is (page cache), no private copy
    assert p.host_memory["verifier_tensors_fp32_copy"] == 0
    assert p.host_memory["verifier_page_cache"] == vcfg["vocab_size"] * H * 4
    assert p.host_memory["process_total"] > p.memory["peak"]


def test_llama_31_8b_shaped(tmp_path):
    d = write_config(tmp_path, "llama8b", LLAMA_31_8B)
    p = plan(PlanSettings(verifier=str(d), samples=10000, tokens_per_sample=2048, draft_vocab=32000))
    assert p.draft["head_dim"] == 128 and p.draft["aux_layer_ids"] == [2, 16, 29]
    assert p.parameters["trainable"] == expected_trainable(4096, 32, 8, 128, 14336, 32000)
    assert p.parameters["frozen"] == 128256 * 4096
    assert p.hidden_states["bytes_per_token"] == 4 * 4096 * 2
    # fp8 with one fp32 scale per stored row: a little over half of bf16
    fp8 = p.hidden_states["by_dtype"]["float8_e4m3"]["bytes_per_token"]
    assert fp8 == 4 * 4096 + 4 * 4
    # the same model nested in text_config (multimodal wrappers) plans the same
    nested = write_config(tmp_path, "nested", {"architectures": ["Wrapper"], "text_config": LLAMA_31_8B})
    q = plan(PlanSettings(verifier=str(nested / "config.json"), samples=10000, tokens_per_sample=2048))
    assert q.parameters == p.parameters and q.memory["peak"] == p.memory["peak"]


def test_kimi_k2_shaped_matches_the_published_draft(tmp_path):
    d = write_config(tmp_path, "kimi", KIMI_K2)
    # AQ-MedAI/Kimi-K2-Instruct-eagle3: 64 heads, 64 KV heads, head_dim 128 (from_verifier alone would take 7168/64)
    s = PlanSettings(verifier=str(d), samples=25000, tokens_per_sample=4000, draft_vocab=32000, head_dim=128,
                     gpus=8, gpu_memory_gb=141, disk_tb=4)
    p = plan(s)
    trainable = p.parameters["trainable"]
    assert trainable == expected_trainable(7168, 64, 64, 128, 18432, 32000)
    assert trainable == pytest.approx(1.19e9, rel=0.01)  # the published file: 1.19B parameters, 2.4 GB bf16
    assert p.parameters["trainable_bytes_bf16"] == pytest.approx(2.4e9, rel=0.02)
    assert p.parameters["frozen"] == 163840 * 7168  # 1.17B frozen embedding
    assert p.hidden_states["bytes_per_token"] == 57344  # 57 KB per token in bf16
    assert p.hidden_states["total_bytes"] == pytest.approx(5.7e12, rel=0.01)
    assert p.verifier["moe"]["n_routed_experts"] == 384
    # bf16 checkpoint, untied: each rank converts embedding and lm_head to fp32 in host RAM
    assert p.host_memory["verifier_tensors_fp32_copy"] == 2 * 163840 * 7168 * 4
    # the memory terms that scale with the vocabularies stay at the draft vocab: no [tokens, 163840] term
    N = p.batch["tokens"]
    assert p.memory["targets"] < N * 32000 * 4 * 1.01
    # 4 TB of disk cannot hold 5.7 TB; a 141 GB GPU holds the training step, but where the verifier's servers run
    # is unknown (config only), so online is not said to fit
    assert p.memory["peak"] < 141e9
    assert not any(x["fits"] for x in p.modes.values()) and p.modes["online"]["fits"] is None
    assert "--server-memory-gb" in p.recommendation and "fp8 storage (2.87 TB)" in p.recommendation
    # servers on other GPUs: only online fits
    apart = plan(dataclasses.replace(s, server_memory_gb=0))
    assert [m for m, x in apart.modes.items() if x["fits"]] == ["online"]
    assert apart.recommendation.startswith("online:")
    # default draft shape (what the trainer derives without overrides): head_dim = hidden / heads
    q = plan(PlanSettings(verifier=str(d), samples=25000, tokens_per_sample=4000))
    assert q.draft["head_dim"] == 112 and q.parameters["trainable"] < trainable


def test_fits_and_recommendation(tmp_path):
    d = write_config(tmp_path, "llama8b", LLAMA_31_8B)
    base = dict(verifier=str(d), samples=1000, tokens_per_sample=2048)
    roomy = plan(PlanSettings(**base, gpu_memory_gb=80, disk_tb=10, server_memory_gb=0))
    assert all(m["fits"] for m in roomy.modes.values()) and roomy.recommendation.startswith("offline (or hybrid")
    # the server beside the trainer leaves no room for hybrid: the recommendation does not offer it
    crowded = plan(PlanSettings(**base, gpu_memory_gb=80, disk_tb=10, server_memory_gb=70))
    assert crowded.modes["offline"]["fits"] and crowded.modes["hybrid"]["fits"] is False
    assert crowded.recommendation.startswith("offline:") and "hybrid" not in crowded.recommendation
    assert "online avoids" not in crowded.recommendation
    # where the server runs is not given: hybrid/online unknown, never silently fitting
    unsaid = plan(PlanSettings(**base, gpu_memory_gb=80, disk_tb=10))
    assert unsaid.modes["hybrid"]["fits"] is None and "--server-memory-gb" in unsaid.recommendation
    assert any("--server-memory-gb" in n for n in unsaid.notes)
    tiny_gpu = plan(PlanSettings(**base, gpu_memory_gb=1, disk_tb=10))
    assert not any(m["fits"] for m in tiny_gpu.modes.values()) and "nothing fits" in tiny_gpu.recommendation
    unknown = plan(PlanSettings(**base))
    assert all(m["fits"] is None for m in unknown.modes.values())
    # more GPUs: the same per-rank memory (replicas), plus the gradient all-reduce on the network
    ddp = plan(PlanSettings(**base, gpus=8))
    assert ddp.memory["ttt_activations"] == unknown.memory["ttt_activations"]
    assert ddp.modes["offline"]["allreduce_bytes_per_step"] > 0 == unknown.modes["offline"]["allreduce_bytes_per_step"]


MLA = dict(architecture="mla", q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
           v_head_dim=16)


@pytest.mark.parametrize("steps,checkpoint_mlp,checkpoint_loss,layer", [(3, True, True, {}), (5, False, False, {}),
                                                                        (3, True, True, MLA)])
@pytest.mark.parametrize("merged", [True, False])
def test_activation_model_matches_saved_tensors(steps, checkpoint_mlp, checkpoint_loss, layer, merged, monkeypatch):
    """The planner's per-term activation bytes vs what autograd keeps for one fp32 micro-batch of `ttt_forward`,
    under either later-step attention kernel."""
    from eagle3_train.model.attention import TTTAttention
    from eagle3_train.train.data import Batch
    from eagle3_train.train.objective import Objective
    from eagle3_train.train.targets import verifier_targets
    from eagle3_train.train.ttt import supervised_counts, ttt_forward

    monkeypatch.setattr(TTTAttention, "ttt_merged", merged)
    torch.manual_seed(0)
    H, V, Vd, B, L = 96, 4096, 512, 4, 128
    cfg = DraftConfig(hidden_size=H, num_attention_heads=6, num_key_value_heads=6 if layer else 2, head_dim=16,
                      intermediate_size=256, vocab_size=V, draft_vocab_size=Vd, **layer)
    model = Eagle3Draft(cfg)
    model.set_vocab(torch.zeros(Vd, dtype=torch.long), torch.arange(V) < Vd)
    ids, mask = torch.randint(0, Vd, (B, L)), torch.ones(B, L, dtype=torch.bool)
    batch = Batch(ids, mask, torch.randn(B, L, 3 * H), torch.randn(B, L, H), torch.full((B,), L))
    targets = verifier_targets(batch.final, mask, torch.randn(V, H) * 0.05, model.draft_token_ids(), model.t2d)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_forward(model, batch, targets, Objective(steps, (1.0,) * steps, checkpoint_loss=checkpoint_loss,
                                                     checkpoint_mlp=checkpoint_mlp), supervised_counts(mask, steps))
    inputs = {batch.aux.untyped_storage().data_ptr(), targets.probs.untyped_storage().data_ptr()}
    measured = sum(n for ptr, n in storages.items() if ptr not in inputs and n > 4096)  # activations, not indices
    modelled = ttt_saved_bytes(cfg, B * L, L, B * (L - 2), steps, False, checkpoint_mlp, checkpoint_loss, Vd,
                               merged=merged)
    assert modelled["total"] == pytest.approx(measured, rel=0.08)


def test_errors_name_the_input(tmp_path):
    with pytest.raises(Eagle3InputError, match="config not found"):
        plan(PlanSettings(verifier=str(tmp_path / "nope"), samples=1, tokens_per_sample=1))
    d = write_config(tmp_path, "bad", {"hidden_size": 64})
    with pytest.raises(Eagle3InputError, match="lacks num_hidden_layers"):
        plan(PlanSettings(verifier=str(d), samples=1, tokens_per_sample=1))
    d = write_config(tmp_path, "ok", LLAMA_31_8B)
    with pytest.raises(Eagle3InputError, match="--store-dtype"):
        plan(PlanSettings(verifier=str(d), samples=1, tokens_per_sample=1, dtype="int4"))
    with pytest.raises(Eagle3InputError, match="samples must be >= 1, got 0"):
        PlanSettings(verifier=str(d), samples=0, tokens_per_sample=1)


def test_cli(tmp_path, capsys):
    d = write_config(tmp_path, "kimi", KIMI_K2)
    rc = cli_main(["plan", "--verifier", str(d), "--samples", "25000", "--tokens-per-sample", "4000",
                   "--draft-head-dim", "128", "--gpus", "8", "--gpu-memory", "141", "--disk", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["trainable"] == expected_trainable(7168, 64, 64, 128, 18432, 32000)
    assert set(out["modes"]) == {"offline", "hybrid", "online"}
    rc = cli_main(["plan", "--verifier", str(d), "--samples", "10", "--tokens-per-sample", "100"])
    text = capsys.readouterr().out
    assert rc == 0 and "offline" in text and "trainable" in text and "peak" in text
    assert cli_main(["plan", "--verifier", str(tmp_path / "missing"), "--samples", "1",
                     "--tokens-per-sample", "1"]) == 2
    # the flags are the settings' own, in the training stage's names (the old spellings above are aliases)
    rc = cli_main(["plan", "--verifier", str(d), "--samples", "10", "--tokens-per-sample", "100", "--ttt-steps", "5",
                   "--store-dtype", "float8_e4m3", "--nodes", "2", "--gpus-per-node", "4", "--no-checkpoint-loss",
                   "--json"])
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert rc == 0 and settings["ttt_steps"] == 5 and settings["dtype"] == "float8_e4m3" and settings["gpus"] == 8
    assert settings["checkpoint_loss"] is False
    with pytest.raises(SystemExit):
        cli_main(["plan", "--verifier", str(d), "--samples", "1", "--tokens-per-sample", "1", "--store-dtype", "fp8"])


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created inside the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if ptr not in self.seen:
                    self.seen.add(ptr)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, ptr, n)
        return out

    def _free(self, ptr: int, n: int) -> None:
        self.live -= n
        self.seen.discard(ptr)


def test_loss_forward_model_matches_the_measured_peak():
    """The planner's loss-forward transient against the bytes `_head_loss` really holds at once."""
    from eagle3_train.train.ttt import _head_loss

    torch.manual_seed(0)
    H, V, Vd, R = 64, 4096, 2048, 512
    model = Eagle3Draft(DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    intermediate_size=128, vocab_size=V, draft_vocab_size=Vd))
    hidden = torch.randn(R, H, requires_grad=True)
    probs = torch.softmax(torch.randn(R, Vd), -1)
    with _LiveBytes() as live:
        _head_loss(model, hidden, probs, torch.arange(R), torch.ones(R), torch.ones(R))
    assert live.peak == pytest.approx(loss_forward_bytes(R, Vd), rel=0.1)


def test_plan_takes_the_finetune_sources_architecture(smollm2_dir, head, vocab_a, tmp_path):
    """`plan --finetune-from SOURCE` plans the draft the finetune builds: the source's layers, widths, vocabulary
    and aux layers (as the finetune reads them), not the verifier's defaults."""
    from support.draft_layouts import SMOL, write_specforge

    source_cfg = DraftConfig.from_verifier(SMOL, vocab_a[0].shape[0], aux_layer_ids=(3, 12, 25), num_layers=2,
                                           intermediate_size=1024)
    source = Eagle3Draft(source_cfg)
    source.set_vocab(*vocab_a)
    d = write_specforge(source, tmp_path / "sf", head[0])
    base = dict(verifier=str(smollm2_dir), samples=100, tokens_per_sample=512, precision="fp32", device="cpu")
    p = plan(PlanSettings(**base, finetune_from=str(d)))
    assert p.draft["num_layers"] == 2 and p.draft["intermediate_size"] == 1024
    assert p.draft["aux_layer_ids"] == [3, 12, 25] and p.draft["draft_vocab_size"] == vocab_a[0].shape[0]
    assert p.parameters["trainable"] == sum(x.numel() for x in source.parameters() if x.requires_grad)
    assert plan(PlanSettings(**base)).draft["num_layers"] == 1


def test_the_servers_memory_and_time_figures(tmp_path):
    """Hybrid and online training run the verifier's server beside the trainer: its memory counts where they share
    GPUs; given throughputs turn into hours per phase and per mode."""
    d = write_config(tmp_path, "kimi", KIMI_K2)
    base = dict(verifier=str(d), samples=25000, tokens_per_sample=4000, draft_vocab=32000, head_dim=128, gpus=8,
                gpu_memory_gb=141, disk_tb=4)
    apart = plan(PlanSettings(**base, server_memory_gb=0))
    beside = plan(PlanSettings(**base, server_memory_gb=120))
    assert apart.modes["online"]["fits"] is True and beside.modes["online"]["fits"] is False
    assert beside.recommendation.startswith("nothing fits") and "beside the trainer" in beside.recommendation
    assert all("seconds" in m and m["seconds"]["run_after_regeneration"] is None for m in apart.modes.values())
    timed = plan(PlanSettings(**base, extract_tokens_per_s=20000, train_tokens_per_s=40000, epochs=2,
                              generate_tokens_per_s=10000, generated_tokens_per_sample=2000))
    tokens = 25000 * 4000
    sec = {name: m["seconds"] for name, m in timed.modes.items()}
    assert sec["offline"]["extract"] == tokens / 20000 and sec["offline"]["train_epoch"] == tokens / 40000
    assert sec["offline"]["run_after_regeneration"] == tokens / 20000 + 2 * tokens / 40000
    assert sec["hybrid"]["run_after_regeneration"] == tokens / 20000 + tokens / 40000  # epoch 1 at the server's rate
    assert sec["online"]["run_after_regeneration"] == 2 * tokens / 20000
    assert sec["online"]["regenerate"] == 25000 * 2000 / 10000
    assert "time: offline" in format_plan(timed)


def test_plan_at_the_kimi_users_settings(tmp_path):
    """The Kimi user's settings (issue 33): 16K-token samples, fp8 storage, servers beside the trainer, an MLA draft
    rebuilt to another vocabulary. Each figure as the trainer holds it, and advice that helps at these settings."""
    from support.kimi_layouts import write_kimi_mla_draft

    d = write_config(tmp_path, "kimi", KIMI_K2)
    index = {"metadata": {"total_size": 595_000_000_000}, "weight_map": {}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    source = write_kimi_mla_draft(tmp_path / "mla")
    base = dict(verifier=str(d), samples=25000, tokens_per_sample=16384, gpus=8, gpu_memory_gb=141, disk_tb=4,
                dtype="float8_e4m3", finetune_from=str(source), ttt_steps=7)
    p = plan(PlanSettings(**base, draft_vocab=64000))
    # --draft-vocab with --finetune-from is a rebuild at that size, said in the notes
    assert p.draft["draft_vocab_size"] == 64000 and p.draft["architecture"] == "mla"
    assert any("rebuilt" in n and "32000" in n for n in p.notes)
    assert plan(PlanSettings(**base)).draft["draft_vocab_size"] == 32000  # keep: the source's
    # bf16 training holds the frozen embedding and lm_head in bf16 (trainer._setup_model)
    assert p.memory["frozen_embedding"] == 163840 * 7168 * 2 and p.memory["verifier_lm_head"] == 163840 * 7168 * 2
    fp32 = plan(PlanSettings(**base, precision="fp32"))
    assert fp32.memory["frozen_embedding"] == 163840 * 7168 * 4
    from eagle3_train.plan.memory import FROZEN_BYTES
    from eagle3_train.train.precision import verifier_tensor_dtype

    assert all(torch.empty((), dtype=verifier_tensor_dtype(p)).element_size() == n for p, n in FROZEN_BYTES.items())
    # the printed draft is MLA, not Llama heads x head_dim
    text = format_plan(p)
    assert "MLA 64 heads (q_lora 1536, kv_lora 512, qk 128+64, v 128)" in text and "x 112" not in text
    # no --server-memory: the 595 GB of weights over 8 GPUs (74 GB each) beside the trainer's peak cannot fit
    assert p.modes["online"]["server_memory_per_gpu"]["at_least_bytes"] == 595_000_000_000 // 8
    assert p.modes["online"]["fits"] is False and "at least 74.38 GB per GPU" in p.recommendation
    # a step that does not fit: at 16K tokens per sample only shorter samples help, not --token-budget
    tight = plan(PlanSettings(**{**base, "gpu_memory_gb": 20}))
    assert tight.modes["offline"]["fits"] is False
    assert "prepare --max-length" in tight.recommendation and "--token-budget does not help" in tight.recommendation


def test_plan_refuses_a_negative_server_share(tmp_path):
    d = write_config(tmp_path, "llama8b", LLAMA_31_8B)
    with pytest.raises(Eagle3InputError, match="server_memory_gb must be >= 0"):
        plan(PlanSettings(verifier=str(d), samples=1, tokens_per_sample=8, server_memory_gb=-1))


LLAMA_405B = {**LLAMA_31_8B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
              "num_attention_heads": 128, "num_key_value_heads": 8}


def test_a_405b_class_draft_fits_16_gpus_of_80_gb_only_sharded(tmp_path):
    d = write_config(tmp_path, "llama405b", LLAMA_405B)
    base = dict(verifier=str(d), samples=100000, tokens_per_sample=2048, draft_vocab=32000, gpus=16, nodes=2,
                gpu_memory_gb=80, disk_tb=100)
    ddp = plan(PlanSettings(**base, parallel="ddp"))
    auto = plan(PlanSettings(**base))
    P = auto.parameters["trainable"]
    assert P > 4.5e9  # a 4.8B-parameter draft
    assert ddp.memory["engine"] == "ddp" and ddp.memory["peak"] > 80e9 and not ddp.modes["offline"]["fits"]
    assert "train.parallel fsdp fits" in ddp.recommendation
    # auto shards (16 bytes of fp32 state per parameter would fill most of each GPU) and it fits
    assert auto.memory["engine"] == "fsdp" and auto.modes["offline"]["fits"] and auto.memory["peak"] < 80e9
    # the fp32 weights, gradients and optimizer states are divided over the 16 ranks; the units gathered in bf16.
    # Muon (the default) keeps one fp32 buffer per matrix element, AdamW two per element
    M = auto.parameters["muon"]
    assert 0.85 * P < M < P and auto.memory["optimizer_states"] == int((8 * P - 4 * M) / 16)
    assert auto.memory["autocast_weight_copies"] == 0
    adamw = plan(PlanSettings(**base, optimizer="adamw"))
    assert adamw.memory["optimizer_states"] == int(8 * P / 16) and adamw.memory["peak"] > auto.memory["peak"]
    assert auto.memory["gathered_units"] > 0 and auto.memory["by_engine"]["ddp"]["fits"] is False
    # fewer bytes per step than the replicated all-reduce: bf16 gathers + an fp32 reduce-scatter vs 2 x fp32
    comm = auto.memory["by_engine"]
    assert comm["fsdp"]["communication"]["total"] < comm["ddp"]["communication"]["total"]
    assert comm["fsdp"]["communication"]["across_nodes"] > 0
    # one node, one GPU: nothing to shard, the replicated figures
    one = plan(PlanSettings(**{**base, "gpus": 1, "nodes": 1}))
    assert one.memory["engine"] == "ddp" and one.memory["optimizer_states"] == 8 * P - 4 * M
    assert "train.parallel fsdp" in format_plan(auto) and "across nodes" in format_plan(auto)
    with pytest.raises(Eagle3InputError, match="--nodes"):
        plan(PlanSettings(**{**base, "gpus": 15}))
    # offloaded: the fp32 weights, gradients and optimizer states of each rank's shard in host memory; the trainer
    # refuses Muon there (its step gathers whole matrices on the GPUs), and so does the plan, by the same words
    off = plan(PlanSettings(**base, optimizer="adamw", parallel="fsdp", offload_optimizer=True))
    assert off.host_memory["offloaded_training_state"] == 16 * P // 16
    with pytest.raises(Eagle3InputError, match="set train.optimizer adamw with offload_optimizer"):
        plan(PlanSettings(**base, parallel="fsdp", offload_optimizer=True))


def test_a_sample_too_long_for_one_gpu_is_said_with_the_longest_that_fits(tmp_path):
    """A 32K-token sample at Kimi's width (MLA draft) does not fit an 80 GB GPU even sharded: the plan says what one
    sample holds, that fsdp does not split it, and the longest length that fits, which does fit when planned."""
    import re

    d = write_config(tmp_path, "kimi", KIMI_K2)
    base = dict(verifier=str(d), samples=25000, draft_vocab=32000, architecture="mla", gpus=8, gpu_memory_gb=80,
                parallel="fsdp", ttt_steps=7)
    p = plan(PlanSettings(**base, tokens_per_sample=32768, token_budget=32768))
    assert p.recommendation.startswith("nothing fits") and "shorten the samples" in p.recommendation
    note = next(n for n in p.notes if "Context parallelism" in n)
    longest = int(re.search(r"longest that fits is ~(\d+) tokens", note).group(1))
    assert 4096 < longest < 32768
    assert plan(PlanSettings(**base, tokens_per_sample=longest, token_budget=longest)).memory["by_engine"]["fsdp"][
        "fits"]
    assert not plan(PlanSettings(**base, tokens_per_sample=longest + 256, token_budget=longest + 256)).memory[
        "by_engine"]["fsdp"]["fits"]
    # a short sample that fits has no such note
    assert not any("Context parallelism" in n for n in plan(PlanSettings(**base, tokens_per_sample=4096)).notes)
