"""The manifest of a hidden-states store, written in one place for both writers (the extract stage and hybrid
training's first epoch), so `train --hidden-states`, resume and the checks read the same fields either way.

`new_manifest(settings, ...)`: the in-progress manifest written before the first shard (`bytes_per_token` from
`utils/store_bytes.py`, the fp8 scales noted, the backend's record); `summarize(manifest)`: counts and status from
the splits' entries; `throughput(...)`: extract's rate record.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_train.hidden_states import store
from eagle3_train.hidden_states.backends import backend_of
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.store_bytes import bytes_per_token as stored_bytes_per_token

FP8_NOTE = ("value = float8_e4m3fn x float32 scale, one scale per token and layer: aux_scale [N, 3], final_scale "
            "[N, 1] (hidden_states/fp8.py)")


def new_manifest(settings: dict[str, Any], *, verifier_name: str, prepared_dir: str | Path,
                 old: dict[str, Any] | None = None, writes: Sequence[str] = (), **extra: Any) -> dict[str, Any]:
    """The in-progress manifest. `settings`: what identifies the states (at least `verifier`, `backend`,
    `layer_ids`, `dtype`, `hidden_size`, `num_layers`, `prepared_manifest_sha256`); `old`: the manifest a resume
    continues (its creation time, the backend's record and the splits other than `writes` are kept); `extra`:
    further fields (they win over the backend's record)."""
    from eagle3_train.hidden_states import fp8

    old = old or {}
    hidden, key = int(settings["hidden_size"]), backend_of(settings["backend"]).record_key
    manifest = {
        "stage": "extract", "format": store.FORMAT, "format_version": store.FORMAT_VERSION, "status": "in_progress",
        **settings, "verifier_name": verifier_name, "prepared_dir": str(Path(prepared_dir).resolve()),
        "aux_width": len(settings["layer_ids"]) * hidden,
        "bytes_per_token": stored_bytes_per_token(hidden, settings["dtype"]),
        "splits": {s: e for s, e in old.get("splits", {}).items() if s not in writes},  # earlier commands' splits
        key: old.get(key),  # HF: the vocab size is filled in when the verifier loads (`HFHiddenStates.open`)
        **extra, "created": old.get("created", now_iso()), "updated": now_iso(), "environment": environment(),
    }
    if settings["dtype"] == fp8.STORE_NAME:
        manifest["fp8_scales"] = FP8_NOTE
    return manifest


def summarize(manifest: dict[str, Any]) -> dict[str, Any]:
    """Set the totals, the status (complete when every split is) and the update time from the splits' entries."""
    splits = manifest["splits"].values()
    manifest["counts"] = {k: sum(s[src] for s in splits)
                          for k, src in (("samples", "num_samples"), ("tokens", "num_tokens"), ("bytes", "bytes"))}
    manifest["status"] = "complete" if all(s["complete"] for s in splits) else "in_progress"
    manifest["updated"] = now_iso()
    return manifest


def throughput(stats: dict, tokens: int, producer: Any, start: float, start_cpu: float, device: str,
               compute_dtype: str | None, token_budget: int, processes: int) -> dict[str, Any]:
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
