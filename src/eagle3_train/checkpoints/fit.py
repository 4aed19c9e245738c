"""The draft-vs-verifier contract: a draft works only with a verifier of its hidden size and vocabulary.

Python API: `verifier_dims(config) -> (hidden_size, vocab_size, num_layers)`,
`check_draft_fits_verifier(draft_config, verifier_config, where, ...)` (evaluate, finetune).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from eagle3_train.assets.families import text_config
from eagle3_train.model.config import DraftConfig
from eagle3_train.utils.io import Eagle3InputError

_OTHER = "A draft only works with the verifier whose hidden states and vocabulary it was trained on."


def verifier_dims(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(hidden_size, vocab_size, num_hidden_layers) of a verifier's config.json (its text config if nested)."""
    c = text_config(config)
    return int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])


def check_draft_fits_verifier(draft: DraftConfig, verifier_config: Mapping[str, Any], where: str,
                              verifier_name: str = "the verifier",
                              tensors: Mapping[str, torch.Tensor] | None = None,
                              tensor_name: Callable[[str], str] = str, draft_hidden: int | None = None,
                              check_layers: bool = True) -> None:
    """Raise one Eagle3InputError naming the tensor or config field that shows `draft` was made for another verifier.

    `tensors` (our names, may be meta tensors) are checked before the config: the weights are what the engines load.
    `tensor_name` spells a key as the source file does. `draft_hidden`: the hidden size the draft must have (finetune
    builds it at the verifier's). `check_layers`: the aux layer ids must exist in the verifier (finetune trains on the
    run's layers instead and checks the source's against them itself).
    """
    H, V, L = verifier_dims(verifier_config)
    tensors = tensors or {}
    name = verifier_name
    fc = tensors.get("fc.weight")
    if fc is not None:
        need = (draft_hidden or fc.shape[0], 3 * H)
        if tuple(fc.shape) != need:
            raise Eagle3InputError(
                f"{where}: tensor '{tensor_name('fc.weight')}' has shape {list(fc.shape)}, but the draft for "
                f"verifier {name} needs {list(need)}: the source was made for a verifier with hidden size "
                f"{fc.shape[1] // 3} (draft hidden size {fc.shape[0]}), and {name} has hidden size {H}. {_OTHER}")
    elif draft.aux_hidden_size != H or (draft_hidden and draft.hidden_size != draft_hidden):
        raise Eagle3InputError(f"{where}: its config has hidden_size {draft.hidden_size}, but verifier {name} "
                               f"has hidden size {H}: the source was made for another verifier. {_OTHER}")
    t2d = tensors.get("t2d")
    if t2d is not None and tuple(t2d.shape) != (V,):
        raise Eagle3InputError(
            f"{where}: tensor '{tensor_name('t2d')}' has shape {list(t2d.shape)} (vocab_size {t2d.shape[0]} of the "
            f"verifier it was made for), but verifier {name} has vocab_size {V} ({V} tokens): the source was made "
            f"for a verifier with another tokenizer. {_OTHER}")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (V, H) and not (draft.own_embedding
                                                                  and tuple(embed.shape) == (V, draft.hidden_size)):
        raise Eagle3InputError(
            f"{where}: tensor '{tensor_name('embed_tokens.weight')}' has shape {list(embed.shape)}, but "
            f"verifier {name}'s embedding is {[V, H]}: the source was made for another verifier. {_OTHER}")
    if draft.vocab_size != V:
        raise Eagle3InputError(f"{where}: its config has vocab_size {draft.vocab_size}, but verifier {name} has "
                               f"vocab_size {V}: the source was made for a verifier with another tokenizer. {_OTHER}")
    bad = [i for i in draft.aux_layer_ids if not 0 <= i < L]
    if check_layers and bad:
        raise Eagle3InputError(f"{where}: aux layer ids {list(draft.aux_layer_ids)} must lie in 0..{L - 1} for "
                               f"this {L}-layer verifier {name}")
