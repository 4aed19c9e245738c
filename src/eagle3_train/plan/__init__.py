"""`eagle3-train plan`: disk, transfer, parameters and memory of a training run, from the verifier's config.json alone.

Python API: `plan(PlanSettings) -> Plan` (a dataclass; `Plan.to_dict()` for JSON). Nothing is downloaded or loaded:
the config is read as JSON (so configs that need trust_remote_code, e.g. DeepSeek-V3 / Kimi-K2, work), and the draft
is built exactly as the trainer builds it (`DraftConfig.from_verifier` + `Eagle3Draft`) on the meta device, so the
parameter counts are the model's own, not a formula that could drift from it.

The memory model follows what `train/trainer.py` and `train/ttt.py` keep alive; every term is named in the output.
It was checked against a measured CPU run (benchmarks/plan_vs_measured.py); the bf16/CUDA terms follow the same code
but are unmeasured here (see `PlanSettings.precision`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from eagle3_train.assets.families import text_config
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.layer_kinds import MLA_DIMS
from eagle3_train.plan.memory import (
    DEFAULT_DRAFT_VOCAB,
    FROZEN_BYTES,
    GB,
    TB,
    communication_per_step,
    geometry,
    memory_per_rank,
)
from eagle3_train.plan.report import Plan, fmt_bytes, format_plan
from eagle3_train.plan.verifier import build_meta_draft, count_parameters, read_verifier_config, verifier_weight_bytes
from eagle3_train.settings.plan import PlanSettings
from eagle3_train.settings.train import auto_parallel
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import add_settings_arguments, choices, flags, settings_from_args
from eagle3_train.utils.store_bytes import FP8, bytes_per_token


def _check(s: PlanSettings) -> None:
    """What the flags' choices check, for the Python API too (ranges: `PlanSettings` itself)."""
    fields = {f.name: f for f in dataclasses.fields(PlanSettings)}
    for name in ("dtype", "precision", "parallel", "device", "architecture", "source_aux_convention"):
        valid = choices(PlanSettings, name)
        if getattr(s, name) not in valid:
            raise Eagle3InputError(f"plan: {flags(fields[name])[0]} must be one of {', '.join(valid)}, got "
                                   f"{getattr(s, name)!r}")
    if s.gpus % s.nodes:
        raise Eagle3InputError(f"plan: --gpus {s.gpus} cannot be spread evenly over --nodes {s.nodes}")




def _from_source(s: PlanSettings, num_layers: int) -> tuple[PlanSettings, int]:
    """The settings with the finetune source's architecture, aux layers and (unless a draft vocabulary size is given:
    a rebuild) its vocabulary: what `train --finetune-from` builds and `extract --finetune-from` taps. The source's
    own vocabulary size comes back for the notes."""
    from eagle3_train.checkpoints.formats import draft_architecture

    c, _ = draft_architecture(s.finetune_from, num_layers, s.source_aux_convention)
    return dataclasses.replace(s, architecture=c.architecture, mla_dims={k: getattr(c, k) for k in MLA_DIMS},
                               num_layers=c.num_layers, intermediate_size=c.intermediate_size,
                               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                               head_dim=c.head_dim, draft_vocab=s.draft_vocab or c.draft_vocab_size,
                               layer_ids=tuple(c.aux_layer_ids)), c.draft_vocab_size


def plan(s: PlanSettings) -> Plan:
    _check(s)
    vcfg, cfg_path = read_verifier_config(s.verifier)
    text = text_config(vcfg)
    source_vocab = None
    if s.finetune_from:
        s, source_vocab = _from_source(s, int(text["num_hidden_layers"]))
    s = dataclasses.replace(s, draft_vocab=s.draft_vocab or DEFAULT_DRAFT_VOCAB)
    draft_cfg, model = build_meta_draft(vcfg, s)
    tied = bool(vcfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    params = count_parameters(model)
    # the dtype the trainer holds the frozen embedding and lm_head in (`train.precision.verifier_tensor_dtype`,
    # applied in train/trainer.py `_setup_model`; tests/unit/test_plan.py keeps the two equal)
    frozen_bytes = FROZEN_BYTES[s.precision]
    H = draft_cfg.aux_hidden_size
    g = geometry(s)
    tokens = s.samples * s.tokens_per_sample

    per_token = {dt: bytes_per_token(H, dt) for dt in ("bfloat16", FP8, "float32")}
    per_token[s.dtype] = bytes_per_token(H, s.dtype)
    hs = {"tokens": tokens, "bytes_per_token": per_token[s.dtype], "storage_dtype": s.dtype,
          "total_bytes": tokens * per_token[s.dtype],
          "by_dtype": {dt: {"bytes_per_token": b, "total_bytes": tokens * b} for dt, b in per_token.items()}}

    checkpoint_dtype = str(text.get("torch_dtype") or text.get("dtype") or vcfg.get("torch_dtype")
                           or vcfg.get("dtype") or "bfloat16")
    by_engine = {e: memory_per_rank(draft_cfg, params, s, frozen_bytes, tied, checkpoint_dtype, e)
                 for e in ("ddp", "fsdp")}
    engine = _engine(s, params["trainable"])
    mem, detail = by_engine[engine]
    host = _host_memory(detail, mem, s)
    mem["saved_by_term"] = detail["saved_by_term"]
    comm = communication_per_step(params, s)
    mem["engine"] = engine
    mem["by_engine"] = {e: {"peak": m["peak"], "peak_phase": m["peak_phase"], "communication": comm[e],
                            "fits": None if s.gpu_memory_gb is None else m["peak"] <= s.gpu_memory_gb * GB}
                        for e, (m, _) in by_engine.items()}

    # Bytes moved per optimizer step and rank: the hidden states of its micro-batches (from disk or from the server,
    # which sends its bf16 compute dtype), plus the engine's gradient reduction (communication_per_step).
    rank_tokens = g["tokens"] * s.grad_accum
    step_tokens = rank_tokens * s.gpus
    disk_step = rank_tokens * per_token[s.dtype]
    wire_step = rank_tokens * per_token["bfloat16"]
    allreduce = comm[engine]["total"]
    steps_per_epoch = max(1, math.ceil(s.samples / (g["batch_size"] * s.grad_accum * s.gpus)))
    total_steps = max(1, math.ceil(s.epochs * steps_per_epoch))
    weight_bytes = verifier_weight_bytes(cfg_path)

    mem_ok = None if s.gpu_memory_gb is None else mem["peak"] <= s.gpu_memory_gb * GB
    disk_need = hs["total_bytes"]
    disk_ok = None if s.disk_tb is None else disk_need <= s.disk_tb * TB

    server = _server_share(s, weight_bytes)
    served_ok = _served_fits(mem["peak"], server, s)
    modes = _modes(disk_need, disk_step, wire_step, allreduce, mem_ok, disk_ok, s, served_ok)
    for name in ("hybrid", "online"):
        modes[name]["server_memory_per_gpu"] = server
    _add_times(modes, tokens, s)
    notes = _notes(weight_bytes, frozen_bytes, s, server)
    if draft_method(s.method).objective != "ttt":
        notes.append(f"method {s.method}: its activations are planned as training-time test's over the same "
                     f"{s.ttt_steps} steps (its blocks run ttt_steps + 1 queries per anchor, up to 512 anchors per "
                     f"sample: an estimate, not measured)")
    if source_vocab is not None and s.draft_vocab != source_vocab:
        notes.append(f"draft vocabulary: {s.draft_vocab} rows, rebuilt from this run's data (the source has "
                     f"{source_vocab}): `train --finetune-vocab rebuild` with a vocabulary of that size")
    if mem_ok is False and g["batch_size"] == 1 and not mem["by_engine"]["fsdp"]["fits"]:
        notes.append(_long_sample_note(draft_cfg, params, s, frozen_bytes, tied, checkpoint_dtype, mem))
    rec = _recommend(modes, mem_ok, disk_ok, s, engine, mem["by_engine"]["fsdp"]["fits"])
    fp8_total = hs["by_dtype"][FP8]["total_bytes"]
    if disk_ok is False and s.dtype != FP8 and fp8_total <= s.disk_tb * TB:
        rec += (f"; fp8 storage ({fmt_bytes(fp8_total)}) would fit offline/hybrid, where extract offers it and the "
                "loss "
                f"stays within noise")
    settings = dataclasses.asdict(s)
    verifier = {"config": str(cfg_path), "architectures": vcfg.get("architectures"),
                "model_type": vcfg.get("model_type"), "hidden_size": text["hidden_size"],
                "num_hidden_layers": text["num_hidden_layers"], "vocab_size": text["vocab_size"],
                "tie_word_embeddings": tied, "dtype": checkpoint_dtype, "weight_bytes": weight_bytes,
                "moe": {k: text[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
                        if k in text}}
    batch = {**g, "tokens_per_step": step_tokens, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps}
    return Plan(settings, verifier, draft_cfg.to_dict(), params, hs, batch, mem, host, modes, rec, notes)




def _engine(s: PlanSettings, trainable: int) -> str:
    """train.parallel as the trainer resolves it (`auto_parallel`); where that does not fit and fsdp does, the
    recommendation says to set fsdp."""
    if s.parallel in ("ddp", "fsdp"):
        return s.parallel
    return auto_parallel(s.gpus, trainable, s.gpu_memory_gb * GB if s.gpu_memory_gb else None)


def _host_memory(detail: dict[str, Any], mem: dict[str, Any], s: PlanSettings) -> dict[str, Any]:
    host = dict(detail["host"])
    host["total"] = sum(host.values())
    host["per_node"] = s.gpus // s.nodes * host["total"]  # one process per GPU, each with its own copies
    host["verifier_page_cache"] = detail["page_cache"]  # file-backed, once per node (not in the totals)
    if s.device == "cpu":  # one memory: the device terms plus the loaded verifier tensors and the stored-dtype batch
        host["process_total"] = mem["peak"] + host["total"]  # anonymous memory: what the benchmark measures
    return host


def _server_share(s: PlanSettings, weight_bytes: int | None) -> dict[str, Any]:
    """GPU memory per training GPU that the verifier's server takes in hybrid/online training: as given, else at least
    its weights spread over these GPUs (KV cache and activations come on top), else unknown."""
    if s.server_memory_gb is not None:
        where = "on other GPUs" if s.server_memory_gb == 0 else "beside the trainer"
        return {"bytes": int(s.server_memory_gb * GB), "basis": f"given (--server-memory-gb: {where})"}
    if weight_bytes:
        return {"bytes": None, "at_least_bytes": weight_bytes // s.gpus,
                "basis": f"not given; its weights alone are {fmt_bytes(weight_bytes // s.gpus)} per GPU over {s.gpus}"}
    return {"bytes": None, "basis": "not given, and the verifier's weight size is unknown (config only)"}


def _served_fits(peak: int, server: dict[str, Any], s: PlanSettings) -> bool | None:
    """Whether the trainer's peak and the server's share fit one GPU; None where either is unknown (a floor that
    already overflows is a no)."""
    if s.gpu_memory_gb is None:
        return None
    limit = s.gpu_memory_gb * GB
    if server["bytes"] is not None:
        return peak + server["bytes"] <= limit
    if server.get("at_least_bytes") and peak + server["at_least_bytes"] > limit:
        return False
    return None


def _modes(disk_need: int, disk_step: int, wire_step: int, allreduce: int, mem_ok: bool | None,
           disk_ok: bool | None, s: PlanSettings, served_ok: bool | None) -> dict[str, dict[str, Any]]:
    """Disk, transfer per step and verifier passes of offline, hybrid and online training, and whether each fits."""
    def mode(disk: int, read: int, server: int, passes: int, how: str) -> dict[str, Any]:
        return {"disk_bytes": disk, "read_bytes_per_step": read, "server_bytes_per_step": server,
                "allreduce_bytes_per_step": allreduce, "verifier_passes": passes, "how": how}
    modes = {
        "offline": mode(disk_need, disk_step, 0, 1,
                        "extract once, then train from disk; later epochs reread the disk"),
        "hybrid": mode(disk_need, disk_step, wire_step, 1,
                       "epoch 1 streams from the server (server column) and writes to disk; later epochs read it"),
        "online": mode(0, 0, wire_step, max(1, math.ceil(s.epochs)),
                       "every epoch streams from the server; nothing written"),
    }
    for name, md in modes.items():
        d_ok = True if name == "online" else disk_ok
        md["memory_fits"] = mem_ok if name == "offline" else served_ok  # the server's share of the same GPUs
        md["disk_fits"] = d_ok
        m_ok = md["memory_fits"]
        md["fits"] = None if (m_ok is None or d_ok is None) else bool(m_ok and d_ok)
        md["needs_server"] = name != "offline"
    return modes


def _long_sample_note(d, params: dict[str, int], s: PlanSettings, frozen_bytes: int, tied: bool,
                      checkpoint_dtype: str, mem: dict[str, Any]) -> str:
    """One sample is a micro-batch and does not fit even sharded: what it holds, the longest that fits, and what
    would split it (context parallelism, not built)."""
    def peak(length: int) -> int:
        at = dataclasses.replace(s, tokens_per_sample=length, token_budget=length)
        return memory_per_rank(d, params, at, frozen_bytes, tied, checkpoint_dtype, "fsdp")[0]["peak"]

    lo, hi = 0, s.tokens_per_sample  # the longest length whose fsdp peak fits: peak grows with length
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= s.gpu_memory_gb * GB else (lo, mid)
    per_token = (mem["ttt_activations"] + mem["targets"] + mem["batch"]) / s.tokens_per_sample
    longest = f"the longest that fits is ~{lo // 64 * 64} tokens" if lo else "no length fits"
    return (f"one {s.tokens_per_sample}-token sample keeps {fmt_bytes(mem['ttt_activations'])} of activations on its "
            f"rank ({fmt_bytes(per_token)} per token with its targets and hidden states); fsdp divides the weights and "
            "optimizer "
            f"states over the ranks, not one sample's activations: {longest} on {s.gpu_memory_gb:g} GB. Context "
            f"parallelism (the sequence split over ranks, docs/GUIDE.md 'Long samples') is the next step; it is "
            f"not built yet")


def _notes(weight_bytes: int | None, frozen_bytes: int, s: PlanSettings, server: dict[str, Any]) -> list[str]:
    notes = []
    if server["bytes"] is None:
        notes.append(f"the verifier's server memory per training GPU is {server['basis']}: pass --server-memory-gb GB "
                     f"(0 if the servers run on other GPUs) to decide whether hybrid/online fit")
    if weight_bytes:
        notes.append(f"the verifier's weights are {weight_bytes / GB:.1f} GB: online/hybrid need them served "
                     f"(vLLM) beside or apart from the training GPUs; offline needs them once, for extraction")
    else:
        notes.append("verifier weight size unknown (config only): online/hybrid need a server for it on other GPUs "
                     "or beside training")
    if s.tokens_per_sample > s.token_budget:
        notes.append(f"samples ({s.tokens_per_sample} tokens) exceed --token-budget {s.token_budget}: each "
                     f"micro-batch holds one sample, so memory is planned at {s.tokens_per_sample} tokens")
    if frozen_bytes == 4:
        notes.append("the frozen verifier embedding and lm_head are held in fp32 (precision fp32, as counted); "
                     "bf16 precision holds them in bf16")
    if s.precision == "bf16":
        notes.append("bf16 terms follow the code but were not measured here (no GPU); fp32 on CPU was measured "
                     "within 20% (benchmarks/README.md)")
    return notes


def _add_times(modes: dict[str, dict[str, Any]], tokens: int, s: PlanSettings) -> None:
    """Seconds per phase from the given throughputs: extraction (or the server's pass), one training epoch, and the
    run per mode (hybrid: epoch 1 runs at the slower of server and trainer; online: every epoch does)."""
    gen_tokens = s.samples * (s.generated_tokens_per_sample or s.tokens_per_sample)
    regenerate = gen_tokens / s.generate_tokens_per_s if s.generate_tokens_per_s else None
    extract = tokens / s.extract_tokens_per_s if s.extract_tokens_per_s else None
    epoch = tokens / s.train_tokens_per_s if s.train_tokens_per_s else None
    epochs = s.epochs
    for name, md in modes.items():
        if epoch is None or extract is None:
            total = None
        elif name == "offline":
            total = extract + epochs * epoch
        elif name == "hybrid":
            total = max(extract, epoch) * min(1.0, epochs) + max(0.0, epochs - 1) * epoch
        else:
            total = epochs * max(extract, epoch)
        md["seconds"] = {"regenerate": regenerate, "extract": extract if name == "offline" else None,
                         "train_epoch": epoch, "run_after_regeneration": total}


def _smaller_step(s: PlanSettings) -> str:
    """What lowers the peak at these settings: a sample longer than the token budget is a micro-batch of its own,
    so only a shorter sample (or less kept per token) helps there."""
    if s.tokens_per_sample >= s.token_budget:
        fix = (f"shorten the samples (prepare --max-length below {s.tokens_per_sample}; each micro-batch already "
               f"holds one sample, so --token-budget does not help)")
    else:
        fix = "lower --token-budget (or --tokens-per-sample)"
    extra = [f for f, on in (("train.checkpoint_mlp", s.checkpoint_mlp), ("train.checkpoint_loss", s.checkpoint_loss))
             if not on]
    return fix + (f", turn on {' and '.join(extra)}" if extra else "") + ", fewer --ttt-steps, or GPUs with more memory"


def _recommend(modes: dict, mem_ok: bool | None, disk_ok: bool | None, s: PlanSettings,
               engine: str = "ddp", sharded_fits: bool | None = None) -> str:
    if mem_ok is False:
        if sharded_fits and engine == "ddp":
            return "nothing fits replicated (train.parallel ddp): train.parallel fsdp fits (--parallel fsdp)"
        return f"nothing fits: the training peak per rank exceeds --gpu-memory-gb; {_smaller_step(s)}"
    if mem_ok is None or disk_ok is None:
        return "pass --gpu-memory-gb and --disk-tb to check which mode fits"
    if disk_ok:
        hybrid = {True: " (or hybrid to overlap extraction with the first epoch)",
                  None: " (hybrid overlaps extraction with the first epoch if the server fits: see --server-memory-gb)",
                  False: ""}[modes["hybrid"]["fits"]]
        return (f"offline{hybrid}: the hidden states fit on disk"
                + ("" if s.epochs > 1 or modes["online"]["fits"] is False
                   else "; with one epoch, online avoids writing them at all"))
    if modes["online"]["fits"] is False:
        share = modes["online"]["server_memory_per_gpu"]
        size = (f"{fmt_bytes(share['bytes'])} per GPU" if share["bytes"] is not None
                else f"at least {fmt_bytes(share['at_least_bytes'])} per GPU for its weights")
        return (f"nothing fits: the hidden states do not fit on disk, and streaming them needs the verifier's server "
                f"({size}) beside the trainer, beyond --gpu-memory-gb: run the servers on other GPUs"
                + ("" if s.dtype == FP8 else ", or store fp8 states"))
    if modes["online"]["fits"] is None:
        return ("online if the verifier's servers run on other GPUs (or fit beside the trainer: pass "
                "--server-memory-gb to check): the hidden states do not fit on disk")
    return "online: the hidden states do not fit on disk; stream them from the server every epoch"




def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, PlanSettings, set_option=False)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(args: argparse.Namespace) -> int:
    result = plan(settings_from_args(PlanSettings, args))
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0

