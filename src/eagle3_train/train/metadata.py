"""`training_metadata.json`: where a run started from and everything needed to reproduce it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_train.model.config import DraftConfig
from eagle3_train.utils.outputs import json_says
from eagle3_train.utils.provenance import environment, now_iso

FORMAT = "eagle3-train/training-metadata"
VERSION = 1
OUTPUT = ("train", "training output directory")  # the stage that owns a run directory, and what errors call it
# The top-level names a training run (or its dry run) writes: what its marker lists, and what --overwrite sets aside.
# The trackers' own names (wandb/, mlruns/, trackers.json) are registered by the metrics log when each starts, where
# the environment says whether it writes in OUT at all (train/trackers.py, `writes`).
WRITES = ("checkpoints", "final", "training_metadata.json", "metrics.jsonl", "metrics.png", "tensorboard",
          "training_metadata.dry-run.json", "dry-run-exports")


def written_by_train(path: Path) -> bool:
    """A run directory from before output markers: its (dry-run) training metadata carries our format."""
    return any(json_says(name, "format", FORMAT)(path)
               for name in ("training_metadata.json", "training_metadata.dry-run.json"))


def build_metadata(cfg, inputs, draft_config: DraftConfig, init: dict[str, Any], world_size: int, *, started: str,
                   status: str, progress: dict[str, Any], metrics: dict[str, Any],
                   source: dict[str, Any] | None = None, compute: dict[str, str] | None = None) -> dict[str, Any]:
    """`compute`: the device and precision the run resolved (`auto` depends on the hardware), the host malloc."""
    pm = inputs.prepared_manifest
    return {
        "format": FORMAT,
        "version": VERSION,
        "run": {"out": cfg.out, "status": status, "started": started, "updated": now_iso(),
                "world_size": world_size, **(compute or {})},
        # How the draft was initialised: {"method": "random", "seed"} or {"method": "finetune", "source", ...}.
        "init": init,
        "data": {
            "prepared": str(inputs.prepared_dir),
            "prepared_manifest_sha256": inputs.prepared_manifest_sha256,
            "source": pm.get("source"),
            "counts": pm.get("counts"),
            "hidden_states": None if inputs.hidden_manifest.get("mode") == "online" else str(inputs.hidden_dir),
            "hidden_states_manifest_sha256": inputs.hidden_manifest_sha256,
            # the dtype the teacher ran in: a draft served against the verifier in another dtype is named as such
            "hidden_states_compute_dtype": inputs.hidden_manifest.get("compute_dtype"),
            "layer_ids": list(inputs.layer_ids),
            "hidden_states_dtype": inputs.hidden_manifest.get("dtype"),
            # mode (offline/online/hybrid), the servers' identity when served, samples skipped
            "hidden_states_source": source or {"mode": "offline"},
        },
        "verifier": inputs.verifier_identity,
        "vocab": _vocab_record(inputs, draft_config, init),
        "draft_config": draft_config.to_dict(),
        "settings": cfg.to_dict(),
        "environment": environment(),
        "progress": progress,
        "metrics": metrics,
    }


def _vocab_record(inputs, draft_config: DraftConfig, init: dict[str, Any]) -> dict[str, Any]:
    """The mapping the draft really uses: the run's vocab file, or the finetune source's under `keep`."""
    if init.get("method") == "finetune" and init.get("vocab_policy") == "keep":
        return {"origin": "finetune source (vocab policy keep)", "source": init.get("resolved") or init.get("source"),
                "draft_vocab_size": draft_config.draft_vocab_size,
                "run_vocab_not_used": None if inputs.vocab_path is None else {"path": str(inputs.vocab_path),
                                                                              "sha256": inputs.vocab_sha256}}
    return {"origin": "run", "path": str(inputs.vocab_path), "sha256": inputs.vocab_sha256,
            "draft_vocab_size": draft_config.draft_vocab_size}


def timing_record(timing: dict[str, float], source) -> dict[str, float]:
    """Where an invocation's time went: `timing` (training compute, the loop waiting on the source) and, online or
    hybrid, the summed request and file-read seconds and the retries of the train split's server client."""
    client = getattr(source, "client", None)
    extra = {f"server_{k}": round(v, 3) for k, v in client.timing.items()} if client is not None else {}
    if client is not None and client.pool is not None:
        extra["server_retries"] = client.pool.retries
    return {**{k: round(v, 3) for k, v in timing.items()}, **extra}
