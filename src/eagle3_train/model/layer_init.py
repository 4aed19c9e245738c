"""Start the draft's decoder layer(s) from the verifier's own layers (`train.layer_init: verifier`).

A draft trained from random weights on a few hundred thousand tokens memorises them; the verifier's layers already
read its hidden-state space (attention patterns, MLP features). The draft's first layer differs from a verifier layer
in one place only: its q/k/v read cat(norm(embedding), norm(hidden)) of width 2H. The hidden half gets the verifier's
q/k/v (the hidden state is the draft's residual stream); the embedding half starts at random or, with
`layer_init_embed: verifier`, as the same weights, so that the layer sees norm(embedding) + norm(hidden) as one input.
Every other tensor (o_proj, the norms, the MLP) is copied as is. Only the tensors of the copied layers are read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.verifier_head import load_tensor, tensor_locations
from eagle3_train.utils.io import Eagle3InputError

# Where a decoder layer's tensors live in HF checkpoints (plain, multimodal wrappers).
_LAYER_PREFIXES = ("model.layers.{i}.", "model.language_model.layers.{i}.", "language_model.model.layers.{i}.")
_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_QKV = ("q_proj", "k_proj", "v_proj")


def source_layers(first: int, count: int, num_verifier_layers: int) -> list[int]:
    """The verifier layers copied into draft layers 0..count-1: `first` (negative counts from the end) onwards."""
    start = first + num_verifier_layers if first < 0 else first
    if start < 0 or start + count > num_verifier_layers:
        raise Eagle3InputError(f"train.layer_init_index {first}: the draft's {count} layer(s) need verifier layers "
                               f"{start}..{start + count - 1}, the verifier has 0..{num_verifier_layers - 1}")
    return list(range(start, start + count))


def load_verifier_layer(verifier_dir: str | Path, index: int) -> dict[str, torch.Tensor]:
    """The tensors of verifier decoder layer `index`, named as in a Llama layer (`self_attn.q_proj.weight`, ...)."""
    loc = tensor_locations(Path(verifier_dir))
    for prefix in (p.format(i=index) for p in _LAYER_PREFIXES):
        if prefix + _LAYER_TENSORS[0] in loc:
            break
    else:
        raise Eagle3InputError(f"verifier {verifier_dir}: no decoder layer {index} (looked for "
                               f"{', '.join(p.format(i=index) + _LAYER_TENSORS[0] for p in _LAYER_PREFIXES)})")
    missing = [prefix + name for name in _LAYER_TENSORS if prefix + name not in loc]
    if missing:
        raise Eagle3InputError(f"verifier {verifier_dir}: layer {index} is not a Llama-style layer, it lacks "
                               f"{', '.join(missing)}")
    return {name: load_tensor(loc, (prefix + name,)) for name in _LAYER_TENSORS}


@torch.no_grad()
def copy_verifier_layer(model: Eagle3Draft, layer: int, tensors: dict[str, torch.Tensor],
                        embed_from_verifier: bool) -> None:
    """Draft layer `layer` <- a verifier layer's tensors; the embedding half of the first layer's q/k/v keeps its
    random init unless `embed_from_verifier`."""
    target = model.layers[layer]
    params = dict(target.named_parameters())
    for name, src in tensors.items():
        dst = params[name]
        proj = name.split(".")[1] if name.startswith("self_attn.") else ""
        if target.first and proj in _QKV:
            H = dst.shape[1] // 2
            want = (dst.shape[0], H)
            if tuple(src.shape) != want:
                raise Eagle3InputError(f"verifier layer tensor {name}: shape {tuple(src.shape)}, the draft needs "
                                       f"{want}")
            dst[:, H:].copy_(src)  # the hidden half: the draft's residual stream
            if embed_from_verifier:
                dst[:, :H].copy_(src)
            continue
        if tuple(src.shape) != tuple(dst.shape):
            raise Eagle3InputError(f"verifier layer tensor {name}: shape {tuple(src.shape)}, the draft has "
                                   f"{tuple(dst.shape)} (train.intermediate_size must be the verifier's to copy the "
                                   f"MLP)")
        dst.copy_(src)
    if target.first:  # the hidden state's norm is the verifier layer's input norm; the embedding's too
        target.hidden_norm.weight.copy_(tensors["input_layernorm.weight"])
