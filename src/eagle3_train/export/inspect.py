"""`eagle3-train inspect PATH`: what a draft checkpoint is and where it came from.

PATH: one of our checkpoints or run directories, an export, or an external draft in any layout `checkpoints/formats.py`
reads. Prints the format, architecture and wiring flags, vocabulary, aux layers, dtypes, every tensor's shape, and the
lineage read from `training_metadata.json` (each finetune's `init.source_metadata`, back to a random start or an
external draft). Only tensor headers are read from safetensors files, so large drafts are inspected quickly.

Python API: `inspect_checkpoint(path, hash_files=False) -> dict`, `lineage(metadata) -> list[dict]`,
`format_report(info) -> str`.
CLI: `eagle3-train inspect PATH [--json] [--sha256]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from eagle3_train.checkpoints.formats import AmbiguousAuxIds, load_draft_source, source_summary
from eagle3_train.model.engines import engine_support, format_support
from eagle3_train.model.layer_kinds import layer_kind
from eagle3_train.utils.io import sha256_file

MAX_DEPTH = 100  # a lineage longer than this is a cycle in hand-edited metadata


def lineage(metadata: dict[str, Any] | None) -> list[dict[str, Any]]:
    """This checkpoint's run first, then the run (or external draft) it was finetuned from, and so on."""
    out: list[dict[str, Any]] = []
    m = metadata
    while m is not None and len(out) < MAX_DEPTH:
        run, init = m.get("run") or {}, m.get("init") or {}
        entry: dict[str, Any] = {
            "run": run.get("out"), "status": run.get("status"), "step": (m.get("progress") or {}).get("step"),
            "verifier": (m.get("verifier") or {}).get("name"), "data": (m.get("data") or {}).get("prepared"),
            "best": (m.get("metrics") or {}).get("best") or None, "init": init.get("method")}
        if m.get("export"):
            entry["export"] = {k: m["export"].get(k) for k in ("format", "dtype", "time")}
        out.append(entry)
        if init.get("method") == "random":
            entry["from"] = f"random initialisation (seed {init.get('seed')})"
            break
        if init.get("method") != "finetune":
            entry["from"] = "unknown (no init record)"
            break
        entry["from"] = init.get("source")
        entry["source_format"] = init.get("format")
        entry["vocab_policy"] = init.get("vocab_policy")
        m = init.get("source_metadata")
        if m is None:
            out.append({"external": init.get("source"), "resolved": init.get("resolved"),
                        "format": init.get("format"), "weight_files": init.get("weight_files"),
                        "from": "external draft (no training metadata)"})
    return out


def _layer_model_type(config: dict[str, Any]) -> str | None:
    """The model_type vLLM reads for the draft's layer: the speculators format's layer config, else the top level."""
    layer = config.get("transformer_layer_config")
    return (layer if isinstance(layer, dict) else config).get("model_type")


def inspect_checkpoint(path: str | Path, hash_files: bool = False) -> dict[str, Any]:
    """Summary, tensor shapes and lineage of a draft; `hash_files` adds each weight file's SHA-256 (reads it all)."""
    try:
        loaded = load_draft_source(path, shapes_only=True)
    except AmbiguousAuxIds as e:  # inspect shows the draft anyway, with both readings named
        loaded = load_draft_source(path, shapes_only=True, aux_convention="sglang")
        loaded.notes.insert(0, f"aux layer ids shown in SGLang's reading; {e}")
    files = {f.name: {"bytes": f.stat().st_size, **({"sha256": sha256_file(f)} if hash_files else {})}
             for f in loaded.files}
    ours_to_source = {v: k for k, v in loaded.renamed.items()}
    rebuilt_t2d = any(n.startswith("t2d rebuilt") for n in loaded.notes)
    tensors = {}
    for k, t in sorted({**loaded.tensors, **loaded.extra}.items()):
        if k == "t2d" and rebuilt_t2d:
            continue  # not in the file (rebuilt from d2t, see notes)
        tensors[ours_to_source.get(k, k)] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
    for k in loaded.unknown:
        tensors[k] = {"unknown": True}
    vocab: dict[str, Any] = {"vocab_size": loaded.config.vocab_size,
                             "draft_vocab_size": loaded.config.draft_vocab_size}
    d2t = loaded.tensors.get("d2t")
    if d2t is not None and d2t.numel():
        ids = torch.arange(d2t.shape[0]) + d2t.long()
        vocab.update({"token_id_range": [int(ids.min()), int(ids.max())],
                      "sorted": bool((ids[1:] > ids[:-1]).all())})
    meta = loaded.metadata or {}
    return {
        "path": str(path), "resolved": str(loaded.path), "format": loaded.format,
        "summary": source_summary(loaded), "vocab": vocab, "tensors": tensors,
        "renamed": loaded.renamed, "unknown": loaded.unknown, "notes": loaded.notes,
        "weight_files": files, "export": meta.get("export"), "lineage": lineage(loaded.metadata),
        "engines": engine_support(loaded.config, "speculators" if loaded.format == "speculators" else "eagle",
                                  loaded.aux_ids_origin, _layer_model_type(loaded.source_config)),
    }


def _lineage_line(i: int, e: dict[str, Any]) -> str:
    if "external" in e:
        return f"  {i}. {e['external']} ({e.get('format')} format): external draft, no training metadata"
    what = e.get("run") or "?"
    facts = [x for x in (e.get("status"), f"step {e['step']}" if e.get("step") is not None else None,
                         f"verifier {e['verifier']}" if e.get("verifier") else None) if x]
    if e.get("export"):
        facts.append(f"exported as {e['export'].get('format')} {e['export'].get('dtype')}")
    head = f"  {i}. {what}" + (f" ({', '.join(facts)})" if facts else "")
    if e.get("init") == "finetune":
        return f"{head}\n     <- finetuned from {e['from']} ({e.get('source_format')} format, vocab " \
               f"{e.get('vocab_policy')})"
    return f"{head}\n     <- {e.get('from')}"


def format_report(info: dict[str, Any]) -> str:
    s = info["summary"]
    lines = [f"{info['resolved']}: {info['format']} format"]
    if s.get("architectures"):
        lines.append(f"  architectures: {', '.join(s['architectures'])}"
                     + (f" (speculators {s['speculators_version']})" if s.get("speculators_version") else ""))
    attention = layer_kind(s.get("architecture") or "llama").describe(s)
    lines.append(f"  shape: hidden {s['hidden_size']}, {s['num_layers']} layer(s), intermediate "
                 f"{s['intermediate_size']}, {attention}, rope_theta {s['rope_theta']}"
                 + (f", rope_scaling {s['rope_scaling']}" if s.get("rope_scaling") else ""))
    mask = s.get("mask_token_id")
    lines.append(f"  method: {s['method']}" + ("" if mask is None else f", mask token {mask}"))
    lines.append("  flags: " + ", ".join(f"{k}={s[k]}" for k in ("norm_before_residual", "norm_before_fc",
                                                                   "fc_norm", "norm_output")))
    v = info["vocab"]
    lines.append(f"  vocab: {v['vocab_size']} verifier tokens, draft vocab {v['draft_vocab_size']}"
                 + (f" (token ids {v['token_id_range'][0]}..{v['token_id_range'][1]})" if "token_id_range" in v
                    else " (no d2t)") + f", stored: d2t {'yes' if s['stores_d2t'] else 'no'}, t2d "
                 f"{'yes' if s['stores_t2d'] else 'no'}, embed_tokens {'yes' if s['has_embed_tokens'] else 'no'}")
    ids = s["aux_layer_ids"]
    lines.append(f"  aux layers: {ids if ids else 'engine default (2, L//2, L-3)'} ({s['aux_ids_origin']})")
    if s.get("verifier"):
        lines.append(f"  verifier: {s['verifier']}")
    lines.append(f"  parameters: {s['parameters']:,}; dtypes: "
                 + ", ".join(f"{d} x{n}" for d, n in sorted(s["dtypes"].items())))
    lines.append("  files: " + ", ".join(f"{n} ({f['bytes']:,} bytes" + (f", sha256 {f['sha256']}" if "sha256" in f
                                                                            else "") + ")"
                                         for n, f in info["weight_files"].items()))
    lines.append("engines:")
    lines += format_support(info["engines"])
    for n in info["notes"]:
        lines.append(f"  note: {n}")
    lines.append("tensors:")
    width = max((len(k) for k in info["tensors"]), default=0)
    for k, t in info["tensors"].items():
        lines.append(f"  {k:<{width}}  " + ("UNKNOWN (no place in an EAGLE-3 draft)" if t.get("unknown")
                                             else f"{str(t['shape']):<16} {t['dtype']}"))
    lines.append("lineage:")
    if not info["lineage"]:
        lines.append("  (no training_metadata.json: an external draft, origin unknown)")
    lines += [_lineage_line(i, e) for i, e in enumerate(info["lineage"])]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint, run directory, export, external draft directory or weight file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--sha256", action="store_true", help="also hash the weight files (reads them completely)")


def main(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.path, hash_files=args.sha256)
    print(json.dumps(info, indent=2, default=str) if args.json else format_report(info))
    return 0
