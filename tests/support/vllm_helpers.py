"""Shared helpers for the tests that start a real vLLM server: a RANDOM EAGLE-3 draft for SmolLM2 (the EAGLE layout,
vLLM's llama_eagle3.py reads) and a per-process cache of servers so test modules share one start-up each."""

from __future__ import annotations

import atexit
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_train.serving.vllm_server import VLLMServer, vllm_available


def attention_draft_beside_mla_served() -> bool:
    """Whether vLLM 0.32 on this CPU serves a draft with ordinary attention (a Llama layer) beside an MLA verifier.
    With AMX its MLA backend takes any KV block size; without (AVX512-BF16, AVX2 hosts) MLA caches in blocks of 16 and
    CPU attention in multiples of 32, so the server cannot start (serving/vllm_server.py names the cause)."""
    return bool(torch.cpu._is_amx_tile_supported())


def draft_beside_mla() -> str:
    """The draft layer the tests serve beside an MLA verifier here: a Llama layer where vLLM serves it, else MLA."""
    return "llama" if attention_draft_beside_mla_served() else "mla"


# SmolLM2-135M shapes.
H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152


def write_random_eagle3_draft(out_dir: Path, draft_vocab: int = 8192, seed: int = 0) -> Path:
    """A randomly initialised single-layer EAGLE-3 draft for SmolLM2 in the original EAGLE format.

    d2t is all zeros (draft id i -> target id i) and t2d marks the first `draft_vocab` target ids.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    tensors = {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": torch.ones(H),
        "lm_head.weight": w(draft_vocab, H),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(VOCAB) < draft_vocab,
    }
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_config": {"use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def require_vllm() -> None:
    """Skip (with the reason) only when the vLLM environment is absent."""
    ok, msg = vllm_available()
    if not ok:
        pytest.skip(f"vLLM environment absent: {msg}")


_SERVERS: dict[str, VLLMServer] = {}


def shared_server(kind: str, tmp_root: Path) -> VLLMServer:
    """One server per kind ("plain" or "eagle3") per pytest process, stopped at exit.

    Both the generate and the served-evaluation tests use these, so a full test run starts each kind once.
    `--enforce-eager` is used because it starts much faster here and the tests need no decode speed.
    """
    if kind in _SERVERS and _SERVERS[kind].running():
        return _SERVERS[kind]
    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.serving.vllm_options import speculative_config

    verifier = resolve_verifier("smollm2-135m-instruct")
    spec = None
    if kind == "eagle3":
        spec = speculative_config(write_random_eagle3_draft(tmp_root / "random-draft"), k=3)
    server = VLLMServer(verifier, served_model_name="smollm2", speculative=spec, enforce_eager=True,
                        max_model_len=2048, log_path=tmp_root / f"vllm-{kind}.log")
    server.start()
    atexit.register(server.stop)
    _SERVERS[kind] = server
    return server
