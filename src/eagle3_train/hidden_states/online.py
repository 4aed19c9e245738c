"""Hidden-state sources backed by vLLM hidden-state servers, for online and hybrid training.

`OnlineSource` asks the servers (`VLLMHiddenStates`: several endpoints share the requests, the client retries a slow
or failing server with exponential backoff) for every sample it is given and keeps nothing. A sample that fails on
its own (rejected, too long, still failing after the retries while others of its fetch got through, NaN/Inf) is
logged and skipped, counted in `skipped`; when no sample of a fetch gets through the servers are down and the run
stops (`ServerUnavailable`; resume continues it). `HybridSource` does the same for samples it has not seen
and stores what it fetched as ordinary extract shards (one shard per fetch, index.json and manifest.json as extract
writes them), so from the second epoch on the states are read from disk and the directory can be reused by
`train --hidden-states`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_train.hidden_states.source import Features
from eagle3_train.hidden_states.vllm_backend import ServerUnavailable, VLLMHiddenStates
from eagle3_train.utils.io import Eagle3InputError, read_json, write_json
from eagle3_train.utils.provenance import environment, now_iso

log = logging.getLogger(__name__)
_MANIFEST_LOCK = threading.Lock()


class OnlineSource:
    def __init__(self, split: str, endpoints: Sequence[str], verifier_dir: str | Path, layer_ids: Sequence[int],
                 dtype: torch.dtype, *, model: str | None = None, concurrency: int = 8) -> None:
        self.split = split
        self.skipped = 0
        self.client = VLLMHiddenStates(endpoints, verifier_dir, layer_ids, dtype, model=model,
                                       concurrency=concurrency)
        self.servers = self.client.open()  # fails fast with a clear error when no server answers

    def sample_indices(self) -> list[int] | None:
        return None

    def fetch(self, samples: Sequence[tuple[int, Sequence[int]]]) -> list[Features | None]:
        results = self.client.run_each([list(ids) for _, ids in samples])
        down = [r for r in results if isinstance(r, ServerUnavailable)]
        if down and len(down) == len(results):  # nothing got through: the servers, not the samples, are failing
            raise down[0]
        out: list[Features | None] = []
        for (index, _), r in zip(samples, results):
            if isinstance(r, Exception):
                self._skip(index, str(r))
                out.append(None)
            elif not (torch.isfinite(r[0]).all() and torch.isfinite(r[1]).all()):
                self._skip(index, "the server's hidden states hold NaN/Inf")
                out.append(None)
            else:
                out.append(Features(aux=r[0], final=r[1]))
        return out

    def _skip(self, index: int, why: str) -> None:
        self.skipped += 1
        log.warning("skipping sample %d of split '%s' (%d skipped so far): %s", index, self.split, self.skipped, why)

    def identity(self) -> dict[str, Any]:
        return {"mode": "online", **self.servers, "server_dtype": self.client.server_dtype}

    def close(self) -> None:
        self.client.close()


class HybridSource(OnlineSource):
    """Online for samples not stored yet; each fetch is appended to `store_dir` as one more extract shard."""

    def __init__(self, split: str, store_dir: str | Path, manifest: dict[str, Any], num_samples: int,
                 **online: Any) -> None:
        from eagle3_train.hidden_states.extract import FORMAT, FORMAT_VERSION

        super().__init__(split, **online)
        self.dir = Path(store_dir)
        self.split_dir = self.dir / split
        self.num_samples = num_samples
        self.index_path = self.split_dir / "index.json"
        self.new_manifest = {"stage": "extract", "format": FORMAT, "format_version": FORMAT_VERSION,
                             "status": "in_progress", "backend": "vllm", "written_by": "train (hybrid mode)",
                             **manifest, "vllm": self.servers, "splits": {}, "environment": environment()}
        self.reader: Any = None  # opened on the first fetch: the trainer claims (or sets aside) its --out first

    def _ready(self) -> None:
        if self.reader is not None:
            return
        mpath = self.dir / "manifest.json"
        if mpath.is_file():
            old = read_json(mpath, "hybrid hidden-states manifest")
            for key in ("prepared_manifest_sha256", "layer_ids", "dtype", "hidden_size"):
                if old.get(key) != self.new_manifest.get(key):
                    raise Eagle3InputError(f"{mpath} holds hidden states with {key} {old.get(key)!r}, this run needs "
                                           f"{self.new_manifest.get(key)!r}: choose another train.hidden_states "
                                           f"directory")
            self.manifest = old
        else:
            self.manifest = {**self.new_manifest, "created": now_iso()}
        self.split_dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[dict] = (read_json(self.index_path, "hidden-state index").get("shards", [])
                                    if self.index_path.is_file() else [])
        # A shard written but not yet indexed (killed in between) is rewritten under the same name: no duplicates.
        self._write_index()
        self._open_reader()

    def _open_reader(self) -> None:
        from eagle3_train.hidden_states.store import HiddenStatesReader

        self.reader = HiddenStatesReader(self.dir, self.split)

    def _write_index(self) -> None:
        from eagle3_train.hidden_states.extract import FORMAT, FORMAT_VERSION

        stored = sum(e["num_samples"] for e in self.entries)
        index = {"format": FORMAT, "format_version": FORMAT_VERSION, "split": self.split,
                 "num_samples": self.num_samples, "num_tokens": sum(e["num_tokens"] for e in self.entries),
                 "num_shards": len(self.entries), "complete": stored >= self.num_samples, "shards": self.entries}
        write_json(self.index_path, index)
        entry = {"num_samples": stored, "num_tokens": index["num_tokens"], "num_shards": len(self.entries),
                 "bytes": sum(e["bytes"] for e in self.entries), "complete": index["complete"]}
        with _MANIFEST_LOCK:  # the train and validation sources share the manifest (and may write concurrently)
            mpath = self.dir / "manifest.json"
            if mpath.is_file():
                self.manifest = read_json(mpath, "hybrid hidden-states manifest")
            self.manifest["splits"][self.split] = entry
            splits = self.manifest["splits"].values()
            self.manifest["status"] = "complete" if all(s["complete"] for s in splits) else "in_progress"
            self.manifest["counts"] = {k: sum(s[src] for s in splits) for k, src in
                                       (("samples", "num_samples"), ("tokens", "num_tokens"), ("bytes", "bytes"))}
            self.manifest["updated"] = now_iso()
            write_json(mpath, self.manifest)

    def fetch(self, samples: Sequence[tuple[int, Sequence[int]]]) -> list[Features | None]:
        from eagle3_train.hidden_states.extract import ShardPlan, _write_shard

        self._ready()
        out: dict[int, Features | None] = {}
        missing = [(k, s) for k, s in enumerate(samples) if s[0] not in self.reader]
        for k, (index, _) in enumerate(samples):
            if index in self.reader:
                hs = self.reader.load(index)
                out[k] = Features(aux=hs["aux"], final=hs["final"])
        if missing:
            fetched = super().fetch([s for _, s in missing])
            keep = [(s[0], f) for (_, s), f in zip(missing, fetched) if f is not None]
            out.update({k: f for (k, _), f in zip(missing, fetched)})
            if keep:
                number = len(self.entries)
                plan = ShardPlan(number, tuple(i for i, _ in keep), tuple(f["aux"].shape[0] for _, f in keep))
                meta = {"format": self.manifest["format"], "split": self.split, "shard": str(number),
                        "layer_ids": ",".join(map(str, self.manifest["layer_ids"])), "dtype": self.manifest["dtype"]}
                entry = _write_shard(self.split_dir / f"shard-{number:05d}.safetensors",
                                     torch.cat([f["aux"] for _, f in keep]), torch.cat([f["final"] for _, f in keep]),
                                     plan, meta)
                self.entries.append(entry)
                self._write_index()
                self._open_reader()
        return [out[k] for k in range(len(samples))]

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "mode": "hybrid", "hidden_states": str(self.dir)}

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        super().close()
