"""Training samples: token ids and loss mask from the prepared dataset joined with the extracted hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_train.hidden_states.store import HiddenStatesReader
from eagle3_train.utils.io import Eagle3InputError


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, L] bool
    aux: torch.Tensor  # [B, L, 3H]
    final: torch.Tensor  # [B, L, H] verifier's last (post-norm) hidden state
    lengths: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.aux.to(device, dtype),
                     self.final.to(device, dtype), self.lengths.to(device))


class TrainingSamples:
    """One split: prepared rows that have hidden states, addressable by position 0..n-1."""

    def __init__(self, prepared_dir: str | Path, hidden_dir: str | Path, split: str):
        from datasets import load_from_disk

        ds_path = Path(prepared_dir) / "dataset"
        if not ds_path.exists():
            raise Eagle3InputError(f"prepared dataset not found: {ds_path} (run `eagle3-train prepare` first)")
        dsd = load_from_disk(str(ds_path))
        if split not in dsd:
            raise Eagle3InputError(f"prepared dataset {ds_path} has no '{split}' split (has {list(dsd)})")
        self.reader = HiddenStatesReader(hidden_dir, split)
        rows = dsd[split].select_columns(["input_ids", "loss_mask", "length"])
        self.indices = list(self.reader.sample_indices)
        if self.indices and max(self.indices) >= len(rows):
            raise Eagle3InputError(f"hidden states in {hidden_dir}/{split} reference sample {max(self.indices)} "
                                   f"but the prepared split has {len(rows)} rows: they belong to other data")
        picked = rows.select(self.indices) if self.indices else rows.select([])
        self.input_ids = picked["input_ids"]
        self.loss_mask = picked["loss_mask"]
        self.lengths = [int(x) for x in picked["length"]]

    def __len__(self) -> int:
        return len(self.indices)

    def _shard(self, sample_index: int) -> str:
        pos = self.reader._locate(sample_index)[0]
        return str(self.reader.dir / self.reader.split / self.reader.index["shards"][pos]["file"])

    def batch(self, positions: list[int]) -> Batch:
        L = max(self.lengths[p] for p in positions)
        B = len(positions)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.bool)
        aux = final = None
        for b, p in enumerate(positions):
            n = self.lengths[p]
            hs = self.reader.load(self.indices[p])
            if hs["aux"].shape[0] != n:
                raise Eagle3InputError(f"sample {self.indices[p]}: {hs['aux'].shape[0]} hidden-state rows but "
                                       f"{n} tokens in the prepared data")
            if not (torch.isfinite(hs["aux"]).all() and torch.isfinite(hs["final"]).all()):
                raise Eagle3InputError(f"hidden states of sample {self.indices[p]} ({self._shard(self.indices[p])}) "
                                       f"hold NaN/Inf: the draft would train to NaN. Re-extract them with "
                                       f"`eagle3-train extract --overwrite` (and check the verifier's dtype)")
            if aux is None:
                aux = torch.zeros(B, L, hs["aux"].shape[-1], dtype=hs["aux"].dtype)
                final = torch.zeros(B, L, hs["final"].shape[-1], dtype=hs["final"].dtype)
            ids[b, :n] = torch.tensor(self.input_ids[p])
            mask[b, :n] = torch.tensor(self.loss_mask[p], dtype=torch.bool)
            aux[b, :n] = hs["aux"]
            final[b, :n] = hs["final"]
        return Batch(ids, mask, aux, final, torch.tensor([self.lengths[p] for p in positions]))
