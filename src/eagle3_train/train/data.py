"""Training samples: token ids and loss mask from the prepared dataset joined with the extracted hidden states."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from eagle3_train.data.prepare import load_prepared
from eagle3_train.hidden_states.modes import open_source
from eagle3_train.hidden_states.source import HiddenStateSource, StoredSource
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

SourceOpener = Callable[[], HiddenStateSource]


def real_tokens(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] bool: True on each row's first lengths[b] (non-padding) positions."""
    return torch.arange(length, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, L] bool
    aux: torch.Tensor  # [B, L, 3H]
    final: torch.Tensor  # [B, L, H] verifier's last (post-norm) hidden state
    lengths: torch.Tensor  # [B]
    # The verifier's full-vocab argmax [B, L] int64 and logsumexp [B, L] float32 per position, when the store has
    # them (extract's `verifier_argmax`/`verifier_lse`): the targets then skip the full-vocab pass. None otherwise.
    verifier_argmax: torch.Tensor | None = None
    verifier_lse: torch.Tensor | None = None
    # [B, L] bool: the positions the metrics count when they differ from the loss mask (`train.supervise: all` keeps
    # the assistant mask here), None: the loss mask's
    scored_mask: torch.Tensor | None = None

    def supervising_every_token(self) -> Batch:
        """The same batch with every real (non-padding) token in the loss mask (`train.supervise: all`); the metrics
        keep counting the assistant tokens (`scored_mask`)."""
        mask = real_tokens(self.lengths, self.input_ids.shape[1])
        return dataclasses.replace(self, loss_mask=mask.to(self.loss_mask.device), scored_mask=self.loss_mask)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        stats = (None, None) if self.verifier_argmax is None else (self.verifier_argmax.to(device),
                                                                   self.verifier_lse.to(device))  # lse stays fp32
        scored = None if self.scored_mask is None else self.scored_mask.to(device)
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.aux.to(device, dtype),
                     self.final.to(device, dtype), self.lengths.to(device), *stats, scored)


class TrainingSamples:
    """One split: prepared rows joined with the features of a hidden-state source, addressable by position 0..n-1.

    `source` is a `HiddenStateSource`, an extract output directory (read through `StoredSource`) or a function that
    opens the source (called once the prepared split is found, so a missing split connects to no server).
    """

    def __init__(self, prepared_dir: str | Path, source: HiddenStateSource | str | Path | SourceOpener, split: str):
        dsd = load_prepared(prepared_dir, (split,), ("input_ids", "loss_mask", "length"))[0]
        if isinstance(source, (str, Path)):
            self.source: HiddenStateSource = StoredSource(source, split)
        else:
            self.source = source() if callable(source) else source
        rows = dsd[split].select_columns(["input_ids", "loss_mask", "length"])
        available = self.source.sample_indices()
        self.indices = list(range(len(rows))) if available is None else list(available)
        if self.indices and max(self.indices) >= len(rows):
            raise Eagle3InputError(f"hidden states of split '{split}' reference sample {max(self.indices)} "
                                   f"but the prepared split has {len(rows)} rows: they belong to other data")
        picked = rows.select(self.indices) if self.indices else rows.select([])
        self.input_ids = picked["input_ids"]
        self.loss_mask = picked["loss_mask"]
        self.lengths = [int(x) for x in picked["length"]]

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def skipped(self) -> int:
        return self.source.skipped

    def batch(self, positions: list[int]) -> Batch | None:
        """The padded batch of these positions; samples the source skipped are left out (None: all were)."""
        feats = self.source.fetch([(self.indices[p], self.input_ids[p]) for p in positions])
        kept = [(p, f) for p, f in zip(positions, feats) if f is not None]
        if not kept:
            return None
        L = max(self.lengths[p] for p, _ in kept)
        B = len(kept)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.bool)
        aux = torch.zeros(B, L, kept[0][1]["aux"].shape[-1], dtype=kept[0][1]["aux"].dtype)
        final = torch.zeros(B, L, kept[0][1]["final"].shape[-1], dtype=kept[0][1]["final"].dtype)
        # all samples of the batch have the stats, or the batch has none (the full pass then runs for all)
        has_stats = all(hs.get("verifier_argmax") is not None for _, hs in kept)
        top = torch.zeros(B, L, dtype=torch.long) if has_stats else None
        lse = torch.zeros(B, L, dtype=torch.float32) if has_stats else None
        for b, (p, hs) in enumerate(kept):
            n = self.lengths[p]
            if hs["aux"].shape[0] != n:
                raise Eagle3InputError(f"sample {self.indices[p]}: {hs['aux'].shape[0]} hidden-state rows but "
                                       f"{n} tokens in the prepared data")
            ids[b, :n] = torch.tensor(self.input_ids[p])
            mask[b, :n] = torch.tensor(self.loss_mask[p], dtype=torch.bool)
            aux[b, :n] = hs["aux"]
            final[b, :n] = hs["final"]
            if has_stats:
                top[b, :n] = hs["verifier_argmax"]
                lse[b, :n] = hs["verifier_lse"]
        return Batch(ids, mask, aux, final, torch.tensor([self.lengths[p] for p, _ in kept]), top, lse)

    def close(self) -> None:
        self.source.close()


def open_samples(cfg, inputs, split: str, rank: int = 0, world_size: int = 1) -> TrainingSamples:
    """A split of the run's data with the hidden-state source its settings choose (`hidden_states.modes`: offline,
    online or hybrid), opened once the prepared split is found; `rank`, `world_size`: this process under torchrun
    (online/hybrid: each rank has its own source)."""
    return TrainingSamples(cfg.prepared, partial(open_source, cfg, inputs, split, rank, world_size), split)


def open_validation(cfg, inputs, rank: int = 0, world_size: int = 1) -> TrainingSamples | None:
    """The validation split as `open_samples` opens it, or None (with a warning) when the run has none."""
    try:
        val = open_samples(cfg, inputs, "validation", rank, world_size)
    except Eagle3InputError as e:
        log.warning("no validation data: %s", e)
        return None
    return val if len(val) > 0 else None
