"""The on-disk format of stored hidden states (the output of the extract stage): writing shards, reading them back,
and checking they belong to a dataset and verifier.

Format (docs/ARCHITECTURE.md): `DIR/{split}/shard-NNNNN.safetensors` with `aux` [N, 3H], `final` [N, H],
`sample_index` [n], `offsets` [n+1] and, optionally, `verifier_argmax` [N] int32 and `verifier_lse` [N] float32;
`DIR/{split}/index.json` (`split_index`: one entry per shard, as `write_shard` returns it); `DIR/manifest.json`
(written by `extract.py`, or by hybrid training in `online.py`). Writing: `plan_shards(lengths, shard_tokens)` (the
deterministic cut a resume relies on), `write_shard(path, aux, final, plan, metadata, stats)`, `split_index`,
`shard_entry_ok`, `store_dtypes(name)` (bytes per token: `utils/store_bytes.py`).

Reading: `HiddenStatesReader(hidden_dir, split)` with `.manifest`, `.sample_indices`, `.num_tokens(i)`,
`.load(i) -> {"aux": Tensor[L, 3H], "final": Tensor[L, H]}` plus, when every shard of the split has them,
`"verifier_argmax": Tensor[L] int64, "verifier_lse": Tensor[L] float32` (`.has_verifier_stats`: the verifier's
full-vocabulary argmax and logsumexp per token, stored by the HF extract backend; a split some of whose shards lack
them, e.g. an older store resumed by a newer extract, is read without them); `check_hidden_states(hidden, prepared_dir,
verifier)` (the one check of the hidden-states contract: made from this prepared data by this verifier, at these
layers); `reextract_command(manifest, hidden_dir, split)`. fp8 shards (extract --store-dtype float8_e4m3) are decoded to
bfloat16 on load (`_rows`).

A damaged shard stops with an Eagle3InputError naming it and the command that re-extracts it: sizes are checked
against index.json when the reader opens, SHA-256 on a shard's first read in a process, NaN/Inf on every sample
(and for the verifier stats: row counts, a finite logsumexp, an argmax inside the verifier's vocabulary).
"""

from __future__ import annotations

import os
import shlex
import typing
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_train.assets.verifier import Verifier, resolve_verifier, same_verifier, verifier_identity
from eagle3_train.settings import StoreDtype
from eagle3_train.utils.io import Eagle3InputError, atomic_path, file_in, read_json, save_safetensors, sha256_file

FORMAT = "eagle3-train-hidden-states"
FORMAT_VERSION = 1
STORE_DTYPES = typing.get_args(StoreDtype)
STATS = ("verifier_argmax", "verifier_lse")  # shard tensors of the verifier's full-vocab stats (extract, HF backend)
STATS_BYTES = 8  # per token: verifier_argmax int32 + verifier_lse float32


@dataclass(frozen=True)
class ShardPlan:
    number: int
    rows: tuple[int, ...]  # row indices in the prepared split, in storage order
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[ShardPlan]:
    """Sort rows by length (ties by row) and cut a shard once it holds >= shard_tokens tokens.

    Deterministic in the data and shard_tokens only, so a rerun finds the same shards to skip. Shortest first:
    similar lengths share batches (little padding).
    """
    order = sorted(range(len(lengths)), key=lambda r: (lengths[r], r))
    shards: list[ShardPlan] = []
    rows: list[int] = []
    tokens = 0
    for r in order:
        rows.append(r)
        tokens += lengths[r]
        if tokens >= shard_tokens:
            shards.append(ShardPlan(len(shards), tuple(rows), tuple(lengths[i] for i in rows)))
            rows, tokens = [], 0
    if rows:
        shards.append(ShardPlan(len(shards), tuple(rows), tuple(lengths[i] for i in rows)))
    return shards


def store_dtypes(name: str):
    """(dtype the states are collected in, bytes per element on disk) for a store dtype; fp8 shards are
    collected in bfloat16 and quantized per row when written (`fp8.encode_rows`)."""
    import torch

    from eagle3_train.hidden_states import fp8

    if name not in STORE_DTYPES:
        raise Eagle3InputError(f"store dtype must be one of {', '.join(STORE_DTYPES)}, got {name!r}")
    if name == fp8.STORE_NAME:
        return torch.bfloat16, 1
    dtype = getattr(torch, name)
    return dtype, torch.empty((), dtype=dtype).element_size()


def write_shard(path: Path, aux, final, plan: ShardPlan, metadata: dict[str, str], stats=None) -> dict:
    """Write one shard atomically and return its index.json entry. `metadata["dtype"]` float8_e4m3 quantizes `aux`
    and `final` per row; `stats`: (verifier_argmax [N], verifier_lse [N]) or None, stored as int32 / float32."""
    import torch

    from eagle3_train.hidden_states import fp8

    offsets = [0]
    for n in plan.lengths:
        offsets.append(offsets[-1] + n)
    tensors = {"aux": aux, "final": final, "sample_index": torch.tensor(plan.rows, dtype=torch.int64),
               "offsets": torch.tensor(offsets, dtype=torch.int64)}
    if metadata.get("dtype") == fp8.STORE_NAME:  # one scale per token row and layer
        for name, groups in (("aux", aux.shape[1] // final.shape[1]), ("final", 1)):
            tensors[name], tensors[name + fp8.SCALE_SUFFIX] = fp8.encode_rows(tensors[name], groups)
    if stats is not None:
        tensors["verifier_argmax"] = stats[0].to(torch.int32)
        tensors["verifier_lse"] = stats[1].to(torch.float32)
    with atomic_path(path) as tmp:
        save_safetensors(tensors, tmp, metadata=metadata)
        digest, size = sha256_file(tmp), tmp.stat().st_size
    return {"shard": plan.number, "file": path.name, "num_samples": len(plan.rows), "num_tokens": plan.num_tokens,
            "sample_indices": list(plan.rows), "offsets": offsets, "bytes": size, "sha256": digest,
            "verifier_stats": stats is not None}


def split_index(split: str, plans: list[ShardPlan], done: dict[int, dict]) -> dict:
    """A split's index.json: the entries of the shards written so far (`done`, by shard number) of those planned."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "split": split,
        "num_samples": sum(len(p.rows) for p in plans), "num_tokens": sum(p.num_tokens for p in plans),
        "num_shards": len(plans), "complete": len(done) == len(plans),
        "shards": [done[n] for n in sorted(done)],
    }


def shard_entry_ok(entry: dict, plan: ShardPlan, split_dir: Path) -> bool:
    """An index entry still describes `plan` and its file has the recorded size (a resume keeps that shard)."""
    f = split_dir / str(entry.get("file", ""))
    return (entry.get("sample_indices") == list(plan.rows) and f.is_file()
            and f.stat().st_size == entry.get("bytes"))


def read_manifest(hidden_dir: str | Path) -> dict:
    hidden_dir = Path(hidden_dir)
    if not hidden_dir.is_dir():
        raise Eagle3InputError(f"hidden-states directory not found: {hidden_dir} (run `eagle3-train extract` first)")
    manifest = read_json(hidden_dir / "manifest.json", "hidden-states manifest")
    if manifest.get("format") != FORMAT:
        raise Eagle3InputError(f"{hidden_dir / 'manifest.json'} is not an extract manifest "
                               f"(format {manifest.get('format')!r}, expected {FORMAT!r})")
    return manifest


def check_hidden_states(hidden: str | Path | dict, prepared_dir: str | Path,
                        verifier: str | Path | Verifier | dict | None = None,
                        layer_ids: Sequence[int] | None = None, require_complete: bool = True,
                        hash_weights: bool = True, where: str | None = None) -> dict:
    """Raise Eagle3InputError unless the hidden states were extracted from `prepared_dir` with `verifier`.

    `hidden` is the extract output dir or its manifest; `verifier` a name/dir, a Verifier or an identity dict (None:
    skip that check). `hash_weights=False` compares weight-file sizes only (fast for large verifiers). The stored
    verifier stats (full-vocab argmax and logsumexp) depend on the verifier's config and lm_head only, so the verifier
    check covers them too; their per-shard sizes and values are checked by `HiddenStatesReader`.
    Returns the manifest.
    """
    manifest = hidden if isinstance(hidden, dict) else read_manifest(hidden)
    where = where or ("the hidden states" if isinstance(hidden, dict) else f"the hidden states in {hidden}")
    prepared_manifest = Path(prepared_dir) / "manifest.json"
    if not prepared_manifest.is_file():
        raise Eagle3InputError(f"prepared data manifest not found: {prepared_manifest}")
    sha = sha256_file(prepared_manifest)
    if manifest.get("prepared_manifest_sha256") != sha:
        raise Eagle3InputError(
            f"{where} do not belong to the prepared data in {prepared_dir}: they were extracted from other data "
            f"({manifest.get('prepared_dir')}, manifest sha256 {str(manifest.get('prepared_manifest_sha256'))[:12]}), "
            f"this data's manifest has sha256 {sha[:12]}; rerun `eagle3-train extract` on this data")
    if verifier is not None:
        if isinstance(verifier, dict):
            ident = verifier
        elif isinstance(verifier, Verifier):
            ident = verifier.identity(hash_weights)
        else:
            ident = verifier_identity(resolve_verifier(verifier), hash_weights=hash_weights)
        if not same_verifier(manifest.get("verifier", {}), ident):
            raise Eagle3InputError(
                f"{where} were made by verifier {manifest.get('verifier', {}).get('path')}: the requested verifier "
                f"{ident.get('path')} is not the one the hidden states were extracted with (config or weights "
                f"differ); extract again with this verifier")
    if layer_ids is not None and list(layer_ids) != list(manifest.get("layer_ids", [])):
        raise Eagle3InputError(f"{where} tap layers {manifest.get('layer_ids')}, but layers {list(layer_ids)} "
                               f"were requested")
    if require_complete and manifest.get("status") != "complete":
        raise Eagle3InputError(f"{where} are incomplete (status {manifest.get('status')!r}); rerun the same "
                               f"`eagle3-train extract` command to finish them")
    return manifest


def reextract_command(manifest: dict, hidden_dir: str | Path, split: str) -> str:
    """The `eagle3-train extract` command that resumes this extraction for one split (same resume settings)."""
    args = ["eagle3-train", "extract", "--prepared", str(manifest.get("prepared_dir", "PREPARED_DIR")),
            "--verifier", str(manifest.get("verifier_name") or manifest.get("verifier", {}).get("path", "VERIFIER")),
            "--out", str(hidden_dir), "--splits", split]
    for key, flag in (("layer_ids", "--layer-ids"), ("dtype", "--dtype"), ("compute_dtype", "--compute-dtype"),
                      ("shard_tokens", "--shard-tokens"), ("max_samples", "--max-samples")):
        value = manifest.get(key)
        if value is not None:
            args += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return " ".join(shlex.quote(a) for a in args)


def _rows(handle: Any, name: str, start: int, end: int):
    """Rows [start, end) of a shard tensor; fp8 tensors (stored with a `NAME_scale` tensor) decoded to bfloat16."""
    from eagle3_train.hidden_states import fp8

    rows = handle.get_slice(name)[start:end]
    if rows.dtype != fp8.FP8:
        return rows
    return fp8.decode_rows(rows, handle.get_slice(name + fp8.SCALE_SUFFIX)[start:end])


class HiddenStatesReader:
    """Random access to one split's stored hidden states, sample by sample.

    Keeps up to `max_open` shard files open (LRU) and reads only the requested sample's rows with `get_slice`.
    Safe to use in forked DataLoader workers: handles opened by another process are dropped, not shared.
    `hash_on_open` checks a shard's SHA-256 the first time it is opened (one extra read of each shard per run).
    """

    def __init__(self, hidden_dir: str | Path, split: str, max_open: int = 8, hash_on_open: bool = True) -> None:
        self.dir = Path(hidden_dir)
        self.split = split
        self.manifest = read_manifest(self.dir)
        self.index = read_json(self.dir / split / "index.json", f"hidden-state index of split '{split}'")
        self.hidden_size = int(self.manifest["hidden_size"])
        self.layer_ids = list(self.manifest["layer_ids"])
        self.max_open = max(1, max_open)
        # sample index -> (shard position in index, first row, end row)
        self._where: dict[int, tuple[int, int, int]] = {}
        for pos, entry in enumerate(self.index.get("shards", [])):
            offsets = entry["offsets"]
            for k, sample in enumerate(entry["sample_indices"]):
                self._where[int(sample)] = (pos, int(offsets[k]), int(offsets[k + 1]))
        self.sample_indices: list[int] = sorted(self._where)
        shards = self.index.get("shards", [])
        stats = self.manifest.get("verifier_stats") or {}
        # all shards or none: one split never mixes stored stats with computed ones
        self.has_verifier_stats = bool(shards) and bool(stats) and all(e.get("verifier_stats") for e in shards)
        self.vocab_size = int(stats["vocab_size"]) if self.has_verifier_stats else None
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._pid = os.getpid()
        self.hash_on_open = hash_on_open
        self._hashed: set[int] = set()
        self.check_sizes()

    def _damaged(self, path: Path, problem: str) -> Eagle3InputError:
        return Eagle3InputError(
            f"hidden-state shard {path} {problem}. Re-extract it: delete that file and run "
            f"`{reextract_command(self.manifest, self.dir, self.split)}` (it recomputes missing shards and keeps the "
            f"others)")

    def shard_path(self, entry: dict) -> Path:
        """A shard's file, which must exist."""
        path = file_in(self.dir / self.split, entry.get("file"), f"{self.dir / self.split / 'index.json'}")
        if not path.is_file():
            raise self._damaged(path, f"listed in {self.dir / self.split / 'index.json'} is missing")
        return path

    def _check_sha256(self, path: Path, entry: dict) -> None:
        if sha256_file(path) != entry["sha256"]:
            raise self._damaged(path, "is corrupt (its SHA-256 differs from index.json)")

    def check_sizes(self) -> None:
        """Every listed shard exists with the size index.json records (cheap: no data is read)."""
        for entry in self.index.get("shards", []):
            path = self.shard_path(entry)
            size = path.stat().st_size
            if entry.get("bytes") is not None and size != entry["bytes"]:  # else: its SHA-256 on first read
                raise self._damaged(path, f"has {size} bytes but index.json records {entry['bytes']} (truncated or "
                                          f"overwritten)")

    @property
    def complete(self) -> bool:
        return bool(self.index.get("complete"))

    def __len__(self) -> int:
        return len(self.sample_indices)

    def __contains__(self, sample_index: int) -> bool:
        return sample_index in self._where

    def _locate(self, sample_index: int) -> tuple[int, int, int]:
        try:
            return self._where[int(sample_index)]
        except KeyError:
            state = "complete" if self.complete else (
                f"incomplete: {len(self)} of {self.index.get('num_samples')} samples extracted; rerun extract")
            raise Eagle3InputError(f"sample {sample_index} of split '{self.split}' has no stored hidden states in "
                                   f"{self.dir} (extraction {state})") from None

    def num_tokens(self, sample_index: int) -> int:
        _, start, end = self._locate(sample_index)
        return end - start

    def _handle(self, pos: int):
        from safetensors import safe_open

        if self._pid != os.getpid():
            self._handles.clear()
            self._pid = os.getpid()
        handle = self._handles.get(pos)
        if handle is not None:
            self._handles.move_to_end(pos)
            return handle
        entry = self.index["shards"][pos]
        path = self.shard_path(entry)
        if self.hash_on_open and pos not in self._hashed and entry.get("sha256"):
            self._check_sha256(path, entry)
            self._hashed.add(pos)
        try:
            handle = safe_open(str(path), framework="pt")
            rows = handle.get_slice("aux").get_shape()[0]
            final_rows = handle.get_slice("final").get_shape()[0]
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise self._damaged(path, f"cannot be read ({type(e).__name__}: {e})") from None
        if rows != entry["num_tokens"] or final_rows != rows:
            raise self._damaged(path, f"holds {rows} rows but index.json says {entry['num_tokens']} tokens")
        if self.has_verifier_stats:
            keys = set(handle.keys())
            for name in STATS:
                if name not in keys:
                    raise self._damaged(path, f"lacks '{name}', which index.json says it holds")
                if handle.get_slice(name).get_shape() != [rows]:
                    raise self._damaged(path, f"holds '{name}' of shape {handle.get_slice(name).get_shape()}, "
                                              f"expected [{rows}] (one value per token)")
        self._handles[pos] = handle
        while len(self._handles) > self.max_open:
            self._handles.popitem(last=False)
        return handle

    def load(self, sample_index: int) -> dict:
        """{"aux": [L, 3H], "final": [L, H]} in the stored dtype (fp8: bfloat16) for one sample (row of the prepared
        split), with "verifier_argmax" [L] int64 and "verifier_lse" [L] float32 when the split has them."""
        import torch

        pos, start, end = self._locate(sample_index)
        handle = self._handle(pos)
        out = {"aux": _rows(handle, "aux", start, end), "final": _rows(handle, "final", start, end)}
        if self.has_verifier_stats:
            out["verifier_argmax"] = handle.get_slice("verifier_argmax")[start:end].long()
            out["verifier_lse"] = handle.get_slice("verifier_lse")[start:end].float()
        for name, t in out.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                path = self.shard_path(self.index["shards"][pos])
                raise self._damaged(path, f"holds NaN/Inf in '{name}' for sample {sample_index} (rows {start}..{end})")
        top = out.get("verifier_argmax")
        if top is not None and top.numel() and not (0 <= int(top.min()) and int(top.max()) < self.vocab_size):
            path = self.shard_path(self.index["shards"][pos])
            raise self._damaged(path, f"holds a 'verifier_argmax' outside the verifier's {self.vocab_size} tokens for "
                                      f"sample {sample_index} (rows {start}..{end})")
        return out

    def verify(self) -> None:
        """Check every listed shard's SHA-256 against index.json (reads all the data)."""
        for entry in self.index.get("shards", []):
            self._check_sha256(self.shard_path(entry), entry)

    def close(self) -> None:
        self._handles.clear()
