"""Our own checkpoints and training run directories: how `train` stores a draft and how every stage finds it.

A checkpoint directory holds `model.safetensors` (trainable weights, whole, float32), `draft_config.json`,
`training_metadata.json` and, for resumable ones, `training_state.pt` (progress, schedule, RNG per rank) and
`optimizer/` (the optimizer states as torch.distributed.checkpoint writes them, one file per rank:
train/parallel.py). A run directory holds `final/`,
`checkpoints/step-N/`, `checkpoints/best/` and the pointer `checkpoints/latest.json`.

Python API: `save_checkpoint(dir, model, state, metadata)`, `load_draft(dir, embed=None) -> Eagle3Draft`,
`resolve_checkpoint(path) -> Path` (a run directory or checkpoint -> the checkpoint: export, evaluate, serve and
finetune all go through it), `read_metadata(dir)`, `recorded_verifier(draft) -> str | None`,
`latest_checkpoint(run_dir)`, `mark_latest`, `prune`.
"""

from __future__ import annotations

import errno
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.networks import build_draft
from eagle3_train.utils.finite import check_finite
from eagle3_train.utils.io import Eagle3InputError, load_safetensors, read_json, save_safetensors, write_json
from eagle3_train.utils.outputs import atomic_dir, marked_by, remove_owned

WEIGHTS = "model.safetensors"
CONFIG = "draft_config.json"
STATE = "training_state.pt"
METADATA = "training_metadata.json"
FINAL = "final"  # a finished run's last weights, inside the run directory
LATEST = "latest.json"  # checkpoints/latest.json: {"dir": NAME} of the newest resumable checkpoint


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
    except (RuntimeError, EOFError, OSError) as e:  # cut off by a full disk or a copy: torch's zip reader fails
        raise Eagle3InputError(f"cannot read {path}: it is damaged ({str(e).strip().splitlines()[0]}); point "
                               f"{path.parent.parent / LATEST} at an earlier checkpoint of the run, or train into a "
                               f"new --out") from None


def save_weights(model: Eagle3Draft, directory: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """`weights`: the trainable state gathered whole (a sharded run's); default: `model`'s own."""
    tensors = {k: v.detach().to("cpu").contiguous()
               for k, v in (model.trainable_state_dict() if weights is None else weights).items()}
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    save_safetensors(tensors, directory / WEIGHTS, metadata={"format": "pt", "producer": "eagle3-train"})


def save_checkpoint(directory: Path, model: Eagle3Draft, training_state: dict[str, Any] | None,
                    metadata: dict[str, Any], weights: dict[str, torch.Tensor] | None = None,
                    shards: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint directory atomically (temp dir + rename): a kill never leaves a half checkpoint.
    `weights`: the trainable state gathered whole (default: `model`'s); `shards(tmp)`: writes the ranks' shards of
    the optimizer state into the temporary directory (every rank takes part) before it is renamed."""
    with atomic_dir(directory, "checkpoint", "checkpoint directory", is_checkpoint) as tmp:
        if shards is not None:
            shards(tmp)
        save_weights(model, tmp, weights)
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
    """Load one of our checkpoints (weights + draft_config.json). The frozen embedding comes from the verifier
    (`embed`), a draft of another width's from its checkpoint."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise Eagle3InputError(f"{directory} is not an eagle3-train checkpoint (needs {CONFIG} and {WEIGHTS})")
    model = build_draft(DraftConfig.load(directory / CONFIG))
    state = load_safetensors(directory / WEIGHTS)
    check_finite(state.items(), f"checkpoint {directory}", "a draft of NaN proposes nothing a verifier accepts: "
                 "use an earlier checkpoint of the run, or retrain (a lower lr, grad_clip > 0)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise Eagle3InputError(f"checkpoint {directory}: missing tensors {missing}, unexpected tensors {unexpected}")
    model.use_embedding(embed, state.get("embed_tokens.weight"), f"checkpoint {directory}")
    return model


_STEP_DIR = re.compile(r"step-\d{7,}")


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def is_run_dir(path: str | Path) -> bool:
    """A training run directory: it has a final checkpoint or a latest-checkpoint pointer."""
    p = Path(path)
    return is_checkpoint(p / FINAL) or (p / "checkpoints" / LATEST).is_file()


def _latest_pointer(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    name = read_json(pointer, "latest checkpoint pointer").get("dir")
    if not isinstance(name, str) or not _STEP_DIR.fullmatch(name):  # a plain step-N name: never a path elsewhere
        raise Eagle3InputError(f"{pointer} names {name!r}, not a checkpoint of this run (expected step-NNNNNNN)")
    return run_dir / "checkpoints" / name


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest resumable checkpoint of a run (None when it has none yet). A pointer to a checkpoint that is gone
    is an error: starting afresh would overwrite the run's older checkpoints."""
    d = _latest_pointer(Path(run_dir))
    if d is not None and not is_checkpoint(d):
        raise Eagle3InputError(f"{Path(run_dir) / 'checkpoints' / LATEST} points to {d.name}, which is missing or "
                               f"incomplete: restore it, point latest.json at another checkpoint of "
                               f"{d.parent}, or train into a new --out")
    return d


def mark_latest(run_dir: Path, directory: Path) -> None:
    write_json(run_dir / "checkpoints" / LATEST, {"dir": directory.name})


def resolve_checkpoint(path: str | Path, notes: list[str] | None = None) -> Path:
    """The checkpoint a path denotes: a checkpoint directory itself, or a training run's `final/` (else its latest
    checkpoint, noted in `notes`). Eagle3InputError when the path is neither."""
    p = Path(path).expanduser()
    if is_checkpoint(p):
        return p
    if is_checkpoint(p / FINAL):
        if notes is not None:
            notes.append(f"{p} is a training run: using its final checkpoint")
        return p / FINAL
    latest = _latest_pointer(p) if p.is_dir() else None
    if latest is not None:
        if not is_checkpoint(latest):
            raise Eagle3InputError(f"{p / 'checkpoints' / LATEST} points to {latest}, which is not a checkpoint "
                                   f"(needs {CONFIG})")
        if notes is not None:
            notes.append(f"{p} is an unfinished training run: using its latest checkpoint {latest.name}")
        return latest
    raise Eagle3InputError(_not_a_checkpoint(p))


def _not_a_checkpoint(p: Path) -> str:
    """What was looked for in `p`, and what to pass instead."""
    want = (f"pass a training run directory (its {FINAL}/ checkpoint, else the one checkpoints/{LATEST} names) or a "
            f"checkpoint directory ({CONFIG} and {WEIGHTS})")
    if not p.exists():
        return f"{p} does not exist; {want}"
    if not p.is_dir():
        return f"{p} is a file, not a directory; {want}"
    looked = f"found none of {p / CONFIG}, {p / FINAL / CONFIG}, {p / 'checkpoints' / LATEST}"
    published = (" (its config.json marks an exported or published draft: vLLM and SGLang load it as it is)"
                 if (p / "config.json").is_file() else "")
    return f"{p} is neither an eagle3-train checkpoint nor a training run directory{published}: {looked}; {want}"


# The sections of training_metadata.json that readers walk into (lineage, inspect, export): each an object when present.
_METADATA_OBJECTS = ("init", "export", "run", "verifier", "settings", "data", "vocab", "draft_config", "metrics",
                     "environment")


def check_metadata(meta: dict[str, Any], where: str, depth: int = 0) -> dict[str, Any]:
    """`meta` with every section a reader walks into of the right shape, down the lineage (a finetune's
    `init.source_metadata`); a damaged or hand-edited file is one clear error naming the key."""
    for key in _METADATA_OBJECTS:
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise Eagle3InputError(f"{where}: '{key}' must be an object, got {type(meta[key]).__name__} "
                                   f"{str(meta[key])[:40]!r} (a damaged or hand-edited file)")
    source = (meta.get("init") or {}).get("source_metadata")
    if source is not None:
        if not isinstance(source, dict):
            raise Eagle3InputError(f"{where}: 'init.source_metadata' must be an object, got "
                                   f"{type(source).__name__}")
        if depth < 100:  # deeper is a cycle in hand-edited metadata; inspect's lineage stops there too
            check_metadata(source, f"{where} (init.source_metadata)", depth + 1)
    return meta


def read_metadata(directory: str | Path) -> dict[str, Any] | None:
    """A checkpoint's (or export's) training_metadata.json, its sections checked; None when it has none."""
    meta = Path(directory) / METADATA
    return check_metadata(read_json(meta, "training metadata"), str(meta)) if meta.is_file() else None


def recorded_verifier(draft: str | Path) -> str | None:
    """The verifier a draft was trained for: its training metadata (the local directory when it still exists here,
    else the name the user gave), else a speculators config's verifier."""
    from eagle3_train.assets.verifier import recorded_name

    path = Path(draft).expanduser()
    try:
        path = resolve_checkpoint(path)
    except Eagle3InputError:
        pass  # an export or a published draft: its own training_metadata.json or config.json
    found = recorded_name((read_metadata(path) or {}).get("verifier"))
    if found:
        return found
    cfg = path / "config.json"
    if cfg.is_file():
        return ((read_json(cfg, "draft config").get("speculators_config") or {}).get("verifier") or {}
                ).get("name_or_path")
    return None


def prune(out_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` periodic checkpoints: only `step-NNNNNNN` directories this tool wrote
    (marked), and in them only the files their marker lists; never anything else in checkpoints/."""
    ckpts = sorted((p for p in (out_dir / "checkpoints").glob("step-*")
                    if _STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
                    and marked_by(p, "checkpoint")),
                   key=lambda p: int(p.name.split("-")[1]))
    for old in ckpts[:-keep_last] if keep_last > 0 else []:
        remove_owned(old)
