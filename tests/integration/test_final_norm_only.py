"""The vLLM hidden-state client reads only the verifier's final norm: from a sharded checkpoint, the one weight file
the index names for it (the others may be absent, as in a hub snapshot that fetched only that file), and the same
through huggingface_hub's own cache (offline: a hub snapshot holding config, tokenizer, index and that one shard)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_train.assets.verifier import same_verifier, verifier_identity
from eagle3_train.hidden_states.vllm_backend import (
    WEIGHT_INDEX,
    VLLMHiddenStates,
    final_norm_file,
    resolve_served_verifier,
)
from eagle3_train.model.verifier_head import load_final_norm
from eagle3_train.utils.io import Eagle3InputError

_NOT_WEIGHTS = ("config.json", "generation_config.json", WEIGHT_INDEX, "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_llama_dir) -> tuple[Path, torch.Tensor]:
    """A tiny random Llama saved in several weight files with an index, its final norm not all ones."""
    from transformers import LlamaForCausalLM

    src = tiny_llama_dir(tie_word_embeddings=False)
    model = LlamaForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.rand(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
                                      + 0.5)
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, max_shard_size="4MB")
    for f in src.iterdir():
        if f.name in _NOT_WEIGHTS and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out, model.model.norm.weight.detach().clone()


def _norm_only_copy(full: Path, dest: Path, keep_norm_file: bool = True) -> Path:
    """What a hub snapshot holds after `resolve_served_verifier`: no weight file but the final norm's."""
    dest.mkdir(parents=True)
    for name in _NOT_WEIGHTS:
        if (full / name).is_file():
            shutil.copy2(full / name, dest / name)
    if keep_norm_file:
        shutil.copy2(full / final_norm_file(full), dest / final_norm_file(full))
    return dest


def test_the_index_names_the_one_weight_file_with_the_final_norm(sharded):
    full, _ = sharded
    weight_map = json.loads((full / WEIGHT_INDEX).read_text())["weight_map"]
    files = set(weight_map.values())
    assert len(files) >= 3  # really sharded
    name = final_norm_file(full)
    assert name == weight_map["model.norm.weight"]
    from safetensors import safe_open

    with safe_open(str(full / name), "pt") as f:
        assert "model.norm.weight" in f.keys()


def test_the_client_needs_only_the_final_norm_file(sharded, tmp_path):
    full, norm = sharded
    partial = _norm_only_copy(full, tmp_path / "partial")
    assert len(list(partial.glob("*.safetensors"))) == 1
    assert resolve_served_verifier(partial) == partial.resolve()
    weight, eps = load_final_norm(partial)
    torch.testing.assert_close(weight, norm, rtol=0, atol=0)
    assert eps == json.loads((full / "config.json").read_text())["rms_norm_eps"]
    client = VLLMHiddenStates(["http://127.0.0.1:9/v1"], partial, (1, 2, 3), torch.bfloat16,  # connects on open()
                              hidden_states_dir=tmp_path)
    torch.testing.assert_close(client.norm_weight, norm, rtol=0, atol=0)
    # Identified as the same verifier as the full checkpoint (same config and index; the files both hold agree)
    assert same_verifier(verifier_identity(partial), verifier_identity(full))
    assert same_verifier(verifier_identity(full), verifier_identity(partial))


def test_a_local_checkpoint_without_the_final_norm_file_is_refused_naming_it(sharded, tmp_path):
    full, _ = sharded
    partial = _norm_only_copy(full, tmp_path / "partial", keep_norm_file=False)
    with pytest.raises(Eagle3InputError, match=f"lacks {final_norm_file(full)}, the weight file that holds its "
                                               f"final norm"):
        resolve_served_verifier(partial)


def test_a_bad_index_is_one_clear_error(tmp_path):
    (tmp_path / WEIGHT_INDEX).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "a.safetensors"}}))
    with pytest.raises(Eagle3InputError, match="names no final norm tensor"):
        final_norm_file(tmp_path)
    (tmp_path / WEIGHT_INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(Eagle3InputError, match="no .weight_map."):
        final_norm_file(tmp_path)


_RESOLVE = """
import sys
from eagle3_train.hidden_states.vllm_backend import resolve_served_verifier
from eagle3_train.model.verifier_head import load_final_norm
from eagle3_train.utils.io import Eagle3InputError
try:
    path = resolve_served_verifier("org/tiny")
except Eagle3InputError as e:
    print("ERROR", e)
    sys.exit(0)
print("PATH", path)
print("NORM", load_final_norm(path)[0].sum().item())
"""


def _hub_cache(full: Path, root: Path, with_norm_file: bool) -> Path:
    """huggingface_hub's cache layout for repo org/tiny at one commit, holding what the client may fetch."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    _norm_only_copy(full, repo / "snapshots" / commit, keep_norm_file=with_norm_file)
    return repo / "snapshots" / commit


@pytest.mark.parametrize("with_norm_file", [True, False])
def test_a_hub_id_reads_config_tokenizer_index_and_the_norm_file_from_the_hub_cache(sharded, tmp_path,
                                                                                     with_norm_file):
    """Offline (no network here), so huggingface_hub answers from its cache: the whole hub path runs with only the
    final norm's weight file cached, and says clearly when that file cannot be had."""
    full, norm = sharded
    snapshot = _hub_cache(full, tmp_path / "hub", with_norm_file)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.run([sys.executable, "-c", _RESOLVE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if with_norm_file:
        assert f"PATH {snapshot}" in proc.stdout
        assert float(proc.stdout.split("NORM ")[1]) == pytest.approx(norm.sum().item(), rel=1e-6)
    else:
        assert f"ERROR could not download {final_norm_file(full)} (the final norm) of verifier 'org/tiny'" \
            in proc.stdout, proc.stdout


@pytest.mark.slow
def test_the_embedded_verifier_final_norm_is_the_models(smollm2_dir):
    from transformers import AutoModelForCausalLM

    assert final_norm_file(smollm2_dir) == "model.safetensors"  # one weight file, no index
    assert resolve_served_verifier("smollm2-135m-instruct") == smollm2_dir
    weight, eps = load_final_norm(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    torch.testing.assert_close(weight.float(), model.model.norm.weight.detach(), rtol=0, atol=0)
    assert eps == model.config.rms_norm_eps
