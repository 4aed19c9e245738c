"""Online and hybrid training under real `torchrun` (2 CPU processes, gloo, FSDP2: `train.parallel fsdp`) against ONE
real vLLM CPU hidden-state server (shared by the module) serving a tiny random Llama:

- online: each rank fetches its own micro-batches; the loss curve is the single-process online run's on the same data
  and seed, and samples the server rejects (longer than its context) are skipped and counted over all ranks, the same
  count as in one process;
- hybrid: the ranks write one store between them during the first epoch (stopped after one step and resumed), read it
  afterwards, and leave a complete, valid extract directory: every sample once, every shard listed, tensors equal to
  `extract --backend vllm` from the same server within bf16 rounding, readable by offline training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.stage_helpers import train_config
from support.torchrun_helpers import torchrun as run_torchrun
from support.vllm_helpers import require_vllm

from eagle3_train.serving.client import ChatPool
from eagle3_train.train.trainer import train

CONTEXT = 160  # the server's max_model_len: the few long samples of the 'long' data do not fit and are skipped


def test_ranks_start_on_different_endpoints():
    """At equal load rank r's pool sends to endpoint r % n first, then moves on by load."""
    urls = ["http://a:1/v1", "http://b:1/v1", "http://c:1/v1"]
    for rank in range(5):
        pool = ChatPool(urls, "m", first=rank)
        assert pool._pick(None, None) == rank % 3
        pool.endpoints[rank % 3].in_flight = 1
        assert pool._pick(None, None) == (rank + 1) % 3
        assert pool._pick(None, (rank + 1) % 3) == (rank + 2) % 3


@pytest.fixture(scope="module")
def verifier(tiny_llama_dir) -> Path:
    return tiny_llama_dir(initializer_range=0.5, num_hidden_layers=8)


def _conversations(path: Path, long: bool) -> Path:
    """14 ShareGPT conversations cut to one exchange of varied length (about 40-120 tokens); with `long`, the first
    two keep their whole first exchange (over CONTEXT tokens once prepared with max_length 200)."""
    from eagle3_train.assets.conversations import load_conversations

    convs, _ = load_conversations("sharegpt", limit=14)
    with open(path, "w") as f:
        for k, c in enumerate(convs):
            user = next(m["content"] for m in c.messages if m["role"] == "user")
            reply = next(m["content"] for m in c.messages if m["role"] == "assistant")
            keep = 4000 if long and k < 2 else 60 + 25 * (k % 7)
            f.write(json.dumps({"id": f"c{k}", "messages": [{"role": "user", "content": user[:keep]},
                                                            {"role": "assistant", "content": reply[:keep * 2]}]})
                    + "\n")
    return path


@pytest.fixture(scope="module")
def stages(tmp_path_factory, verifier) -> Path:
    from datasets import load_from_disk

    from eagle3_train.data.prepare import prepare
    from eagle3_train.vocab.build import build_vocab

    root = tmp_path_factory.mktemp("torchrun-stages")
    for name, long, max_length in (("prepared", False, 128), ("prepared-long", True, 200)):
        prepare(_conversations(root / f"{name}.jsonl", long), verifier, root / name, max_length=max_length,
                val_count=2, seed=0)
    lengths = {name: [n for split in load_from_disk(str(root / name / "dataset")).values() for n in split["length"]]
               for name in ("prepared", "prepared-long")}
    assert max(lengths["prepared"]) < CONTEXT and 0 < sum(n >= CONTEXT for n in lengths["prepared-long"]) <= 3, lengths
    build_vocab(root / "prepared", root / "vocab", size=1024)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, verifier, stages):
    require_vllm()
    from eagle3_train.serving.vllm_server import hidden_states_server

    root = tmp_path_factory.mktemp("hs-server")
    srv = hidden_states_server(verifier, storage_dir=root / "states", served_model_name="tiny", max_model_len=CONTEXT,
                               log_path=root / "vllm.log")
    with srv:
        yield srv


@pytest.fixture(scope="module")
def extracted(stages, server, verifier) -> Path:
    """The offline reference: `extract --backend vllm` of the short data from the same server."""
    from eagle3_train.hidden_states.extract import extract

    extract(stages / "prepared", verifier, stages / "hidden", dtype="bfloat16", backend="vllm",
            endpoints=[server.base_url], vllm_options={"hidden_states_dir": server.hidden_states_dir})
    return stages / "hidden"


def torchrun_train(root: Path, out: Path, prepared: str, *args: str) -> dict:
    """`torchrun --nproc-per-node 2 -m eagle3_train.cli train` under FSDP with the settings of `train_config`
    (grad_accum 1: the two ranks together take the micro-batches one process takes with grad_accum 2)."""
    flags = ["--prepared", str(root / prepared), "--vocab", str(root / "vocab"), "--out", str(out), "--ttt-steps",
             "3", "--token-budget", "512", "--lr", "3e-3", "--seed", "0", "--log-every", "1", "--warmup-ratio", "0.1",
             "--no-tensorboard", "--set", "train.parallel=fsdp", *args]
    proc = run_torchrun(["-m", "eagle3_train.cli", "train", *flags], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "training_metadata.json").read_text())


def curve(run: Path, split: str = "train", key: str = "loss") -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r[key] for r in lines if r["split"] == split]


def close(a: list[float], b: list[float], at_least: int = 3) -> bool:
    # bf16 noise: the server batches requests differently between runs, so a state may round to a neighbouring
    # bf16 value; the loss moves by far less than one step of training changes it.
    return len(a) == len(b) >= at_least and all(abs(x - y) <= 2e-2 * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.vllm
def test_online_under_torchrun_gives_the_single_process_curve_and_counts_skips_over_ranks(stages, server, tmp_path):
    single = train(train_config(stages, tmp_path / "single", prepared=str(stages / "prepared-long"),
                                hidden_states_mode="online", endpoint=[server.base_url], hidden_states="", epochs=2,
                                hidden_states_dir=str(server.hidden_states_dir),
                                grad_accum=2))
    meta = torchrun_train(stages, tmp_path / "ranks", "prepared-long", "--hidden-states-mode", "online", "--endpoint",
                          server.base_url, "--epochs", "2", "--hidden-states-dir", str(server.hidden_states_dir))
    assert (meta["run"]["world_size"], meta["run"]["parallel"]) == (2, "fsdp")
    assert meta["progress"]["step"] == single["step"]
    a, b = curve(tmp_path / "ranks"), curve(tmp_path / "single")
    assert close(a, b), (a, b)
    assert close(curve(tmp_path / "ranks", "validation"), curve(tmp_path / "single", "validation"), at_least=2)
    # The long samples were rejected by the server, skipped and counted: over both ranks, as in one process.
    source = meta["data"]["hidden_states_source"]
    assert source["mode"] == "online" and source["skipped_samples"] == single["skipped_samples"] > 0
    assert curve(tmp_path / "ranks", key="skipped_samples") == curve(tmp_path / "single", key="skipped_samples")
    assert not (tmp_path / "ranks" / "hidden_states").exists()
    assert not any(server.hidden_states_dir.iterdir())  # every connector file read and removed


@pytest.mark.slow
@pytest.mark.vllm
def test_hybrid_under_torchrun_writes_one_valid_store_and_resumes(stages, server, extracted, tmp_path):
    from eagle3_train.hidden_states.store import HiddenStatesReader, check_hidden_states

    # 256-token batches: 2 steps per epoch, so the stop falls inside the first epoch.
    reference = train(train_config(stages, tmp_path / "offline", hidden_states=str(extracted), epochs=2,
                                   grad_accum=2, token_budget=256))
    out = tmp_path / "hybrid"
    hybrid = ["--hidden-states-mode", "hybrid", "--endpoint", server.base_url, "--epochs", "2", "--token-budget",
              "256", "--hidden-states-dir", str(server.hidden_states_dir)]
    torchrun_train(stages, out, "prepared", *hybrid, "--stop-after", "1", "--prefetch", "0")
    assert len(curve(out)) == 1  # one step, checkpointed
    assert len(curve(tmp_path / "offline")) >= 4
    assert json.loads((out / "hidden_states" / "manifest.json").read_text())["status"] == "in_progress"
    # What a kill between writing a shard and indexing it leaves (and a kill mid-write): removed once complete.
    train_dir = out / "hidden_states" / "train"
    shutil.copy(next(train_dir.glob("shard-*.safetensors")), train_dir / "shard-00099.safetensors")
    (train_dir / ".shard-00098.safetensors.x1.tmp").write_bytes(b"partial")
    meta = torchrun_train(stages, out, "prepared", *hybrid, "--resume")
    assert meta["progress"]["step"] == reference["step"] and meta["data"]["hidden_states_source"]["mode"] == "hybrid"
    got, ref = curve(out), curve(tmp_path / "offline")
    assert close(got, ref), (got, ref)
    assert meta["data"]["hidden_states_source"]["skipped_samples"] == 0
    # One complete store, as extract writes it: each sample once, every file listed, no file left over.
    hidden = out / "hidden_states"
    manifest = check_hidden_states(hidden, stages / "prepared", layer_ids=None)
    assert manifest["status"] == "complete" and manifest["backend"] == "vllm"
    for split in ("train", "validation"):
        index = json.loads((hidden / split / "index.json").read_text())
        stored = [i for e in index["shards"] for i in e["sample_indices"]]
        assert len(stored) == len(set(stored)) and index["complete"]
        assert sorted(f.name for f in (hidden / split).iterdir()) == sorted(
            [e["file"] for e in index["shards"]] + ["index.json"])
        mine, theirs = HiddenStatesReader(hidden, split), HiddenStatesReader(extracted, split)
        mine.verify()  # every shard's SHA-256 as index.json records it
        assert mine.complete and mine.sample_indices == theirs.sample_indices
        for i in mine.sample_indices:
            for key in ("aux", "final"):
                x, y = mine.load(i)[key].float(), theirs.load(i)[key].float()
                assert x.shape == y.shape and bool(((x - y).abs() <= torch.maximum(x.abs(), y.abs()) * 2 ** -6
                                                    + 1e-3).all()), (split, i, key)
    # Both ranks wrote shards of their own: rank r's shard numbers are r modulo the world size.
    numbers = [e["shard"] for e in json.loads((hidden / "train" / "index.json").read_text())["shards"]]
    assert {n % 2 for n in numbers} == {0, 1}
    assert max(numbers) > 99  # the resumed ranks numbered above every file present, the leftover included
    # ...and offline training reads it.
    again = train(train_config(stages, tmp_path / "reuse", hidden_states=str(hidden), max_steps=2))
    assert again["step"] == 2

