"""A run config checked against the settings dataclasses: each section becomes the dict of keys its stage key
hashes (so adding a setting with its default never reruns a finished stage)."""

from __future__ import annotations

import dataclasses
from typing import Any

from eagle3_train.settings import SECTIONS, SHARED_SECTIONS, RunSettings
from eagle3_train.utils.settings import (
    build_settings,
    unknown_key_error,
    yaml_keys,
)

# Keys each section's settings hash has always included, set or not (older runs' pipeline_state.json stays valid);
# any other key counts once it is set. Their defaults come from the settings dataclasses.
_HASHED_KEYS: dict[str, tuple[str, ...]] = {
    "prepare": ("data", "limit", "max_length", "overflow", "val_fraction", "seed"), "generate": ("enabled",),
    "vocab": ("size",), "extract": ("dtype", "token_budget"), "train": (), "select": ("by",),
    "export": ("formats", "dtype", "speculative_tokens"), "evaluate": ("vllm", "offline")}


def merged_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Check a run config against the settings dataclasses; each section becomes the dict of its hashed keys."""
    top = [f.name for f in dataclasses.fields(RunSettings)]
    for key in raw:
        if key not in SECTIONS and key not in SHARED_SECTIONS and key not in top:
            raise unknown_key_error(str(key), [*top, *SECTIONS, *SHARED_SECTIONS],
                                    "the top level of the config (sections and keys)")
    run = build_settings(RunSettings, {k: raw[k] for k in top if k in raw}, "the top level of the config")
    out: dict[str, Any] = dataclasses.asdict(run)
    for name, cls in SECTIONS.items():
        given = raw.get(name) or {}
        checked = build_settings(cls, given, f"config section '{name}'", yaml_only=True)
        out[name] = {k: getattr(checked, k) for k in yaml_keys(cls) if k in given or k in _HASHED_KEYS[name]}
    data = out["prepare"]["data"]
    if len(data) == 1:  # one source is a string, as before lists: earlier runs' prepare keys stay valid
        out["prepare"]["data"] = data[0]
    for name, cls in SHARED_SECTIONS.items():  # only the keys set: a stage's settings hash includes them if any
        given = raw.get(name) or {}
        checked = build_settings(cls, given, f"config section '{name}'", yaml_only=True)
        out[name] = {k: getattr(checked, k) for k in yaml_keys(cls) if k in given}
    return out
