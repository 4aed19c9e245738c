"""Online and hybrid training against a real vLLM CPU hidden-state server (one server for the whole module) serving
a tiny random Llama: the same data and seed give the same loss curve as offline training on states extracted from
that server, hybrid mode writes an ordinary hidden-states directory once and reads it afterwards, resume continues
exactly, and a sample the server cannot serve is skipped and counted, never silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.stage_helpers import train_config
from support.vllm_helpers import require_vllm

from eagle3_train.hidden_states.extract import extract
from eagle3_train.hidden_states.store import HiddenStatesReader, check_hidden_states
from eagle3_train.serving.vllm_server import hidden_states_server
from eagle3_train.train.trainer import train
from eagle3_train.utils.io import Eagle3InputError

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 8


@pytest.fixture(scope="module")
def verifier(tiny_llama_dir) -> Path:
    return tiny_llama_dir(initializer_range=0.5, num_hidden_layers=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory, verifier):
    require_vllm()
    root = tmp_path_factory.mktemp("hs-server")
    srv = hidden_states_server(verifier, storage_dir=root / "states", served_model_name="tiny", max_model_len=512,
                               log_path=root / "vllm.log")
    with srv:
        yield srv


@pytest.fixture(scope="module")
def stages(tmp_path_factory, verifier, server) -> Path:
    """Prepared data, a vocab, and the offline reference: hidden states extracted from the same server."""
    from eagle3_train.data.prepare import prepare
    from eagle3_train.vocab.build import build_vocab

    root = tmp_path_factory.mktemp("online-stages")
    prepare("sharegpt", verifier, root / "prepared", max_length=128, limit=20, val_count=2, seed=0)
    build_vocab(root / "prepared", root / "vocab", size=1024)
    extract(root / "prepared", verifier, root / "hidden", dtype="bfloat16", backend="vllm",
            endpoints=[server.base_url], vllm_options={"hidden_states_dir": server.hidden_states_dir})
    return root


def losses(run: Path, split: str = "train") -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in lines if r["split"] == split]


def served(root: Path, out: Path, server, mode: str, **kw):
    kw.setdefault("max_steps", STEPS)
    kw.setdefault("prefetch", 2)
    return train_config(root, out, hidden_states_mode=mode, endpoint=[server.base_url], hidden_states="",
                        hidden_states_dir=str(server.hidden_states_dir), **kw)


def close(a: list[float], b: list[float]) -> bool:
    # bf16 noise: the server batches requests differently between runs, so a state may round to a neighbouring
    # bf16 value; the loss moves by far less than one step of training changes it.
    return len(a) == len(b) == STEPS and all(abs(x - y) <= 2e-2 * max(1.0, abs(y)) for x, y in zip(a, b))


def test_online_training_matches_offline_on_states_from_the_same_server(stages, server, tmp_path):
    offline = train(train_config(stages, tmp_path / "offline", max_steps=STEPS))
    online = train(served(stages, tmp_path / "online", server, "online"))
    a, b = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert close(a, b), (a, b)
    assert abs(online["validation"]["loss"] - offline["validation"]["loss"]) <= 2e-2 * offline["validation"]["loss"]
    assert a[-1] < a[0]  # it learns
    meta = json.loads((tmp_path / "online" / "training_metadata.json").read_text())
    source = meta["data"]["hidden_states_source"]
    assert meta["settings"]["hidden_states_mode"] == "online" and source["mode"] == "online"
    assert source["model"] == "tiny" and source["endpoints"] == [server.base_url] and source["vllm_version"]
    assert source["skipped_samples"] == 0 and online["skipped_samples"] == 0 and meta["data"]["hidden_states"] is None
    assert json.loads((tmp_path / "offline" / "training_metadata.json").read_text()
                      )["data"]["hidden_states_source"]["mode"] == "offline"
    timing = meta["run"]["timing"]
    assert timing["train_s"] > 0 and timing["server_request_s"] > 0
    # online writes no hidden states, and the connector's files are removed once read
    assert not (tmp_path / "online" / "hidden_states").exists()
    assert not any(server.hidden_states_dir.iterdir())


def test_hybrid_writes_an_ordinary_hidden_states_dir_once_and_resumes(stages, server, tmp_path):
    reference = tmp_path / "offline"
    train(train_config(stages, reference, epochs=2))
    # Interrupted in the first epoch, then resumed: the same curve as the uninterrupted offline run.
    out = tmp_path / "hybrid"
    cfg = dict(max_steps=None, epochs=2)
    first = train(served(stages, out, server, "hybrid", stop_after=1, **{**cfg, "prefetch": 0}))
    assert first["stopped"]
    partial = json.loads((out / "hidden_states" / "manifest.json").read_text())
    assert partial["status"] == "in_progress"
    result = train(served(stages, out, server, "hybrid", resume=True, **cfg))
    ref = losses(reference)
    got = losses(out)
    assert len(got) == len(ref) > 2 and all(abs(x - y) <= 2e-2 * max(1.0, abs(y)) for x, y in zip(got, ref))
    assert result["skipped_samples"] == 0
    # The states are stored once, as extract stores them, and match the extracted ones.
    hidden = out / "hidden_states"
    manifest = check_hidden_states(hidden, stages / "prepared", layer_ids=None)
    assert manifest["status"] == "complete" and manifest["backend"] == "vllm"
    for split in ("train", "validation"):
        mine, theirs = HiddenStatesReader(hidden, split), HiddenStatesReader(stages / "hidden", split)
        assert mine.complete and mine.sample_indices == theirs.sample_indices
        for i in mine.sample_indices:
            x, y = mine.load(i)["aux"].float(), theirs.load(i)["aux"].float()
            assert x.shape == y.shape and bool(((x - y).abs() <= torch.maximum(x.abs(), y.abs()) * 2 ** -6 + 1e-3)
                                               .all()), (split, i)
    # Epoch 2 read the disk: no more shards than samples fetched in epoch 1 (one per fetch), nothing fetched twice.
    index = json.loads((hidden / "train" / "index.json").read_text())
    stored = [i for e in index["shards"] for i in e["sample_indices"]]
    assert len(stored) == len(set(stored))
    meta = json.loads((out / "training_metadata.json").read_text())
    assert meta["data"]["hidden_states_source"]["mode"] == "hybrid"
    # ...and an offline run can train on that directory.
    again = train(train_config(stages, tmp_path / "reuse", hidden_states=str(hidden), max_steps=2))
    assert again["step"] == 2


def test_a_sample_the_server_cannot_serve_is_skipped_and_counted(stages, server, verifier):
    from eagle3_train.hidden_states.online import OnlineSource
    from eagle3_train.train.data import TrainingSamples

    source = OnlineSource("train", endpoints=[server.base_url], verifier_dir=verifier, layer_ids=(2, 4, 5),
                          dtype=torch.bfloat16, hidden_states_dir=server.hidden_states_dir)
    data = TrainingSamples(stages / "prepared", source, "train")
    try:
        too_long = [1] * 600  # over the server's 512-token context: rejected for this sample only
        feats = source.fetch([(0, data.input_ids[0]), (99, too_long), (1, data.input_ids[1])])
        assert feats[0] is not None and feats[2] is not None and feats[1] is None
        assert feats[0]["aux"].shape == (len(data.input_ids[0]), 3 * 64)
        assert source.skipped == 1 and data.skipped == 1
        batch = data.batch([0, 1])
        assert batch is not None and batch.aux.shape[0] == 2
    finally:
        data.close()


@pytest.mark.parametrize("mode", ["online", "hybrid"])
def test_dry_run_asks_the_servers_and_stores_nothing(stages, server, tmp_path, mode):
    from eagle3_train.train.dry_run import dry_run

    cfg = served(stages, tmp_path / "train", server, mode)
    report = dry_run(cfg)
    assert any(c.startswith(f"servers {server.base_url}: answered") for c in report["checked"])
    assert any(f"from the servers ({mode} mode)" in c for c in report["checked"])
    assert report["data"]["train"]["samples"] > 0 and report["data"]["train"]["total_steps"] == STEPS
    assert not (tmp_path / "train" / "hidden_states").exists()  # hybrid: the store is the run's, not the dry run's
    assert not any(server.hidden_states_dir.iterdir())
    # a server that does not answer fails the dry run as it would fail the run
    down = served(stages, tmp_path / "down", server, mode)
    down.endpoint = ["http://127.0.0.1:9/v1"]
    with pytest.raises(Eagle3InputError, match="cannot list the models of http://127.0.0.1:9/v1"):
        dry_run(down)
