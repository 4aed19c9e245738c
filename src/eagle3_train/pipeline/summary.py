"""The run's summary: what each stage's manifest adds to it, and the table printed at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_train.assets.data_spec import DataSource
from eagle3_train.utils.display import number
from eagle3_train.utils.io import sha256_file


def data_sha256(source: DataSource, cached_only: bool = False) -> str:
    """The SHA-256 of the one file `source` names; `cached_only` (a dry run): raises hub_datasets.NotFetched for a
    dataset the data cache lacks instead of fetching it."""
    from eagle3_train.assets.conversations import resolve_source

    return sha256_file(resolve_source(source, cached_only))


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


def format_summary(s: dict[str, Any], path: str | Path | None = None) -> str:
    """The table `run` ends with: each value short and rounded (a few significant digits), never a JSON text cut
    mid-way; `path` (the run's summary.json) holds everything in full."""
    rows: list[tuple[str, str]] = [("data", data_row(((s.get("data") or {}).get("counts")) or {}))]
    throughput = (s.get("extract") or {}).get("throughput")
    if throughput:
        rows.append(("extract", extract_row(throughput)))
    tr = s.get("train") or {}
    if tr:
        rows.append(("training tokens/s", number(tr.get("tokens_per_s"))))
        rows.append(("estimated acceptance length (validation)", estimates_row(tr.get("validation") or {})))
    if s.get("select"):
        rows.append(("checkpoint exported", select_row(s["select"])))
    rows += evaluate_rows(s.get("evaluate") or {})
    for fmt, out in (s.get("exports") or {}).items():
        rows.append((f"exported draft ({fmt})", str(out)))
    for fmt, cmd in (s.get("serve") or {}).items():
        rows.append((f"serve with vLLM ({fmt})", cmd))
    for fmt, cmd in (s.get("serve_sglang") or {}).items():
        rows.append((f"serve with SGLang ({fmt})", cmd))
    if path is not None:
        rows.append(("every figure in full", str(path)))
    width = max(len(r[0]) for r in rows)
    lines = ["", "=" * 100, "eagle3-train run summary", "-" * 100]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("=" * 100)
    return "\n".join(lines)


def select_row(sel: dict[str, Any]) -> str:
    """The checkpoint select chose, how, and what it was measured at."""
    chosen = next((c for c in sel.get("candidates", []) if c["step"] == sel.get("selected_step")), {})
    figures = ", ".join(f"{what} {number(chosen[key])}" for key, what in (("served", "served"),
                                                                         ("estimate", "estimate"))
                        if chosen.get(key) is not None)
    return (f"step {sel.get('selected_step')} of {sel.get('last_step')} by {sel.get('by')}"
            + (f" ({figures})" if figures else ""))


def data_row(c: dict[str, Any]) -> str:
    """Samples, tokens and what was left out, from prepare's manifest counts."""
    if not c:
        return "-"
    kept, tokens, supervised = (c.get(k) or {} for k in ("kept", "tokens", "supervised_tokens"))
    parts = [" + ".join(f"{number(n)} {split}" for split, n in kept.items()) + " samples" if kept else "",
             f"{number(sum(tokens.values()))} tokens ({number(sum(supervised.values()))} supervised)" if tokens else ""]
    dropped = [f"{c[k]:,} {what}" for k, what in (("truncated", "truncated"), ("skipped_total", "skipped"),
                                                  ("duplicates_dropped", "repeated conversations kept once"))
               if isinstance(c.get(k), int) and c[k]]
    return "; ".join(p for p in [*parts, ", ".join(dropped)] if p) or "-"


def extract_row(tp: dict[str, Any]) -> str:
    """The rate of extract's manifest `throughput`, where it ran and in what dtype."""
    text = f"{number(tp.get('tokens_per_s'))} tokens/s"
    if isinstance(tp.get("processes"), int) and tp["processes"] > 1:
        text += f" over {tp['processes']} processes"
    where = ", ".join(str(tp[k]) for k in ("device", "compute_dtype") if tp.get(k))
    return text + (f" ({where})" if where else "")


def estimates_row(validation: dict[str, Any]) -> str:
    """accept_len_kN of the last validation, by k: `k=1 1.000, k=2 1.412, ...`."""
    ests = sorted((int(k.removeprefix("accept_len_k")), v) for k, v in validation.items()
                  if k.startswith("accept_len_k") and k.removeprefix("accept_len_k").isdigit())
    return ", ".join(f"k={k} {number(v)}" for k, v in ests) or "-"


def evaluate_rows(ev: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name, res in ev.items():
        if isinstance(res, dict) and "mean_acceptance_length" in res:
            temps = res.get("at_temperature") or {}
            if len(temps) > 1:  # one row per temperature
                rows += [(f"acceptance length: {name}, T {t}", number(a)) for t, a in temps.items()]
            else:
                rows.append((f"acceptance length: {name}", number(res["mean_acceptance_length"])))
    if isinstance(ev.get("vllm_skipped"), str):
        rows.append(("vLLM evaluation skipped", ev["vllm_skipped"]))
    return rows
