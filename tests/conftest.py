"""Shared test fixtures.

- `smollm2_dir` (session): the converted SmolLM2-135M-Instruct checkpoint directory (the real verifier; converted
  from the embedded GGUF on first use, then cached). Use it in tests marked `@pytest.mark.slow` when loading the model.
- `smollm2_tokenizer` (session): its fast tokenizer (ChatML template, vocab 49152). Shared: `copy.deepcopy` it before
  adding tokens or changing its template.
- `tiny_llama_dir` (session factory): `tiny_llama_dir(**config_overrides) -> Path` saves a tiny random
  LlamaForCausalLM (hidden 64, 2 heads of dim 32, 2 kv heads, 4 layers, intermediate 128, vocab 49152, tied
  embeddings, float32) with the SmolLM2 tokenizer and chat template into a temporary directory: a loadable HF
  checkpoint that every stage accepts as a verifier, about 13 MB. Same overrides -> same directory (cached per
  session); weights come from `seed` (an override key, default 0), so they are reproducible.
  Example: `tiny_llama_dir(num_hidden_layers=6, tie_word_embeddings=False)`. Keep `vocab_size` >= 49152 when
  feeding it text from the tokenizer (a smaller vocabulary cannot embed every token id it produces).

- `head`, `vocab_a`, `ref` (session), `inputs` (per test): the published-layout reference of support/draft_layouts.py,
  shared by the finetune, aux-layer, inspect and output-directory tests (at SmolLM2's dimensions it takes seconds to
  build): a random bf16-exact (embedding, lm_head) pair standing in for SmolLM2's, a 2048-token draft vocabulary
  (d2t, t2d) drawn with seed 1, the reference draft on them with default flags, and the RunInputs of a run on them.
  Treat them as read-only; a module needing another reference overrides `ref` (tests/unit/test_inspect.py).

Tests not marked `slow` run on one intra-op thread (see `pytest_runtest_setup`). `train.precision: auto` resolves to
fp32 on every CPU in tests (EAGLE3_TRAIN_CPU_BF16=0, inherited by the subprocesses they start), so that results do not
depend on whether the host has native bf16; tests of bf16 ask for it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("EAGLE3_TRAIN_CPU_BF16", "0")
# MKL may otherwise run a GEMM on fewer threads than asked, differently in each process: a subprocess's result would
# then differ in the last bits from the in-process side of a bit-exact comparison on Intel hosts (support/numerics.py).
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

TINY_LLAMA_CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "vocab_size": 49152,  # the SmolLM2 tokenizer's vocabulary
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_default_threads: int | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """One intra-op thread for the fast tier (its fixtures included), torch's default for tests marked slow.

    On tiny tensors thread hand-offs cost far more than they save, the more so on a shared CPU: on the 2-core test
    machine under load, 400 Adam steps on a 4x7 tensor took 7 s of CPU with two threads and 0.05 s with one."""
    import torch

    global _default_threads
    if _default_threads is None:
        _default_threads = torch.get_num_threads()
    want = _default_threads if item.get_closest_marker("slow") else 1
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)



@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eagle3_train.assets.verifier import resolve_verifier

    return resolve_verifier("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_stages(tmp_path_factory, smollm2_dir) -> Path:
    """A directory with prepare (150 ShareGPT conversations, 384 tokens), vocab (4096) and extract (bf16) outputs
    for SmolLM2: what the vLLM tests train their drafts on, built once per test process."""
    from eagle3_train.data.prepare import prepare
    from eagle3_train.hidden_states.extract import extract
    from eagle3_train.vocab.build import build_vocab

    root = tmp_path_factory.mktemp("smollm2-stages")
    prepare("sharegpt", smollm2_dir, root / "prepared", max_length=384, limit=150, val_count=6, seed=0)
    build_vocab(root / "prepared", root / "vocab", size=4096)
    extract(root / "prepared", smollm2_dir, root / "hidden", dtype="bfloat16")
    return root


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir):
    cache: dict[str, Path] = {}

    def make(**overrides) -> Path:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        key = json.dumps(overrides, sort_keys=True)
        if key in cache:
            return cache[key]
        settings = {**TINY_LLAMA_CONFIG, **overrides}
        seed = settings.pop("seed", 0)
        out = tmp_path_factory.mktemp("tiny-llama")
        torch.manual_seed(seed)
        config = LlamaConfig(**settings)
        config.architectures = ["LlamaForCausalLM"]
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(out, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            if (smollm2_dir / name).is_file():
                shutil.copy2(smollm2_dir / name, out / name)
        cache[key] = out
        return out

    return make


@pytest.fixture(scope="session")
def tiny_stages(tmp_path_factory, tiny_llama_dir):
    """(root, verifier): real prepare/vocab/extract outputs for a tiny random Llama whose large init scale gives
    peaked next-token distributions (something to learn). See tests/support/stage_helpers.py."""
    from support.stage_helpers import build_stages

    verifier = tiny_llama_dir(initializer_range=0.5)
    return build_stages(tmp_path_factory.mktemp("tiny-stages"), verifier), verifier


@pytest.fixture(scope="session")
def head():
    from support.draft_layouts import verifier_head

    return verifier_head()


@pytest.fixture(scope="session")
def vocab_a():
    from support.draft_layouts import VD, random_token_ids, vocab_from_ids

    return vocab_from_ids(random_token_ids(VD, seed=1))


@pytest.fixture(scope="session")
def ref(head, vocab_a):
    from support.draft_layouts import reference_draft

    return reference_draft(head[0], vocab_a)


@pytest.fixture
def inputs(tmp_path, head, vocab_a):
    from support.draft_layouts import make_inputs

    return make_inputs(tmp_path, head[0], head[1], vocab_a)
