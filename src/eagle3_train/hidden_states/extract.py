"""Extract stage: run the verifier over the prepared samples and store its aux and final hidden states.

Python API: `extract(prepared_dir, verifier, out_dir, ...) -> dict` (the manifest).
CLI: `eagle3-train extract --prepared DIR --out DIR [--verifier NAME_OR_DIR] [--layer-ids 2,15,27] [--store-dtype D]
[--compute-dtype D] [--token-budget N] [--shard-tokens N] [--device auto|cpu|cuda] [--max-samples N]
[--splits train,validation] [--overwrite] [--backend hf|vllm --endpoint URL [--endpoint URL2] [--concurrency N]]`
(defaults: `ExtractSettings`, docs/CONFIG.md).

Backends: `hf` (default) runs the verifier here with transformers; `vllm` asks hidden-state servers (`eagle3-train
serve --extract-hidden-states`) for the same states, for verifiers only a serving engine can run
(`hidden_states/vllm_backend.py`). Both write the same shards, index and manifest (`backend` records which).

Output (docs/ARCHITECTURE.md): `OUT/{split}/shard-NNNNN.safetensors` with `aux` [N, 3H], `final` [N, H],
`sample_index` [n], `offsets` [n+1], and (HF backend) `verifier_argmax` [N] int32 and `verifier_lse` [N] float32;
`OUT/{split}/index.json`; `OUT/manifest.json`.

Only the base model runs (no full-vocab logits kept, no `output_hidden_states`): forward pre-hooks keep the unpadded
rows of the three tapped layer inputs, and the base model's output is the final-norm state. The HF backend also
stores the verifier's full-vocabulary argmax and logsumexp per token (`model.verifier_head.full_vocab_stats`: float32,
from the final state as stored, i.e. after the store dtype's rounding, with the verifier's logit transform; computed in
row chunks), so training need not redo that pass every epoch; the vLLM backend has no lm_head and stores none (the
manifest's `verifier_stats` and each index entry's `verifier_stats` flag say which shards have them). Shards are
planned deterministically from the data (length-sorted, cut every `shard_tokens` tokens), written atomically, and
listed in `index.json` after each one, so rerunning the same command resumes where a killed run stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from eagle3_train.assets.verifier import Verifier, as_verifier, from_pretrained, same_verifier
from eagle3_train.data.prepare import check_prepared_tokenizer
from eagle3_train.hidden_states.layers import AuxCapture, decoder_parts
from eagle3_train.model.aux_layers import parse_layer_ids, validate_layer_ids
from eagle3_train.settings import Dtype, ExtractBackend, ExtractSettings, StoreDtype
from eagle3_train.utils.io import (
    Eagle3InputError,
    atomic_path,
    check_at_least,
    read_json,
    save_safetensors,
    sha256_file,
    write_json,
)
from eagle3_train.utils.outputs import claim_output_dir, claimed_output, holds_files, json_says
from eagle3_train.utils.progress import progress
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

log = logging.getLogger(__name__)

DTYPES = typing.get_args(Dtype)
STORE_DTYPES = typing.get_args(StoreDtype)
FORMAT = "eagle3-train-hidden-states"
FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 256 * 2**20  # default shard_tokens aims at shards of about this size
DISK_MARGIN_ENV = "EAGLE3_TRAIN_DISK_MARGIN_BYTES"
# Free space left over after the estimate, for index files and other jobs: a tenth of the estimate, at most 1 GiB,
# so a small job on a nearly full disk still runs and a large one keeps room for its checkpoints.
DEFAULT_DISK_MARGIN = 2**30
REQUIRED_COLUMNS = ("id", "input_ids", "length")
# Settings that change the stored numbers or the shard layout: a resume must match them exactly.
RESUME_KEYS = ("layer_ids", "dtype", "compute_dtype", "hidden_size", "num_layers", "prepared_manifest_sha256",
               "max_samples", "shard_tokens", "backend")
RESUME_DEFAULTS = {"backend": "hf"}  # manifests written before the key existed
BACKENDS = typing.get_args(ExtractBackend)
STATS_BYTES = 8  # per token: verifier_argmax int32 + verifier_lse float32 (HF backend)


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


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[tuple[int, int]]:
    """Cut consecutive samples into batches whose padded size (count * longest) stays <= token_budget.

    Returns (start, end) ranges into `lengths`; a sample longer than the budget gets a batch of its own.
    """
    batches: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if i > start and (i - start + 1) * new_longest > token_budget:
            batches.append((start, i))
            start, new_longest = i, n
        longest = new_longest
    if start < len(lengths):
        batches.append((start, len(lengths)))
    return batches


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise Eagle3InputError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def _store_dtypes(name: str):
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


def resolve_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Eagle3InputError(f"--device {device} was requested but torch sees no CUDA device "
                               f"(torch {torch.__version__}); use --device cpu")
    return device


def load_prepared(prepared_dir: str | Path, splits: Sequence[str]):
    """Open DIR/dataset (a DatasetDict) and check the splits and columns extract needs."""
    import datasets

    prepared_dir = Path(prepared_dir)
    if not prepared_dir.is_dir():
        raise Eagle3InputError(f"prepared directory not found: {prepared_dir} (run `eagle3-train prepare` first)")
    if not (prepared_dir / "manifest.json").is_file():
        raise Eagle3InputError(f"{prepared_dir} has no manifest.json: not the output of `eagle3-train prepare`")
    data_dir = prepared_dir / "dataset"
    if not data_dir.is_dir():
        raise Eagle3InputError(f"{prepared_dir} has no dataset/ directory (expected a saved datasets.DatasetDict)")
    try:
        ds = datasets.load_from_disk(str(data_dir))
    except Exception as e:  # noqa: BLE001 - datasets raises several types for broken dirs
        raise Eagle3InputError(f"could not load the prepared dataset {data_dir}: {e}") from None
    if not isinstance(ds, datasets.DatasetDict):
        raise Eagle3InputError(f"{data_dir} holds a single Dataset; expected a DatasetDict with splits "
                               f"{', '.join(splits)}")
    for split in splits:
        if split not in ds:
            raise Eagle3InputError(f"split '{split}' not found in {data_dir} (it has: {', '.join(ds)})")
        missing = [c for c in REQUIRED_COLUMNS if c not in ds[split].column_names]
        if missing:
            raise Eagle3InputError(f"split '{split}' of {data_dir} lacks column(s) {', '.join(missing)} "
                                   f"(has {', '.join(ds[split].column_names)})")
    return ds




def run_batch(base, capture: AuxCapture, seqs: Sequence[Sequence[int]], pad_id: int, device: str, store_dtype):
    """One padded forward of the base model; returns (aux [n, 3H], final [n, H]) for the real tokens, on device."""
    import torch

    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[b, : len(s)] = True
    ids, mask = ids.to(device), mask.to(device)
    capture.mask = mask
    # Right padding: real tokens never attend to the pads after them and keep positions 0..n-1.
    out = base(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    final = out.last_hidden_state[mask].to(store_dtype)
    return capture.take(), final


def _check_finite(aux, final, lengths: Sequence[int], sample_ids: Sequence[str], split: str, dtype: str) -> None:
    import torch

    bad = ~(torch.isfinite(aux).all(dim=-1) & torch.isfinite(final).all(dim=-1))
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0, 0])
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    k = int(torch.searchsorted(offsets, torch.tensor(row), right=True)) - 1
    hint = " (float16 overflows above 65504: try --dtype bfloat16)" if dtype == "float16" else ""
    raise Eagle3InputError(f"the verifier produced NaN/Inf hidden states for sample id {sample_ids[k]!r} "
                           f"(split '{split}', token {row - int(offsets[k])}){hint}; check the verifier weights "
                           f"and --compute-dtype")


def _disk_margin(margin: int | None, estimate: int) -> int:
    if margin is not None:
        return int(margin)
    env = os.environ.get(DISK_MARGIN_ENV)
    if env:
        try:
            return int(env)
        except ValueError:
            raise Eagle3InputError(f"{DISK_MARGIN_ENV} must be an integer number of bytes, got {env!r}") from None
    return min(DEFAULT_DISK_MARGIN, estimate // 10)


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _our_files(out_dir: Path) -> list[Path]:
    """Files this stage writes (and may delete on --overwrite): never anything else in OUT."""
    if not out_dir.is_dir():
        return []
    files = [f for f in out_dir.iterdir() if f.is_file() and (
        f.name == "manifest.json" or (f.name.startswith(".manifest.json.") and f.name.endswith(".tmp")))]
    for sub in out_dir.iterdir():
        if sub.is_dir():
            files += [f for f in sub.iterdir() if f.is_file() and (
                (f.name.startswith("shard-") and f.suffix == ".safetensors") or f.name == "index.json"
                or (f.name.startswith((".shard-", ".index.json.")) and f.name.endswith(".tmp")))]
    return files


def _resume_conflicts(old: dict, new: dict) -> list[str]:
    diffs = []
    if not same_verifier(old.get("verifier", {}), new["verifier"]):
        diffs.append(f"verifier: existing {old.get('verifier', {}).get('path')} "
                     f"(config {str(old.get('verifier', {}).get('config_sha256'))[:12]}), "
                     f"requested {new['verifier']['path']} (config {new['verifier']['config_sha256'][:12]})")
    for k in RESUME_KEYS:
        if old.get(k, RESUME_DEFAULTS.get(k)) != new[k]:
            diffs.append(f"{k}: existing {old.get(k)!r}, requested {new[k]!r}")
    return diffs


def _shard_entry_ok(entry: dict, plan: ShardPlan, split_dir: Path) -> bool:
    f = split_dir / str(entry.get("file", ""))
    return (entry.get("sample_indices") == list(plan.rows) and f.is_file()
            and f.stat().st_size == entry.get("bytes"))


def _index(split: str, plans: list[ShardPlan], done: dict[int, dict]) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "split": split,
        "num_samples": sum(len(p.rows) for p in plans), "num_tokens": sum(p.num_tokens for p in plans),
        "num_shards": len(plans), "complete": len(done) == len(plans),
        "shards": [done[n] for n in sorted(done)],
    }


def _write_shard(path: Path, aux, final, plan: ShardPlan, metadata: dict[str, str], stats=None) -> dict:
    """`stats`: (verifier_argmax [N], verifier_lse [N]) or None; stored as int32 / float32, never quantized."""
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


_D = ExtractSettings  # keyword defaults below are the settings dataclass's


def extract(prepared_dir: str | Path, verifier: str | Path | Verifier | None, out_dir: str | Path,
            layer_ids: Sequence[int] | str | None = _D.layer_ids, dtype: str = _D.dtype, device: str | None = _D.device,
            token_budget: int = _D.token_budget, shard_tokens: int | None = _D.shard_tokens,
            splits: Sequence[str] | None = None, max_samples: int | None = _D.max_samples,
            compute_dtype: str | None = _D.compute_dtype, overwrite: bool = _D.overwrite,
            disk_margin: int | None = None, backend: str = _D.backend, endpoints: Sequence[str] = (),
            vllm_options: dict[str, Any] | None = None, trust_remote_code: bool = _D.trust_remote_code,
            hash_weights: bool = _D.hash_weights, finetune_from: str | None = _D.finetune_from) -> dict:
    """Store the verifier's aux (3 tapped layer inputs, concatenated) and final hidden states per token.

    `shard_tokens` defaults to about 256 MiB per shard; `disk_margin` (bytes, default $EAGLE3_TRAIN_DISK_MARGIN_BYTES
    or a tenth of the estimate, at most 1 GiB) is the free space that must remain after the estimated output.
    `backend="vllm"` reads the states from the hidden-state servers at `endpoints` (`vllm_options`: `model`,
    `concurrency`, ... of `VLLMHiddenStates`).
    Returns the manifest.
    """
    prepared_dir = Path(prepared_dir)
    splits = tuple(_D().splits if splits is None else splits)
    _check_arguments(splits, token_budget, max_samples, backend, endpoints, vllm_options)
    # never a directory this stage did not write, even with --overwrite (which replaces only our own states)
    out_dir = claim_output_dir(out_dir, "extract", WHAT, written_by_extract, create=False)
    store_dtype, store_bytes = _store_dtypes(dtype)  # fp8: collected in bfloat16, 1 byte per element on disk
    ds = load_prepared(prepared_dir, splits)
    verifier, verifier_path, text_config = _open_verifier(prepared_dir, verifier, trust_remote_code, backend)
    num_layers, hidden = int(text_config.num_hidden_layers), int(text_config.hidden_size)
    ids = _layer_ids(layer_ids, finetune_from, num_layers, verifier.name)
    if backend == "vllm":  # the server decides where and in which dtype the verifier runs
        device, compute_dtype = "vllm", None
    else:
        device = resolve_device(device)
        if not compute_dtype:  # the teacher is the verifier as our vLLM server runs it here (the judge of the draft)
            from eagle3_train.serving.vllm_server import server_options

            compute_dtype = server_options("cpu" if device == "cpu" else "cuda", model_config=verifier.config)["dtype"]
        _torch_dtype(compute_dtype)  # a bad name fails before any output is touched
    bytes_per_token = 4 * hidden * store_bytes + (4 * 4 if store_bytes == 1 else 0)  # fp8: + 4 float32 scales
    if shard_tokens is None:
        shard_tokens = max(1, DEFAULT_SHARD_BYTES // bytes_per_token)
    check_at_least("shard_tokens", shard_tokens, 1)

    # Plan every split up front: the disk estimate and the resume check need the whole picture.
    plans = {split: _plan_split(ds[split], split, max_samples, shard_tokens, text_config) for split in splits}
    settings = {
        # Served verifiers are large: identify the weights by file sizes, not hashes. name: as the user gave it.
        "verifier": verifier.identity(hash_weights),
        "backend": backend,
        "layer_ids": list(ids), "layer_ids_from": finetune_from, "dtype": dtype, "compute_dtype": compute_dtype,
        "hidden_size": hidden, "num_layers": num_layers,
        "prepared_manifest_sha256": sha256_file(prepared_dir / "manifest.json"),
        "max_samples": max_samples, "shard_tokens": int(shard_tokens),
    }
    old_manifest = _resumable_manifest(out_dir, settings, overwrite)
    done = _done_shards(out_dir, plans, old_manifest)
    total_tokens = sum(p.num_tokens for s in splits for p in plans[s])
    todo_tokens = sum(p.num_tokens for s in splits for p in plans[s] if p.number not in done[s])
    what = (f"{sum(len(p.rows) for s in splits for p in plans[s])} samples, {total_tokens} tokens ({todo_tokens} "
            f"left) x {bytes_per_token} B/token (4 x H={hidden} x {dtype})")
    # the HF backend's verifier stats add STATS_BYTES per token to the hidden states' bytes_per_token
    disk_bytes_per_token = bytes_per_token + (STATS_BYTES if backend == "hf" else 0)
    _check_disk_space(out_dir, what, todo_tokens, disk_bytes_per_token, disk_margin, overwrite)
    # nothing is deleted while another extract writes
    with claimed_output(out_dir, "extract", WHAT, written_by_extract):
        _clear_output(out_dir, overwrite)

        manifest = _new_manifest(settings, old_manifest, splits, verifier=verifier, prepared_dir=prepared_dir,
                                 aux_width=len(ids) * hidden, bytes_per_token=bytes_per_token,
                                 token_budget=token_budget, device=device, trust_remote_code=trust_remote_code,
                                 estimated_bytes=total_tokens * bytes_per_token)
        write_json(out_dir / "manifest.json", manifest)

        forward = _VerifierForward(backend, verifier_path, ids, store_dtype, text_config, device=device,
                                   compute_dtype=compute_dtype, trust_remote_code=trust_remote_code,
                                   endpoints=endpoints, vllm_options=vllm_options)
        stats = {"tokens": 0, "forward_s": 0.0, "write_s": 0.0}
        start, start_cpu = time.perf_counter(), time.process_time()
        bar = progress(total=todo_tokens, desc="extract", unit="tok")
        try:
            for split in splits:
                manifest["splits"][split] = _extract_split(
                    ds[split], split, plans[split], done[split], out_dir / split, forward, manifest, bar, stats,
                    token_budget=token_budget, width=(len(ids) * hidden, hidden), store_dtype=store_dtype, dtype=dtype)
        finally:
            bar.close()
            forward.close(manifest)

        if stats["tokens"]:
            manifest["throughput"] = _throughput(stats, forward, start, start_cpu, device, compute_dtype, token_budget)
        manifest["counts"] = {k: sum(s[src] for s in manifest["splits"].values())
                              for k, src in (("samples", "num_samples"), ("tokens", "num_tokens"), ("bytes", "bytes"))}
        manifest["status"] = "complete" if all(s["complete"] for s in manifest["splits"].values()) else "in_progress"
        manifest["updated"] = now_iso()
        write_json(out_dir / "manifest.json", manifest)
        return manifest


def _open_verifier(prepared_dir: Path, verifier: str | Path | Verifier | None, trust_remote_code: bool,
                   backend: str = "hf") -> tuple[Verifier, Path, Any]:
    """(the Verifier, its local directory, its text config); None: the verifier the data was prepared with."""
    from transformers import AutoConfig

    if verifier is None:  # the verifier that tokenized the data: another one would read other token ids
        recorded = read_json(prepared_dir / "manifest.json", "prepared-data manifest").get("verifier")
        verifier = Verifier.from_record(recorded, f"the prepared data {prepared_dir}",
                                        need="tokenizer" if backend == "vllm" else "weights")
    if backend == "vllm":  # the servers run the weights: here config, tokenizer and the final norm only
        from eagle3_train.hidden_states.vllm_backend import resolve_served_verifier

        name = verifier.name if isinstance(verifier, Verifier) else str(verifier)
        path = resolve_served_verifier(name)
        verifier = Verifier(name, path, read_json(path / "config.json", "verifier config"))
    verifier = as_verifier(verifier)
    check_prepared_tokenizer(prepared_dir, verifier.path)
    config = from_pretrained(AutoConfig, verifier.path, trust_remote_code)
    return verifier, verifier.path, config.get_text_config() if hasattr(config, "get_text_config") else config


def _new_manifest(settings: dict, old_manifest: dict | None, splits: Sequence[str], *, verifier: Verifier,
                  prepared_dir: Path, aux_width: int, bytes_per_token: int, token_budget: int, device: str,
                  trust_remote_code: bool, estimated_bytes: int) -> dict:
    """The in-progress manifest written before the first shard (what a resume keeps of the old one included)."""
    from eagle3_train.hidden_states import fp8

    manifest = {
        "stage": "extract", "format": FORMAT, "format_version": FORMAT_VERSION, "status": "in_progress",
        **settings,
        "verifier_name": verifier.name, "prepared_dir": str(prepared_dir.resolve()),
        "aux_width": aux_width, "bytes_per_token": bytes_per_token, "splits": {},
        "token_budget": token_budget, "device": device, "trust_remote_code": bool(trust_remote_code),
        "estimated_bytes": estimated_bytes,
        "created": (old_manifest or {}).get("created", now_iso()), "updated": now_iso(),
        "throughput": (old_manifest or {}).get("throughput"), "environment": environment(),
    }
    if settings["dtype"] == fp8.STORE_NAME:
        manifest["fp8_scales"] = ("value = float8_e4m3fn x float32 scale, one scale per token and layer: aux_scale "
                                  "[N, 3], final_scale [N, 1] (hidden_states/fp8.py)")
    if settings["backend"] == "vllm":
        manifest["vllm"] = (old_manifest or {}).get("vllm")
    else:  # the vocab size is filled in when the verifier loads (`_VerifierForward.open`)
        manifest["verifier_stats"] = (old_manifest or {}).get("verifier_stats")
    for split in (old_manifest or {}).get("splits", {}):
        if split not in splits:  # splits extracted by an earlier command stay recorded
            manifest["splits"][split] = old_manifest["splits"][split]
    return manifest


def _check_arguments(splits: Sequence[str], token_budget: int, max_samples: int | None, backend: str,
                     endpoints: Sequence[str], vllm_options: dict[str, Any] | None) -> None:
    if not splits:
        raise Eagle3InputError("no splits to extract")
    check_at_least("token_budget", token_budget, 1)
    check_at_least("max_samples", max_samples, 1)
    if backend not in BACKENDS:
        raise Eagle3InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "vllm" and not endpoints:
        raise Eagle3InputError("--backend vllm needs --endpoint URL (a server started with "
                               "`eagle3-train serve --extract-hidden-states`)")
    if backend == "vllm" and not (vllm_options or {}).get("hidden_states_dir"):
        raise Eagle3InputError("--backend vllm needs --hidden-states-dir DIR: the directory the servers write each "
                               "request's states to (`eagle3-train serve` prints it), as this machine sees it")


def _plan_split(ds, split: str, max_samples: int | None, shard_tokens: int, text_config) -> list[ShardPlan]:
    """The shards of one split, after checking that no sample is longer than the verifier's positions."""
    lengths = ds.data.column("length").to_pylist()
    if max_samples is not None:
        lengths = lengths[:max_samples]
    max_pos = getattr(text_config, "max_position_embeddings", None)
    if max_pos and lengths and max(lengths) > max_pos:
        r = max(range(len(lengths)), key=lengths.__getitem__)
        raise Eagle3InputError(f"sample id {ds[r]['id']!r} (split '{split}') has {lengths[r]} tokens, "
                               f"more than the verifier's max_position_embeddings {max_pos}; prepare with a "
                               f"shorter max length")
    return plan_shards(lengths, shard_tokens)


def _layer_ids(layer_ids, finetune_from: str | None, num_layers: int, verifier: str) -> tuple[int, ...]:
    """The taps: given, else the finetune source's (so the finetune is not refused after hours of extraction)."""
    given = parse_layer_ids(layer_ids)
    if finetune_from:
        from eagle3_train.checkpoints.formats import draft_layer_ids

        source, origin = draft_layer_ids(finetune_from, num_layers)
        if given is not None and tuple(given) != source:
            raise Eagle3InputError(f"--layer-ids {list(given)} differ from the layers the finetune source "
                                   f"{finetune_from} was trained on, {list(source)} (vLLM's input-of-layer ids, read "
                                   f"from {origin}): drop --layer-ids to extract the source's")
        log.info("extract: the layers of finetune source %s: %s (%s)", finetune_from, list(source), origin)
        given = source
    return validate_layer_ids(given, num_layers, f"verifier {verifier}")


WHAT = "hidden-states directory"
written_by_extract = json_says("manifest.json", "format", FORMAT)  # a store from before output markers


def _resumable_manifest(out_dir: Path, settings: dict, overwrite: bool) -> dict | None:
    """The manifest of an earlier extraction into `out_dir` to resume (None: start afresh); refuses another stage's
    output, and an earlier extraction with other settings unless `overwrite`."""
    old_manifest = None
    if (out_dir / "manifest.json").is_file():
        existing = read_json(out_dir / "manifest.json", "extract manifest")
        if existing.get("format") != FORMAT:  # never overwrite another stage's output
            raise Eagle3InputError(f"{out_dir / 'manifest.json'} belongs to another stage "
                                   f"({existing.get('stage', 'unknown')!r}); choose a separate --out directory")
        old_manifest = None if overwrite else existing
    if old_manifest is not None:
        diffs = _resume_conflicts(old_manifest, settings)
        if diffs:
            raise Eagle3InputError(f"{out_dir} already holds hidden states made with different settings ("
                                   + "; ".join(diffs) + "); pass --overwrite to replace them or choose another --out")
    elif holds_files(out_dir) and not overwrite:  # ours (claimed), from a run killed before its manifest
        raise Eagle3InputError(f"{out_dir} holds files of an earlier extract but no manifest.json; pass "
                               f"--overwrite to replace them, or choose a new --out directory")
    return old_manifest


def _done_shards(out_dir: Path, plans: dict[str, list[ShardPlan]], old_manifest: dict | None
                 ) -> dict[str, dict[int, dict]]:
    """Index entries of the shards a resume keeps, per split: those matching the plan and their file."""
    done: dict[str, dict[int, dict]] = {s: {} for s in plans}
    if old_manifest is None:
        return done
    for split, split_plans in plans.items():
        index_path = out_dir / split / "index.json"
        if index_path.is_file():
            for e in read_json(index_path, "hidden-state index").get("shards", []):
                n = e.get("shard")
                if isinstance(n, int) and n < len(split_plans) and _shard_entry_ok(e, split_plans[n], out_dir / split):
                    done[split][n] = e
                else:
                    log.warning("%s: shard entry %s does not match the plan or its file; recomputing it",
                                index_path, n)
    return done


def _check_disk_space(out_dir: Path, what: str, todo_tokens: int, bytes_per_token: int, disk_margin: int | None,
                      overwrite: bool) -> None:
    estimate = todo_tokens * bytes_per_token
    margin = _disk_margin(disk_margin, estimate)
    freeable = sum(f.stat().st_size for f in _our_files(out_dir)) if overwrite else 0
    free = _free_bytes(out_dir) + freeable
    log.info("extract: %s = %s to write to %s; %s free", what, _gib(estimate), out_dir, _gib(free))
    if estimate + margin > free:
        raise Eagle3InputError(f"not enough disk space in {out_dir}: the hidden states need about {_gib(estimate)} "
                               f"({todo_tokens} tokens x {bytes_per_token} bytes) plus a margin of {_gib(margin)}, but "
                               f"only {_gib(free)} is free; free space, choose another --out, use --max-samples, or "
                               f"lower the margin with {DISK_MARGIN_ENV}")


def _clear_output(out_dir: Path, overwrite: bool) -> None:
    """Delete our earlier files on overwrite, and temp files of writes interrupted by a kill."""
    if overwrite:
        for f in _our_files(out_dir):
            f.unlink()
    for f in _our_files(out_dir):
        if f.name.endswith(".tmp"):
            f.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


class _VerifierForward:
    """`compute(seqs) -> (aux, final)` of the chosen backend, loaded on first use (a finished resume loads nothing)."""

    def __init__(self, backend: str, verifier_path: Path, ids: Sequence[int], store_dtype, text_config, *,
                 device: str, compute_dtype: str | None, trust_remote_code: bool, endpoints: Sequence[str],
                 vllm_options: dict[str, Any] | None) -> None:
        self.backend, self.verifier_path, self.ids, self.store_dtype = backend, verifier_path, ids, store_dtype
        self.text_config, self.device, self.compute_dtype = text_config, device, compute_dtype
        self.trust_remote_code, self.endpoints, self.vllm_options = trust_remote_code, endpoints, vllm_options
        self.compute = self.source = self.capture = None
        self.stats = None  # HF: final [n, H] -> (full-vocab argmax [n], logsumexp [n]); vLLM: no lm_head, None
        self.load_s = self.load_cpu_s = 0.0

    def open(self, manifest: dict):
        """The compute function; the vLLM backend records its servers in `manifest["vllm"]`."""
        if self.compute is not None:
            return self.compute
        if self.backend == "vllm":
            from eagle3_train.hidden_states.vllm_backend import VLLMHiddenStates

            self.source = VLLMHiddenStates(self.endpoints, self.verifier_path, self.ids, self.store_dtype,
                                           **(self.vllm_options or {}))
            manifest["vllm"] = self.source.open()
            self.compute = self.source.run_batch
            return self.compute
        from transformers import AutoModelForCausalLM

        log.info("loading verifier %s on %s (%s)", self.verifier_path, self.device, self.compute_dtype)
        t_load, cpu_load = time.perf_counter(), time.process_time()
        model = from_pretrained(AutoModelForCausalLM, self.verifier_path, self.trust_remote_code,
                                dtype=_torch_dtype(self.compute_dtype))
        model = model.to(self.device).eval()
        base, layers = decoder_parts(model)
        self.stats, manifest["verifier_stats"] = self._stats_fn(model)
        self.capture = AuxCapture(layers, self.ids, self.store_dtype)
        pad_id = getattr(self.text_config, "pad_token_id", None) or 0
        self.load_s = time.perf_counter() - t_load
        self.load_cpu_s = time.process_time() - cpu_load
        self.compute = partial(run_batch, base, self.capture, pad_id=pad_id, device=self.device,
                               store_dtype=self.store_dtype)
        return self.compute

    def _stats_fn(self, model):
        """The full-vocab stats function (float32 lm_head, the verifier's logit transform) and its manifest record."""
        from eagle3_train.model.verifier_head import full_vocab_stats, logit_transform

        head = model.get_output_embeddings()
        if head is None:
            raise Eagle3InputError(f"verifier {self.verifier_path}: its model class has no output embeddings "
                                   f"(lm_head) to compute the full-vocabulary stats with")
        weight = head.weight.detach().float()  # no copy when the verifier runs in float32
        transform = logit_transform(self.verifier_path)
        if transform.bias is not None:
            transform.bias = transform.bias.to(weight.device)
        record = {"vocab_size": int(weight.shape[0]), "tensors": "verifier_argmax [N] int32, verifier_lse [N] "
                  "float32: argmax and logsumexp of the verifier's full-vocabulary logits of the stored final state",
                  "transform": transform.describe()}
        return partial(full_vocab_stats, lm_head=weight, transform=transform), record

    def close(self, manifest: dict) -> None:
        if self.source is not None:
            if manifest.get("vllm") and self.source.server_dtype:
                manifest["vllm"]["server_dtype"] = self.source.server_dtype
            self.source.close()
        elif self.capture is not None:
            self.capture.remove()


def _extract_split(ds, split: str, plans: list[ShardPlan], done: dict[int, dict], split_dir: Path,
                   forward: _VerifierForward, manifest: dict, bar, stats: dict, *, token_budget: int,
                   width: tuple[int, int], store_dtype, dtype: str) -> dict:
    """Compute and write the shards of one split not in `done` (updated, with index.json after each shard); returns
    the split's manifest entry."""
    split_dir.mkdir(parents=True, exist_ok=True)
    todo = [p for p in plans if p.number not in done]
    compute = forward.open(manifest) if todo else None
    write_json(split_dir / "index.json", _index(split, plans, done))
    columns = ds.select_columns(["id", "input_ids"])
    for plan in todo:
        bar.set_postfix_str(f"{split} shard {plan.number + 1}/{len(plans)}")
        rows = columns[list(plan.rows)]
        t0 = time.perf_counter()
        aux, final, vstats = _compute_shard(plan, rows, compute, bar, split=split, token_budget=token_budget,
                                            width=width, store_dtype=store_dtype, dtype=dtype, stats_fn=forward.stats)
        t1 = time.perf_counter()
        meta = {"format": FORMAT, "split": split, "shard": str(plan.number),
                "layer_ids": ",".join(map(str, forward.ids)), "dtype": dtype}
        done[plan.number] = _write_shard(split_dir / f"shard-{plan.number:05d}.safetensors", aux, final, plan, meta,
                                         vstats)
        write_json(split_dir / "index.json", _index(split, plans, done))
        stats["forward_s"] += t1 - t0
        stats["write_s"] += time.perf_counter() - t1
        stats["tokens"] += plan.num_tokens
    index = _index(split, plans, done)
    write_json(split_dir / "index.json", index)
    return {"num_samples": index["num_samples"], "num_tokens": index["num_tokens"],
            "num_shards": index["num_shards"], "bytes": sum(e["bytes"] for e in index["shards"]),
            "complete": index["complete"]}


def _compute_shard(plan: ShardPlan, rows: dict[str, list], compute, bar, *, split: str, token_budget: int,
                   width: tuple[int, int], store_dtype, dtype: str, stats_fn=None):
    """(aux [N, 3H], final [N, H], stats) of one shard's samples, in batches of at most `token_budget` padded tokens;
    stats: (full-vocab argmax [N], logsumexp [N]) from `stats_fn` applied to the final state as stored, or None."""
    import torch

    from eagle3_train.hidden_states import fp8

    for sid, seq, n in zip(rows["id"], rows["input_ids"], plan.lengths):
        if len(seq) != n:
            raise Eagle3InputError(f"sample id {sid!r} (split '{split}'): column 'length' says {n} but "
                                   f"input_ids has {len(seq)} tokens")
    aux = torch.empty((plan.num_tokens, width[0]), dtype=store_dtype)
    final = torch.empty((plan.num_tokens, width[1]), dtype=store_dtype)
    top = torch.empty(plan.num_tokens, dtype=torch.int32) if stats_fn else None
    lse = torch.empty(plan.num_tokens, dtype=torch.float32) if stats_fn else None
    row = 0
    with torch.inference_mode():
        for b0, b1 in plan_batches(plan.lengths, token_budget):
            n_tok = sum(plan.lengths[b0:b1])
            if n_tok:
                a, f = compute(rows["input_ids"][b0:b1])
                _check_finite(a, f, plan.lengths[b0:b1], rows["id"][b0:b1], split, dtype)
                aux[row:row + n_tok] = a.cpu()
                final[row:row + n_tok] = f.cpu()
                if stats_fn is not None:  # from what training will read: fp8 is quantized per row, so per batch
                    h = fp8.decode_rows(*fp8.encode_rows(f), torch.float32) if dtype == fp8.STORE_NAME else f.float()
                    t, z = stats_fn(h)
                    if not bool(torch.isfinite(z).all()):
                        raise Eagle3InputError(f"the verifier's full-vocabulary logsumexp is NaN/Inf in a batch of "
                                               f"split '{split}' (sample ids {rows['id'][b0]!r}..); check the "
                                               f"verifier's lm_head weights")
                    top[row:row + n_tok], lse[row:row + n_tok] = t.cpu(), z.cpu()
            row += n_tok
            bar.update(n_tok)
    return aux, final, (None if stats_fn is None else (top, lse))


def _throughput(stats: dict, forward: _VerifierForward, start: float, start_cpu: float, device: str,
                compute_dtype: str | None, token_budget: int) -> dict:
    import torch

    seconds = time.perf_counter() - start - forward.load_s  # throughput of the extraction loop, not the load
    # CPU time of all threads: on a shared machine tokens per CPU-second varies less than wall-clock tokens/s.
    cpu_seconds = time.process_time() - start_cpu - forward.load_cpu_s
    peak = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.startswith("cuda"):
        peak["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return {
        "tokens": stats["tokens"], "seconds": round(seconds, 3),
        "tokens_per_s": round(stats["tokens"] / seconds, 1) if seconds > 0 else None,
        "forward_seconds": round(stats["forward_s"], 3), "write_seconds": round(stats["write_s"], 3),
        "load_seconds": round(forward.load_s, 3), "cpu_seconds": round(cpu_seconds, 3),
        "device": device, "compute_dtype": compute_dtype, "token_budget": token_budget, **peak}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, ExtractSettings)


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(ExtractSettings, args)
    manifest = extract(s.prepared, s.verifier, s.out, layer_ids=s.layer_ids, dtype=s.dtype, device=s.device,
                       token_budget=s.token_budget, shard_tokens=s.shard_tokens, splits=s.splits,
                       max_samples=s.max_samples, compute_dtype=s.compute_dtype, overwrite=s.overwrite,
                       finetune_from=s.finetune_from,
                       backend=s.backend, endpoints=s.endpoint, hash_weights=s.hash_weights,
                       vllm_options={"model": s.model, "concurrency": s.concurrency,
                                     "hidden_states_dir": s.hidden_states_dir},
                       trust_remote_code=s.trust_remote_code)
    c, tp = manifest["counts"], manifest.get("throughput") or {}
    print(f"{manifest['status']}: {c['samples']} samples, {c['tokens']} tokens, {_gib(c['bytes'])} in {s.out} "
          f"(layers {manifest['layer_ids']}, {manifest['dtype']}"
          + (f", {tp['tokens_per_s']} tokens/s" if tp.get("tokens_per_s") else "") + ")")
    return 0

