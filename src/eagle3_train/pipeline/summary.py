"""The run's summary: what each stage's manifest adds to it, and the table printed at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_train.utils.io import sha256_file


def data_sha256(source: str | Path) -> str:
    from eagle3_train.assets.conversations import resolve_source

    return sha256_file(resolve_source(source))


def counts(manifest: dict[str, Any]) -> dict[str, Any]:
    return {"counts": manifest.get("counts"), "source": manifest.get("source")}


def vocab_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in ("draft_vocab_size", "coverage", "sha256") if k in m} or m


def extract_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {"counts": m.get("counts"), "throughput": m.get("throughput"), "layer_ids": m.get("layer_ids"),
            "backend": m.get("backend")}


def torch_dtype(name: str) -> Any:
    import torch

    return torch.bfloat16 if name == "float8_e4m3" else getattr(torch, name)


def format_summary(s: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    counts = ((s.get("data") or {}).get("counts")) or {}
    rows.append(("data", json.dumps(counts, default=str)[:200]))
    ext = s.get("extract") or {}
    if ext.get("throughput"):
        rows.append(("extract", json.dumps(ext["throughput"], default=str)[:200]))
    tr = s.get("train") or {}
    if tr:
        rows.append(("training tokens/s", f"{tr.get('tokens_per_s', 0):.0f}"))
        val = tr.get("validation") or {}
        ests = {k: round(v, 3) for k, v in val.items() if k.startswith("accept_len_k")}
        rows.append(("estimated acceptance length (validation)", json.dumps(ests)))
    ev = s.get("evaluate") or {}
    for name, res in ev.items():
        if isinstance(res, dict) and "mean_acceptance_length" in res:
            temps = res.get("at_temperature") or {}
            if len(temps) > 1:  # one row per temperature
                rows += [(f"acceptance length: {name}, T {t}", f"{a:.3f}" if a is not None else "-")
                         for t, a in temps.items()]
            else:
                rows.append((f"acceptance length: {name}", f"{res['mean_acceptance_length']:.3f}"))
    for fmt, path in (s.get("exports") or {}).items():
        rows.append((f"exported draft ({fmt})", path))
    for fmt, cmd in (s.get("serve") or {}).items():
        rows.append((f"serve with vLLM ({fmt})", cmd))
    for fmt, cmd in (s.get("serve_sglang") or {}).items():
        rows.append((f"serve with SGLang ({fmt})", cmd))
    width = max(len(r[0]) for r in rows)
    lines = ["", "=" * 100, "eagle3-train run summary", "-" * 100]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("=" * 100)
    return "\n".join(lines)
