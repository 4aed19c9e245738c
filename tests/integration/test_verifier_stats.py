"""The verifier's full-vocabulary stats (argmax, logsumexp) stored by extract: equal to a direct computation from the
stored final state, the same training targets and loss curve as the full pass they replace, and stores without them
(older stores, a split only partly holding them) still train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_extract import MIXED, make_prepared, make_tiny_llama

from eagle3_train.hidden_states.extract import extract
from eagle3_train.hidden_states.store import STATS, HiddenStatesReader
from eagle3_train.model.verifier_head import LogitTransform, full_vocab_stats, load_verifier_head
from eagle3_train.train.targets import verifier_targets
from eagle3_train.utils.io import Eagle3InputError, sha256_file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("stats")
    return make_tiny_llama(root / "verifier"), make_prepared(root / "prepared", MIXED)


def direct_stats(final: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = final.float() @ lm_head.float().T
    return logits.argmax(-1), torch.logsumexp(logits, -1)


def strip_stats(store: Path) -> None:
    """Rewrite a store as the extract before the stats wrote it: shards without the two tensors, index entries
    without the flag (sizes and SHA-256 updated), manifest without `verifier_stats`."""
    for index_path in store.glob("*/index.json"):
        index = json.loads(index_path.read_text())
        for e in index["shards"]:
            path = index_path.parent / e["file"]
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            tensors = {k: v for k, v in load_file(str(path)).items() if k not in STATS}
            save_file(tensors, str(path), metadata=meta)
            e.pop("verifier_stats")
            e["bytes"], e["sha256"] = path.stat().st_size, sha256_file(path)
        index_path.write_text(json.dumps(index))
    manifest = json.loads((store / "manifest.json").read_text())
    manifest.pop("verifier_stats")
    (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_stored_stats_equal_a_direct_full_vocab_pass_over_the_stored_final_state(tmp_path, tiny, dtype):
    verifier, prepared = tiny
    manifest = extract(prepared, verifier, tmp_path / "hs", layer_ids=(0, 2, 3), dtype=dtype, device="cpu",
                       token_budget=64, shard_tokens=60)
    _, lm_head, config = load_verifier_head(verifier)
    assert manifest["verifier_stats"]["vocab_size"] == config["vocab_size"] == lm_head.shape[0]
    for split in MIXED:
        reader = HiddenStatesReader(tmp_path / "hs", split)
        assert reader.has_verifier_stats
        for e in reader.index["shards"]:
            assert e["verifier_stats"] is True
            with safe_open(str(tmp_path / "hs" / split / e["file"]), "pt") as f:  # never quantized
                assert f.get_slice("verifier_argmax").get_dtype() == "I32"
                assert f.get_slice("verifier_lse").get_dtype() == "F32"
        for i in reader.sample_indices:
            got = reader.load(i)
            assert got["verifier_argmax"].dtype == torch.long and got["verifier_lse"].dtype == torch.float32
            top, lse = direct_stats(got["final"], lm_head)  # the final state as training reads it
            assert torch.equal(got["verifier_argmax"], top), (split, i)
            torch.testing.assert_close(got["verifier_lse"], lse, rtol=1e-5, atol=1e-5)  # fp32 sum order


def test_full_vocab_stats_apply_the_logit_transform_chunk_by_chunk():
    g = torch.Generator().manual_seed(0)
    h, head = torch.randn(37, 16, generator=g), torch.randn(300, 16, generator=g)
    t = LogitTransform(scale=0.7, softcap=5.0, bias=torch.randn(300, generator=g))
    top, lse = full_vocab_stats(h, head, t, chunk=1024, max_elements=5 * 300)  # 5 rows per chunk
    logits = torch.tanh((h @ head.T + t.bias) * 0.7 / 5.0) * 5.0
    assert torch.equal(top, logits.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    empty = full_vocab_stats(h[:0], head, t)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_targets_from_stored_stats_equal_the_full_pass(tmp_path, tiny):
    from eagle3_train.train.data import TrainingSamples

    verifier, prepared = tiny
    extract(prepared, verifier, tmp_path / "hs", layer_ids=(0, 2, 3), dtype="float32", device="cpu",
            token_budget=64, shard_tokens=60)
    _, lm_head, _ = load_verifier_head(verifier)
    V = lm_head.shape[0]
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(V, generator=g)[:V // 4].sort().values  # a quarter of the vocab: some misses
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    samples = TrainingSamples(prepared, tmp_path / "hs", "train")
    batch = samples.batch(list(range(len(samples))))
    assert batch.verifier_argmax.shape == batch.loss_mask.shape == batch.verifier_lse.shape
    full = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d, chunk=7)
    cached = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d, chunk=7,
                              full_argmax=batch.verifier_argmax, full_lse=batch.verifier_lse)
    assert full.row_of.shape[0] and torch.equal(full.row_of, cached.row_of)
    assert 0 < int(full.in_vocab.sum()) < full.in_vocab.numel()  # both in- and out-of-vocab positions
    assert torch.equal(full.in_vocab, cached.in_vocab) and torch.equal(full.argmax, cached.argmax)
    torch.testing.assert_close(cached.probs, full.probs)
    torch.testing.assert_close(cached.in_mass, full.in_mass, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d, full_argmax=batch.verifier_argmax)


def test_a_split_only_partly_holding_stats_is_read_without_them(tmp_path, tiny):
    """An old store (no stats) resumed by this extract: the new shards have them, the split is read without."""
    verifier, prepared = tiny
    out = tmp_path / "hs"
    kw = dict(layer_ids=(0, 2, 3), dtype="float32", device="cpu", token_budget=64, shard_tokens=60)
    extract(prepared, verifier, out, **kw)
    strip_stats(out)
    index = json.loads((out / "train" / "index.json").read_text())
    dropped = index["shards"].pop()
    (out / "train" / dropped["file"]).unlink()
    index["complete"] = False
    (out / "train" / "index.json").write_text(json.dumps(index))
    extract(prepared, verifier, out, **kw)  # resumes: recomputes the dropped shard, with stats
    entries = json.loads((out / "train" / "index.json").read_text())["shards"]
    assert [bool(e.get("verifier_stats")) for e in entries] == [False] * (len(entries) - 1) + [True]
    reader = HiddenStatesReader(out, "train")
    assert not reader.has_verifier_stats
    assert all(set(reader.load(i)) == {"aux", "final"} for i in reader.sample_indices)
    assert not HiddenStatesReader(out, "validation").has_verifier_stats  # stripped, untouched by the resume


def test_damaged_stats_stop_with_a_clear_error(tmp_path, tiny):
    verifier, prepared = tiny
    out = tmp_path / "hs"
    extract(prepared, verifier, out, layer_ids=(0, 2, 3), dtype="float32", device="cpu", token_budget=64,
            shard_tokens=60, splits=("validation",))
    index_path = out / "validation" / "index.json"
    index = json.loads(index_path.read_text())
    path = out / "validation" / index["shards"][0]["file"]
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))

    def rewrite(**changed) -> None:
        save_file({**tensors, **changed}, str(path), metadata=meta)
        index["shards"][0]["bytes"], index["shards"][0]["sha256"] = path.stat().st_size, sha256_file(path)
        index_path.write_text(json.dumps(index))

    lse = tensors["verifier_lse"].clone()
    lse[1] = float("nan")
    rewrite(verifier_lse=lse)
    reader = HiddenStatesReader(out, "validation")
    with pytest.raises(Eagle3InputError, match="NaN/Inf in 'verifier_lse'"):
        for i in reader.sample_indices:
            reader.load(i)
    top = tensors["verifier_argmax"].clone()
    top[0] = 10**6
    rewrite(verifier_argmax=top)
    reader = HiddenStatesReader(out, "validation")
    with pytest.raises(Eagle3InputError, match="outside the verifier's"):
        for i in reader.sample_indices:
            reader.load(i)
    rewrite(verifier_argmax=tensors["verifier_argmax"][:-1])
    with pytest.raises(Eagle3InputError, match="'verifier_argmax' of shape"):
        HiddenStatesReader(out, "validation").load(reader.sample_indices[0])


@pytest.mark.slow
def test_training_on_stored_stats_gives_the_loss_curve_of_the_full_pass(tiny_stages, tmp_path):
    from support.stage_helpers import train_config

    from eagle3_train.train.data import TrainingSamples
    from eagle3_train.train.trainer import train

    root, _ = tiny_stages
    assert HiddenStatesReader(root / "hidden", "train").has_verifier_stats
    old = tmp_path / "hidden-old"
    shutil.copytree(root / "hidden", old)
    strip_stats(old)  # what the extract before the stats wrote
    assert TrainingSamples(root / "prepared", old, "train").batch([0]).verifier_argmax is None

    curves = {}
    for name, hidden in (("stats", root / "hidden"), ("old", old)):
        # AdamW: Muon's bf16 Newton-Schulz would turn the two paths' float roundings into bf16 steps
        result = train(train_config(root, tmp_path / f"run-{name}", hidden_states=str(hidden), max_steps=6,
                                    optimizer="adamw"))
        assert result["step"] == 6
        rows = [json.loads(x) for x in (tmp_path / f"run-{name}" / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [(r["split"], r["step"], r["loss_0"], r["loss_2"], r.get("acc_0")) for r in rows
                        if "loss_0" in r]
    assert len(curves["stats"]) >= 6 and [c[:2] for c in curves["stats"]] == [c[:2] for c in curves["old"]]
    for a, b in zip(curves["stats"], curves["old"]):
        torch.testing.assert_close(torch.tensor(a[2:4]), torch.tensor(b[2:4]), rtol=1e-4, atol=1e-5)
        assert a[4] == pytest.approx(b[4], abs=1e-6)


def test_a_bf16_verifier_stores_the_argmax_its_own_bf16_head_takes(tmp_path, tiny):
    """Extract in bf16 keeps the lm_head in bf16: the stored argmax is the one the verifier (and a bf16 server)
    takes from the stored final state, not a float32 recomputation that disagrees on near-ties."""
    from transformers import AutoModelForCausalLM

    verifier, prepared = tiny
    manifest = extract(prepared, verifier, tmp_path / "hs", layer_ids=(0, 2, 3), dtype="bfloat16", device="cpu",
                       token_budget=64, shard_tokens=60, compute_dtype="bfloat16")
    assert manifest["verifier_stats"]["lm_head_dtype"] == "bfloat16"
    head = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.bfloat16).get_output_embeddings()
    same = total = 0
    own_gap = fp32_gap = 0.0  # |stored logsumexp - the bf16 head's| and |... - a float32 head's|
    for split in MIXED:
        reader = HiddenStatesReader(tmp_path / "hs", split)
        for i in reader.sample_indices:
            got = reader.load(i)
            with torch.no_grad():
                own = head(got["final"].bfloat16()).float()
                fp32_lse = direct_stats(got["final"], head.weight)[1]
            # another row count may order the float32 accumulation otherwise, moving a logit by one bf16 step:
            # only positions whose top two logits lie further apart than that must agree
            top2 = own.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1]) > top2[:, 0].abs() * 2**-7
            same += int(((got["verifier_argmax"] == own.argmax(-1)) | ~clear).sum())
            total += got["verifier_argmax"].numel()
            own_gap = max(own_gap, float((got["verifier_lse"] - torch.logsumexp(own, -1)).abs().max()))
            fp32_gap = max(fp32_gap, float((got["verifier_lse"] - fp32_lse).abs().max()))
    # one-step moves change a logsumexp by ~1e-6 here; a float32 head's differs ~40x more (3.9e-5 on this model)
    assert own_gap < fp32_gap / 4, (own_gap, fp32_gap)
    assert total > 0 and same == total, f"{total - same} of {total} positions (near-ties excused) store another argmax"
