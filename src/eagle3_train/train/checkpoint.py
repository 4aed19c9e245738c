"""Atomic training checkpoints: weights (safetensors), draft config, full training state, metadata."""

from __future__ import annotations

import errno
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.utils.io import Eagle3InputError, atomic_dir, read_json, save_safetensors, write_json

WEIGHTS = "model.safetensors"
CONFIG = "draft_config.json"
STATE = "training_state.pt"
METADATA = "training_metadata.json"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# What np.random.get_state() pickles into; everything else in a training state is tensors and plain containers.
_NP_CORE = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
_RNG_GLOBALS = [_NP_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_training_state(path: Path) -> dict[str, Any]:
    """torch.load with weights_only=True: a training_state.pt from elsewhere can hold data, never code to run."""
    try:
        with torch.serialization.safe_globals(_RNG_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Eagle3InputError(f"refusing to load {path}: it holds objects other than tensors, numbers and the RNG "
                               f"state that eagle3-train writes ({reason}); delete that checkpoint directory or "
                               f"train into a new --out") from None


def save_weights(model: Eagle3Draft, directory: Path) -> None:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.trainable_state_dict().items()}
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    save_safetensors(tensors, directory / WEIGHTS, metadata={"format": "pt", "producer": "eagle3-train"})


def save_checkpoint(directory: Path, model: Eagle3Draft, training_state: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> Path:
    """Write a checkpoint directory atomically (temp dir + rename): a kill never leaves a half checkpoint."""
    with atomic_dir(directory) as tmp:
        save_weights(model, tmp)
        model.config.save(tmp / CONFIG)
        if training_state is not None:
            try:
                torch.save(training_state, tmp / STATE)
            except RuntimeError as e:  # torch reports a failed write (e.g. a full disk) as RuntimeError
                if "write" not in str(e):
                    raise
                raise OSError(errno.EIO, f"writing failed ({e}); is the disk full?", str(tmp / STATE)) from None
        write_json(tmp / METADATA, metadata)
    return directory


def load_draft(directory: str | Path, embed: torch.Tensor | None = None) -> Eagle3Draft:
    """Load one of our checkpoints (weights + draft_config.json). The frozen embedding comes from the verifier."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise Eagle3InputError(f"{directory} is not an eagle3-train checkpoint (needs {CONFIG} and {WEIGHTS})")
    model = Eagle3Draft(DraftConfig.load(directory / CONFIG))
    state = load_file(str(directory / WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise Eagle3InputError(f"checkpoint {directory}: missing tensors {missing}, unexpected tensors {unexpected}")
    if embed is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    return model


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = out_dir / "checkpoints" / "latest.json"
    if not pointer.is_file():
        return None
    d = out_dir / "checkpoints" / read_json(pointer, "latest checkpoint pointer")["dir"]
    return d if d.is_dir() else None


def mark_latest(out_dir: Path, directory: Path) -> None:
    write_json(out_dir / "checkpoints" / "latest.json", {"dir": directory.name})


def prune(out_dir: Path, keep_last: int) -> None:
    ckpts = sorted((out_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    for old in ckpts[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
