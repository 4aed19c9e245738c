"""Stage `vocab`: choose the draft vocabulary from token frequencies and write the d2t/t2d maps.

Frequencies are counted over the supervised (assistant) tokens of the TRAIN split only, so validation coverage is
an honest estimate. The `size` most frequent tokens are kept (ties broken by the lower token id); when fewer
distinct tokens occur, the unused lowest ids pad the set to exactly `size`. With the chosen ids sorted ascending:
`d2t[i] = ids[i] - i` (int64 [size]: draft index i maps to verifier id i + d2t[i]) and `t2d[ids] = True`
(bool [V], V = the verifier config's vocab_size) - the layout vLLM and SGLang read from EAGLE-3 checkpoints.

Output: `OUT/vocab.safetensors` (`d2t`, `t2d`) and `OUT/manifest.json` (its sha256, the prepared manifest's sha256,
coverage at the chosen size and at a few others).

Python API: `build_vocab(prepared_dir, out_dir, size=..., overwrite=False) -> dict` (the manifest; defaults from
`VocabSettings`), `load_vocab(path) -> (d2t, t2d)`.
CLI: `eagle3-train vocab --prepared DIR --out DIR [--size N] [--overwrite]`.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_train.data.prepare import load_prepared, verifier_vocab_size
from eagle3_train.data.split import TRAIN, VALIDATION
from eagle3_train.settings import VocabSettings
from eagle3_train.utils.io import (
    Eagle3InputError,
    atomic_path,
    check_at_least,
    read_json,
    save_safetensors,
    sha256_file,
    write_json,
)
from eagle3_train.utils.outputs import claim_output_dir, claimed_output, stage_manifest
from eagle3_train.utils.progress import progress
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

log = logging.getLogger(__name__)

VOCAB_FILE = "vocab.safetensors"
_WRITES = (VOCAB_FILE, "manifest.json")
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32000)


def count_supervised(ds, vocab_size: int, where: str = "dataset") -> np.ndarray:
    """Frequency of each token id among the supervised positions of a prepared split (int64 [vocab_size])."""
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    with progress(total=len(ds), desc=f"count {where}", unit="sample") as bar:
        for table in ds.with_format("arrow").iter(batch_size=2048):
            ids = pc.list_flatten(table["input_ids"]).to_numpy().astype(np.int64, copy=False)
            mask = pc.list_flatten(table["loss_mask"]).to_numpy()
            if len(ids) != len(mask):
                raise Eagle3InputError(f"{where}: input_ids and loss_mask lengths differ")
            sup = ids[mask.astype(bool)]
            if len(sup) and (sup.min() < 0 or sup.max() >= vocab_size):
                raise Eagle3InputError(f"{where}: token id {int(sup.max())} outside the verifier vocabulary "
                                       f"[0, {vocab_size}) - was the data prepared with another tokenizer?")
            counts += np.bincount(sup, minlength=vocab_size)
            bar.update(table.num_rows)
    return counts


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """All token ids, most frequent first; equal counts (including zero) by ascending id."""
    ids = np.arange(len(counts))
    return np.lexsort((ids, -counts))


def make_maps(ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [len(ids)], t2d bool [vocab_size]) for a set of verifier token ids."""
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    if len(np.unique(ids)) != len(ids):
        raise ValueError("draft vocabulary ids must be distinct")
    d2t = ids - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[ids] = True
    return d2t, t2d


def coverage(counts: np.ndarray, ids: np.ndarray) -> float | None:
    total = int(counts.sum())
    return float(counts[ids].sum() / total) if total else None


def _check_replace(out_dir: Path, prepared_sha: str, size: int) -> None:
    """Refuse to replace a vocabulary built from other prepared data or for another size (unless --overwrite)."""
    old = out_dir / "manifest.json"
    if not old.is_file():
        if (out_dir / VOCAB_FILE).exists():
            raise Eagle3InputError(f"{out_dir} holds a {VOCAB_FILE} without manifest.json; pass --overwrite to "
                                   f"replace it")
        return
    m = read_json(old, "vocab manifest")
    if m.get("stage") != "vocab":
        raise Eagle3InputError(f"{old} is not a vocab manifest; refusing to replace it (choose another --out)")
    was = ((m.get("prepared") or {}).get("manifest_sha256"), m.get("requested_size"))
    if was != (prepared_sha, size):
        raise Eagle3InputError(f"{out_dir} holds a vocabulary built from other prepared data or with another size "
                               f"(size {m.get('requested_size')}); pass --overwrite to replace it")


def build_vocab(prepared_dir: str | Path, out_dir: str | Path, size: int = VocabSettings.size,
                overwrite: bool = VocabSettings.overwrite) -> dict[str, Any]:
    """Build the draft vocabulary from a prepared directory; returns the manifest written to `out_dir`.

    A vocabulary already in `out_dir` made from the same prepared data and size is rebuilt (same result); one made
    otherwise is replaced only with `overwrite`."""
    import torch

    t0 = time.time()
    prepared_dir = Path(prepared_dir)
    what = "vocab output directory"
    out_dir = claim_output_dir(out_dir, "vocab", what, stage_manifest("vocab"), create=False, writes=_WRITES)
    check_at_least("draft vocabulary size", size, 1)
    dd, prep = load_prepared(prepared_dir)
    if not overwrite:
        _check_replace(out_dir, sha256_file(prepared_dir / "manifest.json"), size)
    vocab_size = (prep.get("verifier") or {}).get("vocab_size")
    if not isinstance(vocab_size, int):
        vocab_size = verifier_vocab_size(Path(prep["verifier"]["path"]))
    chosen = min(size, vocab_size)
    if chosen < size:
        log.warning("draft vocabulary size %d clipped to the verifier vocabulary size %d", size, vocab_size)

    train = count_supervised(dd[TRAIN], vocab_size, f"{prepared_dir}/{TRAIN}")
    val = count_supervised(dd[VALIDATION], vocab_size, f"{prepared_dir}/{VALIDATION}")
    if train.sum() == 0:
        raise Eagle3InputError(f"{prepared_dir}: the train split has no supervised tokens")
    order = rank_tokens(train)
    distinct = int((train > 0).sum())
    ids = order[:chosen]
    d2t, t2d = make_maps(ids, vocab_size)

    table = []
    for k in sorted({min(s, vocab_size) for s in COVERAGE_SIZES} | {chosen}):
        table.append({"size": k, "train": coverage(train, order[:k]), "validation": coverage(val, order[:k])})

    with claimed_output(out_dir, "vocab", what, stage_manifest("vocab"), writes=_WRITES):
        vocab_path = out_dir / VOCAB_FILE
        with atomic_path(vocab_path) as tmp:
            save_safetensors({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, tmp,
                             metadata={"format": "pt"})
        manifest = {
            "stage": "vocab",
            "created": now_iso(),
            "prepared": {"path": str(prepared_dir), "manifest_sha256": sha256_file(prepared_dir / "manifest.json")},
            "verifier_vocab_size": vocab_size,
            "requested_size": size,
            "size": chosen,
            "distinct_supervised_train_tokens": distinct,
            "padded_with_unused": max(chosen - distinct, 0),
            "supervised_tokens": {TRAIN: int(train.sum()), VALIDATION: int(val.sum())},
            "coverage": {TRAIN: coverage(train, ids), VALIDATION: coverage(val, ids)},
            "coverage_table": table,
            "vocab_file": VOCAB_FILE,
            "vocab_sha256": sha256_file(vocab_path),
            "environment": environment(),
            "elapsed_s": round(time.time() - t0, 3),
        }
        write_json(out_dir / "manifest.json", manifest)
    log.info("draft vocabulary: %d of %d tokens, train coverage %.4f -> %s", chosen, vocab_size,
             manifest["coverage"][TRAIN], vocab_path)
    return manifest


def load_vocab(path: str | Path):
    """Load and check `vocab.safetensors` (or a vocab directory): returns torch tensors (d2t int64, t2d bool)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_FILE
    if not path.is_file():
        raise Eagle3InputError(f"draft vocabulary not found: {path}")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise Eagle3InputError(f"{path} is not a readable safetensors file: {e}") from None
    for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        if key not in tensors:
            raise Eagle3InputError(f"{path} has no tensor '{key}' (expected 'd2t' int64 and 't2d' bool)")
        t = tensors[key]
        if t.dtype != dtype or t.dim() != 1:
            raise Eagle3InputError(f"{path}: '{key}' must be a 1-D {dtype} tensor, got {t.dtype} {list(t.shape)}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if int(t2d.sum()) != len(d2t):
        raise Eagle3InputError(f"{path}: t2d marks {int(t2d.sum())} tokens but d2t has {len(d2t)} entries")
    targets = torch.arange(len(d2t), dtype=torch.int64) + d2t
    if not torch.equal(targets, torch.nonzero(t2d).flatten()):
        raise Eagle3InputError(f"{path}: i + d2t[i] are not exactly the ids marked in t2d (in ascending order)")
    return d2t, t2d


def check_vocab_fits(t2d, vocab_size: int, path: str | Path) -> None:
    """The vocabulary-vs-verifier contract: t2d covers exactly the verifier's vocabulary."""
    if t2d.shape[0] != vocab_size:
        raise Eagle3InputError(f"vocab {path}: t2d covers {t2d.shape[0]} target tokens but the verifier's "
                               f"vocab_size is {vocab_size}")


def format_coverage(manifest: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "     -" if x is None else f"{100 * x:6.2f}%"

    lines = [f"{'size':>7}  {'train':>7}  {'valid':>7}"]
    for row in manifest["coverage_table"]:
        mark = "  <- chosen" if row["size"] == manifest["size"] else ""
        lines.append(f"{row['size']:>7}  {pct(row['train'])}  {pct(row['validation'])}{mark}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, VocabSettings)


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(VocabSettings, args)
    manifest = build_vocab(s.prepared, s.out, s.size, overwrite=s.overwrite)
    print(f"draft vocabulary: {manifest['size']} tokens of {manifest['verifier_vocab_size']} "
          f"({manifest['distinct_supervised_train_tokens']} distinct supervised train tokens, "
          f"{manifest['padded_with_unused']} padding ids)")
    print("coverage of supervised tokens:")
    print(format_coverage(manifest))
    print(f"-> {Path(s.out) / VOCAB_FILE}")
    return 0
