"""Hidden-state sources backed by vLLM hidden-state servers, for online and hybrid training.

`OnlineSource` asks the servers (`VLLMHiddenStates`: several endpoints share the requests, the client retries a slow
or failing server with exponential backoff) for every sample it is given and keeps nothing. A sample that fails on
its own (rejected, too long, still failing after the retries while others of its fetch got through, NaN/Inf) is
logged and skipped, counted in `skipped`; when no sample of a fetch gets through the servers are down and the run
stops (`ServerUnavailable`; resume continues it). `HybridSource` does the same for samples it has not seen
and stores what it fetched as ordinary extract shards (one shard per fetch, index.json and manifest.json as extract
writes them), so from the second epoch on the states are read from disk and the directory can be reused by
`train --hidden-states`.

Under torchrun each rank has its own sources and fetches only its own micro-batches (`rank`, `world_size`); the
hybrid store is shared, see `HybridSource` for how the ranks write it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_train.hidden_states.manifest import summarize
from eagle3_train.hidden_states.resume import written_by_extract
from eagle3_train.hidden_states.source import Features
from eagle3_train.hidden_states.store import FORMAT, FORMAT_VERSION, HiddenStatesReader, ShardPlan, write_shard
from eagle3_train.hidden_states.vllm_backend import ServerUnavailable, VLLMHiddenStates
from eagle3_train.utils.io import Eagle3InputError, read_json, write_json
from eagle3_train.utils.outputs import claim_output_dir
from eagle3_train.utils.provenance import now_iso

log = logging.getLogger(__name__)


class OnlineSource:
    def __init__(self, split: str, endpoints: Sequence[str], verifier_dir: str | Path, layer_ids: Sequence[int],
                 dtype: torch.dtype, *, model: str | None = None, concurrency: int = 8, rank: int = 0,
                 world_size: int = 1, hidden_states_dir: str | Path | None = None) -> None:
        self.split = split
        self.skipped = 0
        self.rank, self.world_size = rank, world_size
        # At equal load rank r sends to endpoint r % n first: ranks with few requests in flight spread over servers.
        self.client = VLLMHiddenStates(endpoints, verifier_dir, layer_ids, dtype, model=model,
                                       concurrency=concurrency, first_endpoint=rank,
                                       hidden_states_dir=hidden_states_dir)
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
    """Online for samples not stored yet; each fetch is stored in `store_dir` as one more extract shard.

    Under torchrun every rank has its own HybridSource on the same directory (one filesystem):
    - a rank writes only its own shard files: numbers congruent to its rank modulo the world size, above every number
      present when it opened (an earlier run's files included), each written to a temporary name and renamed;
    - index.json and manifest.json are read, extended and replaced by one rank at a time, under an exclusive `flock`
      on the store directory, so no entry is lost and every write is atomic;
    - no sample is fetched twice: within an epoch each sample belongs to one rank's micro-batch, epochs are separated
      by a barrier (the end-of-epoch checkpoint), and a rank that misses a sample re-reads the index before fetching,
      so it reads what another rank stored in an earlier epoch. Validation batches go to the same rank every time.
    A shard written but not indexed (killed in between) is removed when nothing else can be writing: on opening in a
    single process, and when the split's index becomes complete.
    """

    def __init__(self, split: str, store_dir: str | Path, manifest: dict[str, Any], num_samples: int,
                 **online: Any) -> None:
        """`manifest`: the store's manifest as `manifest.new_manifest` makes it (the servers' record added here)."""
        super().__init__(split, **online)
        self.dir = Path(store_dir)
        self.split_dir = self.dir / split
        self.num_samples = num_samples
        self.index_path = self.split_dir / "index.json"
        self.new_manifest = {**manifest, "vllm": self.servers}
        self.reader: Any = None  # opened on the first fetch: the trainer claims (or sets aside) its --out first
        self.next_number = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive over all ranks' (and this process's other) sources on this store: flock on its directory."""
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _ready(self) -> None:
        if self.reader is not None:
            return
        claim_output_dir(self.dir, "extract", "hybrid hidden-states directory", written_by_extract,
                         writes=("manifest.json", self.split))
        self.split_dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            mpath = self.dir / "manifest.json"
            if mpath.is_file():
                old = read_json(mpath, "hybrid hidden-states manifest")
                for key in ("prepared_manifest_sha256", "layer_ids", "dtype", "hidden_size"):
                    if old.get(key) != self.new_manifest.get(key):
                        raise Eagle3InputError(f"{mpath} holds hidden states with {key} {old.get(key)!r}, this run "
                                               f"needs {self.new_manifest.get(key)!r}: choose another "
                                               f"train.hidden_states directory")
            else:
                write_json(mpath, {**self.new_manifest, "created": now_iso()})
            entries = self._entries()
            if self.world_size == 1:
                self._remove_unindexed(entries)
            taken = [e["shard"] for e in entries] + [_shard_number(f) for f in self.split_dir.glob("shard-*")]
            start = max(taken, default=-1) + 1
            self.next_number = start + (self.rank - start) % self.world_size
            self._write_index(entries)
        self._open_reader()

    def _entries(self) -> list[dict]:
        return read_json(self.index_path, "hidden-state index").get("shards", []) if self.index_path.is_file() else []

    def _remove_unindexed(self, entries: list[dict]) -> None:
        """Shard files no entry lists (a kill between writing a shard and indexing it), and temporary files."""
        listed = {e["file"] for e in entries}
        for f in self.split_dir.iterdir():
            if (f.name.startswith("shard-") and f.name not in listed) or (
                    f.name.startswith((".shard-", ".index.json.")) and f.name.endswith(".tmp")):
                log.warning("removing %s: a shard not in %s (written before a kill)", f, self.index_path)
                f.unlink(missing_ok=True)

    def _open_reader(self) -> None:
        self.reader = HiddenStatesReader(self.dir, self.split)

    def _write_index(self, entries: list[dict]) -> None:
        """Write this split's index and its entry in the manifest (the caller holds the lock)."""
        stored = sum(e["num_samples"] for e in entries)
        index = {"format": FORMAT, "format_version": FORMAT_VERSION, "split": self.split,
                 "num_samples": self.num_samples, "num_tokens": sum(e["num_tokens"] for e in entries),
                 "num_shards": len(entries), "complete": stored >= self.num_samples, "shards": entries}
        write_json(self.index_path, index)
        if index["complete"]:  # every sample is stored: no rank is writing into this split any more
            self._remove_unindexed(entries)
        mpath = self.dir / "manifest.json"
        manifest = read_json(mpath, "hybrid hidden-states manifest")
        manifest["splits"][self.split] = {"num_samples": stored, "num_tokens": index["num_tokens"],
                                          "num_shards": len(entries), "bytes": sum(e["bytes"] for e in entries),
                                          "complete": index["complete"]}
        write_json(mpath, summarize(manifest))

    def _store(self, keep: list[tuple[int, Features]]) -> None:
        """Write the fetched samples as this rank's next shard, then add it to the index."""
        number, self.next_number = self.next_number, self.next_number + self.world_size
        plan = ShardPlan(number, tuple(i for i, _ in keep), tuple(f["aux"].shape[0] for _, f in keep))
        meta = {"format": self.new_manifest["format"], "split": self.split, "shard": str(number),
                "layer_ids": ",".join(map(str, self.new_manifest["layer_ids"])), "dtype": self.new_manifest["dtype"]}
        entry = write_shard(self.split_dir / f"shard-{number:05d}.safetensors",
                            torch.cat([f["aux"] for _, f in keep]), torch.cat([f["final"] for _, f in keep]), plan,
                            meta)
        with self._locked():
            self._write_index([*self._entries(), entry])

    def fetch(self, samples: Sequence[tuple[int, Sequence[int]]]) -> list[Features | None]:
        self._ready()
        if any(index not in self.reader for index, _ in samples):
            self._open_reader()  # another rank may have stored them (in an earlier epoch)
        out: dict[int, Features | None] = {}
        missing = [(k, s) for k, s in enumerate(samples) if s[0] not in self.reader]
        for k, (index, _) in enumerate(samples):
            if index in self.reader:
                hs = self.reader.load(index)
                out[k] = Features(aux=hs["aux"], final=hs["final"])
        if missing:
            fetched = super().fetch([s for _, s in missing])
            out.update({k: f for (k, _), f in zip(missing, fetched)})
            keep = [(s[0], f) for (_, s), f in zip(missing, fetched) if f is not None]
            if keep:
                self._store(keep)
        return [out[k] for k in range(len(samples))]

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "mode": "hybrid", "hidden_states": str(self.dir)}

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        super().close()


def _shard_number(path: Path) -> int:
    """NNNNN of shard-NNNNN.safetensors (-1 for another name)."""
    digits = path.name.removeprefix("shard-").split(".")[0]
    return int(digits) if digits.isdigit() else -1
