"""The memory model: what `train/trainer.py` and `train/ttt.py` keep alive per rank, term by term, the bytes a stored
token takes, and what a step moves between ranks. Checked against a measured CPU run
(benchmarks/plan_vs_measured.py); the bf16/CUDA terms follow the same code but are unmeasured here."""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3_train.model.architectures import architecture_of
from eagle3_train.model.config import default_ttt_query_block
from eagle3_train.model.optimizer_groups import muon_step_bytes, optimizer_state_bytes
from eagle3_train.model.ttt_attention import merged_available
from eagle3_train.model.verifier_head import LOGITS_CHUNK_ELEMENTS, chunk_rows
from eagle3_train.settings.plan import PlanSettings
from eagle3_train.utils.store_bytes import ELEMENT_BYTES

DEFAULT_DRAFT_VOCAB = 32000  # `eagle3-train vocab`'s default size
FROZEN_BYTES = {"bf16": 2, "fp32": 4}  # bytes per element of the frozen verifier tensors, by training precision
GB = 1e9
TB = 1e12


def geometry(s: PlanSettings) -> dict[str, int]:
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
    gradients and optimizer states (train/optimizer.py) divided over the ranks, offloaded to the host with
    offload_optimizer; the units in the compute dtype gathered, the layers and the root (with lm_head) for the whole
    step, fc in turn; a unit's whole gradient and its fp32 reduce-scatter buffer at the end of its backward)."""
    g = geometry(s)
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
        "optimizer_states": int(optimizer_state_bytes(s.optimizer, P, params.get("muon", 0)) * share),
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
    # under checkpoint_loss the loss runs in pieces of rows (train/ttt.py `step_loss`): one piece's logits at a time
    piece = min(R, chunk_rows(R, Vd, LOGITS_CHUNK_ELEMENTS)) if s.checkpoint_loss else R
    loss_fwd, loss_bwd = loss_forward_bytes(piece, Vd), 3 * piece * Vd * 4
    w = architecture_of(d).attention_widths(d)
    kv_caches = sum(N * (w["k"] + w["v"]) * (2 if bf16 else 4) for j in range(1, s.ttt_steps)) * d.num_layers
    static = sum(m.values()) - m["ttt_activations"] - m["targets"] - m["batch"]
    muon_step = muon_step_bytes(params.get("muon_largest", 0)) if s.optimizer == "muon" else 0
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
        "optimizer_step": static + muon_step,
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
            "offloaded_training_state": (8 * P + optimizer_state_bytes(s.optimizer, P, params.get("muon", 0)))
            // s.gpus if sharded and s.offload_optimizer else 0,
            # train_step loads all of this rank's micro-batches of the step, in the storage dtype
            "batches_in_storage_dtype": s.grad_accum * N * 4 * Ht * ELEMENT_BYTES.get(s.dtype, 2)}
    page_cache = n_verifier * ckpt_bytes
    return m, {"saved_by_term": saved, "candidates": candidates, "host": host, "page_cache": page_cache}


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


