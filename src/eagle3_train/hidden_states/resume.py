"""The extract stage's output directory: whose it is, what a rerun resumes, whether the disk can hold the rest.

- `written_by_extract` / `WHAT`: the ownership test and name `claim_output_dir` uses (extract never writes into a
  directory another stage or a user filled; hybrid training in `online.py` uses the same test for its store);
- `resumable_manifest(out_dir, settings, overwrite)`: the earlier manifest to resume, refused when it was made with
  other settings (`RESUME_KEYS`, the verifier) unless `overwrite`;
- `done_shards(out_dir, plans, old_manifest)`: the index entries of shards a resume keeps (`store.shard_entry_ok`);
- `check_disk_space(...)`: the estimate plus a margin (`disk_margin`, default $EAGLE3_TRAIN_DISK_MARGIN_BYTES or a
  tenth of the estimate, at most 1 GiB) must fit in the free space;
- `clear_output(out_dir, overwrite)`: deletes our earlier files on overwrite and temp files of killed writes, never
  anything else in the directory.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from eagle3_train.assets.verifier import same_verifier
from eagle3_train.hidden_states.store import FORMAT, ShardPlan, shard_entry_ok
from eagle3_train.utils.io import Eagle3InputError, read_json
from eagle3_train.utils.outputs import holds_files, json_says, owned

log = logging.getLogger(__name__)

WHAT = "hidden-states directory"
written_by_extract = json_says("manifest.json", "format", FORMAT)  # a store from before output markers
DISK_MARGIN_ENV = "EAGLE3_TRAIN_DISK_MARGIN_BYTES"
# Free space left over after the estimate, for index files and other jobs: a tenth of the estimate, at most 1 GiB,
# so a small job on a nearly full disk still runs and a large one keeps room for its checkpoints.
DEFAULT_DISK_MARGIN = 2**30
# Settings that change the stored numbers or the shard layout: a resume must match them exactly.
RESUME_KEYS = ("layer_ids", "dtype", "compute_dtype", "hidden_size", "num_layers", "prepared_manifest_sha256",
               "max_samples", "shard_tokens", "backend")
RESUME_DEFAULTS = {"backend": "hf"}  # manifests written before the key existed


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _disk_margin(margin: int | None, estimate: int) -> int:
    if margin is not None:
        return int(margin)
    env = os.environ.get(DISK_MARGIN_ENV)
    if env:
        try:
            return int(env)
        except ValueError:
            raise Eagle3InputError(f"{DISK_MARGIN_ENV} must be an integer number of bytes, got {env!r}") from None
    return min(DEFAULT_DISK_MARGIN, estimate // 10)


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def writes(splits: Sequence[str]) -> tuple[str, ...]:
    """The top-level names an extraction into OUT writes: what its marker lists."""
    return ("manifest.json", *splits)


def _our_files(out_dir: Path) -> list[Path]:
    """Files this stage wrote (and may delete on --overwrite): the manifest and the shards and index of the split
    directories its marker lists; never anything else in OUT (a user's `train.bak/` holds shards too)."""
    if not out_dir.is_dir():
        return []
    files = [f for f in out_dir.iterdir() if f.is_file() and (
        f.name == "manifest.json" or (f.name.startswith(".manifest.json.") and f.name.endswith(".tmp")))]
    mine = owned(out_dir)
    for sub in out_dir.iterdir():
        if sub.name in mine and sub.is_dir() and not sub.is_symlink():
            files += [f for f in sub.iterdir() if f.is_file() and (
                (f.name.startswith("shard-") and f.suffix == ".safetensors") or f.name == "index.json"
                or (f.name.startswith((".shard-", ".index.json.")) and f.name.endswith(".tmp")))]
    return files


def _resume_conflicts(old: dict, new: dict) -> list[str]:
    diffs = []
    if not same_verifier(old.get("verifier", {}), new["verifier"]):
        diffs.append(f"verifier: existing {old.get('verifier', {}).get('path')} "
                     f"(config {str(old.get('verifier', {}).get('config_sha256'))[:12]}), "
                     f"requested {new['verifier']['path']} (config {new['verifier']['config_sha256'][:12]})")
    for k in RESUME_KEYS:
        if old.get(k, RESUME_DEFAULTS.get(k)) != new[k]:
            diffs.append(f"{k}: existing {old.get(k)!r}, requested {new[k]!r}")
    return diffs


def resumable_manifest(out_dir: Path, settings: dict, overwrite: bool) -> dict | None:
    """The manifest of an earlier extraction into `out_dir` to resume (None: start afresh); refuses another stage's
    output, and an earlier extraction with other settings unless `overwrite`."""
    old_manifest = None
    if (out_dir / "manifest.json").is_file():
        existing = read_json(out_dir / "manifest.json", "extract manifest")
        if existing.get("format") != FORMAT:  # never overwrite another stage's output
            raise Eagle3InputError(f"{out_dir / 'manifest.json'} belongs to another stage "
                                   f"({existing.get('stage', 'unknown')!r}); choose a separate --out directory")
        old_manifest = None if overwrite else existing
    if old_manifest is not None:
        diffs = _resume_conflicts(old_manifest, settings)
        if diffs:
            raise Eagle3InputError(f"{out_dir} already holds hidden states made with different settings ("
                                   + "; ".join(diffs) + "); pass --overwrite to replace them or choose another --out")
    elif holds_files(out_dir) and not overwrite:  # ours (claimed), from a run killed before its manifest
        raise Eagle3InputError(f"{out_dir} holds files of an earlier extract but no manifest.json; pass "
                               f"--overwrite to replace them, or choose a new --out directory")
    return old_manifest


def done_shards(out_dir: Path, plans: dict[str, list[ShardPlan]], old_manifest: dict | None
                ) -> dict[str, dict[int, dict]]:
    """Index entries of the shards a resume keeps, per split: those matching the plan and their file."""
    done: dict[str, dict[int, dict]] = {s: {} for s in plans}
    if old_manifest is None:
        return done
    for split, split_plans in plans.items():
        index_path = out_dir / split / "index.json"
        if index_path.is_file():
            for e in read_json(index_path, "hidden-state index").get("shards", []):
                n = e.get("shard")
                if isinstance(n, int) and n < len(split_plans) and shard_entry_ok(e, split_plans[n], out_dir / split):
                    done[split][n] = e
                else:
                    log.warning("%s: shard entry %s does not match the plan or its file; recomputing it",
                                index_path, n)
    return done


def check_disk_space(out_dir: Path, what: str, todo_tokens: int, bytes_per_token: int, disk_margin: int | None,
                     overwrite: bool) -> None:
    estimate = todo_tokens * bytes_per_token
    margin = _disk_margin(disk_margin, estimate)
    freeable = sum(f.stat().st_size for f in _our_files(out_dir)) if overwrite else 0
    free = _free_bytes(out_dir) + freeable
    log.info("extract: %s = %s to write to %s; %s free", what, gib(estimate), out_dir, gib(free))
    if estimate + margin > free:
        raise Eagle3InputError(f"not enough disk space in {out_dir}: the hidden states need about {gib(estimate)} "
                               f"({todo_tokens} tokens x {bytes_per_token} bytes) plus a margin of {gib(margin)}, but "
                               f"only {gib(free)} is free; free space, choose another --out, use --max-samples, or "
                               f"lower the margin with {DISK_MARGIN_ENV}")


def clear_output(out_dir: Path, overwrite: bool) -> None:
    """Delete our earlier files on overwrite, and temp files of writes interrupted by a kill."""
    if overwrite:
        for f in _our_files(out_dir):
            f.unlink()
    for f in _our_files(out_dir):
        if f.name.endswith(".tmp"):
            f.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
