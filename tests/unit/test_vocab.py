"""Stage `vocab`: draft vocabulary from supervised train-token frequencies, d2t/t2d maps and coverage."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import save_file

from eagle3_train.cli import main as cli_main
from eagle3_train.data.prepare import prepare
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.vocab.build import COVERAGE_SIZES, build_vocab, load_vocab


def make_prepared(root: Path, train: list[tuple[list[int], list[int]]], validation: list[tuple[list[int], list[int]]],
                  vocab_size: int) -> Path:
    """A prepared directory written by hand (rows of (input_ids, loss_mask)), for exact control of frequencies."""
    def split(rows, prefix):
        return datasets.Dataset.from_dict({
            "id": [f"{prefix}{k}" for k in range(len(rows))],
            "input_ids": [r[0] for r in rows],
            "loss_mask": [r[1] for r in rows],
            "length": [len(r[0]) for r in rows],
            "n_supervised": [sum(r[1]) for r in rows],
        }, features=datasets.Features({
            "id": datasets.Value("string"), "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")), "length": datasets.Value("int32"),
            "n_supervised": datasets.Value("int32")}))

    root.mkdir(parents=True, exist_ok=True)
    dd = datasets.DatasetDict({"train": split(train, "t"), "validation": split(validation, "v")})
    dd.save_to_disk(str(root / "dataset"), num_shards={"train": 1, "validation": 1})
    (root / "manifest.json").write_text(json.dumps({"stage": "prepare", "verifier": {"vocab_size": vocab_size}}))
    return root


def supervised(rows) -> Counter:
    c: Counter = Counter()
    for ids, mask in rows:
        c.update(t for t, m in zip(ids, mask) if m)
    return c


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, expected_ids: list[int], vocab_size: int) -> None:
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.shape == (vocab_size,) and d2t.shape == (len(expected_ids),)
    targets = [i + int(d2t[i]) for i in range(len(d2t))]
    assert targets == sorted(expected_ids)
    assert int(t2d.sum()) == len(expected_ids)
    assert all(bool(t2d[t]) for t in expected_ids)


# train: token 10 x5, 20 x4, 30 x4, 40/50/60 x1 supervised; token 99 frequent but never supervised
TRAIN = [
    ([99, 10, 10, 20, 99], [0, 1, 1, 1, 0]),
    ([99, 10, 20, 30, 30, 40], [0, 1, 1, 1, 1, 1]),
    ([99, 99, 10, 10, 20, 20, 30, 30, 50, 60], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]),
]
VALIDATION = [([98, 98, 98, 10, 20, 70], [1, 1, 1, 1, 1, 1])]  # 98 is frequent only in validation


def test_frequencies_ties_and_round_trip(tmp_path):
    prep = make_prepared(tmp_path / "prep", TRAIN, VALIDATION, vocab_size=100)
    m = build_vocab(prep, tmp_path / "vocab", size=5)
    d2t, t2d = load_vocab(tmp_path / "vocab")
    # 10 (5x), 20 and 30 (4x), then the three 1x tokens tie: lower ids first -> 40, 50
    check_maps(d2t, t2d, [10, 20, 30, 40, 50], 100)
    assert d2t.tolist() == [10, 19, 28, 37, 46]
    assert not t2d[99] and not t2d[98]  # unsupervised and validation-only tokens do not count
    assert m["size"] == 5 and m["requested_size"] == 5 and m["verifier_vocab_size"] == 100
    assert m["distinct_supervised_train_tokens"] == 6 and m["padded_with_unused"] == 0
    train_c, val_c = supervised(TRAIN), supervised(VALIDATION)
    chosen = {10, 20, 30, 40, 50}
    assert m["supervised_tokens"] == {"train": sum(train_c.values()), "validation": sum(val_c.values())}
    assert m["coverage"]["train"] == pytest.approx(sum(train_c[t] for t in chosen) / sum(train_c.values()))
    assert m["coverage"]["validation"] == pytest.approx(sum(val_c[t] for t in chosen) / sum(val_c.values()))
    assert [r["size"] for r in m["coverage_table"]] == [5, 100]  # every default size clipped to V=100
    assert m["coverage_table"][-1]["train"] == pytest.approx(1.0)
    assert m["coverage_table"][-1]["validation"] == pytest.approx(1.0)
    assert m["vocab_sha256"] == hashlib.sha256((tmp_path / "vocab" / "vocab.safetensors").read_bytes()).hexdigest()
    assert m["prepared"]["manifest_sha256"] == hashlib.sha256((prep / "manifest.json").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "vocab" / "manifest.json").read_text())["vocab_sha256"] == m["vocab_sha256"]


def test_padding_with_lowest_unused_ids(tmp_path):
    prep = make_prepared(tmp_path / "prep", [([5, 7, 90, 7], [1, 1, 1, 1])], [([5], [1])], vocab_size=100)
    m = build_vocab(prep, tmp_path / "vocab", size=6)
    d2t, t2d = load_vocab(tmp_path / "vocab" / "vocab.safetensors")
    check_maps(d2t, t2d, [0, 1, 2, 5, 7, 90], 100)
    assert m["padded_with_unused"] == 3 and m["distinct_supervised_train_tokens"] == 3
    assert m["coverage"] == {"train": 1.0, "validation": 1.0}


def test_size_clipped_to_verifier_vocab(tmp_path):
    prep = make_prepared(tmp_path / "prep", [([1, 2, 3], [1, 1, 1])], [], vocab_size=16)
    m = build_vocab(prep, tmp_path / "vocab", size=32000)
    d2t, t2d = load_vocab(tmp_path / "vocab")
    assert m["size"] == 16 and m["requested_size"] == 32000
    check_maps(d2t, t2d, list(range(16)), 16)
    assert d2t.tolist() == [0] * 16
    assert m["coverage"]["validation"] is None  # no validation tokens: coverage undefined, not 0


def test_built_from_real_prepare_output(tmp_path, tiny_llama_dir):
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    recs = [{"id": f"c{k}", "conversations": [
        {"from": "human", "value": f"Question {k}: say {words[k % 8]}"},
        {"from": "gpt", "value": " ".join(words[: 1 + k % 8]) + f" and number {k}"}]} for k in range(40)]
    src = tmp_path / "chats.json"
    src.write_text(json.dumps(recs))
    prepare(src, tiny_llama_dir(), tmp_path / "prep", val_fraction=0.2, seed=0)
    m = build_vocab(tmp_path / "prep", tmp_path / "vocab", size=64)
    dd = datasets.load_from_disk(str(tmp_path / "prep" / "dataset"))
    train_c = supervised(zip(dd["train"]["input_ids"], dd["train"]["loss_mask"]))
    val_c = supervised(zip(dd["validation"]["input_ids"], dd["validation"]["loss_mask"]))
    d2t, t2d = load_vocab(tmp_path / "vocab")
    chosen = {i + int(d2t[i]) for i in range(len(d2t))}
    assert len(chosen) == 64 == int(t2d.sum()) and t2d.shape == (49152,)
    ranked = sorted(train_c, key=lambda t: (-train_c[t], t))
    expected = ranked[:64] + [t for t in range(49152) if t not in train_c][: max(0, 64 - len(ranked))]
    assert chosen == set(expected)
    assert m["coverage"]["train"] == pytest.approx(sum(train_c[t] for t in chosen) / sum(train_c.values()))
    assert m["coverage"]["validation"] == pytest.approx(sum(val_c[t] for t in chosen) / sum(val_c.values()))
    assert m["distinct_supervised_train_tokens"] == len(train_c)
    sizes = [r["size"] for r in m["coverage_table"]]
    assert sizes == sorted({64, *COVERAGE_SIZES})
    for row in m["coverage_table"]:
        top = set(ranked[: row["size"]])
        assert row["train"] == pytest.approx(sum(train_c[t] for t in top) / sum(train_c.values()))


def test_cli_vocab_prints_coverage_table(tmp_path, capsys):
    prep = make_prepared(tmp_path / "prep", TRAIN, VALIDATION, vocab_size=100)
    rc = cli_main(["vocab", "--prepared", str(prep), "--out", str(tmp_path / "vocab"), "--size", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "<- chosen" in out and "coverage" in out
    assert (tmp_path / "vocab" / "vocab.safetensors").is_file()


def test_vocab_replaces_another_vocabulary_only_with_overwrite(tmp_path):
    prep = make_prepared(tmp_path / "prep", TRAIN, VALIDATION, vocab_size=100)
    out = tmp_path / "vocab"
    first = build_vocab(prep, out, size=4)
    assert build_vocab(prep, out, size=4)["vocab_sha256"] == first["vocab_sha256"]  # same inputs: rebuilt as is
    with pytest.raises(Eagle3InputError, match="another size.*--overwrite"):
        build_vocab(prep, out, size=8)
    assert build_vocab(prep, out, size=8, overwrite=True)["size"] == 8
    assert cli_main(["vocab", "--prepared", str(prep), "--out", str(out), "--size", "4"]) == 2
    assert cli_main(["vocab", "--prepared", str(prep), "--out", str(out), "--size", "4", "--overwrite"]) == 0


# ---- bad input -------------------------------------------------------------------------------------------------

def test_build_errors(tmp_path):
    with pytest.raises(Eagle3InputError, match="manifest not found"):
        build_vocab(tmp_path / "missing", tmp_path / "vocab")
    prep = make_prepared(tmp_path / "p1", TRAIN, VALIDATION, vocab_size=100)
    with pytest.raises(Eagle3InputError, match="size must be >= 1"):
        build_vocab(prep, tmp_path / "vocab", size=0)
    prep = make_prepared(tmp_path / "p2", TRAIN, VALIDATION, vocab_size=50)  # ids up to 99
    with pytest.raises(Eagle3InputError, match="outside the verifier vocabulary"):
        build_vocab(prep, tmp_path / "vocab")
    prep = make_prepared(tmp_path / "p3", [([1, 2], [0, 0])], VALIDATION, vocab_size=100)
    with pytest.raises(Eagle3InputError, match="no supervised tokens"):
        build_vocab(prep, tmp_path / "vocab")
    prep = make_prepared(tmp_path / "p4", TRAIN, VALIDATION, vocab_size=100)
    (prep / "dataset").rename(prep / "moved")
    with pytest.raises(Eagle3InputError, match="expected the prepared DatasetDict"):
        build_vocab(prep, tmp_path / "vocab")


@pytest.mark.parametrize("tensors, pattern", [
    ({"t2d": torch.zeros(4, dtype=torch.bool)}, "no tensor 'd2t'"),
    ({"d2t": torch.zeros(2, dtype=torch.int64)}, "no tensor 't2d'"),
    ({"d2t": torch.zeros(2, dtype=torch.int32), "t2d": torch.tensor([1, 1, 0, 0], dtype=torch.bool)},
     "'d2t' must be a 1-D torch.int64"),
    ({"d2t": torch.zeros(2, dtype=torch.int64), "t2d": torch.tensor([1, 1, 0, 0], dtype=torch.uint8)},
     "'t2d' must be a 1-D torch.bool"),
    ({"d2t": torch.zeros(2, dtype=torch.int64), "t2d": torch.tensor([1, 1, 1, 0], dtype=torch.bool)},
     "t2d marks 3 tokens but d2t has 2"),
    ({"d2t": torch.tensor([0, 0], dtype=torch.int64), "t2d": torch.tensor([1, 0, 1, 0], dtype=torch.bool)},
     "not exactly the ids marked in t2d"),
])
def test_load_vocab_rejects_inconsistent_files(tmp_path, tensors, pattern):
    f = tmp_path / "vocab.safetensors"
    save_file(tensors, str(f))
    with pytest.raises(Eagle3InputError, match=pattern):
        load_vocab(f)


def test_load_vocab_missing_or_garbage(tmp_path):
    with pytest.raises(Eagle3InputError, match="not found"):
        load_vocab(tmp_path)
    f = tmp_path / "vocab.safetensors"
    f.write_bytes(b"not a safetensors file")
    with pytest.raises(Eagle3InputError, match="not a readable safetensors"):
        load_vocab(f)
