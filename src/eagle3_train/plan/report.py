"""The plan as a person reads it: sizes, times and counts rounded for the eye, every term named."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.layer_kinds import layer_kind
from eagle3_train.plan.memory import GB, TB


@dataclass
class Plan:
    settings: dict[str, Any]
    verifier: dict[str, Any]  # the fields read from config.json
    draft: dict[str, Any]  # DraftConfig (as the trainer would build it)
    parameters: dict[str, int]  # trainable / frozen counts, from the meta-device model
    hidden_states: dict[str, Any]  # bytes per token and totals per storage dtype
    batch: dict[str, int]  # micro-batch geometry per rank
    memory: dict[str, Any]  # per rank, bytes, named terms and the peak
    host_memory: dict[str, int]  # per rank process on the host (CPU RAM), bytes
    modes: dict[str, dict[str, Any]]  # offline / hybrid / online: disk, bytes moved, fits
    recommendation: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)



def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", TB), ("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_time(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds / 3600:.1f} h"


def fmt_count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_plan(p: Plan) -> str:
    s, d, pr, hs, m, b = p.settings, p.draft, p.parameters, p.hidden_states, p.memory, p.batch
    v = p.verifier
    attention = layer_kind(d.get("architecture") or "llama").describe(d)
    lines = [
        f"verifier  {v['config']}: {v['model_type']} {v['architectures']}, hidden {v['hidden_size']}, "
        f"{v['num_hidden_layers']} layers, vocab {v['vocab_size']}",
        f"draft     {d['num_layers']} layer(s), hidden {d['hidden_size']}, {attention}, intermediate "
        f"{d['intermediate_size']}, draft vocab {d['draft_vocab_size']}, aux layers {d['aux_layer_ids']}",
        f"method    {d.get('method') or 'eagle3'}: {draft_method(d.get('method') or 'eagle3').describe}",
        f"params    trainable {fmt_count(pr['trainable'])} ({fmt_bytes(pr['trainable_bytes_bf16'])} bf16); frozen "
        f"{fmt_count(pr['frozen'])} (verifier embedding); the verifier lm_head [{v['vocab_size']}, "
        f"{v['hidden_size']}] is also held for the targets",
        f"data      {s['samples']} samples x {s['tokens_per_sample']} tokens = {hs['tokens']:,} tokens; micro-batch "
        f"{b['batch_size']} x {b['seq_len']} per rank, {b['tokens_per_step']:,} tokens per step on {s['gpus']} "
        f"rank(s) over {s['nodes']} node(s), {b['steps_per_epoch']} steps/epoch",
        "hidden states on disk (3 aux + final per token):",
    ]
    for dt, x in hs["by_dtype"].items():
        mark = " <- --store-dtype" if dt == hs["storage_dtype"] else ""
        per_token, total = fmt_bytes(x["bytes_per_token"]), fmt_bytes(x["total_bytes"])
        lines.append(f"  {dt:9s} {per_token:>10s}/token  {total:>10s}{mark}")
    lines.append(f"training memory per rank (ttt {s['ttt_steps']}, {s['precision']}, budget {s['token_budget']}, "
                 f"train.parallel {m['engine']}, train.optimizer {s['optimizer']}):")
    for k in ("weights_fp32_master", "grads", "optimizer_states", "autocast_weight_copies", "gathered_units",
              "frozen_embedding", "verifier_lm_head", "batch", "targets", "ttt_activations", "transient_at_peak"):
        lines.append(f"  {k:24s} {fmt_bytes(m[k]):>10s}")
    lines.append(f"  {'peak':24s} {fmt_bytes(m['peak']):>10s}  (at {m['peak_phase']})")
    for e, x in m["by_engine"].items():
        fits = {None: "", True: ", fits", False: ", does NOT fit"}[x["fits"]]
        c = x["communication"]
        lines.append(f"  {e:4s} peak {fmt_bytes(x['peak']):>10s}{fits}; sends {fmt_bytes(c['total'])} per step and rank"
                     + (f" ({fmt_bytes(c['across_nodes'])} across nodes)" if s["nodes"] > 1 else "")
                     + ("  <- recommended" if e == m["engine"] else ""))
    hm = p.host_memory
    lines.append(f"host RAM per rank: {fmt_bytes(hm['total'])} (fp32 copies of the verifier embedding/lm_head unless "
                 f"stored in fp32, batches); {fmt_bytes(hm['per_node'])} for the {s['gpus'] // s['nodes']} rank(s) "
                 f"of a node, plus {fmt_bytes(hm['verifier_page_cache'])} of page cache for the memory-mapped verifier "
                 "tensors" + (f"; CPU training, whole process: {fmt_bytes(hm['process_total'])}"
                              if "process_total" in hm else ""))
    lines.append("modes:")
    for name, md in p.modes.items():
        fits = {None: "?", True: "fits", False: "does NOT fit"}[md["fits"]]
        lines.append(f"  {name:8s} disk {fmt_bytes(md['disk_bytes']):>9s} | per rank and step: disk read "
                     f"{fmt_bytes(md['read_bytes_per_step']):>9s}, from server "
                     f"{fmt_bytes(md['server_bytes_per_step']):>9s}, "
                     f"gradients {fmt_bytes(md['allreduce_bytes_per_step']):>9s} | {md['verifier_passes']} verifier "
                     f"pass(es) -> {fits}")
    times = next(iter(p.modes.values())).get("seconds") or {}
    if any(v is not None for v in times.values()):
        lines.append("time: " + ", ".join(
            f"{name} {fmt_time(md['seconds']['run_after_regeneration'])}" for name, md in p.modes.items())
            + f" (extraction {fmt_time(p.modes['offline']['seconds']['extract'])}, one epoch "
              f"{fmt_time(times['train_epoch'])}; regeneration first: {fmt_time(times['regenerate'])})")
    lines.append(f"recommendation: {p.recommendation}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


