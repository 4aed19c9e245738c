"""`extract --backend vllm` opens and deletes only the files its servers write in --hidden-states-dir: an endpoint
that names any other path (outside, through `..`, through a symlink) is refused with the file untouched, and a file
that cannot be read is left in place. The endpoint here is a stub OpenAI-compatible server (a real vLLM one never
sends such paths; the point is what a wrong or hostile endpoint can make the client do)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from eagle3_train import cli

REPO = Path(__file__).resolve().parents[2]


def _campaign():
    """scripts/reliability_campaign.py as a module: its hostile endpoint is the one the campaign's rows use."""
    spec = importlib.util.spec_from_file_location("reliability_campaign", REPO / "scripts" / "reliability_campaign.py")
    module = sys.modules.setdefault("reliability_campaign", importlib.util.module_from_spec(spec))
    if not hasattr(module, "HostileEndpoint"):
        spec.loader.exec_module(module)  # registered first: its dataclasses look themselves up there
    return module


def test_the_client_touches_only_files_in_the_hidden_states_dir(tiny_stages, tmp_path, capsys):
    root, verifier = tiny_stages
    hs_dir = tmp_path / "hs-tmp"
    hs_dir.mkdir()
    victim = tmp_path / "precious.safetensors"
    victim.write_bytes(b"the user's file")
    (hs_dir / "link.safetensors").symlink_to(victim)
    garbage = hs_dir / "req-1.safetensors"
    garbage.write_bytes(b"not safetensors")
    hostile = _campaign().HostileEndpoint

    def extract(case: str, named: str, with_dir: bool = True) -> int:
        endpoint = hostile(named)
        try:
            return cli.main(["extract", "--backend", "vllm", "--endpoint", endpoint.url, "--prepared",
                             str(root / "prepared"), "--verifier", str(verifier), "--max-samples", "1",
                             "--out", str(tmp_path / f"out-{case}"),
                             *(["--hidden-states-dir", str(hs_dir)] if with_dir else [])])
        finally:
            endpoint.close()

    named = {"outside": str(victim), "dotdot": str(hs_dir / ".." / victim.name),
             "symlink": str(hs_dir / "link.safetensors"), "relative": victim.name}
    for case, path in named.items():
        assert extract(case, path) == 2, case
        assert "refusing to read or delete it" in capsys.readouterr().err, case
        assert victim.read_bytes() == b"the user's file", case
    assert extract("garbage", str(garbage)) == 2
    assert "left in place" in capsys.readouterr().err
    assert garbage.read_bytes() == b"not safetensors"
    # without the directory the client refuses before sending anything
    assert extract("none", str(victim), with_dir=False) == 2
    assert "needs --hidden-states-dir" in capsys.readouterr().err


def test_float16_states_of_a_deepseek_verifier_are_refused(tmp_path):
    """vLLM's DeepSeek-V2/V3 (and Kimi) layers divide the residual stream by routed_scaling_factor in float16: states
    captured from such a server are off by that factor, so they are refused, naming the fix; bf16 ones pass."""
    import torch
    from safetensors.torch import save_file

    from eagle3_train.hidden_states.vllm_backend import VLLMHiddenStates
    from eagle3_train.utils.io import Eagle3InputError

    verifier = tmp_path / "deepseek"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 8,
                                                      "hidden_size": 4, "rms_norm_eps": 1e-6,
                                                      "routed_scaling_factor": 2.5}))
    save_file({"model.norm.weight": torch.ones(4)}, str(verifier / "model.safetensors"))
    client = VLLMHiddenStates(["http://127.0.0.1:9/v1"], verifier, (2, 4, 5), torch.bfloat16,
                              hidden_states_dir=tmp_path)
    ids = [1, 2, 3]
    states = torch.randn(3, 4, 4)
    with pytest.raises(Eagle3InputError, match=r"float16.*routed_scaling_factor 2.5.*bfloat16"):
        client._split({"hidden_states": states.half(), "token_ids": torch.tensor(ids), "metadata": {}}, ids, "url")
    client.server_dtype = None
    aux, final = client._split({"hidden_states": states.bfloat16(), "token_ids": torch.tensor(ids), "metadata": {}},
                               ids, "url")
    assert aux.shape == (3, 12) and final.shape == (3, 4)


def test_a_verifier_whose_shards_are_not_here_fetches_only_what_is_read(tmp_path, monkeypatch):
    """After `extract --backend vllm` from a hub id only the config, index and final-norm shard are local: training
    reads the embedding and lm_head and must fetch just their shard (the hub's download is stubbed: no network
    here); a local directory that lacks a shard names it; a dry run reads shapes from the config, downloading
    nothing."""
    import huggingface_hub
    import torch
    from safetensors.torch import save_file

    from eagle3_train.model.verifier_head import load_verifier_head, verifier_head_shapes
    from eagle3_train.utils.io import Eagle3InputError

    def make(d):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"vocab_size": 6, "hidden_size": 4, "tie_word_embeddings": False}))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors"}}))
        return d

    local = make(tmp_path / "local")
    with pytest.raises(Eagle3InputError, match=r"lacks model-00001-of-00002.safetensors.*embed_tokens"):
        load_verifier_head(local)
    snapshot = make(tmp_path / "hub" / "models--org--big" / "snapshots" / "abc123")
    assert verifier_head_shapes(snapshot)[0].shape == (6, 4)  # the dry run: nothing fetched
    fetched = []

    def download(repo, name, revision=None):
        fetched.append((repo, name, revision))
        save_file({"model.embed_tokens.weight": torch.ones(6, 4), "lm_head.weight": torch.zeros(6, 4)},
                  str(snapshot / name))
        return str(snapshot / name)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    embed, head, _ = load_verifier_head(snapshot)
    assert fetched == [("org/big", "model-00001-of-00002.safetensors", "abc123")]
    assert torch.equal(embed, torch.ones(6, 4)) and torch.equal(head, torch.zeros(6, 4))
