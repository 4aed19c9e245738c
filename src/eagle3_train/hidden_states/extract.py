"""Extract stage: run the verifier over the prepared samples and store its aux and final hidden states.

Python API: `extract(prepared_dir, verifier, out_dir, ...) -> dict` (the manifest).
CLI: `eagle3-train extract --prepared DIR --out DIR [--verifier NAME_OR_DIR] [--layer-ids 2,15,27] [--store-dtype D]
[--compute-dtype D] [--token-budget N] [--shard-tokens N] [--device auto|cpu|cuda] [--max-samples N]
[--splits train,validation] [--overwrite] [--backend hf|vllm --endpoint URL [--endpoint URL2] [--concurrency N]]`
(defaults: `ExtractSettings`, docs/CONFIG.md).

This module is the stage's loop; the pieces it runs live next to it:
- the producers (`source.HiddenStateProducer`): `hf_backend.py` (default: the verifier run here with transformers,
  which also yields its full-vocabulary argmax and logsumexp per token) and `vllm_backend.py` (hidden-state servers,
  `eagle3-train serve --extract-hidden-states`, for verifiers only a serving engine can run; no lm_head, no stats).
  Both write the same shards, index and manifest (`backend` records which);
- the on-disk format: `store.py` (`plan_shards`, `write_shard`, `split_index`; the reader training uses);
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
import resource
import time
import typing
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_train.assets.families import family_of
from eagle3_train.assets.verifier import Verifier, as_verifier, from_pretrained
from eagle3_train.data.prepare import check_prepared_tokenizer, load_prepared
from eagle3_train.hidden_states import resume, store
from eagle3_train.hidden_states.compute import compute_shard
from eagle3_train.hidden_states.hf_backend import HFHiddenStates, resolve_device, torch_dtype
from eagle3_train.hidden_states.parallel import ExtractGroup
from eagle3_train.model.aux_layers import parse_layer_ids, validate_layer_ids
from eagle3_train.settings import ExtractBackend, ExtractSettings
from eagle3_train.utils.io import Eagle3InputError, check_at_least, read_json, sha256_file, write_json
from eagle3_train.utils.outputs import claim_output_dir, claimed_output
from eagle3_train.utils.progress import progress
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

if TYPE_CHECKING:
    from eagle3_train.hidden_states.source import HiddenStateProducer

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 256 * 2**20  # default shard_tokens aims at shards of about this size
REQUIRED_COLUMNS = ("id", "input_ids", "length")  # of the prepared data (training also needs the loss mask)
BACKENDS = typing.get_args(ExtractBackend)


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
    _check_arguments(splits, token_budget, max_samples, backend, endpoints, vllm_options, group.world)
    # never a directory this stage did not write, even with --overwrite (which replaces only our own states)
    out_dir = group.on_main(lambda: claim_output_dir(out_dir, "extract", resume.WHAT, resume.written_by_extract,
                                                     create=False, writes=resume.writes(splits)))
    store_dtype, store_bytes = store.store_dtypes(dtype)  # fp8: collected in bfloat16, 1 byte per element on disk
    ds = load_prepared(prepared_dir, splits, REQUIRED_COLUMNS)[0]
    verifier, verifier_path, text_config = _open_verifier(prepared_dir, verifier, trust_remote_code, backend)
    num_layers, hidden = int(text_config.num_hidden_layers), int(text_config.hidden_size)
    ids = _layer_ids(layer_ids, finetune_from, num_layers, verifier.name, family_of(verifier.config).first_aux_layer,
                     source_aux_convention)
    if backend == "vllm":  # the server decides where and in which dtype the verifier runs
        device, compute_dtype = "vllm", None
    else:
        device = group.device(resolve_device(device))
        if not compute_dtype:  # the teacher is the verifier as our vLLM server runs it here (the judge of the draft)
            from eagle3_train.serving.vllm_server import server_options

            compute_dtype = server_options("cpu" if device == "cpu" else "cuda", model_config=verifier.config)["dtype"]
        torch_dtype(compute_dtype)  # a bad name fails before any output is touched
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
    # the HF backend's verifier stats add store.STATS_BYTES per token to the hidden states' bytes_per_token
    disk_bytes_per_token = bytes_per_token + (store.STATS_BYTES if backend == "hf" else 0)
    group.on_main(lambda: resume.check_disk_space(out_dir, what, todo_tokens, disk_bytes_per_token, disk_margin,
                                                  overwrite))
    # nothing is deleted while another extract writes
    with group.holding(lambda: claimed_output(out_dir, "extract", resume.WHAT, resume.written_by_extract,
                                              resume.writes(splits))):
        manifest = _new_manifest(settings, old_manifest, splits, verifier=verifier, prepared_dir=prepared_dir,
                                 aux_width=len(ids) * hidden, bytes_per_token=bytes_per_token,
                                 token_budget=token_budget, device=device, trust_remote_code=trust_remote_code,
                                 estimated_bytes=total_tokens * bytes_per_token, processes=group.world)
        group.on_main(lambda: (resume.clear_output(out_dir, overwrite), write_json(out_dir / "manifest.json",
                                                                                   manifest)))
        if backend == "vllm":
            from eagle3_train.hidden_states.vllm_backend import VLLMHiddenStates

            make = partial(VLLMHiddenStates, endpoints, verifier_path, ids, store_dtype, **(vllm_options or {}))
        else:
            make = partial(HFHiddenStates, verifier_path, ids, store_dtype, text_config, device=device,
                           compute_dtype=compute_dtype, trust_remote_code=trust_remote_code)
        forward = _Producer(backend, ids, make)
        stats = {"tokens": 0, "forward_s": 0.0, "write_s": 0.0}
        start, start_cpu = time.perf_counter(), time.process_time()
        bar = progress(total=todo_tokens, desc="extract", unit="tok", disable=not group.is_main)
        try:
            for split in splits:
                manifest["splits"][split] = _extract_split(
                    ds[split], split, plans[split], done[split], out_dir / split, forward, manifest, bar, stats,
                    group, token_budget=token_budget, width=(len(ids) * hidden, hidden), store_dtype=store_dtype,
                    dtype=dtype)
        finally:
            bar.close()
            forward.close(manifest)

        tokens = sum(group.gather(stats["tokens"]))  # of every process
        if tokens and group.is_main:
            manifest["throughput"] = _throughput(stats, tokens, forward.it, start, start_cpu, device, compute_dtype,
                                                 token_budget, group.world)
        manifest["counts"] = {k: sum(s[src] for s in manifest["splits"].values())
                              for k, src in (("samples", "num_samples"), ("tokens", "num_tokens"), ("bytes", "bytes"))}
        manifest["status"] = "complete" if all(s["complete"] for s in manifest["splits"].values()) else "in_progress"
        manifest["updated"] = now_iso()
        return group.on_main(lambda: (write_json(out_dir / "manifest.json", manifest), manifest)[1])


def _resumable(out_dir: Path, settings: dict, overwrite: bool, plans: dict) -> tuple[dict | None, dict]:
    """(the manifest a rerun continues, the shards already done per split)."""
    old_manifest = resume.resumable_manifest(out_dir, settings, overwrite)
    return old_manifest, resume.done_shards(out_dir, plans, old_manifest)


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
                  trust_remote_code: bool, estimated_bytes: int, processes: int = 1) -> dict:
    """The in-progress manifest written before the first shard (what a resume keeps of the old one included)."""
    from eagle3_train.hidden_states import fp8

    manifest = {
        "stage": "extract", "format": store.FORMAT, "format_version": store.FORMAT_VERSION, "status": "in_progress",
        **settings,
        "verifier_name": verifier.name, "prepared_dir": str(prepared_dir.resolve()),
        "aux_width": aux_width, "bytes_per_token": bytes_per_token, "splits": {},
        "token_budget": token_budget, "device": device, "trust_remote_code": bool(trust_remote_code),
        "estimated_bytes": estimated_bytes, "processes": processes,
        "created": (old_manifest or {}).get("created", now_iso()), "updated": now_iso(),
        "throughput": (old_manifest or {}).get("throughput"), "environment": environment(),
    }
    if settings["dtype"] == fp8.STORE_NAME:
        manifest["fp8_scales"] = ("value = float8_e4m3fn x float32 scale, one scale per token and layer: aux_scale "
                                  "[N, 3], final_scale [N, 1] (hidden_states/fp8.py)")
    if settings["backend"] == "vllm":
        manifest["vllm"] = (old_manifest or {}).get("vllm")
    else:  # the vocab size is filled in when the verifier loads (`HFHiddenStates.open`)
        manifest["verifier_stats"] = (old_manifest or {}).get("verifier_stats")
    for split in (old_manifest or {}).get("splits", {}):
        if split not in splits:  # splits extracted by an earlier command stay recorded
            manifest["splits"][split] = old_manifest["splits"][split]
    return manifest


def _check_arguments(splits: Sequence[str], token_budget: int, max_samples: int | None, backend: str,
                     endpoints: Sequence[str], vllm_options: dict[str, Any] | None, processes: int = 1) -> None:
    if not splits:
        raise Eagle3InputError("no splits to extract")
    check_at_least("token_budget", token_budget, 1)
    check_at_least("max_samples", max_samples, 1)
    if backend not in BACKENDS:
        raise Eagle3InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "vllm" and processes > 1:
        raise Eagle3InputError("--backend vllm runs in one process (the servers hold the verifier; several "
                               "--endpoint share the work): run it without torchrun")
    if backend == "vllm" and not endpoints:
        raise Eagle3InputError("--backend vllm needs --endpoint URL (a server started with "
                               "`eagle3-train serve --extract-hidden-states`)")
    if backend == "vllm" and not (vllm_options or {}).get("hidden_states_dir"):
        raise Eagle3InputError("--backend vllm needs --hidden-states-dir DIR: the directory the servers write each "
                               "request's states to (`eagle3-train serve` prints it), as this machine sees it")


def _plan_split(ds, split: str, max_samples: int | None, shard_tokens: int, text_config) -> list[store.ShardPlan]:
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
    return store.plan_shards(lengths, shard_tokens)


def _layer_ids(layer_ids, finetune_from: str | None, num_layers: int, verifier: str, first: int,
               convention: str = "auto") -> tuple[int, ...]:
    """The taps: given, else the finetune source's (so the finetune is not refused after hours of extraction)."""
    given = parse_layer_ids(layer_ids)
    if finetune_from:
        from eagle3_train.checkpoints.formats import draft_layer_ids

        source, origin = draft_layer_ids(finetune_from, num_layers, convention)
        if given is not None and tuple(given) != source:
            raise Eagle3InputError(f"--layer-ids {list(given)} differ from the layers the finetune source "
                                   f"{finetune_from} was trained on, {list(source)} (vLLM's input-of-layer ids, read "
                                   f"from {origin}): drop --layer-ids to extract the source's")
        log.info("extract: the layers of finetune source %s: %s (%s)", finetune_from, list(source), origin)
        given = source
    return validate_layer_ids(given, num_layers, f"verifier {verifier}", first)


class _Producer:
    """The backend's producer, made and opened on first use (a finished resume loads nothing); keeps its record in
    the manifest: `vllm` (the servers) or `verifier_stats` (HF)."""

    def __init__(self, backend: str, ids: Sequence[int], make: Callable[[], HiddenStateProducer]) -> None:
        self.backend, self.ids, self.make = backend, ids, make
        self.it: HiddenStateProducer | None = None

    def open(self, manifest: dict) -> HiddenStateProducer:
        if self.it is None:
            self.it = self.make()
            manifest["vllm" if self.backend == "vllm" else "verifier_stats"] = self.it.open()
        return self.it

    def close(self, manifest: dict) -> None:
        if self.it is not None:
            if manifest.get("vllm") and getattr(self.it, "server_dtype", None):
                manifest["vllm"]["server_dtype"] = self.it.server_dtype
            self.it.close()


def _extract_split(ds, split: str, plans: list[store.ShardPlan], done: dict[int, dict], split_dir: Path,
                   forward: _Producer, manifest: dict, bar, stats: dict, group: ExtractGroup, *, token_budget: int,
                   width: tuple[int, int], store_dtype, dtype: str) -> dict:
    """Compute and write the shards of one split not in `done` (updated, with index.json after each round of one
    shard per process); returns the split's manifest entry."""
    split_dir.mkdir(parents=True, exist_ok=True)
    todo = [p for p in plans if p.number not in done]
    producer = forward.open(manifest) if todo else None
    if group.is_main:
        write_json(split_dir / "index.json", store.split_index(split, plans, done))
    columns = ds.select_columns(["id", "input_ids"])
    for first in range(0, len(todo), group.world):
        plan = todo[first + group.rank] if first + group.rank < len(todo) else None
        entry = None
        if plan is not None:
            bar.set_postfix_str(f"{split} shard {plan.number + 1}/{len(plans)}")
            rows = columns[list(plan.rows)]
            t0 = time.perf_counter()
            aux, final, vstats = compute_shard(plan, rows, producer.run_batch, bar, split=split,
                                               token_budget=token_budget, width=width, store_dtype=store_dtype,
                                               dtype=dtype, stats_fn=producer.stats)
            t1 = time.perf_counter()
            meta = {"format": store.FORMAT, "split": split, "shard": str(plan.number),
                    "layer_ids": ",".join(map(str, forward.ids)), "dtype": dtype}
            path = split_dir / f"shard-{plan.number:05d}.safetensors"
            entry = (plan.number, store.write_shard(path, aux, final, plan, meta, vstats), plan.num_tokens)
            stats["forward_s"] += t1 - t0
            stats["write_s"] += time.perf_counter() - t1
            stats["tokens"] += plan.num_tokens
        for rank, got in enumerate(group.gather(entry)):
            if got is not None:
                done[got[0]] = got[1]
                if rank != group.rank:
                    bar.update(got[2])  # the other processes' tokens
        if group.is_main:
            write_json(split_dir / "index.json", store.split_index(split, plans, done))
    index = store.split_index(split, plans, done)
    if group.is_main:
        write_json(split_dir / "index.json", index)
    return {"num_samples": index["num_samples"], "num_tokens": index["num_tokens"],
            "num_shards": index["num_shards"], "bytes": sum(e["bytes"] for e in index["shards"]),
            "complete": index["complete"]}


def _throughput(stats: dict, tokens: int, producer: HiddenStateProducer, start: float, start_cpu: float,
                device: str, compute_dtype: str | None, token_budget: int, processes: int) -> dict:
    """The extraction loop's rate: tokens of every process over this one's wall time; CPU and memory: this one's."""
    import torch

    seconds = time.perf_counter() - start - producer.load_s  # throughput of the extraction loop, not the load
    # CPU time of all threads: on a shared machine tokens per CPU-second varies less than wall-clock tokens/s.
    cpu_seconds = time.process_time() - start_cpu - producer.load_cpu_s
    peak = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.startswith("cuda"):
        peak["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return {
        "tokens": tokens, "seconds": round(seconds, 3), "processes": processes,
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "forward_seconds": round(stats["forward_s"], 3), "write_seconds": round(stats["write_s"], 3),
        "load_seconds": round(producer.load_s, 3), "cpu_seconds": round(cpu_seconds, 3),
        "device": device, "compute_dtype": compute_dtype, "token_budget": token_budget, **peak}


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

