"""Training samples: token ids and loss mask from the prepared dataset joined with the extracted hidden states."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_train.hidden_states.source import HiddenStateSource, StoredSource
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)


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

    `source` is a `HiddenStateSource` or an extract output directory (read through `StoredSource`).
    """

    def __init__(self, prepared_dir: str | Path, source: HiddenStateSource | str | Path, split: str):
        from datasets import load_from_disk

        ds_path = Path(prepared_dir) / "dataset"
        if not ds_path.exists():
            raise Eagle3InputError(f"prepared dataset not found: {ds_path} (run `eagle3-train prepare` first)")
        dsd = load_from_disk(str(ds_path))
        if split not in dsd:
            raise Eagle3InputError(f"prepared dataset {ds_path} has no '{split}' split (has {list(dsd)})")
        self.source: HiddenStateSource = StoredSource(source, split) if isinstance(source, (str, Path)) else source
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
    """A split of the run's data with the hidden-state source its settings choose (offline, online or hybrid);
    `rank`, `world_size`: this process under torchrun (online/hybrid: each rank has its own source)."""
    mode = cfg.hidden_states_mode
    if mode == "offline":
        return TrainingSamples(cfg.prepared, cfg.hidden_states, split)
    from eagle3_train.hidden_states.online import HybridSource, OnlineSource

    dtype = getattr(torch, cfg.hidden_states_dtype)
    online = dict(endpoints=cfg.endpoint, verifier_dir=inputs.verifier.path, layer_ids=inputs.layer_ids, dtype=dtype,
                  model=cfg.served_model, concurrency=cfg.online_concurrency, rank=rank, world_size=world_size,
                  hidden_states_dir=cfg.hidden_states_dir)
    if mode == "online":
        return TrainingSamples(cfg.prepared, OnlineSource(split, **online), split)
    if mode != "hybrid":
        raise Eagle3InputError(f"train.hidden_states_mode must be offline, online or hybrid, got {mode!r}")
    from datasets import load_from_disk

    ds = load_from_disk(str(Path(cfg.prepared) / "dataset"))
    if split not in ds:
        raise Eagle3InputError(f"prepared dataset {cfg.prepared}/dataset has no '{split}' split (has {list(ds)})")
    text = inputs.verifier.config.get("text_config", inputs.verifier.config)
    hidden = int(text["hidden_size"])
    manifest = {"verifier": inputs.verifier_identity, "verifier_name": inputs.verifier.name,
                "layer_ids": list(inputs.layer_ids), "dtype": cfg.hidden_states_dtype, "hidden_size": hidden,
                "num_layers": int(text["num_hidden_layers"]),
                "prepared_manifest_sha256": inputs.prepared_manifest_sha256,
                "prepared_dir": str(Path(cfg.prepared).resolve()), "aux_width": len(inputs.layer_ids) * hidden,
                "bytes_per_token": 4 * hidden * torch.empty((), dtype=dtype).element_size()}
    source = HybridSource(split, inputs.hidden_dir, manifest, len(ds[split]), **online)
    return TrainingSamples(cfg.prepared, source, split)


def open_validation(cfg, inputs, rank: int = 0, world_size: int = 1) -> TrainingSamples | None:
    """The validation split as `open_samples` opens it, or None (with a warning) when the run has none."""
    try:
        val = open_samples(cfg, inputs, "validation", rank, world_size)
    except Eagle3InputError as e:
        log.warning("no validation data: %s", e)
        return None
    return val if len(val) > 0 else None
