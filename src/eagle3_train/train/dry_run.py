"""`eagle3-train train --dry-run`: everything a training run checks and writes, except the optimizer steps.

At full size and without reading weight data: the verifier's config (and its embedding/lm_head shapes from the
safetensors headers), the prepared data, hidden-states manifest and shard headers, the vocab, and the finetune
source (keys, shapes, dtypes, aux-layer convention, vocab policy) are resolved and checked exactly as `train` does;
the draft is built on the meta device. It prints memory and disk figures, writes the training metadata the run would
write to OUT/training_metadata.dry-run.json, writes the draft in both export formats as header-only safetensors (real
names, shapes and dtypes, zeros in a sparse file; the real d2t/t2d) and reads them back the way the engines read
them. It ends by listing what it did not check.

Python API: `dry_run(TrainConfig) -> dict` (the report, also stored under `dry_run` in the metadata file).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.families import text_config
from eagle3_train.checkpoints.formats import EAGLE, SPECULATORS, load_draft_source, read_aux_ids
from eagle3_train.checkpoints.layouts import eagle_config_json, export_key, speculators_config_json, stored_shapes
from eagle3_train.hidden_states.modes import states_mode
from eagle3_train.model.config import default_aux_layer_ids
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.engines import engine_support, format_support
from eagle3_train.model.layer_kinds import MLA_DIMS, layer_kind
from eagle3_train.model.verifier_head import LOGITS_CHUNK_ELEMENTS
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.batching import plan_batches
from eagle3_train.train.data import TrainingSamples
from eagle3_train.train.inputs import resolve_inputs
from eagle3_train.train.metadata import OUTPUT, WRITES, build_metadata, written_by_train
from eagle3_train.utils.io import Eagle3InputError, write_json
from eagle3_train.utils.outputs import claim_output_dir
from eagle3_train.utils.provenance import now_iso

log = logging.getLogger(__name__)

METADATA_FILE = "training_metadata.dry-run.json"
EXPORTS_DIR = "dry-run-exports"
_ST = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
       torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.bool: "BOOL"}
_ENGINE_KEYS = {  # config keys each format must carry for the engines' loaders
    "eagle": ("architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "num_hidden_layers", "vocab_size", "draft_vocab_size", "rms_norm_eps", "tie_word_embeddings"),
    "speculators": ("speculators_model_type", "speculators_config", "transformer_layer_config", "draft_vocab_size",
                    "norm_before_residual"),
}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# --- memory and disk ------------------------------------------------------------------------------------------------
def memory_figures(model, inputs, cfg: TrainConfig, precision: str, world_sizes: tuple[int, ...] = (1, 8),
                   max_target_elements: int = LOGITS_CHUNK_ELEMENTS) -> dict[str, Any]:
    """Bytes per rank by counting (no activations: those depend on the data; see benchmarks/kimi_dry_run.py).

    Hook: the `eagle3-train plan` module computes the same and more; this local count keeps the dry run standalone.
    Data parallel replicates everything, so the per-rank figure does not shrink with more ranks; only the tokens do.
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    from eagle3_train.model.optimizer_groups import muon_parameter_sizes, optimizer_state_bytes
    from eagle3_train.train.precision import verifier_tensor_dtype

    states = optimizer_state_bytes(cfg.optimizer, trainable, muon_parameter_sizes(model)[0])

    head_dtype = verifier_tensor_dtype(precision)
    esize = torch.empty((), dtype=head_dtype).element_size()
    V, H = inputs.lm_head.shape
    targets_chunk = max(1, min(1024, max_target_elements // V))  # as verifier_targets cuts it
    parts = {
        "trainable weights (fp32 master)": 4 * trainable,
        "gradients (fp32)": 4 * trainable,
        f"optimizer state ({cfg.optimizer}, fp32)": states,
        f"frozen embedding [{V}, {H}] ({str(head_dtype)[6:]}, no grad, not in the optimizer)": esize * frozen,
        f"verifier lm_head [{V}, {H}] for the targets ({str(head_dtype)[6:]})": esize * V * H,
        f"target logits, one chunk of {targets_chunk} rows x {V} (fp32)": 4 * targets_chunk * V,
    }
    per_rank = sum(parts.values())
    ckpt = 4 * trainable + states  # fp32 weights + optimizer state
    return {
        "trainable_parameters": trainable, "frozen_parameters": frozen, "parts_bytes": parts,
        "per_rank_bytes_without_activations": per_rank,
        "data_parallel": {str(n): {"bytes_per_rank": per_rank, "tokens_per_rank_per_step": cfg.token_budget
                                   * cfg.grad_accum} for n in world_sizes},
        "disk_bytes": {"checkpoint (weights + optimizer state)": ckpt,
                       f"checkpoints kept (keep_last {cfg.keep_last} + best)": ckpt * (cfg.keep_last + 1),
                       "final (weights only)": 4 * trainable,
                       "export, each format (bf16)": 2 * trainable},
    }


def _planned_peak(mc, inputs, cfg: TrainConfig, train_data: dict[str, Any], precision: str,
                  world_size: int) -> dict[str, Any]:
    """The planner's per-rank memory for this very draft shape and data (activations included)."""
    from eagle3_train.plan import PlanSettings, plan

    n = max(1, int(train_data["samples"]))
    p = plan(PlanSettings(
        verifier=str(inputs.verifier.path), samples=n, tokens_per_sample=max(1, int(train_data["tokens"]) // n),
        draft_vocab=mc.draft_vocab_size, ttt_steps=cfg.ttt_steps, token_budget=cfg.token_budget,
        grad_accum=cfg.grad_accum, epochs=cfg.epochs, gpus=world_size, precision=precision,
        device="cuda" if precision == "bf16" else "cpu", num_layers=mc.num_layers,
        intermediate_size=mc.intermediate_size, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, architecture=mc.architecture,
        mla_dims={k: getattr(mc, k) for k in MLA_DIMS}, dtype=_stored_dtype(inputs),
        checkpoint_mlp=cfg.checkpoint_mlp, checkpoint_loss=cfg.checkpoint_loss, layer_ids=tuple(mc.aux_layer_ids),
        optimizer=cfg.optimizer, method=mc.method))
    return {"peak_bytes": p.memory["peak"], "peak_phase": p.memory["peak_phase"],
            "ttt_activations_bytes": p.memory["ttt_activations"]}


def _stored_dtype(inputs) -> str:
    """The hidden states' storage dtype as the planner names it (served states arrive in bf16)."""
    dtype = str((inputs.hidden_manifest or {}).get("dtype") or "bfloat16")
    return "fp8" if dtype.startswith("float8") or dtype == "fp8" else dtype


# --- header-only exports --------------------------------------------------------------------------------------------
def write_header_only_safetensors(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                                  real: dict[str, torch.Tensor]) -> None:
    """A valid safetensors file with the given names, shapes and dtypes: `real` tensors hold their data, the others
    are zeros that the file system stores sparsely (a 2.4 GB draft costs a few kB of disk)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "eagle3-train dry run"}}
    offset, chunks = 0, []
    for name, (shape, dtype) in specs.items():
        if name in real:
            data = real[name].to(dtype).contiguous().view(torch.uint8).numpy().tobytes()  # bf16: no numpy dtype
            chunks.append((offset, data))
            n = len(data)
        else:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for off, data in chunks:
            f.seek(8 + len(hb) + off)
            f.write(data)
        f.truncate(8 + len(hb) + offset)


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {dtype, shape}, from the file's JSON header only (what a loader sees before reading data)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: {"dtype": v["dtype"], "shape": tuple(v["shape"])} for k, v in header.items()}


def export_header_only(model, d2t: torch.Tensor, t2d: torch.Tensor, fmt: str, out: Path, verifier: str,
                       dtype: str = "bfloat16", speculative_tokens: int = 3) -> Path:
    cfg = model.config
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    stored = stored_shapes(cfg)  # a whole-vocabulary draft's export holds no d2t/t2d, as the real export
    layout = draft_method(cfg.method).layout
    specs = {export_key(k, fmt, layout): (tuple(v.shape), torch_dtype if v.is_floating_point() else v.dtype)
             for k, v in model.trainable_state_dict().items() if k in stored}
    out.mkdir(parents=True, exist_ok=True)
    write_header_only_safetensors(out / "model.safetensors", specs,
                                  {k: t for k, t in (("d2t", d2t), ("t2d", t2d)) if k in stored})
    config = eagle_config_json(cfg, dtype) if fmt == "eagle" else speculators_config_json(
        cfg, dtype, speculative_tokens, verifier)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def check_export_as_engines_read_it(out: Path, fmt: str, model, run_layer_ids: tuple[int, ...],
                                    verifier_layers: int) -> list[str]:
    """Config keys, tensor names/shapes/dtypes from the header, aux layers as each engine reads them, and our reader.
    Returns what was checked; raises Eagle3InputError on the first problem."""
    cfg = model.config
    config = json.loads((out / "config.json").read_text())
    header = read_safetensors_header(out / "model.safetensors")
    where = f"dry-run export {out}"
    missing_keys = [k for k in _ENGINE_KEYS[fmt] if k not in config]
    if missing_keys:
        raise Eagle3InputError(f"{where}: config.json lacks {missing_keys}")
    want = {export_key(k, fmt, draft_method(cfg.method).layout): s for k, s in stored_shapes(cfg).items()}
    if set(header) != set(want):
        raise Eagle3InputError(f"{where}: tensors missing {sorted(set(want) - set(header))}, unexpected "
                               f"{sorted(set(header) - set(want))} (vLLM rejects unknown tensors)")
    bad = [(k, header[k]["shape"], s) for k, s in want.items() if header[k]["shape"] != s]
    if bad:
        raise Eagle3InputError(f"{where}: tensor shapes differ from the config: {bad[:5]}")
    if any(k.startswith("model.") for k in header):
        raise Eagle3InputError(f"{where}: tensor names must not start with 'model.'")
    if "d2t" in header and (header["d2t"]["dtype"] != "I64" or header["t2d"]["dtype"] != "BOOL"):
        raise Eagle3InputError(f"{where}: d2t must be I64 and t2d BOOL, got {header['d2t']['dtype']}, "
                               f"{header['t2d']['dtype']}")
    layer = config if fmt == "eagle" else config["transformer_layer_config"]
    if fmt == "eagle":
        want_config = eagle_config_json(cfg, "bfloat16")  # the layer kind's (or the method's own) class and type
        if config["architectures"] != want_config["architectures"] or \
                config["model_type"] != want_config["model_type"] or config["tie_word_embeddings"] is not False:
            raise Eagle3InputError(f"{where}: the engines need architectures {want_config['architectures']}, "
                                   f"model_type {want_config['model_type']} and tie_word_embeddings false")
    else:
        sc = config["speculators_config"]
        if not (sc.get("proposal_methods") or [{}])[0].get("speculative_tokens") or \
                not sc.get("verifier", {}).get("name_or_path"):
            raise Eagle3InputError(f"{where}: vLLM needs speculators_config.proposal_methods[0].speculative_tokens "
                                   f"and verifier.name_or_path")
    for key, value in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size),
                       ("intermediate_size", cfg.intermediate_size), ("num_hidden_layers", cfg.num_layers)):
        if layer.get(key) != value:
            raise Eagle3InputError(f"{where}: config {key} {layer.get(key)} but the draft has {value}")
    if config["draft_vocab_size"] != header["lm_head.weight"]["shape"][0]:
        raise Eagle3InputError(f"{where}: draft_vocab_size {config['draft_vocab_size']} but lm_head has "
                               f"{header['lm_head.weight']['shape'][0]} rows")
    ids, origin = read_aux_ids(config, EAGLE if fmt == "eagle" else SPECULATORS, str(out / "config.json"))
    served = tuple(ids) if ids else default_aux_layer_ids(verifier_layers)
    if served != tuple(run_layer_ids):
        raise Eagle3InputError(f"{where}: the engines would feed verifier layers {list(served)} ({origin}), but the "
                               f"draft is trained on {list(run_layer_ids)}")
    loaded = load_draft_source(out, shapes_only=True)
    if loaded.unknown:
        raise Eagle3InputError(f"{where}: our reader does not know tensors {loaded.unknown}")
    for f in ("architecture", *MLA_DIMS, "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "draft_vocab_size", "vocab_size", "rope_theta",
              "norm_before_residual", "norm_before_fc", "method", "mask_token_id"):
        if f == "head_dim" and f not in layer_kind(cfg.architecture).summary_fields:
            continue  # no dimension of an MLA layer: exported as the rotary width HF readers build (architectures)
        if getattr(loaded.config, f) != getattr(cfg, f):
            raise Eagle3InputError(f"{where}: read back, {f} is {getattr(loaded.config, f)} instead of "
                                   f"{getattr(cfg, f)}")
    return [f"{fmt} export: config keys the engines need, {len(header)} tensor names/shapes/dtypes from the "
            f"safetensors header, aux layers {list(served)} as vLLM and SGLang read them ({origin}), "
            f"read back by our loader"]


# --- the dry run ----------------------------------------------------------------------------------------------------
def _check_data(cfg: TrainConfig, inputs, H: int, V: int, max_pos: int, world_size: int,
                checked: list[str], not_checked: list[str]) -> dict[str, Any]:
    """Stored states: every shard's header. Online/hybrid: the servers, asked who they are and what they capture
    (the run's first request would fail the same way), never for states."""
    splits: dict[str, Any] = {}
    served = states_mode(cfg.hidden_states_mode).served
    for split in ("train", "validation"):
        try:
            data = _served_samples(cfg, inputs, split, checked) if served else \
                TrainingSamples(cfg.prepared, cfg.hidden_states, split)
        except Eagle3InputError as e:
            if split == "train":
                raise
            not_checked.append(f"validation data: {e}")
            continue
        if split == "train" and len(data) == 0:
            raise Eagle3InputError(f"no training samples with hidden states in {cfg.hidden_states}/train")
        widths = set() if served else _shard_widths(data, split, cfg, inputs, H)
        longest = max(data.lengths, default=0)
        if longest > max_pos:
            raise Eagle3InputError(f"{split}: a sample has {longest} tokens, more than the draft's "
                                   f"max_position_embeddings {max_pos}")
        top = max((max(ids) for ids in data.input_ids if ids), default=-1)
        if top >= V:
            raise Eagle3InputError(f"{split}: token id {top} is outside the verifier's vocabulary of {V}")
        complete = True if served else data.source.reader.complete
        splits[split] = {"samples": len(data), "tokens": sum(data.lengths), "longest": longest,
                         "shard_dtypes": sorted({w[2] for w in widths}), "complete": complete}
        if not complete:
            not_checked.append(f"{split}: the hidden states are incomplete (extract still running?)")
        if split == "train":
            micro = cfg.grad_accum * world_size
            n_batches = len(plan_batches(data.lengths, cfg.token_budget, cfg.seed, 0))
            steps = max(1, n_batches // micro)
            splits[split].update({"batches_per_epoch": n_batches, "steps_per_epoch": steps,
                                  "total_steps": cfg.max_steps or max(1, math.ceil(cfg.epochs * steps))})
        data.close()
    where = (f"hidden states from the servers ({cfg.hidden_states_mode} mode)" if served else
             f"hidden-states manifest (prepared sha256, verifier, layer_ids {list(inputs.layer_ids)}), every shard "
             f"header (aux 3x{H}, final {H})")
    checked.append(f"data: prepared manifest, {where}, token ids < {V}, lengths <= {max_pos}: "
                   + ", ".join(f"{k} {v['samples']} samples / {v['tokens']} tokens" for k, v in splits.items()))
    if served:
        not_checked.append("the servers' states themselves and their throughput (the run requests them; "
                           "`eagle3-train extract --backend vllm --max-samples N` measures it)")
    return splits


def _served_samples(cfg: TrainConfig, inputs, split: str, checked: list[str]) -> TrainingSamples:
    """The split read from the servers as an online run would: opening the source asks every endpoint for its
    model, vLLM version and captured layers and refuses a mismatch. Nothing is stored, even in hybrid mode."""
    from dataclasses import replace

    from eagle3_train.train.data import open_samples

    data = open_samples(replace(cfg, hidden_states_mode="online"), inputs, split)
    if split == "train":
        checked.append(f"servers {', '.join(cfg.endpoint)}: answered, identity {data.source.identity()}")
    return data


def _shard_widths(data: TrainingSamples, split: str, cfg: TrainConfig, inputs, H: int) -> set:
    from safetensors import safe_open

    reader = data.source.reader  # a StoredSource: the dry run checks stored shards
    widths = set()
    for entry in reader.index.get("shards", []):
        with safe_open(str(reader.shard_path(entry)), "pt") as f:
            widths.add((tuple(f.get_slice("aux").get_shape()[1:]), tuple(f.get_slice("final").get_shape()[1:]),
                        f.get_slice("aux").get_dtype()))
    for aux_w, final_w, _ in widths:
        if aux_w != (3 * H,) or final_w != (H,):
            raise Eagle3InputError(f"hidden states in {cfg.hidden_states}/{split}: shards hold aux {list(aux_w)} "
                                   f"and final {list(final_w)} per token, but verifier {inputs.verifier.name} "
                                   f"needs {[3 * H]} and {[H]}")
    return widths


def _meta_draft(cfg: TrainConfig, inputs, checked: list[str], not_checked: list[str]):
    """(the draft built on the meta device, its init record, its (d2t, t2d)): random, or the finetune source's
    names/shapes/dtypes loaded without data."""
    from eagle3_train.train.build import build_model, init_record

    init = init_record(cfg)
    d2t, t2d = inputs.d2t, inputs.t2d
    if cfg.finetune_from:
        from eagle3_train.train.finetune import apply_finetune_source, load_finetune_source

        source = load_finetune_source(cfg, inputs, read_data=False)
        model = build_model(cfg, inputs, overrides=source.draft_overrides, vocab=source.vocab, device="meta")
        init = apply_finetune_source(model, cfg, inputs, source, copy=False)
        if source.vocab is not None:
            d2t, t2d = source.vocab
        s = source.summary
        n = len(init["keys"]["loaded"])
        checked.append(f"finetune source {source.loaded.path} ({source.loaded.format}): config, {n} tensors' "
                       f"names/shapes/dtypes ({s['dtypes']}, {s['parameters'] / 1e9:.2f}B parameters), "
                       f"fit to the verifier, aux layers {init['aux_layers']['source']} "
                       f"({init['aux_layers']['source_origin']}) vs the run's {init['aux_layers']['run']}, "
                       f"vocab policy {cfg.finetune_vocab}"
                       + (f" ({init['vocab_overlap']['shared_tokens']} shared tokens)"
                          if init["vocab_overlap"]["shared_tokens"] is not None else " (no run vocab given)"))
        not_checked.append("finetune source tensor values (not read: NaN/Inf, embed_tokens against the verifier's) "
                           "and file hashes (computed by the real run)")
    else:
        model = build_model(cfg, inputs, device="meta")
    return model, init, (d2t, t2d)


def _header_only_exports(model, d2t, t2d, root: Path, inputs, num_layers: int, checked: list[str]) -> dict[str, Any]:
    """Write each export format header-only and check it as the engines' loaders read it."""
    exports: dict[str, Any] = {}
    speculators = layer_kind(model.config.architecture).speculators_format and \
        not draft_method(model.config.method).speculators_refusal
    formats = ("eagle", "speculators") if speculators else ("eagle",)
    for fmt in formats:
        d = export_header_only(model, d2t, t2d, fmt, root / fmt, inputs.verifier.name)
        checked += check_export_as_engines_read_it(d, fmt, model, inputs.layer_ids, num_layers)
        exports[fmt] = {"dir": str(d), "engines": engine_support(model.config, fmt)}
    return exports


def dry_run(cfg: TrainConfig, world_size: int = 1, precision: str | None = None) -> dict[str, Any]:
    """Check and write everything `train(cfg)` would, without optimizer steps or weight data (see module doc)."""
    from eagle3_train.model.verifier_head import verifier_head_shapes

    out = Path(cfg.out)
    claim_output_dir(out, *OUTPUT, written_by_train, writes=WRITES)
    checked: list[str] = []
    not_checked: list[str] = []
    precision = precision or (cfg.precision if cfg.precision != "auto" else "bf16")
    inputs = resolve_inputs(cfg, head_shapes_only=True)
    _, _, vcfg, head_origin = verifier_head_shapes(inputs.verifier.path)
    c = text_config(vcfg)
    H, V, L = int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])
    checked.append(f"verifier {inputs.verifier.name}: config ({vcfg.get('architectures')}, {L} layers, hidden {H}, "
                   f"vocab {V}), identity against the hidden-states manifest (config hash, weight-file sizes), "
                   f"embedding/lm_head shapes from {head_origin}")
    not_checked.append("verifier weight values and hashes (sizes only)" if "headers" in head_origin else
                       "verifier weights: none in the directory, so the embedding and lm_head shapes come from "
                       "config.json; the real run needs them")
    if inputs.d2t is not None:
        checked.append(f"vocab {inputs.vocab_path}: d2t/t2d consistent, {inputs.d2t.shape[0]} draft tokens over {V}")

    model, init, (d2t, t2d) = _meta_draft(cfg, inputs, checked, not_checked)
    mc = model.config
    checked.append(f"draft built on the meta device: {mc.num_layers} layer(s), hidden {mc.hidden_size}, "
                   f"draft vocab {mc.draft_vocab_size}, aux layers {list(mc.aux_layer_ids)}")

    data = _check_data(cfg, inputs, H, V, model.config.max_position_embeddings, world_size, checked, not_checked)
    figures = memory_figures(model, inputs, cfg, precision)
    figures["plan"] = _planned_peak(model.config, inputs, cfg, data["train"], precision, world_size)
    checked.append(f"planned peak per rank with TTT activations at token budget {cfg.token_budget}: "
                   f"{figures['plan']['peak_bytes'] / 2**30:.1f} GiB ({figures['plan']['peak_phase']}; "
                   f"`eagle3-train plan`)")
    hidden_bytes = (inputs.hidden_manifest.get("counts") or {}).get("bytes")
    if hidden_bytes:
        figures["disk_bytes"]["hidden states (extracted)"] = hidden_bytes

    exports = _header_only_exports(model, d2t, t2d, out / EXPORTS_DIR, inputs, L, checked)
    not_checked += [
        "optimizer steps and speed, and the measured (not planned) activation memory at this token budget "
        "(benchmarks/kimi_dry_run.py runs a width-reduced forward/backward)",
        "export logits round trip (the dry-run exports are header-only: zeros, not the draft's weights)",
        "the engines themselves: exports are checked against their loaders' rules, not loaded in vLLM/SGLang",
        "tokenizer and chat template (prepare's job, already done for this data)",
    ]
    report = {"time": now_iso(), "checked": checked, "not_checked": not_checked, "data": data,
              "memory": figures, "exports": exports, "precision": precision, "world_size": world_size}
    meta = build_metadata(cfg, inputs, model.config, init, world_size, started=report["time"], status="dry-run",
                          progress={"step": 0, "total_steps": data["train"]["total_steps"], "epoch": 0, "tokens": 0},
                          metrics={})
    meta["dry_run"] = report
    write_json(out / METADATA_FILE, meta)
    report["metadata_file"] = str(out / METADATA_FILE)
    return report


def format_report(report: dict[str, Any]) -> str:
    m = report["memory"]
    lines = ["dry run: checked"] + [f"  + {c}" for c in report["checked"]]
    lines.append(f"memory per rank without activations ({report['precision']}): "
                 f"{_gib(m['per_rank_bytes_without_activations'])} ({m['trainable_parameters'] / 1e9:.3f}B trainable, "
                 f"{m['frozen_parameters'] / 1e9:.3f}B frozen); data parallel replicates it on every rank")
    lines += [f"    {k}: {_gib(v)}" for k, v in m["parts_bytes"].items()]
    lines.append(f"planned peak per rank with TTT activations: {_gib(m['plan']['peak_bytes'])} "
                 f"(activations {_gib(m['plan']['ttt_activations_bytes'])}, peak at {m['plan']['peak_phase']})")
    lines.append("disk:")
    lines += [f"    {k}: {_gib(v)}" for k, v in m["disk_bytes"].items()]
    for fmt, e in report["exports"].items():
        lines.append(f"{fmt} export (header-only) {e['dir']}:")
        lines += format_support(e["engines"])
    lines.append("NOT checked:")
    lines += [f"  - {c}" for c in report["not_checked"]]
    lines.append(f"training metadata the run would write: {report['metadata_file']}")
    return "\n".join(lines)
