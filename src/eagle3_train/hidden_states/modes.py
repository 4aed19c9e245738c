"""Where training gets its hidden states (`train.hidden_states_mode`), one entry per mode, so the trainer, the dry
run and the pipeline read facts (`reads_stored`, `stores`, `served`) instead of comparing mode names, and one
function, `open_source`, turns a mode into a `HiddenStateSource`.

- offline: an extract output (`train.hidden_states`), read from disk (`source.StoredSource`);
- online: the verifier's hidden-state servers compute every batch, nothing is kept (`online.OnlineSource`);
- hybrid: online in the first epoch, which stores the states as an extract output (`train.hidden_states`, default
  OUT/hidden_states) read from then on (`online.HybridSource`).

This stage may not import `train/`: the run's settings and resolved inputs come in as duck-typed objects (`cfg`: a
`TrainConfig`, `inputs`: a `RunInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_train.data.prepare import load_prepared
from eagle3_train.hidden_states.source import HiddenStateSource, StoredSource
from eagle3_train.utils.io import Eagle3InputError


@dataclass(frozen=True)
class StatesMode:
    name: str
    reads_stored: bool  # needs train.hidden_states, an extract output (checked against the data and the verifier)
    stores: bool  # writes the states it fetches as an extract output (`states_dir`)
    served: bool  # servers compute states while training: they need endpoints (or the pipeline starts one), and
    # prefetching the next steps' states hides their latency

    @property
    def on_disk(self) -> bool:
        """The run's states end up in a store: read (offline) or written (hybrid)."""
        return self.reads_stored or self.stores

    def states_dir(self, hidden_states: str | None, out: str | Path) -> Path:
        """Where this mode's stored states are: train.hidden_states (stores: default OUT/hidden_states); none:
        Path("")."""
        if self.stores:
            return Path(hidden_states or Path(out) / "hidden_states")
        return Path(hidden_states or "") if self.reads_stored else Path("")


MODES: dict[str, StatesMode] = {
    "offline": StatesMode("offline", reads_stored=True, stores=False, served=False),
    "online": StatesMode("online", reads_stored=False, stores=False, served=True),
    "hybrid": StatesMode("hybrid", reads_stored=False, stores=True, served=True),
}


def states_mode(name: str | None) -> StatesMode:
    """The entry of mode `name`, or an Eagle3InputError naming train.hidden_states_mode and the valid modes."""
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise Eagle3InputError(f"train.hidden_states_mode must be one of {', '.join(MODES)}, got {name!r}")
    return mode


def open_source(cfg: Any, inputs: Any, split: str, rank: int = 0, world_size: int = 1) -> HiddenStateSource:
    """The source of one split's states that `cfg.hidden_states_mode` chooses; `rank`, `world_size`: this process
    under torchrun (online/hybrid: each rank has its own source). `inputs`: the run's resolved inputs (verifier,
    layer ids, the hybrid store's directory `hidden_dir`)."""
    mode = states_mode(cfg.hidden_states_mode)
    if not mode.served:
        return StoredSource(cfg.hidden_states, split)
    import torch

    from eagle3_train.hidden_states.online import HybridSource, OnlineSource

    online = dict(endpoints=cfg.endpoint, verifier_dir=inputs.verifier.path, layer_ids=inputs.layer_ids,
                  dtype=getattr(torch, cfg.hidden_states_dtype), model=cfg.served_model,
                  concurrency=cfg.online_concurrency, rank=rank, world_size=world_size,
                  hidden_states_dir=cfg.hidden_states_dir)
    if not mode.stores:
        return OnlineSource(split, **online)
    return HybridSource(split, inputs.hidden_dir, _store_manifest(cfg, inputs), _split_rows(cfg.prepared, split),
                        **online)


def _split_rows(prepared: str | Path, split: str) -> int:
    """Rows of a prepared split (a hybrid split's index is complete once all are stored)."""
    return len(load_prepared(prepared, (split,), ())[0][split])


def _store_manifest(cfg: Any, inputs: Any) -> dict[str, Any]:
    """The hybrid store's manifest, as extract's with the vLLM backend would be."""
    from eagle3_train.hidden_states.manifest import new_manifest

    text = inputs.verifier.text_config
    settings = {"verifier": inputs.verifier_identity, "backend": "vllm", "layer_ids": list(inputs.layer_ids),
                "dtype": cfg.hidden_states_dtype, "hidden_size": int(text["hidden_size"]),
                "num_layers": int(text["num_hidden_layers"]),
                "prepared_manifest_sha256": inputs.prepared_manifest_sha256}
    return new_manifest(settings, verifier_name=inputs.verifier.name, prepared_dir=cfg.prepared,
                        written_by="train (hybrid mode)")
