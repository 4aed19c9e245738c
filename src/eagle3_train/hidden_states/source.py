"""The two interfaces of hidden states: where training gets them (`HiddenStateSource`, the consumer side) and what
computes them from the verifier (`HiddenStateProducer`, the producer side). The trainer never knows the source, and
extract runs every backend through the same calls.

A source serves one split's features sample by sample: for a row of the prepared split (its index and token ids) the
aux states [T, 3H] and the final state [T, H] (after the verifier's final norm, as our format defines), or None when
the sample could not be had (the source counts and reports it; the caller skips it). Token ids are passed in because
a serving engine computes the states from them; the shard store only checks their count.

Implementations: `StoredSource` (shards written by `extract`); the vLLM-backed ones in `hidden_states/online.py`.

A producer computes the aux and final states of a batch of token sequences, concatenated (`run_batch`); extract
writes what it returns as shards. Implementations: `hf_backend.HFHiddenStates` (the verifier run here with
transformers, with the full-vocab `stats` function), `vllm_backend.VLLMHiddenStates` (hidden-state servers, no stats).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NotRequired, Protocol, TypedDict

import torch

from eagle3_train.hidden_states.store import HiddenStatesReader
from eagle3_train.utils.io import Eagle3InputError


class Features(TypedDict):
    aux: torch.Tensor  # [T, 3H]
    final: torch.Tensor  # [T, H], post-norm
    # The verifier's full-vocab argmax [T] and logsumexp [T] (float32), stored by the HF extract backend; a source
    # without them leaves them out and training computes them from `final` and the lm_head.
    verifier_argmax: NotRequired[torch.Tensor]
    verifier_lse: NotRequired[torch.Tensor]


class HiddenStateSource(Protocol):
    split: str
    skipped: int  # samples that could not be had (reported and left out of their batch)

    def sample_indices(self) -> list[int] | None:
        """Rows of the prepared split this source can serve (None: any row)."""

    def fetch(self, samples: Sequence[tuple[int, Sequence[int]]]) -> list[Features | None]:
        """Features of each (row index, token ids), in order; None for a sample that is skipped."""

    def identity(self) -> dict[str, Any]:
        """What produced the features, for the training metadata."""

    def close(self) -> None: ...


class HiddenStateProducer(Protocol):
    # final [n, H] -> (full-vocab argmax [n], logsumexp [n]), set by `open`; None: no lm_head here (training
    # computes the stats)
    stats: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    load_s: float  # wall and CPU seconds `open` spent loading the verifier here (left out of the throughput)
    load_cpu_s: float

    def open(self) -> dict[str, Any]:
        """Load the verifier or connect to its servers; returns the record extract keeps in its manifest."""

    def run_batch(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [n, 3H], final [n, H]) in the store dtype for the concatenated tokens of `seqs`, in order."""

    def close(self) -> None: ...


class StoredSource:
    """Hidden states stored by `extract` (or by a hybrid run's first epoch)."""

    def __init__(self, hidden_dir: str | Path, split: str) -> None:
        self.split = split
        self.reader = HiddenStatesReader(hidden_dir, split)
        self.skipped = 0

    def sample_indices(self) -> list[int] | None:
        return list(self.reader.sample_indices)

    def fetch(self, samples: Sequence[tuple[int, Sequence[int]]]) -> list[Features | None]:
        out: list[Features | None] = []
        for index, ids in samples:
            hs = self.reader.load(index)
            if hs["aux"].shape[0] != len(ids):
                raise Eagle3InputError(f"sample {index} (split '{self.split}'): {hs['aux'].shape[0]} hidden-state "
                                       f"rows in {self.reader.dir} but {len(ids)} tokens in the prepared data")
            out.append(Features(**hs))
        return out

    def identity(self) -> dict[str, Any]:
        return {"mode": "offline", "hidden_states": str(self.reader.dir)}

    def close(self) -> None:
        self.reader.close()
