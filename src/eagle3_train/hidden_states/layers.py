"""Tapping the verifier's aux layers (which ones: `model/aux_layers.py`, "input of layer i" convention;
`extract_layer_ids`: those extract taps).

`AuxCapture` taps those layer inputs with forward pre-hooks: extract stores them and the offline evaluator feeds them
to the draft, so what the draft is trained on and what it is evaluated with come from this one hook.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)


def decoder_parts(model) -> tuple[Any, Any]:
    """The base model (embeddings + decoder layers + final norm, no lm_head) and its list of decoder layers."""
    base = getattr(model, "model", None)
    if base is None and hasattr(model, "get_decoder"):
        base = model.get_decoder()
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        raise Eagle3InputError(f"unsupported verifier architecture {type(model).__name__}: expected a causal LM "
                               f"with .model.layers (Llama-style decoder)")
    return base, layers


class AuxCapture:
    """Forward pre-hooks that keep the inputs of the tapped decoder layers (id i = HF `hidden_states[i]`).

    `mask` ([B, T] bool, set before a forward) keeps only those rows (the unpadded tokens), else the whole [B, T, H]
    input is kept; `dtype` casts what is kept; `enabled = False` skips capturing (forwards whose taps are not needed).
    """

    def __init__(self, layers, layer_ids: Sequence[int], dtype=None) -> None:
        self.layer_ids = tuple(layer_ids)
        self.dtype = dtype
        self.mask = None
        self.enabled = True
        self.captured: dict[int, Any] = {}
        self.handles = [layers[i].register_forward_pre_hook(partial(self._hook, i), with_kwargs=True)
                        for i in sorted(set(self.layer_ids))]

    def _hook(self, layer_id: int, module, args, kwargs) -> None:
        if not self.enabled:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.mask is not None:
            hidden = hidden[self.mask]
        self.captured[layer_id] = hidden if self.dtype is None else hidden.to(self.dtype)

    def take(self):
        """The tapped inputs concatenated in `layer_ids` order on the last dim ([n, 3H] masked, else [B, T, 3H])."""
        import torch

        out = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def extract_layer_ids(layer_ids: Any, finetune_from: str | None, num_layers: int, verifier: str, first: int,
                      convention: str = "auto") -> tuple[int, ...]:
    """The layers extract taps: given, else the finetune source's (so the finetune is not refused after hours of
    extraction); checked against the verifier's `num_layers` (`first`: its family's lowest usable layer)."""
    from eagle3_train.model.aux_layers import parse_layer_ids, validate_layer_ids

    given = parse_layer_ids(layer_ids)
    if finetune_from:
        from eagle3_train.checkpoints.formats import draft_layer_ids

        source, origin = draft_layer_ids(finetune_from, num_layers, convention)
        if given is not None and tuple(given) != source:
            raise Eagle3InputError(f"--layer-ids {list(given)} differ from the layers the finetune source "
                                   f"{finetune_from} was trained on, {list(source)} (vLLM's input-of-layer ids, read "
                                   f"from {origin}): drop --layer-ids to extract the source's")
        log.info("extract: the layers of finetune source %s: %s (%s)", finetune_from, list(source), origin)
        given = source
    return validate_layer_ids(given, num_layers, f"verifier {verifier}", first)
