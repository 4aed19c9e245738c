"""Extract stage: stored hidden states vs an independent `output_hidden_states=True` forward, resume, bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.numerics import fp32_atol
from support.stage_helpers import another_writer, assert_same_hidden_states, kill_after_first_shard
from support.torchrun_helpers import run_group

from eagle3_train import cli
from eagle3_train.hidden_states.extract import extract
from eagle3_train.hidden_states.hf_backend import plan_batches
from eagle3_train.hidden_states.store import HiddenStatesReader, check_hidden_states, plan_shards
from eagle3_train.model.aux_layers import default_layer_ids, parse_layer_ids, validate_layer_ids
from eagle3_train.utils.io import Eagle3InputError, sha256_file

VOCAB = 512
NUM_LAYERS = 4
HIDDEN = 64
MIXED = {"train": [5, 17, 3, 40, 22, 9, 31, 12, 26, 8, 1, 35, 17], "validation": [7, 19, 4]}


# ---------------------------------------------------------------- fixtures built by the tests themselves

def make_tiny_llama(path: Path, seed: int = 0, poison_token: int | None = None) -> Path:
    """A random LlamaForCausalLM saved like a real checkpoint; `poison_token` gets an Inf embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, vocab_size=VOCAB,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if poison_token is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight[poison_token] = float("inf")
    model.save_pretrained(path)
    return path


def make_prepared(path: Path, lengths: dict[str, list[int]], seed: int = 0, avoid_token: int | None = None,
                  tokens: dict[tuple[str, int], list[int]] | None = None) -> Path:
    """A prepared dir per docs/ARCHITECTURE.md: DIR/dataset (DatasetDict) + DIR/manifest.json."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    low = 0 if avoid_token is None else avoid_token + 1
    splits = {}
    for split, lens in lengths.items():
        rows = {"id": [], "input_ids": [], "loss_mask": [], "length": [], "n_supervised": []}
        for r, n in enumerate(lens):
            ids = (tokens or {}).get((split, r)) or torch.randint(low, VOCAB, (n,), generator=gen).tolist()
            mask = [int(i >= n // 2) for i in range(n)]
            rows["id"].append(f"{split}-{r}")
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
            rows["length"].append(len(ids))
            rows["n_supervised"].append(sum(mask))
        splits[split] = datasets.Dataset.from_dict(rows)
    datasets.DatasetDict(splits).save_to_disk(str(path / "dataset"))
    (path / "manifest.json").write_text(json.dumps({"stage": "prepare", "seed": seed, "lengths": lengths}))
    return path


def reference_states(model_dir: Path, input_ids: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Independent computation: the full CausalLM with output_hidden_states=True on one unpadded sample."""
    from transformers import AutoModelForCausalLM

    model = _REF_MODELS.get(model_dir)
    if model is None:
        model = _REF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states), out.hidden_states[-1][0]


_REF_MODELS: dict[Path, object] = {}


def samples(prepared: Path, split: str) -> list[list[int]]:
    import datasets

    return list(datasets.load_from_disk(str(prepared / "dataset"))[split]["input_ids"])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"))


@pytest.fixture(scope="module")
def mixed_prepared(tmp_path_factory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("prepared"), MIXED)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, tiny_llama, mixed_prepared) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("hs") / "fp32"
    manifest = extract(mixed_prepared, tiny_llama, out, layer_ids=(0, 2, 3), dtype="float32", device="cpu",
                       token_budget=64, shard_tokens=60, hash_weights=True)  # tells same-shape weights apart
    return out, manifest


def assert_matches_reference(out: Path, prepared: Path, model_dir: Path, layer_ids, exact: bool = False,
                             **tol) -> None:
    for split in MIXED:
        reader = HiddenStatesReader(out, split)
        seqs = samples(prepared, split)
        assert reader.sample_indices == list(range(len(seqs)))
        for i, seq in enumerate(seqs):
            got = reader.load(i)
            hs, final = reference_states(model_dir, seq)
            want_aux = torch.cat([hs[j] for j in layer_ids], dim=-1)
            assert got["aux"].shape == (len(seq), 3 * HIDDEN) and got["final"].shape == (len(seq), HIDDEN)
            assert reader.num_tokens(i) == len(seq)
            if exact:
                assert torch.equal(got["aux"], want_aux) and torch.equal(got["final"], final), (split, i)
            else:
                torch.testing.assert_close(got["aux"].float(), want_aux, **tol)
                torch.testing.assert_close(got["final"].float(), final, **tol)


# ---------------------------------------------------------------- correctness

def test_planning_groups_mixed_lengths_with_padding():
    lengths = MIXED["train"]
    shards = plan_shards(lengths, 60)
    assert sorted(r for s in shards for r in s.rows) == list(range(len(lengths)))
    assert all(s.num_tokens >= 60 for s in shards[:-1])
    flat = [lengths[r] for s in shards for r in s.rows]
    assert flat == sorted(flat)
    mixed_batches = 0
    for s in shards:
        for b0, b1 in plan_batches(s.lengths, 64):
            batch = s.lengths[b0:b1]
            assert (b1 - b0) * max(batch) <= 64 or b1 - b0 == 1
            mixed_batches += len(set(batch)) > 1
    assert mixed_batches >= 2, "the fixture must exercise padded batches of mixed lengths"
    assert plan_batches([5, 100, 7], 50) == [(0, 1), (1, 2), (2, 3)]  # over-budget samples run alone


def test_float32_matches_independent_forward_with_padding(fp32_run, mixed_prepared, tiny_llama):
    out, _ = fp32_run
    # Padded batches change the matmul shapes, so equality holds to float32 rounding only.
    assert_matches_reference(out, mixed_prepared, tiny_llama, (0, 2, 3), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_float32_exact_when_unpadded(tmp_path, tiny_llama, mixed_prepared):
    out = tmp_path / "hs"
    extract(mixed_prepared, tiny_llama, out, layer_ids="0,1,3", dtype="float32", device="cpu", token_budget=1)
    assert_matches_reference(out, mixed_prepared, tiny_llama, (0, 1, 3), exact=True)


def test_bfloat16_default_layers_match_within_bf16_rounding(tmp_path, tiny_llama, mixed_prepared):
    out = tmp_path / "hs"
    manifest = extract(mixed_prepared, tiny_llama, out, device="cpu", token_budget=48, shard_tokens=100)
    assert manifest["layer_ids"] == list(default_layer_ids(NUM_LAYERS))
    assert manifest["dtype"] == "bfloat16"
    reader = HiddenStatesReader(out, "train")
    assert reader.load(0)["aux"].dtype == torch.bfloat16
    # bf16 keeps 8 significant bits: relative rounding error <= 2**-9.
    assert_matches_reference(out, mixed_prepared, tiny_llama, manifest["layer_ids"], rtol=2**-8, atol=1e-6)


def test_shard_files_index_and_manifest_agree(fp32_run, mixed_prepared, tiny_llama):
    out, manifest = fp32_run
    assert manifest["status"] == "complete"
    assert manifest["layer_ids"] == [0, 2, 3] and manifest["dtype"] == "float32"
    assert manifest["hidden_size"] == HIDDEN and manifest["num_layers"] == NUM_LAYERS
    assert manifest["prepared_manifest_sha256"] == sha256_file(mixed_prepared / "manifest.json")
    assert manifest["verifier"]["path"] == str(tiny_llama.resolve())
    assert manifest["verifier"]["weights"]["model.safetensors"]["sha256"] == sha256_file(
        tiny_llama / "model.safetensors")  # hash_weights=True; by default sizes only (test_server_options)
    total_bytes = 0
    for split, lens in MIXED.items():
        index = json.loads((out / split / "index.json").read_text())
        assert index["complete"] and index["num_tokens"] == sum(lens) and index["num_samples"] == len(lens)
        assert len(index["shards"]) == index["num_shards"] == len(plan_shards(lens, 60))
        for entry in index["shards"]:
            path = out / split / entry["file"]
            assert entry["sha256"] == sha256_file(path) and entry["bytes"] == path.stat().st_size
            total_bytes += entry["bytes"]
            with safe_open(str(path), framework="pt") as f:
                assert f.get_tensor("sample_index").tolist() == entry["sample_indices"]
                assert f.get_tensor("offsets").tolist() == entry["offsets"]
                assert f.get_tensor("aux").shape == (entry["num_tokens"], 3 * HIDDEN)
                assert f.get_tensor("final").shape == (entry["num_tokens"], HIDDEN)
                assert [entry["offsets"][k + 1] - entry["offsets"][k] for k in range(entry["num_samples"])] == [
                    lens[i] for i in entry["sample_indices"]]
    assert manifest["counts"] == {"samples": sum(map(len, MIXED.values())),
                                  "tokens": sum(map(sum, MIXED.values())), "bytes": total_bytes}
    assert manifest["throughput"]["tokens"] == manifest["counts"]["tokens"]
    assert manifest["bytes_per_token"] == 4 * HIDDEN * 4
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


def test_nan_names_the_sample(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "poisoned", poison_token=7)
    lengths = {"train": [6, 9, 12, 4], "validation": [5]}
    bad = [20, 21, 7, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # only train-2 contains token 7
    prepared = make_prepared(tmp_path / "prep", lengths, avoid_token=7, tokens={("train", 2): bad})
    with pytest.raises(Eagle3InputError, match=r"NaN/Inf.*sample id 'train-2' \(split 'train'"):
        extract(prepared, model_dir, tmp_path / "hs", dtype="float32", device="cpu", token_budget=64)


# ---------------------------------------------------------------- reader and compatibility

def test_reader_errors_and_handle_cache(fp32_run, tmp_path):
    out, _ = fp32_run
    reader = HiddenStatesReader(out, "train", max_open=2)
    assert len(reader) == len(MIXED["train"]) and 3 in reader and 999 not in reader
    with pytest.raises(Eagle3InputError, match="sample 999 of split 'train' has no stored hidden states"):
        reader.load(999)
    for i in reader.sample_indices:
        reader.load(i)
    assert len(reader._handles) <= 2
    reader.verify()
    with pytest.raises(Eagle3InputError, match="index of split 'test' not found"):
        HiddenStatesReader(out, "test")
    with pytest.raises(Eagle3InputError, match="hidden-states directory not found"):
        HiddenStatesReader(tmp_path / "nowhere", "train")


def test_check_compatible(fp32_run, mixed_prepared, tiny_llama, tmp_path):
    out, _ = fp32_run
    assert check_hidden_states(out, mixed_prepared, tiny_llama)["layer_ids"] == [0, 2, 3]
    check_hidden_states(out, mixed_prepared, tiny_llama, layer_ids=[0, 2, 3], hash_weights=False)
    other_data = make_prepared(tmp_path / "other", {"train": [4, 5], "validation": [3]}, seed=3)
    with pytest.raises(Eagle3InputError, match="do not belong to the prepared data"):
        check_hidden_states(out, other_data, tiny_llama)
    other_model = make_tiny_llama(tmp_path / "other-model", seed=1)
    with pytest.raises(Eagle3InputError, match="were made by verifier"):
        check_hidden_states(out, mixed_prepared, other_model)
    with pytest.raises(Eagle3InputError, match="tap layers"):
        check_hidden_states(out, mixed_prepared, tiny_llama, layer_ids=[1, 2, 3])


def test_reader_reports_missing_shard_file(tmp_path, tiny_llama, mixed_prepared):
    out = tmp_path / "hs"
    extract(mixed_prepared, tiny_llama, out, dtype="float32", device="cpu", shard_tokens=60, splits=("validation",))
    entry = json.loads((out / "validation" / "index.json").read_text())["shards"][0]
    (out / "validation" / entry["file"]).unlink()
    with pytest.raises(Eagle3InputError, match="is missing"):
        HiddenStatesReader(out, "validation").load(entry["sample_indices"][0])


# ---------------------------------------------------------------- bad inputs and resume rules

def test_layer_id_validation():
    assert default_layer_ids(30) == (2, 15, 27)
    assert default_layer_ids(32) == (2, 16, 29)
    assert validate_layer_ids(parse_layer_ids("2,15,27"), 30) == (2, 15, 27)
    with pytest.raises(Eagle3InputError, match="final-norm output"):
        validate_layer_ids([2, 15, 30], 30)
    with pytest.raises(Eagle3InputError, match=r"out of range.*0\.\.29"):
        validate_layer_ids([-1, 15, 27], 30)
    with pytest.raises(Eagle3InputError, match="exactly 3"):
        validate_layer_ids([2, 15], 30)
    with pytest.raises(Eagle3InputError, match="comma-separated integers"):
        parse_layer_ids("2;15;27")


def test_unsorted_or_duplicate_layer_ids_are_refused():
    """The engines concatenate the taps in layer order: another order would train a draft served scrambled."""
    with pytest.raises(Eagle3InputError,
                       match=r"--layer-ids: aux layer ids \[27, 15, 2\] are not in increasing order.*2,15,27"):
        validate_layer_ids(parse_layer_ids("27,15,2"), 30)
    with pytest.raises(Eagle3InputError, match=r"\[2, 15, 15\] have duplicates"):
        validate_layer_ids([2, 15, 15], 30)


def test_bad_inputs(tmp_path, tiny_llama, mixed_prepared):
    with pytest.raises(Eagle3InputError, match="prepared directory not found"):
        extract(tmp_path / "missing", tiny_llama, tmp_path / "hs")
    no_manifest = tmp_path / "no-manifest"
    no_manifest.mkdir()
    with pytest.raises(Eagle3InputError, match="no manifest.json"):
        extract(no_manifest, tiny_llama, tmp_path / "hs")
    with pytest.raises(Eagle3InputError, match="split 'test' not found"):
        extract(mixed_prepared, tiny_llama, tmp_path / "hs", splits=("test",))
    with pytest.raises(Eagle3InputError, match=f"layer id {NUM_LAYERS} is the final-norm output"):
        extract(mixed_prepared, tiny_llama, tmp_path / "hs", layer_ids=(1, 2, NUM_LAYERS))
    with pytest.raises(Eagle3InputError, match="dtype must be one of"):
        extract(mixed_prepared, tiny_llama, tmp_path / "hs", dtype="int8")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("not ours")
    # never a directory extract did not write, even with --overwrite (it used to delete files matching its names)
    (stranger / "index.json").write_text("{}")
    (stranger / "manifest.json").write_text("{}")
    (stranger / "train").mkdir()
    (stranger / "train" / "shard-00000.safetensors").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(Eagle3InputError, match="not an earlier output of eagle3-train extract"):
            extract(mixed_prepared, tiny_llama, stranger, device="cpu", overwrite=overwrite)
        with pytest.raises(Eagle3InputError, match="not an earlier output of eagle3-train extract"):
            extract(mixed_prepared, tiny_llama, mixed_prepared, device="cpu", overwrite=overwrite)
    assert sorted(str(p.relative_to(stranger)) for p in stranger.rglob("*")) == [
        "index.json", "manifest.json", "notes.txt", "train", "train/shard-00000.safetensors"]
    assert (mixed_prepared / "manifest.json").is_file()
    assert not (tmp_path / "hs").exists()


def test_refuses_when_disk_cannot_hold_the_estimate(tmp_path, tiny_llama, mixed_prepared, monkeypatch):
    out = tmp_path / "hs"
    # 4 x H x 4 bytes of float32 states + 8 bytes of verifier stats per token
    with pytest.raises(Eagle3InputError, match=r"not enough disk space.*\d+ tokens x 1032 bytes"):
        extract(mixed_prepared, tiny_llama, out, dtype="float32", device="cpu", disk_margin=2**62)
    monkeypatch.setenv("EAGLE3_TRAIN_DISK_MARGIN_BYTES", str(2**62))
    with pytest.raises(Eagle3InputError, match="not enough disk space"):
        extract(mixed_prepared, tiny_llama, out, device="cpu")
    assert not out.exists(), "nothing may be written before the disk check"


def test_default_disk_margin_is_a_tenth_of_the_estimate_capped_at_one_gib(monkeypatch):
    from eagle3_train.hidden_states.resume import _disk_margin

    monkeypatch.delenv("EAGLE3_TRAIN_DISK_MARGIN_BYTES", raising=False)
    # a 30 MB test extraction must not need 1 GiB free; a 100 GiB one keeps 1 GiB for its checkpoints
    assert _disk_margin(None, 30 * 2**20) == 3 * 2**20
    assert _disk_margin(None, 100 * 2**30) == 2**30
    assert _disk_margin(0, 100 * 2**30) == 0


@pytest.mark.slow
def test_rerun_skips_and_mismatch_needs_overwrite(tmp_path, tiny_llama, mixed_prepared):
    out = tmp_path / "hs"
    # hash_weights: the other verifier below has the same config and file sizes (by default sizes identify it)
    kw = dict(dtype="float32", device="cpu", token_budget=64, shard_tokens=60, hash_weights=True)
    first = extract(mixed_prepared, tiny_llama, out, **kw)
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*/shard-*.safetensors")}
    again = extract(mixed_prepared, tiny_llama, out, **kw)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*/shard-*.safetensors")} == stamps
    assert again["counts"] == first["counts"] and again["throughput"] == first["throughput"]

    with pytest.raises(Eagle3InputError, match=r"layer_ids: existing \[1, 2, 3\], requested \[0, 1, 2\].*--overwrite"):
        extract(mixed_prepared, tiny_llama, out, layer_ids=(0, 1, 2), **kw)
    with pytest.raises(Eagle3InputError, match="dtype: existing 'float32', requested 'bfloat16'"):
        extract(mixed_prepared, tiny_llama, out, **{**kw, "dtype": "bfloat16"})
    other_model = make_tiny_llama(tmp_path / "other-model", seed=1)
    with pytest.raises(Eagle3InputError, match="verifier: existing"):
        extract(mixed_prepared, other_model, out, **kw)
    changed = make_prepared(tmp_path / "changed", MIXED, seed=5)
    with pytest.raises(Eagle3InputError, match="prepared_manifest_sha256"):
        extract(changed, tiny_llama, out, **kw)

    replaced = extract(mixed_prepared, other_model, out, overwrite=True, **kw)
    assert replaced["verifier"]["path"] == str(other_model.resolve())
    check_hidden_states(out, mixed_prepared, other_model)


def test_a_second_extract_into_the_same_dir_stops_and_deletes_nothing(tmp_path, tiny_llama, mixed_prepared):
    """Another process holds the output directory: extract refuses before touching its temporary files; once that
    process is gone (even by kill -9), the directory is free again."""
    out = tmp_path / "hs"
    kw = dict(dtype="float32", device="cpu", token_budget=64, shard_tokens=60)
    extract(mixed_prepared, tiny_llama, out, **kw)  # the directory as a writer leaves it between two shards
    with another_writer(f"output_lock({str(out)!r}, 'x')") as (holder, _):
        in_flight = out / "train" / ".shard-00000.safetensors.abc.tmp"
        in_flight.write_bytes(b"half a shard")
        busy = rf"{out} is being written by another process \(pid {holder.pid}\)"
        with pytest.raises(Eagle3InputError, match=busy):
            extract(mixed_prepared, tiny_llama, out, **kw)
        assert in_flight.read_bytes() == b"half a shard"
    extract(mixed_prepared, tiny_llama, out, **kw)
    assert not in_flight.exists()  # the dead writer's temporary file is cleared as before
    check_hidden_states(out, mixed_prepared, tiny_llama)


def test_cli_extract(tmp_path, tiny_llama, mixed_prepared, capsys):
    out = tmp_path / "hs"
    args = ["extract", "--prepared", str(mixed_prepared), "--verifier", str(tiny_llama), "--out", str(out),
            "--dtype", "float16", "--layer-ids", "0,2,3", "--token-budget", "64", "--shard-tokens", "50",
            "--device", "cpu", "--max-samples", "5"]
    assert cli.main(args) == 0
    assert "complete: 8 samples" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layer_ids"] == [0, 2, 3] and manifest["dtype"] == "float16" and manifest["max_samples"] == 5
    assert HiddenStatesReader(out, "train").sample_indices == [0, 1, 2, 3, 4]
    assert HiddenStatesReader(out, "train").load(4)["final"].dtype == torch.float16
    assert cli.main([*args[:-4], "--layer-ids", "1,2,9", "--device", "cpu"]) == 2
    assert "layer id 9 is out of range" in capsys.readouterr().err
    assert cli.main([*args[:-4], "--layer-ids", "3,2,0", "--device", "cpu"]) == 2
    assert "[3, 2, 0] are not in increasing order" in capsys.readouterr().err


# ---------------------------------------------------------------- a real kill in the middle

@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path, tiny_llama):
    # Shard 0 is a few short samples (done quickly); then one long sample per shard keeps the process busy.
    lengths = {"train": [16, 16, 16, 16] + [1536] * 8, "validation": [12, 20]}
    prepared = make_prepared(tmp_path / "prep", lengths)
    opts = ["--dtype", "float32", "--device", "cpu", "--token-budget", "2048", "--shard-tokens", "64"]
    out = tmp_path / "hs"
    cmd = [sys.executable, "-m", "eagle3_train.cli", "extract", "--prepared", str(prepared),
           "--verifier", str(tiny_llama), "--out", str(out), *opts]
    env = {**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"}

    index = kill_after_first_shard(cmd, env, out)
    assert 1 <= len(index["shards"]) < index["num_shards"] and not index["complete"]
    assert json.loads((out / "manifest.json").read_text())["status"] == "in_progress"
    finished = {out / "train" / e["file"]: (os.stat(out / "train" / e["file"]).st_ino,
                                            os.stat(out / "train" / e["file"]).st_mtime_ns) for e in index["shards"]}
    with pytest.raises(Eagle3InputError, match="incomplete"):
        check_hidden_states(out, prepared, tiny_llama)

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    for path, stamp in finished.items():
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == stamp, f"{path} was rewritten"
    assert not list(out.glob("**/*.tmp"))

    reference = tmp_path / "reference"
    assert cli.main(["extract", "--prepared", str(prepared), "--verifier", str(tiny_llama), "--out", str(reference),
                     *opts]) == 0
    check_hidden_states(out, prepared, tiny_llama)
    for split in lengths:
        assert HiddenStatesReader(reference, split).sample_indices == list(range(len(lengths[split])))
    assert_same_hidden_states(reference, out, lengths)
    assert json.loads((out / "manifest.json").read_text())["counts"] == json.loads(
        (reference / "manifest.json").read_text())["counts"]


# ---------------------------------------------------------------- the real verifier

@pytest.mark.slow
def test_smollm2_matches_output_hidden_states(tmp_path):
    from transformers import AutoTokenizer

    from eagle3_train.assets.verifier import resolve_verifier

    verifier = resolve_verifier("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(verifier)
    texts = ["What is speculative decoding?", "Name three colours.", "Hi"]
    tokens = {("train", r): tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                    add_generation_prompt=True, return_dict=False)
              for r, t in enumerate(texts)}
    tokens[("validation", 0)] = tokens[("train", 0)]
    prepared = make_prepared(tmp_path / "prep", {"train": [len(tokens[("train", r)]) for r in range(3)],
                                                 "validation": [len(tokens[("train", 0)])]}, tokens=tokens)
    out = tmp_path / "hs"
    manifest = extract(prepared, "smollm2-135m-instruct", out, dtype="float32", device="cpu")
    assert manifest["layer_ids"] == [2, 15, 27] and manifest["hidden_size"] == 576
    reader = HiddenStatesReader(out, "train")
    for r in range(3):
        hs, final = reference_states(verifier, tokens[("train", r)])
        got = reader.load(r)
        # a padded batch against one sample: the same fp32 math summed in another order, per layer
        for part, layer in zip(got["aux"].chunk(3, dim=-1), (2, 15, 27), strict=True):
            torch.testing.assert_close(part, hs[layer], rtol=1e-4, atol=fp32_atol(hs[layer]))
        torch.testing.assert_close(got["final"], final, rtol=1e-4, atol=fp32_atol(final))


def test_extract_and_offline_evaluation_tap_the_same_states(tmp_path):
    """Training reads what extract stores, evaluation feeds the draft what TappedVerifier captures: for the same
    tokens both are the inputs of the aux layers (HF hidden_states[i]), whatever the padding around them."""
    from transformers import AutoModelForCausalLM

    from eagle3_train.evaluate.decode import TappedVerifier
    from eagle3_train.hidden_states.hf_backend import run_batch
    from eagle3_train.hidden_states.layers import AuxCapture, decoder_parts

    model_dir = make_tiny_llama(tmp_path / "verifier")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = (0, 2, 3)
    seqs = [[5, 9, 2, 7, 11, 3], [4, 8, 1]]  # the shorter one is padded in extract's batch
    base, layers = decoder_parts(model)
    capture = AuxCapture(layers, ids, torch.float32)
    with torch.no_grad():
        aux, _ = run_batch(base, capture, seqs, pad_id=0, device="cpu", store_dtype=torch.float32)
    capture.remove()
    tapped = TappedVerifier(model, ids)
    try:
        offsets = [0, len(seqs[0]), len(seqs[0]) + len(seqs[1])]
        for b, seq in enumerate(seqs):
            _, eval_aux = tapped(seq, tapped.new_cache(), 0)
            torch.testing.assert_close(eval_aux, aux[offsets[b]:offsets[b + 1]], rtol=1e-5, atol=1e-5)
            hidden, _ = reference_states(model_dir, seq)
            torch.testing.assert_close(eval_aux, torch.cat([hidden[i] for i in ids], dim=-1), rtol=1e-5, atol=1e-5)
    finally:
        tapped.close()
    assert all(not layer._forward_pre_hooks for layer in layers)  # both removed their hooks


def test_a_draft_taught_in_another_dtype_than_it_is_served_in_is_named(tmp_path):
    from eagle3_train.evaluate.served import _trained_dtype_note

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "training_metadata.json").write_text(json.dumps({"data": {"hidden_states_compute_dtype": "bfloat16"}}))
    note = _trained_dtype_note(str(draft), "float32")
    assert note["trained_on"] == "bfloat16" and "--compute-dtype float32" in note["note"]
    assert _trained_dtype_note(str(draft), "bfloat16") is None
    assert _trained_dtype_note(str(tmp_path / "no-metadata"), "float32") is None


def test_extract_takes_the_layers_of_the_draft_it_will_finetune(tmp_path, tiny_llama, mixed_prepared, head, vocab_a):
    """`--finetune-from SOURCE` extracts the layers the source was trained on (read as the finetune reads them), so
    the finetune is not refused after the extraction; --layer-ids that contradict the source are refused first."""
    from support.draft_layouts import SMOL, write_specforge

    from eagle3_train.model.config import DraftConfig
    from eagle3_train.model.draft import Eagle3Draft

    draft = Eagle3Draft(DraftConfig.from_verifier(SMOL, vocab_a[0].shape[0], aux_layer_ids=(1, 2, 3)))
    draft.set_vocab(*vocab_a)
    source = write_specforge(draft, tmp_path / "sf", head[0])  # nested in eagle_config as 0,1,2: output of layer i
    m = extract(mixed_prepared, tiny_llama, tmp_path / "hs", device="cpu", max_samples=1, splits=("train",),
                finetune_from=str(source))
    assert m["layer_ids"] == [1, 2, 3] and m["layer_ids_from"] == str(source)
    with pytest.raises(Eagle3InputError, match=r"differ from the layers the finetune source"):
        extract(mixed_prepared, tiny_llama, tmp_path / "hs2", device="cpu", layer_ids="0,1,2",
                finetune_from=str(source))
    # the user's word on how the source's ids are meant decides, and is recorded
    m = extract(mixed_prepared, tiny_llama, tmp_path / "hs3", device="cpu", max_samples=1, splits=("train",),
                finetune_from=str(source), source_aux_convention="vllm")
    assert m["layer_ids"] == [0, 1, 2] and m["layer_ids_convention"] == "vllm"


@pytest.mark.slow
def test_torchrun_processes_share_one_store_and_resume_any_run(tmp_path, tiny_llama):
    """Two processes (a GPU each on a real node) extract disjoint shards into one store, equal to one process's; a
    single-process run killed after its first shard is finished by two processes."""
    from support.numerics import fixed_threads

    lengths = {"train": [16, 16, 16, 16] + [768] * 7, "validation": [12, 20, 30]}
    prepared = make_prepared(tmp_path / "prep", lengths)
    opts = ["--dtype", "float32", "--device", "cpu", "--token-budget", "1024", "--shard-tokens", "64"]
    reference = tmp_path / "reference"
    # the threads of each of the two processes (the cores shared between them): the same kernels on both sides
    with fixed_threads(max(1, (os.cpu_count() or 1) // 2)):
        assert cli.main(["extract", "--prepared", str(prepared), "--verifier", str(tiny_llama), "--out",
                         str(reference), *opts]) == 0
    env = {**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"}
    single = [sys.executable, "-m", "eagle3_train.cli", "extract", "--prepared", str(prepared), "--verifier",
              str(tiny_llama), *opts]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *single[1:]]

    both = tmp_path / "both"
    r = run_group([*torchrun, "--out", str(both)], 900, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("complete:") == 1  # rank 0 reports for both
    manifest = json.loads((both / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["processes"] == 2
    assert manifest["throughput"]["tokens"] == sum(map(sum, lengths.values()))
    check_hidden_states(both, prepared, tiny_llama)
    assert_same_hidden_states(reference, both, lengths)

    resumed = tmp_path / "resumed"
    index = kill_after_first_shard([*single, "--out", str(resumed)], env, resumed)
    assert not index["complete"]
    r = run_group([*torchrun, "--out", str(resumed)], 900, env)
    assert r.returncode == 0, r.stderr[-3000:]
    check_hidden_states(resumed, prepared, tiny_llama)
    assert_same_hidden_states(reference, resumed, lengths)
    assert json.loads((resumed / "manifest.json").read_text())["throughput"]["tokens"] < manifest["throughput"][
        "tokens"]  # the killed run's shards were kept, not redone
