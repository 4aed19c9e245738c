"""vLLM servers configured for where they run, vLLM flags passed through, and a verifier read cheaply.

Fast: builds command lines, settings and identities only (no server, no network, no model).
"""

from __future__ import annotations

import json

import pytest

from eagle3_train.assets.verifier import hub_allow_patterns, same_verifier, verifier_identity
from eagle3_train.cli import build_parser
from eagle3_train.pipeline.config import merged_config
from eagle3_train.serving import vllm_server
from eagle3_train.serving.vllm_checks import check_draft_serves_beside, check_memory_share
from eagle3_train.serving.vllm_options import server_options, speculative_config, split_vllm_args
from eagle3_train.serving.vllm_server import VLLMServer, hidden_states_server
from eagle3_train.settings import ServeSettings
from eagle3_train.settings.common import MAX_MODEL_LEN
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import settings_from_args


def option(cmd: list[str], name: str) -> str | None:
    """The value following `name` in a command line (None when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_auto_settings_follow_the_device():
    cpu = server_options("cpu")
    assert cpu == {"dtype": "float32", "enforce_eager": False, "max_model_len": MAX_MODEL_LEN}
    assert server_options("cpu", startup_matters=True)["enforce_eager"] is True
    cuda = server_options("cuda", startup_matters=True)
    assert cuda == {"dtype": "bfloat16", "enforce_eager": False, "max_model_len": None}
    explicit = server_options("cuda", dtype="float16", enforce_eager=True, max_model_len=4096)
    assert explicit == {"dtype": "float16", "enforce_eager": True, "max_model_len": 4096}


def test_command_line_on_cpu_and_on_cuda(tmp_path):
    cpu = VLLMServer(tmp_path, port=8001, device="cpu", startup_matters=True).command()
    assert option(cpu, "--dtype") == "float32" and option(cpu, "--max-model-len") == str(MAX_MODEL_LEN)
    assert "--enforce-eager" in cpu
    cuda = VLLMServer(tmp_path, port=8001, device="cuda", startup_matters=True).command()
    assert option(cuda, "--dtype") == "bfloat16"
    assert "--max-model-len" not in cuda and "--enforce-eager" not in cuda  # the model's context, compiled


def test_vllm_args_reach_the_command_line_and_replace_ours(tmp_path):
    args = ["--tensor-parallel-size 8", "--max_model_len=32768", "--no-enforce-eager",
            "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 5}']
    cmd = VLLMServer(tmp_path, port=8001, device="cpu", enforce_eager=True, vllm_args=args).command()
    tail = ["--tensor-parallel-size", "8", "--max_model_len=32768", "--no-enforce-eager", "--speculative-config",
            '{"method": "eagle3", "num_speculative_tokens": 5}']
    assert cmd[-len(tail):] == tail
    head = cmd[:-len(tail)]
    assert "--max-model-len" not in head and "--enforce-eager" not in head  # replaced, never given twice
    assert option(head, "--dtype") == "float32" and option(head, "--model") == str(tmp_path)


def test_hidden_state_server_passes_vllm_args_through(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "hidden_size": 64}))
    server = hidden_states_server(tmp_path, storage_dir=tmp_path / "hs", port=8002, device="cpu",
                                  vllm_args=["--gpu-memory-utilization=0.5", "--tensor-parallel-size", "2"])
    cmd = server.command()
    assert "--enforce-eager" in cmd  # start-up matters on CPU
    assert "--gpu-memory-utilization" not in cmd and "--gpu-memory-utilization=0.5" in cmd
    assert option(cmd, "--tensor-parallel-size") == "2" and "--kv-transfer-config" in cmd
    on_gpu = hidden_states_server(tmp_path, storage_dir=tmp_path / "hs", port=8002, device="cuda").command()
    assert "--enforce-eager" not in on_gpu and option(on_gpu, "--dtype") == "bfloat16"


def test_split_vllm_args():
    assert split_vllm_args(None) == []
    assert split_vllm_args("--tensor-parallel-size 8") == ["--tensor-parallel-size", "8"]
    assert split_vllm_args(["-tp 2", "--enable-expert-parallel"]) == ["-tp", "2", "--enable-expert-parallel"]
    json_value = '--speculative-config={"method": "eagle3", "k": 2}'
    assert split_vllm_args([json_value, '{"a": 1}']) == [json_value, '{"a": 1}']  # kept whole


def test_vllm_arg_flag_repeats_and_keeps_commas():
    argv = ["serve", "--verifier", "v", "--vllm-arg=--tensor-parallel-size=8",
            '--vllm-arg=--speculative-config={"a": 1, "b": 2}']
    args = build_parser(argv).parse_args(argv)
    s = settings_from_args(ServeSettings, args)
    assert s.vllm_args == ["--tensor-parallel-size=8", '--speculative-config={"a": 1, "b": 2}']
    assert s.dtype == "auto" and s.enforce_eager == "auto" and s.max_model_len is None


def test_serving_section_of_a_run_config():
    cfg = merged_config({"serving": {"vllm_args": ["--tensor-parallel-size", "8"], "enforce_eager": False}})
    assert cfg["serving"] == {"vllm_args": ["--tensor-parallel-size", "8"], "enforce_eager": False}
    assert merged_config({})["serving"] == {}  # nothing set: stage hashes stay as before
    with pytest.raises(Eagle3InputError, match="vllm_args"):
        merged_config({"serving": {"vllm_arg": ["--x"]}})


def test_server_device_override(monkeypatch):
    vllm_server.server_device.cache_clear()
    monkeypatch.setenv("EAGLE3_VLLM_DEVICE", "cuda")
    assert vllm_server.server_device() == "cuda"
    vllm_server.server_device.cache_clear()
    monkeypatch.setenv("EAGLE3_VLLM_DEVICE", "cpu")
    assert vllm_server.server_device() == "cpu"
    vllm_server.server_device.cache_clear()


def test_hub_downloads_only_what_a_stage_needs():
    tok, cfg, weights = (hub_allow_patterns(n) for n in ("tokenizer", "config", "weights"))
    assert not any("safetensors" in p or p.endswith(".bin") for p in tok + cfg)
    assert "config.json" in cfg and "*.json" in tok and "*.jinja" in tok
    assert "*.safetensors" in weights and set(tok) <= set(weights)
    with pytest.raises(ValueError):
        hub_allow_patterns("everything")


def _fake_checkpoint(d, index_extra: str = ""):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    (d / "model-00001-of-00002.safetensors").write_bytes(b"a" * 100)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"b" * 50)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002"
                                                                               ".safetensors"}}) + index_extra)
    return d


def test_identity_without_hashing_the_weights(tmp_path):
    a = verifier_identity(_fake_checkpoint(tmp_path / "a"))
    assert {f: w["bytes"] for f, w in a["weights"].items()} == {"model-00001-of-00002.safetensors": 100,
                                                                 "model-00002-of-00002.safetensors": 50}
    assert not any("sha256" in w for w in a["weights"].values())  # no weight byte read
    assert set(a["index_sha256"]) == {"model.safetensors.index.json"}
    assert same_verifier(a, verifier_identity(_fake_checkpoint(tmp_path / "copy")))
    assert not same_verifier(a, verifier_identity(_fake_checkpoint(tmp_path / "other", index_extra=" ")))
    hashed = verifier_identity(tmp_path / "a", hash_weights=True)
    assert all(len(w["sha256"]) == 64 for w in hashed["weights"].values())
    assert same_verifier(a, hashed)  # sizes compared when only one side hashed


@pytest.mark.parametrize("pp", [["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size=4"], ["-pp", "2"]])
def test_pipeline_parallel_serving_needs_the_drafts_own_embedding(tmp_path, pp):
    """vLLM shares the verifier's embedding with a draft only at pipeline-parallel size 1; at 2+ a draft without
    embed_tokens would run on an uninitialised one (no error, acceptance ~1): refused before any server starts."""
    import torch
    from safetensors.torch import save_file

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    save_file({"fc.weight": torch.zeros(2, 6)}, str(draft / "model.safetensors"))
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(Eagle3InputError, match="--include-embed"):
        VLLMServer(tmp_path, port=8001, device="cpu", speculative=spec, vllm_args=pp)
    VLLMServer(tmp_path, port=8001, device="cpu", speculative=spec, vllm_args=["--pipeline-parallel-size", "1"])
    VLLMServer(tmp_path, port=8001, device="cpu", speculative=spec)
    save_file({"fc.weight": torch.zeros(2, 6), "embed_tokens.weight": torch.zeros(4, 2)},
              str(draft / "model.safetensors"))
    VLLMServer(tmp_path, port=8001, device="cpu", speculative=spec, vllm_args=pp)  # its own embedding: served


def test_the_family_table_decides_the_cpu_dtype_and_its_doc_is_current():
    from pathlib import Path

    from eagle3_train.assets.families import family_of, markdown_table

    assert server_options("cpu", model_config={"model_type": "deepseek_v3"})["dtype"] == "bfloat16"  # MLA kernels
    assert server_options("cpu", model_config={"model_type": "kimi_k25", "text_config": {}})["dtype"] == "bfloat16"
    assert server_options("cpu", model_config={"model_type": "qwen3_moe"})["dtype"] == "float32"
    assert server_options("cpu", model_config={"model_type": "something_new"})["dtype"] == "float32"
    assert server_options("cpu", dtype="float16", model_config={"model_type": "deepseek_v3"})["dtype"] == "float16"
    assert family_of({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}).name == "kimi_k25"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "VERIFIER_FAMILIES.md").read_text()
    assert markdown_table() in doc, "docs/VERIFIER_FAMILIES.md is stale: python -m eagle3_train.assets.families " \
                                    "--markdown"


def test_serve_refuses_a_draft_made_for_another_verifier_before_vllm_starts(ref, tiny_llama_dir, tmp_path, capsys):
    """vLLM would load a draft of another hidden size or vocabulary and serve it, accepting nothing (a Kimi-K2 draft
    came up "serving" beside SmolLM2 after 276 s): `serve` compares the two first."""
    from support.draft_layouts import SMOL, write_speculators

    from eagle3_train import cli

    draft = write_speculators(ref, tmp_path / "spec")  # made for a SmolLM2-shaped verifier (hidden 576)
    verifier = tiny_llama_dir()  # hidden 64
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert f"the draft {draft}" in err and "hidden size 576" in err, err
    same = tmp_path / "smol"
    same.mkdir()
    (same / "config.json").write_text(json.dumps(SMOL))
    check_draft_serves_beside(draft, same)  # the verifier it was made for: no complaint


def test_a_memory_share_that_cannot_hold_the_weights_is_refused_before_vllm_starts(tmp_path):
    """Kimi-K2.5 (595 GB) on 8 x 96 GB at the extraction server's 0.3: 74.4 GB of weights per GPU against 28.8 GB;
    refused, naming the share that holds them. At 0.9 it fits."""
    d = tmp_path / "kimi"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 595 * 10**9},
                                                                "weight_map": {}}))
    gpu = 96 * 10**9
    command = ["vllm", "--model", str(d), "--gpu-memory-utilization", "0.3", "--tensor-parallel-size", "8"]
    with pytest.raises(Eagle3InputError, match=r"weights need 69.3 GiB per GPU .* --gpu-memory-utilization 0\.9"):
        check_memory_share(d, command, gpu_bytes=gpu)
    check_memory_share(d, [*command[:-4], "--gpu-memory-utilization=0.9", "-tp", "8"], gpu_bytes=gpu)


def test_float16_beside_a_deepseek_verifier_with_a_draft_is_refused(tmp_path):
    verifier = tmp_path / "v"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "routed_scaling_factor": 2.5}))
    draft = tmp_path / "d"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    spec = speculative_config(draft)
    with pytest.raises(Eagle3InputError, match="routed_scaling_factor 2.5 in float16"):
        VLLMServer(verifier, speculative=spec, dtype="float16")
    VLLMServer(verifier, speculative=spec, dtype="bfloat16")  # the dtype it is served in
    VLLMServer(verifier, dtype="float16")  # no draft: nothing reads the aux states


def test_native_dtype_is_bf16_only_where_the_cpu_computes_it(monkeypatch):
    """serving.dtype native: bf16 on CUDA and on CPUs with AVX512-BF16/AMX, else as auto (float32; MLA's bf16)."""
    from eagle3_train.serving.vllm_options import resolve_dtype, server_options

    mla = {"model_type": "deepseek_v3"}
    monkeypatch.setenv("EAGLE3_TRAIN_CPU_BF16", "1")
    assert resolve_dtype("cpu", "native", {}) == "bfloat16" == server_options("cpu", "native")["dtype"]
    monkeypatch.setenv("EAGLE3_TRAIN_CPU_BF16", "0")
    assert resolve_dtype("cpu", "native", {}) == "float32" and resolve_dtype("cpu", "native", mla) == "bfloat16"
    assert resolve_dtype("cuda", "native", {}) == "bfloat16" and resolve_dtype("cpu", "auto", {}) == "float32"
    assert resolve_dtype("cpu", "float16", {}) == "float16"
