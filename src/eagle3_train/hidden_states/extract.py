"""Extract stage: run the verifier over the prepared samples and store its aux and final hidden states.

Python API: `extract(prepared_dir, verifier, out_dir, ...) -> dict` (the manifest).
CLI: `eagle3-train extract --prepared DIR --out DIR [--verifier NAME_OR_DIR] [--layer-ids 2,15,27] [--store-dtype D]
[--compute-dtype D] [--token-budget N] [--shard-tokens N] [--device auto|cpu|cuda] [--max-samples N]
[--splits train,validation] [--overwrite] [--backend hf|vllm --endpoint URL [--endpoint URL2] [--concurrency N]]`
(defaults: `ExtractSettings`, docs/CONFIG.md).

This module is the stage's loop; the pieces it runs live next to it:
- the backends (`backends.py`: `backend_of(name)`, what differs between them) and their producers
  (`source.HiddenStateProducer`): `hf_backend.py` (default: the verifier run here with transformers, which also
  yields its full-vocabulary argmax and logsumexp per token) and `vllm_backend.py` (hidden-state servers,
  `eagle3-train serve --extract-hidden-states`, for verifiers only a serving engine can run; no lm_head, no stats).
  Both write the same shards, index and manifest (`backend` records which);
- the on-disk format: `store.py` (`plan_shards`, `write_shard`, `split_index`; the reader training uses) and
  `manifest.py` (the manifest, shared with hybrid training);
- the output directory: `resume.py` (ownership, what a rerun resumes, the disk-space check);
- the prepared data: `data.prepare.load_prepared`.

Output (docs/ARCHITECTURE.md): `OUT/{split}/shard-NNNNN.safetensors`, `OUT/{split}/index.json`, `OUT/manifest.json`.
The verifier stats are computed from the final state as stored (after the store dtype's rounding), so training need
not redo that pass every epoch (the manifest's `verifier_stats` and each index entry's flag say which shards have
them). Shards are planned deterministically (length-sorted, cut every `shard_tokens` tokens), written atomically and
listed in `index.json` after each one, so rerunning the same command resumes where a killed run stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_train.assets.families import family_of
from eagle3_train.assets.verifier import Verifier
from eagle3_train.data.prepare import load_prepared
from eagle3_train.hidden_states import resume, store
from eagle3_train.hidden_states.backends import Backend, backend_of
from eagle3_train.hidden_states.compute import compute_split, plan_split
from eagle3_train.hidden_states.layers import extract_layer_ids
from eagle3_train.hidden_states.manifest import new_manifest, summarize, throughput
from eagle3_train.hidden_states.parallel import ExtractGroup
from eagle3_train.settings import ExtractSettings
from eagle3_train.utils.io import Eagle3InputError, check_at_least, sha256_file, write_json
from eagle3_train.utils.outputs import claim_output_dir, claimed_output
from eagle3_train.utils.progress import progress
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args
from eagle3_train.utils.store_bytes import bytes_per_token as stored_bytes_per_token

if TYPE_CHECKING:
    from eagle3_train.hidden_states.source import HiddenStateProducer

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 256 * 2**20  # default shard_tokens aims at shards of about this size
REQUIRED_COLUMNS = ("id", "input_ids", "length")  # of the prepared data (training also needs the loss mask)


_D = ExtractSettings  # keyword defaults below are the settings dataclass's


def extract(prepared_dir: str | Path, verifier: str | Path | Verifier | None, out_dir: str | Path,
            layer_ids: Sequence[int] | str | None = _D.layer_ids, dtype: str = _D.dtype, device: str | None = _D.device,
            token_budget: int = _D.token_budget, shard_tokens: int | None = _D.shard_tokens,
            splits: Sequence[str] | None = None, max_samples: int | None = _D.max_samples,
            compute_dtype: str | None = _D.compute_dtype, overwrite: bool = _D.overwrite,
            disk_margin: int | None = None, backend: str = _D.backend, endpoints: Sequence[str] = (),
            vllm_options: dict[str, Any] | None = None, trust_remote_code: bool = _D.trust_remote_code,
            hash_weights: bool = _D.hash_weights, finetune_from: str | None = _D.finetune_from,
            source_aux_convention: str = _D.source_aux_convention) -> dict:
    """Store the verifier's aux (3 tapped layer inputs, concatenated) and final hidden states per token.

    `shard_tokens` defaults to about 256 MiB per shard; `disk_margin` (bytes, default $EAGLE3_TRAIN_DISK_MARGIN_BYTES
    or a tenth of the estimate, at most 1 GiB) is the free space that must remain after the estimated output.
    `backend="vllm"` reads the states from the hidden-state servers at `endpoints` (`vllm_options`: `model`,
    `concurrency`, ... of `VLLMHiddenStates`).
    Returns the manifest.
    """
    prepared_dir = Path(prepared_dir)
    splits = tuple(_D().splits if splits is None else splits)
    group = ExtractGroup()  # under torchrun: this process's share of the shards (parallel.py)
    try:
        return _extract(group, prepared_dir, verifier, out_dir, layer_ids, dtype, device, token_budget, shard_tokens,
                        splits, max_samples, compute_dtype, overwrite, disk_margin, backend, endpoints, vllm_options,
                        trust_remote_code, hash_weights, finetune_from, source_aux_convention)
    finally:
        group.close()


def _extract(group: ExtractGroup, prepared_dir: Path, verifier, out_dir, layer_ids, dtype, device, token_budget,
             shard_tokens, splits, max_samples, compute_dtype, overwrite, disk_margin, backend, endpoints,
             vllm_options, trust_remote_code, hash_weights, finetune_from, source_aux_convention) -> dict:
    options = dict(vllm_options or {})
    be = _check_arguments(splits, token_budget, max_samples, backend, endpoints, options, group.world)
    # never a directory this stage did not write, even with --overwrite (which replaces only our own states)
    out_dir = group.on_main(lambda: claim_output_dir(out_dir, "extract", resume.WHAT, resume.written_by_extract,
                                                     create=False, writes=resume.writes(splits)))
    store_dtype, _ = store.store_dtypes(dtype)  # fp8: collected in bfloat16, 1 byte per element on disk
    ds = load_prepared(prepared_dir, splits, REQUIRED_COLUMNS)[0]
    verifier, verifier_path, text_config = be.open_verifier(prepared_dir, verifier, trust_remote_code)
    num_layers, hidden = int(text_config.num_hidden_layers), int(text_config.hidden_size)
    ids = extract_layer_ids(layer_ids, finetune_from, num_layers, verifier.name,
                            family_of(verifier.config).first_aux_layer, source_aux_convention)
    device, compute_dtype = be.placement(device, compute_dtype, verifier.config, group.device)
    bytes_per_token = stored_bytes_per_token(hidden, dtype)
    if shard_tokens is None:
        shard_tokens = max(1, DEFAULT_SHARD_BYTES // bytes_per_token)
    check_at_least("shard_tokens", shard_tokens, 1)

    # Plan every split up front: the disk estimate and the resume check need the whole picture.
    plans = {split: plan_split(ds[split], split, max_samples, shard_tokens, text_config) for split in splits}
    settings = {
        # Served verifiers are large: identify the weights by file sizes, not hashes. name: as the user gave it.
        "verifier": verifier.identity(hash_weights),
        "backend": be.name,
        "layer_ids": list(ids), "layer_ids_from": finetune_from, "dtype": dtype, "compute_dtype": compute_dtype,
        **({"layer_ids_convention": source_aux_convention} if finetune_from else {}),
        "hidden_size": hidden, "num_layers": num_layers,
        "prepared_manifest_sha256": sha256_file(prepared_dir / "manifest.json"),
        "max_samples": max_samples, "shard_tokens": int(shard_tokens),
    }
    old_manifest, done = group.on_main(lambda: _resumable(out_dir, settings, overwrite, plans))
    total_tokens = sum(p.num_tokens for s in splits for p in plans[s])
    todo_tokens = sum(p.num_tokens for s in splits for p in plans[s] if p.number not in done[s])
    what = (f"{sum(len(p.rows) for s in splits for p in plans[s])} samples, {total_tokens} tokens ({todo_tokens} "
            f"left) x {bytes_per_token} B/token (4 x H={hidden} x {dtype})")
    group.on_main(lambda: resume.check_disk_space(out_dir, what, todo_tokens, bytes_per_token + be.stats_bytes,
                                                  disk_margin, overwrite))
    # nothing is deleted while another extract writes
    with group.holding(lambda: claimed_output(out_dir, "extract", resume.WHAT, resume.written_by_extract,
                                              resume.writes(splits))):
        manifest = new_manifest(settings, verifier_name=verifier.name, prepared_dir=prepared_dir, old=old_manifest,
                                writes=splits, token_budget=token_budget, device=device,
                                trust_remote_code=bool(trust_remote_code),
                                estimated_bytes=total_tokens * bytes_per_token, processes=group.world,
                                throughput=(old_manifest or {}).get("throughput"))
        group.on_main(lambda: (resume.clear_output(out_dir, overwrite), write_json(out_dir / "manifest.json",
                                                                                   manifest)))
        make = be.producer(verifier_path, ids, store_dtype, text_config, device=device, compute_dtype=compute_dtype,
                           trust_remote_code=trust_remote_code, endpoints=endpoints, options=options)
        forward = _Producer(be, make)
        stats = {"tokens": 0, "forward_s": 0.0, "write_s": 0.0}
        start, start_cpu = time.perf_counter(), time.process_time()
        bar = progress(total=todo_tokens, desc="extract", unit="tok", disable=not group.is_main)
        try:
            for split in splits:
                manifest["splits"][split] = compute_split(
                    ds[split], split, plans[split], done[split], out_dir / split, lambda: forward.open(manifest), bar,
                    stats, group, layer_ids=ids, token_budget=token_budget, width=(len(ids) * hidden, hidden),
                    store_dtype=store_dtype, dtype=dtype)
        finally:
            bar.close()
            forward.close(manifest)

        tokens = sum(group.gather(stats["tokens"]))  # of every process
        if tokens and group.is_main:
            manifest["throughput"] = throughput(stats, tokens, forward.it, start, start_cpu, device, compute_dtype,
                                                token_budget, group.world)
        summarize(manifest)
        return group.on_main(lambda: (write_json(out_dir / "manifest.json", manifest), manifest)[1])


def _resumable(out_dir: Path, settings: dict, overwrite: bool, plans: dict) -> tuple[dict | None, dict]:
    """(the manifest a rerun continues, the shards already done per split)."""
    old_manifest = resume.resumable_manifest(out_dir, settings, overwrite)
    return old_manifest, resume.done_shards(out_dir, plans, old_manifest)


def _check_arguments(splits: Sequence[str], token_budget: int, max_samples: int | None, backend: str,
                     endpoints: Sequence[str], options: dict[str, Any], processes: int = 1) -> Backend:
    """The backend's entry, after refusing arguments no extraction can run with."""
    if not splits:
        raise Eagle3InputError("no splits to extract")
    check_at_least("token_budget", token_budget, 1)
    check_at_least("max_samples", max_samples, 1)
    be = backend_of(backend)
    be.check_arguments(processes, endpoints, options)
    return be


class _Producer:
    """The backend's producer, made and opened on first use (a finished resume loads nothing); keeps its record in
    the manifest under the backend's `record_key` (`vllm`: the servers, `verifier_stats`: HF)."""

    def __init__(self, backend: Backend, make: Callable[[], HiddenStateProducer]) -> None:
        self.backend, self.make = backend, make
        self.it: HiddenStateProducer | None = None

    def open(self, manifest: dict) -> HiddenStateProducer:
        if self.it is None:
            self.it = self.make()
            manifest[self.backend.record_key] = self.it.open()
        return self.it

    def close(self, manifest: dict) -> None:
        if self.it is not None:
            record = manifest.get(self.backend.record_key)
            if record and getattr(self.it, "server_dtype", None):  # the servers' dtype, seen in their first answer
                record["server_dtype"] = self.it.server_dtype
            self.it.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, ExtractSettings)


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(ExtractSettings, args)
    manifest = extract(s.prepared, s.verifier, s.out, layer_ids=s.layer_ids, dtype=s.dtype, device=s.device,
                       token_budget=s.token_budget, shard_tokens=s.shard_tokens, splits=s.splits,
                       max_samples=s.max_samples, compute_dtype=s.compute_dtype, overwrite=s.overwrite,
                       finetune_from=s.finetune_from, source_aux_convention=s.source_aux_convention,
                       backend=s.backend, endpoints=s.endpoint,
                       hash_weights=s.hash_weights, trust_remote_code=s.trust_remote_code,
                       vllm_options={"model": s.model, "concurrency": s.concurrency,
                                     "hidden_states_dir": s.hidden_states_dir})
    c, tp = manifest["counts"], manifest.get("throughput") or {}
    if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 reports for all
        return 0
    print(f"{manifest['status']}: {c['samples']} samples, {c['tokens']} tokens, {resume.gib(c['bytes'])} in {s.out} "
          f"(layers {manifest['layer_ids']}, {manifest['dtype']}"
          + (f", {tp['tokens_per_s']} tokens/s" if tp.get("tokens_per_s") else "") + ")")
    return 0

