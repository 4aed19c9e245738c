"""Extraction by several processes (`torchrun --nproc-per-node N -m eagle3_train.cli extract ...`): one verifier
replica per process (a GPU each), disjoint shards, one store.

The shard plan is deterministic, so every rank knows it; rank r computes the r-th shard of each round of N shards and
writes its file (atomically, as one process would). Rank 0 alone touches everything else: the claim, the resume check,
the manifest and index.json, which it updates after each round from the entries the ranks report. A kill loses at most
the round in flight, and a rerun with any number of processes resumes the same store. Only small Python objects cross
between ranks, so the group is gloo on every device (multi-node included).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from eagle3_train.utils.distributed import DistInfo, barrier, destroy, init_distributed
from eagle3_train.utils.io import Eagle3InputError

T = TypeVar("T")


class ExtractGroup:
    """The ranks of one extraction; a single process is a group of one (every call is then local)."""

    def __init__(self) -> None:
        # gloo whatever the device (the "cpu" group); on a CPU the local processes share its cores
        self.info: DistInfo = init_distributed("cpu")
        self.world, self.rank = self.info.world_size, self.info.rank

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    def device(self, device: str) -> str:
        """This rank's device: a CUDA device without an index is the local rank's GPU."""
        return f"cuda:{self.info.local_rank}" if device == "cuda" and self.world > 1 else device

    def on_main(self, fn: Callable[[], T]) -> T:
        """`fn()` on rank 0, its result on every rank; a clear error there is raised on every rank (none waits on a
        rank that stopped)."""
        if self.world == 1:
            return fn()
        result: list[Any] = [None]
        if self.is_main:
            try:
                result[0] = ("ok", fn())
            except (Eagle3InputError, OSError) as e:
                result[0] = ("error", e)
        import torch.distributed as dist

        dist.broadcast_object_list(result, src=0)
        status, value = result[0]
        if status == "error":
            raise value
        return value

    def holding(self, cm: Callable[[], AbstractContextManager]) -> AbstractContextManager:
        """A context (a lock on the output) that rank 0 holds for the others too."""
        return cm() if self.is_main else nullcontext()

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def close(self) -> None:
        barrier(self.info)
        destroy(self.info)
