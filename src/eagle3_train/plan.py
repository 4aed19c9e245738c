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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_train.model.architectures import architecture_of
from eagle3_train.model.config import MLA_DIMS, default_ttt_query_block, describe_mla
from eagle3_train.model.ttt_attention import merged_available
from eagle3_train.model.verifier_head import LOGITS_CHUNK_ELEMENTS, chunk_rows
from eagle3_train.train.config import TrainConfig, auto_parallel
from eagle3_train.utils.io import Eagle3InputError

_TRAIN_DEFAULTS = TrainConfig()
DEFAULT_DRAFT_VOCAB = 32000  # `eagle3-train vocab`'s default size
FROZEN_BYTES = {"bf16": 2, "fp32": 4}  # bytes per element of the frozen verifier tensors, by training precision
# bytes per element of stored hidden states; fp8 adds one fp32 scale per row (per token and per stored state)
_STORAGE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_FP8_SCALE_BYTES = 4
GB = 1e9
TB = 1e12


@dataclass
class PlanSettings:
    verifier: str  # a config.json, a directory holding one, an embedded name or a hub id (config.json only fetched)
    samples: int
    tokens_per_sample: int
    # draft vocabulary rows; None: the finetune source's (`--finetune-vocab keep`), else 32000 (vocab's default).
    # Given with finetune_from, it is planned as `--finetune-vocab rebuild` at this size.
    draft_vocab: int | None = None
    ttt_steps: int = _TRAIN_DEFAULTS.ttt_steps
    token_budget: int = _TRAIN_DEFAULTS.token_budget  # padded tokens per micro-batch and rank
    grad_accum: int = _TRAIN_DEFAULTS.grad_accum
    epochs: float = _TRAIN_DEFAULTS.epochs
    gpus: int = 1  # data-parallel ranks over all nodes
    nodes: int = 1  # machines the ranks are spread over (gpus / nodes per node)
    parallel: str = "auto"  # train.parallel: ddp (replicated) | fsdp (sharded) | auto (as the trainer decides)
    offload_optimizer: bool = False  # train.offload_optimizer: fsdp's sharded states in host memory
    gpu_memory_gb: float | None = None  # per GPU
    disk_tb: float | None = None
    dtype: str = "bfloat16"  # storage dtype of the hidden states: bfloat16 | float16 | float32 | fp8
    precision: str = "bf16"  # training compute: bf16 (autocast, fp32 master weights; GPU) | fp32 (the CPU default)
    device: str = "cuda"  # cuda: frozen tensors copied to the GPU; cpu: "device" and host memory are the same
    supervised_fraction: float = 1.0  # share of tokens with a loss (assistant tokens); 1.0 = the worst case
    # draft architecture: the trainer's settings, and overrides of what from_verifier derives (e.g. a published draft)
    architecture: str = _TRAIN_DEFAULTS.architecture  # llama | mla (the MLA dims: the verifier's or the source's)
    mla_dims: dict[str, int | None] | None = None  # a finetune source's MLA dims
    num_layers: int = _TRAIN_DEFAULTS.num_layers
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    checkpoint_mlp: bool = _TRAIN_DEFAULTS.checkpoint_mlp
    checkpoint_loss: bool = _TRAIN_DEFAULTS.checkpoint_loss
    layer_ids: tuple[int, ...] | None = None  # the verifier layers tapped; None: those extract taps by default
    # the verifier's vLLM server on the training GPUs (GB per GPU; 0: it runs on other GPUs): hybrid and online
    # training need it. None (not given): unknown, and at least the weights spread over these GPUs when their size
    # is known - never silently zero.
    server_memory_gb: float | None = None
    # throughputs, measured (e.g. `generate`'s probe, `extract --max-samples N`, a short `train --max-steps N`) or
    # given, in tokens/s over the whole run: they turn into time figures
    generate_tokens_per_s: float | None = None
    generated_tokens_per_sample: int | None = None  # default: tokens_per_sample
    extract_tokens_per_s: float | None = None  # also the server's rate in hybrid/online training
    train_tokens_per_s: float | None = None
    finetune_from: str | None = None  # a draft to finetune: its architecture, vocabulary size and layers are planned
    source_aux_convention: str = "auto"  # how its eagle_config aux ids are meant (train's setting of the same name)


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


# --- reading the verifier ---------------------------------------------------------------------------------------------
def read_verifier_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Return (config dict, config.json path). JSON only: no transformers class, no remote code, no weights."""
    p = Path(path).expanduser()
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        from eagle3_train.assets.verifier import EMBEDDED, resolve_verifier

        if not p.exists() and str(path) in EMBEDDED:
            return read_verifier_config(resolve_verifier(str(path)))
        if not p.exists() and "/" in str(path) and not str(path).startswith((".", "/", "~")):
            return read_verifier_config(_hub_config(str(path)))
        raise Eagle3InputError(f"plan: verifier config not found: {cfg_path} (pass a config.json or a directory "
                               f"holding one; weights are not needed)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3InputError(f"plan: {cfg_path} is not valid JSON: {e}") from None
    text = config.get("text_config", config)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                           "intermediate_size") if k not in text]
    if missing:
        where = f"{cfg_path} (text_config)" if "text_config" in config else str(cfg_path)
        raise Eagle3InputError(f"plan: {where} lacks {', '.join(missing)}")
    return config, cfg_path


def _hub_config(repo_id: str) -> Path:
    """Fetch only config.json (and the weight index, for the size) of a hub model: never its weights."""
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise Eagle3InputError(f"plan: could not fetch config.json of '{repo_id}' from the hub: {e}") from None
    try:
        hf_hub_download(repo_id, "model.safetensors.index.json")
    except Exception:  # noqa: BLE001 - optional: single-file models have no index
        pass
    return path


def _verifier_weight_bytes(cfg_path: Path) -> int | None:
    """Size of the verifier's weights if its directory says so (index metadata or files); None from a bare config."""
    d = cfg_path.parent
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        except json.JSONDecodeError:
            pass
    files = [f for f in d.glob("*.safetensors") if f.is_file()]
    return sum(f.stat().st_size for f in files) or None


# --- the draft, counted -------------------------------------------------------------------------------------------
def build_meta_draft(verifier_config: dict[str, Any], s: PlanSettings):
    """The draft the trainer would build (same config code, same module), on the meta device: shapes, no memory."""
    from eagle3_train.model.config import DraftConfig
    from eagle3_train.model.draft import Eagle3Draft

    overrides = {"intermediate_size": s.intermediate_size, "num_layers": s.num_layers,
                 "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
                 "head_dim": s.head_dim, "architecture": s.architecture, **(s.mla_dims or {})}
    try:
        draft_cfg = DraftConfig.from_verifier(verifier_config, draft_vocab_size=s.draft_vocab,
                                              aux_layer_ids=s.layer_ids, verifier_name=f"verifier {s.verifier}",
                                              **overrides)
    except KeyError as e:
        raise Eagle3InputError(f"plan: verifier config lacks {e}") from None
    with torch.device("meta"):
        model = Eagle3Draft(draft_cfg)
    return draft_cfg, model


def count_parameters(model) -> dict[str, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    by_module: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:3])
        by_module[key] = by_module.get(key, 0) + p.numel()
    return {"trainable": trainable, "frozen": frozen, "frozen_embedding": model.embed_tokens.weight.numel(),
            "trainable_bytes_bf16": 2 * trainable, **{f"module:{k}": v for k, v in sorted(by_module.items())}}


# --- memory model -------------------------------------------------------------------------------------------------
def _geometry(s: PlanSettings) -> dict[str, int]:
    """Micro-batch shape per rank: `plan_batches` packs B samples of length L with B*L <= budget; a sample longer than
    the budget gets a batch of its own."""
    L = s.tokens_per_sample
    B = max(1, s.token_budget // L)
    N = B * L
    return {"batch_size": B, "seq_len": L, "tokens": N,
            "supervised_rows": max(0, math.ceil(s.supervised_fraction * N))}


def ttt_saved_bytes(d, N: int, L: int, R: int, steps: int, bf16: bool, checkpoint_mlp: bool,
                    checkpoint_loss: bool, Vd: int, merged: bool = True) -> dict[str, int]:
    """Bytes the autograd graph keeps from the forward of one micro-batch to its backward (see train/ttt.py and
    model/draft.py), by term. N tokens in [B, L], R supervised rows per TTT step (an upper bound for later steps).

    Per decoder layer and TTT step: the RMSNorms keep their fp32 input and normalised output; q/k/v keep their input
    (under autocast one bf16 cast per projection, in fp32 one shared tensor); attention keeps q, its output and the
    keys and values it read: `merged` (model/ttt_attention.py) the step-0 keys once, each later step's own keys and
    an fp32 logsumexp per query and head, all linear in L; `masked` at step j, per query block, the step-0 keys up to
    the block's end plus one key per later step for its own rows (a new tensor per block) and the block's mask
    (additive, in the compute dtype), quadratic in L; o_proj keeps its input; the MLP keeps its input only
    (recomputed in backward) or its four [N, I] activations. The loss keeps the gathered [R, H] rows (recomputed)
    or two [R, Vd] tensors (the targets gathered for the step and the draft's softmax)."""
    H, inter = d.hidden_size, d.intermediate_size
    w = architecture_of(d).attention_widths(d)
    a = 2 if bf16 else 4  # matmul inputs/outputs under autocast
    qkv_copies = 3 if bf16 else 1
    T = default_ttt_query_block(L)
    t = {"norms": 0, "qkv_inputs": 0, "attention_q_out": 0, "attention_kv": 0, "attention_extra": 0,
         "attention_lse": 0, "attention_mask": 0,
         "o_proj_input": 0, "mlp": 0, "loss": 0}
    for j in range(steps):
        if L - 2 - j <= 0:
            break
        for layer in range(d.num_layers):
            first = layer == 0
            # first layer: hidden_norm (input + output) and input_layernorm over the frozen embedding (output only)
            t["norms"] += (3 if first else 2) * N * H * 4
            t["qkv_inputs"] += qkv_copies * N * (2 * H if first else H) * a
            t["attention_q_out"] += N * (w["q"] + w["out"]) * a
            t["attention_extra"] += N * w["extra"] * a
            if j == 0 or merged:
                t["attention_kv"] += N * (w["k"] + w["v"]) * a
                t["attention_lse"] += N * d.num_attention_heads * 4 if j and merged else 0
            else:  # masked query blocks: each keeps the prefix up to its end + its diagonal keys
                blocks = [(min(b + T, L), min(b + T, L) - b) for b in range(0, L, T)]
                t["attention_kv"] += N // L * sum(e + j * n for e, n in blocks) * (w["k"] + w["v"]) * a
                # [block, end + j*block]: SDPA turns the bool mask into an additive one of the compute dtype
                t["attention_mask"] += sum(n * (e + j * n) for e, n in blocks) * a
            t["o_proj_input"] += N * w["o_in"] * a
            t["mlp"] += N * H * 4 if checkpoint_mlp else (2 * N * H * 4 + N * H * a + 4 * N * inter * a)
        t["loss"] += R * H * 4 if checkpoint_loss else R * H * 4 + 2 * R * Vd * 4
    t["fc_input"] = N * 3 * d.aux_hidden_size * a if bf16 else 0  # fp32: the batch's aux tensor itself
    t["total"] = sum(t.values())
    return t


def loss_forward_bytes(R: int, Vd: int) -> int:
    """Peak of one TTT step's loss forward (ttt._head_loss): four [R, Vd] fp32 tensors at once (see memory_per_rank)."""
    return 4 * R * Vd * 4


def shard_units(params: dict[str, int]) -> dict[str, int]:
    """Trainable parameters of each unit train/parallel.py shards: every decoder layer, fc, the root (the rest:
    lm_head, norms, a draft's own embedding)."""
    units: dict[str, int] = {"fc": 0}
    for key, n in params.items():
        name = key.removeprefix("module:")
        if name.startswith("layers."):
            layer = ".".join(name.split(".")[:2])
            units[layer] = units.get(layer, 0) + n
        elif name == "fc":
            units[name] = n
    units["root"] = params["trainable"] - sum(units.values())
    return units


def memory_per_rank(d, params: dict[str, int], s: PlanSettings, frozen_bytes: int, tied: bool,
                    checkpoint_dtype: str, engine: str = "ddp") -> tuple[dict[str, Any], dict]:
    """Device memory per rank (bytes) at the peak of a training step, and host memory of the rank process, under
    `engine`: ddp (every rank holds the whole training state) or fsdp (train/parallel.py: the fp32 weights,
    gradients and AdamW states divided over the ranks, offloaded to the host with offload_optimizer; the units in
    the compute dtype gathered, the layers and the root (with lm_head) for the whole step, fc in turn; a unit's
    whole gradient and its fp32 reduce-scatter buffer at the end of its backward)."""
    g = _geometry(s)
    N, L, R = g["tokens"], g["seq_len"], g["supervised_rows"]
    P = params["trainable"]
    V, Vd, H, Ht = d.vocab_size, d.draft_vocab_size, d.hidden_size, d.aux_hidden_size
    bf16 = s.precision == "bf16"
    sharded = engine == "fsdp" and s.gpus > 1
    share = (0 if s.offload_optimizer else 1) / s.gpus if sharded else 1  # of the fp32 state on this device
    units = shard_units(params)
    pb = 2 if bf16 else 4  # compute dtype of the gathered units
    m: dict[str, Any] = {
        "weights_fp32_master": int(4 * P * share),  # the trainer keeps fp32 parameters (autocast computes in bf16)
        "grads": int(4 * P * share),
        "adamw_states": int(8 * P * share),  # exp_avg + exp_avg_sq, fp32
        # ddp: bf16 casts of the weights, kept for backward; fsdp: the units gathered in the compute dtype
        "autocast_weight_copies": 2 * P if bf16 and not sharded else 0,
        "gathered_units": pb * (P - units["fc"]) if sharded else 0,
        "frozen_embedding": V * H * frozen_bytes,  # the verifier's input embedding inside the draft
        # verifier lm_head for the targets (train/targets.py), in the trainer's frozen dtype (bf16 under bf16): a copy
        # on the GPU; on CPU the loaded tensor itself (counted in host memory)
        "verifier_lm_head": V * Ht * frozen_bytes if s.device == "cuda" else 0,
        "buffers": V + 8 * Vd,  # t2d (bool), d2t (int64)
        "batch": N * 4 * Ht * 4,  # aux [N, 3H] + final [N, H], converted to fp32 on the device
        "targets": R * Vd * 4 + 16 * R,  # verifier distribution over the DRAFT vocab only, kept for the step
    }
    saved = ttt_saved_bytes(d, N, L, R, s.ttt_steps, bf16, s.checkpoint_mlp, s.checkpoint_loss, Vd,
                            merged=merged_available(s.device, torch.bfloat16 if bf16 else torch.float32))
    m["ttt_activations"] = saved["total"]
    # Transients, one at a time: the targets' chunked full-vocab logits (1024 rows, argmax only) before the forward;
    # the end of the forward (the K/V caches of steps >= 1, alive until ttt_forward returns, plus the last step's loss);
    # the start of the backward (the recomputed loss of the last step); the gradient all-reduce buffer (DDP).
    # The loss (ttt._head_loss) holds four [R, Vd] fp32 tensors at once in the forward: the draft's softmax, the
    # gathered targets and the alpha metric's two temporaries (the logits and log-softmax before them are three); three
    # in backward: softmax, targets and the logits' gradient (train/losses.py, soft_cross_entropy).
    # The full-vocab pass multiplies in lm_head's dtype (the trainer holds it in `frozen_bytes`), then in fp32; the
    # rows per chunk are capped as `chunk_rows` caps them (409 rows of Kimi's 163840 tokens).
    chunk = max(1, min(chunk_rows(1024, V, LOGITS_CHUNK_ELEMENTS), R))
    full_logits = chunk * V * (4 if frozen_bytes == 4 else frozen_bytes + 4)
    targets_tmp = full_logits + chunk * Vd * 8 + Vd * Ht * 4 + R * Ht * 4
    # under checkpoint_loss the loss runs in pieces of rows (train/ttt.py `_step_loss`): one piece's logits at a time
    piece = min(R, chunk_rows(R, Vd, LOGITS_CHUNK_ELEMENTS)) if s.checkpoint_loss else R
    loss_fwd, loss_bwd = loss_forward_bytes(piece, Vd), 3 * piece * Vd * 4
    w = architecture_of(d).attention_widths(d)
    kv_caches = sum(N * (w["k"] + w["v"]) * (2 if bf16 else 4) for j in range(1, s.ttt_steps)) * d.num_layers
    static = sum(m.values()) - m["ttt_activations"] - m["targets"] - m["batch"]
    # fsdp: the largest unit's whole gradient in the compute dtype, and its fp32 copy for the reduce-scatter
    unit_grad = (pb + 4) * max(units.values()) if sharded else 0
    candidates = {
        # before the forward: gradients were freed (zero_grad(set_to_none)), no autocast weight copies yet
        "targets": static - m["grads"] - m["autocast_weight_copies"] - m["gathered_units"] + m["batch"]
        + m["targets"] + targets_tmp,
        "forward_end": static - m["grads"] + m["batch"] + m["targets"] + saved["total"] + kv_caches + loss_fwd,
        # all gradients counted (an upper bound: they are allocated as the backward proceeds)
        "backward_start": static + m["batch"] + m["targets"] + saved["total"] + loss_bwd,
        "backward_end": static + unit_grad + (pb * units["fc"] if sharded else 0),
        # ddp reduces in 25 MB buckets that the gradients are views of (gradient_as_bucket_view): no flat copy
        "all_reduce": static + 2 * 25 * 2**20 if s.gpus > 1 and not sharded else 0,
    }
    where = max(candidates, key=candidates.get)
    m["transient_at_peak"] = candidates[where] - (static + m["batch"] + m["targets"] + m["ttt_activations"])
    m["peak"] = candidates[where]
    m["peak_phase"] = where
    # model/verifier_head.py reads the embedding and lm_head with safetensors (memory-mapped: page cache, shared by the
    # ranks of a node) and converts them to fp32; only a checkpoint stored in another dtype makes a private fp32 copy.
    n_verifier = V * H + (0 if tied else V * Ht)  # tied: the embedding tensor serves as lm_head
    ckpt_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(checkpoint_dtype, 2)
    host = {"verifier_tensors_fp32_copy": 0 if checkpoint_dtype == "float32" else 4 * n_verifier,
            "offloaded_training_state": 16 * P // s.gpus if sharded and s.offload_optimizer else 0,
            # train_step loads all of this rank's micro-batches of the step, in the storage dtype
            "batches_in_storage_dtype": s.grad_accum * N * 4 * Ht * _STORAGE_BYTES.get(s.dtype, 2)}
    page_cache = n_verifier * ckpt_bytes
    return m, {"saved_by_term": saved, "candidates": candidates, "host": host, "page_cache": page_cache}


# --- the plan -----------------------------------------------------------------------------------------------------
def _check(s: PlanSettings) -> None:
    for name in ("samples", "tokens_per_sample", "draft_vocab", "ttt_steps", "token_budget", "gpus", "grad_accum",
                 "nodes"):
        if getattr(s, name) is not None and getattr(s, name) < 1:
            raise Eagle3InputError(f"plan: --{name.replace('_', '-')} must be at least 1, got {getattr(s, name)}")
    if s.dtype not in _STORAGE_BYTES:
        raise Eagle3InputError(f"plan: --dtype must be one of {', '.join(_STORAGE_BYTES)}, got {s.dtype!r}")
    if s.precision not in ("bf16", "fp32"):
        raise Eagle3InputError(f"plan: --precision must be bf16 or fp32, got {s.precision!r}")
    if s.parallel not in ("auto", "ddp", "fsdp"):
        raise Eagle3InputError(f"plan: --parallel must be auto, ddp or fsdp, got {s.parallel!r}")
    if s.gpus % s.nodes:
        raise Eagle3InputError(f"plan: --gpus {s.gpus} cannot be spread evenly over --nodes {s.nodes}")
    if s.device not in ("cuda", "cpu"):
        raise Eagle3InputError(f"plan: --device must be cuda or cpu, got {s.device!r}")
    if not 0 < s.supervised_fraction <= 1:
        raise Eagle3InputError(f"plan: --supervised-fraction must be in (0, 1], got {s.supervised_fraction}")
    if s.server_memory_gb is not None and s.server_memory_gb < 0:
        raise Eagle3InputError(f"plan: --server-memory must be >= 0 GB (0: the server runs on other GPUs), got "
                               f"{s.server_memory_gb}")


def hidden_state_bytes_per_token(H: int, dtype: str) -> int:
    """3 aux states + the final state per token; fp8 stores one fp32 scale per state row."""
    b = 4 * H * _STORAGE_BYTES[dtype]
    return b + 4 * _FP8_SCALE_BYTES if dtype == "fp8" else b


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
    text = vcfg.get("text_config", vcfg)
    source_vocab = None
    if s.finetune_from:
        s, source_vocab = _from_source(s, int(text["num_hidden_layers"]))
    s = dataclasses.replace(s, draft_vocab=s.draft_vocab or DEFAULT_DRAFT_VOCAB)
    draft_cfg, model = build_meta_draft(vcfg, s)
    tied = bool(vcfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    params = count_parameters(model)
    # the dtype the trainer holds the frozen embedding and lm_head in (`train.precision.verifier_tensor_dtype`,
    # applied in train/trainer.py `_setup_model`; tests/test_plan.py keeps the two equal)
    frozen_bytes = FROZEN_BYTES[s.precision]
    H = draft_cfg.aux_hidden_size
    g = _geometry(s)
    tokens = s.samples * s.tokens_per_sample

    per_token = {dt: hidden_state_bytes_per_token(H, dt) for dt in ("bfloat16", "fp8", "float32")}
    per_token[s.dtype] = hidden_state_bytes_per_token(H, s.dtype)
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
    weight_bytes = _verifier_weight_bytes(cfg_path)

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
    if source_vocab is not None and s.draft_vocab != source_vocab:
        notes.append(f"draft vocabulary: {s.draft_vocab} rows, rebuilt from this run's data (the source has "
                     f"{source_vocab}): `train --finetune-vocab rebuild` with a vocabulary of that size")
    if mem_ok is False and g["batch_size"] == 1 and not mem["by_engine"]["fsdp"]["fits"]:
        notes.append(_long_sample_note(draft_cfg, params, s, frozen_bytes, tied, checkpoint_dtype, mem))
    rec = _recommend(modes, mem_ok, disk_ok, s, engine, mem["by_engine"]["fsdp"]["fits"])
    fp8_total = hs["by_dtype"]["fp8"]["total_bytes"]
    if disk_ok is False and s.dtype != "fp8" and fp8_total <= s.disk_tb * TB:
        rec += (f"; fp8 storage ({_b(fp8_total)}) would fit offline/hybrid, where extract offers it and the loss "
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


def communication_per_step(params: dict[str, int], s: PlanSettings) -> dict[str, dict[str, int]]:
    """Bytes each rank sends per optimizer step, by engine (ring collectives move (G-1)/G of the data each way):
    ddp all-reduces the fp32 gradients (2x); fsdp all-gathers the units in the compute dtype (fc twice: it is
    resharded after its forward) and reduce-scatters the fp32 gradients. Gradient accumulation reduces once."""
    G, P = s.gpus, params["trainable"]
    ring = (G - 1) / G if G > 1 else 0.0
    pb = 2 if s.precision == "bf16" else 4
    fc = shard_units(params)["fc"]
    gather = int(ring * pb * (P + fc))
    scatter = int(ring * 4 * P)
    ddp = int(2 * ring * 4 * P)
    inter = (s.nodes - 1) / s.nodes if s.nodes > 1 else 0.0  # share of a ring's hops that cross nodes (flat ring)
    return {"ddp": {"all_reduce": ddp, "total": ddp, "across_nodes": int(inter * ddp)},
            "fsdp": {"all_gather": gather, "reduce_scatter": scatter, "total": gather + scatter,
                     "across_nodes": int(inter * (gather + scatter))}}


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
        return {"bytes": int(s.server_memory_gb * GB), "basis": f"given (--server-memory: {where})"}
    if weight_bytes:
        return {"bytes": None, "at_least_bytes": weight_bytes // s.gpus,
                "basis": f"not given; its weights alone are {_b(weight_bytes // s.gpus)} per GPU over {s.gpus}"}
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
    return (f"one {s.tokens_per_sample}-token sample keeps {_b(mem['ttt_activations'])} of activations on its rank "
            f"({_b(per_token)} per token with its targets and hidden states); fsdp divides the weights and optimizer "
            f"states over the ranks, not one sample's activations: {longest} on {s.gpu_memory_gb:g} GB. Context "
            f"parallelism (the sequence split over ranks, docs/GUIDE.md 'Long samples') is the next step; it is "
            f"not built yet")


def _notes(weight_bytes: int | None, frozen_bytes: int, s: PlanSettings, server: dict[str, Any]) -> list[str]:
    notes = []
    if server["bytes"] is None:
        notes.append(f"the verifier's server memory per training GPU is {server['basis']}: pass --server-memory GB "
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
    return fix + (f", turn on {' and '.join(extra)}" if extra else "") + ", fewer --ttt steps, or GPUs with more memory"


def _recommend(modes: dict, mem_ok: bool | None, disk_ok: bool | None, s: PlanSettings,
               engine: str = "ddp", sharded_fits: bool | None = None) -> str:
    if mem_ok is False:
        if sharded_fits and engine == "ddp":
            return "nothing fits replicated (train.parallel ddp): train.parallel fsdp fits (--parallel fsdp)"
        return f"nothing fits: the training peak per rank exceeds --gpu-memory; {_smaller_step(s)}"
    if mem_ok is None or disk_ok is None:
        return "pass --gpu-memory and --disk to check which mode fits"
    if disk_ok:
        hybrid = {True: " (or hybrid to overlap extraction with the first epoch)",
                  None: " (hybrid overlaps extraction with the first epoch if the server fits: see --server-memory)",
                  False: ""}[modes["hybrid"]["fits"]]
        return (f"offline{hybrid}: the hidden states fit on disk"
                + ("" if s.epochs > 1 or modes["online"]["fits"] is False
                   else "; with one epoch, online avoids writing them at all"))
    if modes["online"]["fits"] is False:
        share = modes["online"]["server_memory_per_gpu"]
        size = (f"{_b(share['bytes'])} per GPU" if share["bytes"] is not None
                else f"at least {_b(share['at_least_bytes'])} per GPU for its weights")
        return (f"nothing fits: the hidden states do not fit on disk, and streaming them needs the verifier's server "
                f"({size}) beside the trainer, beyond --gpu-memory: run the servers on other GPUs"
                + ("" if s.dtype == "fp8" else ", or store fp8 states"))
    if modes["online"]["fits"] is None:
        return ("online if the verifier's servers run on other GPUs (or fit beside the trainer: pass --server-memory "
                "to check): the hidden states do not fit on disk")
    return "online: the hidden states do not fit on disk; stream them from the server every epoch"


# --- printing -----------------------------------------------------------------------------------------------------
def _b(n: float) -> str:
    for unit, size in (("TB", TB), ("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _t(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds / 3600:.1f} h"


def _n(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_plan(p: Plan) -> str:
    s, d, pr, hs, m, b = p.settings, p.draft, p.parameters, p.hidden_states, p.memory, p.batch
    v = p.verifier
    attention = describe_mla(d) if d.get("architecture") == "mla" else \
        f"heads {d['num_attention_heads']}/{d['num_key_value_heads']} x {d['head_dim']}"
    lines = [
        f"verifier  {v['config']}: {v['model_type']} {v['architectures']}, hidden {v['hidden_size']}, "
        f"{v['num_hidden_layers']} layers, vocab {v['vocab_size']}",
        f"draft     {d['num_layers']} layer(s), hidden {d['hidden_size']}, {attention}, intermediate "
        f"{d['intermediate_size']}, draft vocab {d['draft_vocab_size']}, aux layers {d['aux_layer_ids']}",
        f"params    trainable {_n(pr['trainable'])} ({_b(pr['trainable_bytes_bf16'])} bf16); frozen "
        f"{_n(pr['frozen'])} (verifier embedding); the verifier lm_head [{v['vocab_size']}, "
        f"{v['hidden_size']}] is also held for the targets",
        f"data      {s['samples']} samples x {s['tokens_per_sample']} tokens = {hs['tokens']:,} tokens; micro-batch "
        f"{b['batch_size']} x {b['seq_len']} per rank, {b['tokens_per_step']:,} tokens per step on {s['gpus']} "
        f"rank(s) over {s['nodes']} node(s), {b['steps_per_epoch']} steps/epoch",
        "hidden states on disk (3 aux + final per token):",
    ]
    for dt, x in hs["by_dtype"].items():
        mark = " <- --dtype" if dt == hs["storage_dtype"] else ""
        lines.append(f"  {dt:9s} {_b(x['bytes_per_token']):>10s}/token  {_b(x['total_bytes']):>10s}{mark}")
    lines.append(f"training memory per rank (ttt {s['ttt_steps']}, {s['precision']}, budget {s['token_budget']}, "
                 f"train.parallel {m['engine']}):")
    for k in ("weights_fp32_master", "grads", "adamw_states", "autocast_weight_copies", "gathered_units",
              "frozen_embedding", "verifier_lm_head", "batch", "targets", "ttt_activations", "transient_at_peak"):
        lines.append(f"  {k:24s} {_b(m[k]):>10s}")
    lines.append(f"  {'peak':24s} {_b(m['peak']):>10s}  (at {m['peak_phase']})")
    for e, x in m["by_engine"].items():
        fits = {None: "", True: ", fits", False: ", does NOT fit"}[x["fits"]]
        c = x["communication"]
        lines.append(f"  {e:4s} peak {_b(x['peak']):>10s}{fits}; sends {_b(c['total'])} per step and rank"
                     + (f" ({_b(c['across_nodes'])} across nodes)" if s["nodes"] > 1 else "")
                     + ("  <- recommended" if e == m["engine"] else ""))
    hm = p.host_memory
    lines.append(f"host RAM per rank: {_b(hm['total'])} (fp32 copies of the verifier embedding/lm_head unless stored "
                 f"in fp32, batches); {_b(hm['per_node'])} for the {s['gpus'] // s['nodes']} rank(s) of a node, "
                 f"plus {_b(hm['verifier_page_cache'])} of page cache for the memory-mapped verifier tensors"
                 + (f"; CPU training, whole process: {_b(hm['process_total'])}" if "process_total" in hm else ""))
    lines.append("modes:")
    for name, md in p.modes.items():
        fits = {None: "?", True: "fits", False: "does NOT fit"}[md["fits"]]
        lines.append(f"  {name:8s} disk {_b(md['disk_bytes']):>9s} | per rank and step: disk read "
                     f"{_b(md['read_bytes_per_step']):>9s}, from server {_b(md['server_bytes_per_step']):>9s}, "
                     f"gradients {_b(md['allreduce_bytes_per_step']):>9s} | {md['verifier_passes']} verifier "
                     f"pass(es) -> {fits}")
    times = next(iter(p.modes.values())).get("seconds") or {}
    if any(v is not None for v in times.values()):
        lines.append("time: " + ", ".join(
            f"{name} {_t(md['seconds']['run_after_regeneration'])}" for name, md in p.modes.items())
            + f" (extraction {_t(p.modes['offline']['seconds']['extract'])}, one epoch "
              f"{_t(times['train_epoch'])}; regeneration first: {_t(times['regenerate'])})")
    lines.append(f"recommendation: {p.recommendation}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


# --- CLI ------------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", required=True,
                   help="verifier config.json, a directory holding one, an embedded name or a hub id (no weights read)")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--tokens-per-sample", type=int, required=True)
    p.add_argument("--draft-vocab", type=int, help="draft vocabulary rows (default: the finetune source's, else "
                   f"{DEFAULT_DRAFT_VOCAB}); with --finetune-from, planned as --finetune-vocab rebuild")
    p.add_argument("--ttt", dest="ttt_steps", type=int, default=_TRAIN_DEFAULTS.ttt_steps)
    p.add_argument("--gpus", type=int, default=1, help="ranks in all (or --nodes with --gpus-per-node)")
    p.add_argument("--nodes", type=int, default=1, help="machines the ranks are spread over")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node: --gpus = --nodes x this")
    p.add_argument("--parallel", default="auto", choices=("auto", "ddp", "fsdp"),
                   help="train.parallel to plan (auto: as the trainer decides)")
    p.add_argument("--offload-optimizer", action="store_true", help="train.offload_optimizer (fsdp)")
    p.add_argument("--gpu-memory", dest="gpu_memory_gb", type=float, help="GB per GPU")
    p.add_argument("--disk", dest="disk_tb", type=float, help="TB free for hidden states")
    p.add_argument("--token-budget", type=int, default=_TRAIN_DEFAULTS.token_budget)
    p.add_argument("--grad-accum", type=int, default=_TRAIN_DEFAULTS.grad_accum)
    p.add_argument("--epochs", type=float, default=_TRAIN_DEFAULTS.epochs)
    p.add_argument("--dtype", default="bfloat16", help="hidden-state storage: bfloat16 | float16 | float32 | fp8")
    p.add_argument("--precision", default="bf16", help="training compute: bf16 (GPU) | fp32 (CPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--supervised-fraction", type=float, default=1.0, help="share of tokens with a loss (1 = bound)")
    p.add_argument("--num-layers", type=int, default=_TRAIN_DEFAULTS.num_layers)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--draft-heads", dest="num_attention_heads", type=int)
    p.add_argument("--draft-kv-heads", dest="num_key_value_heads", type=int)
    p.add_argument("--draft-head-dim", dest="head_dim", type=int)
    p.add_argument("--finetune-from", help="a draft to finetune (dir, export or hub id): plan its architecture, "
                                           "vocabulary and aux layers (headers only)")
    p.add_argument("--source-aux-convention", choices=("auto", "sglang", "vllm"), default="auto",
                   help="how the finetune source's eagle_config aux ids are meant (see `train --help`)")
    p.add_argument("--server-memory", dest="server_memory_gb", type=float,
                   help="GB per GPU the verifier's vLLM server holds on the training GPUs (hybrid/online); 0: the "
                        "servers run on other GPUs; not given: unknown (at least its weights)")
    p.add_argument("--generate-tokens-per-s", type=float, help="regeneration throughput (tokens/s, whole run)")
    p.add_argument("--generated-tokens-per-sample", type=int, help="answer tokens per sample (default: --tokens-"
                   "per-sample)")
    p.add_argument("--extract-tokens-per-s", type=float, help="hidden-state throughput (tokens/s, all servers)")
    p.add_argument("--train-tokens-per-s", type=float, help="training throughput (tokens/s, all ranks)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(PlanSettings)}
    if args.gpus_per_node:
        args.gpus = args.nodes * args.gpus_per_node
    result = plan(PlanSettings(**{k: v for k, v in vars(args).items() if k in names}))
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0
