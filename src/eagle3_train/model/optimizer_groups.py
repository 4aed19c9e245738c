"""Which of the draft's parameters each optimizer updates, and the bytes of their state: one rule for the trainer
(train/optimizer.py) and for `plan` and the dry run, which count memory without importing the training stage."""

from __future__ import annotations

import torch

# 2-D, but a classifier and a lookup table: AdamW, as Muon's authors and speculators do (and a one-row vector,
# P-EAGLE's mask_hidden, like the norms)
ADAMW_ONLY = ("lm_head.", "embed_tokens.")


def muon_parameter_names(model: torch.nn.Module) -> list[str]:
    """Trainable 2-D weights that Muon updates."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and min(p.shape) > 1 and not n.startswith(ADAMW_ONLY)]


def muon_parameter_sizes(model: torch.nn.Module) -> tuple[int, int]:
    """(elements Muon updates, elements of its largest matrix): works on the meta device (the planner's draft)."""
    sizes = dict(model.named_parameters())
    numels = [sizes[n].numel() for n in muon_parameter_names(model)]
    return sum(numels), max(numels, default=0)


def optimizer_state_bytes(optimizer: str, trainable: int, muon: int) -> int:
    """fp32 optimizer state of `trainable` elements, `muon` of them Muon's under optimizer muon: AdamW keeps two
    moments per element (8 B), Muon one momentum buffer (4 B)."""
    return 8 * trainable - (4 * muon if optimizer == "muon" else 0)


def muon_step_bytes(largest: int) -> int:
    """Muon's transient at the optimizer step, one matrix at a time (torch.optim._muon): the fp32 Nesterov update
    (under FSDP gathered whole), Newton-Schulz's bf16 iterate, its two Gram products (at most the matrix's size each,
    as a tall matrix is transposed) and the next iterate: 12 bytes per element of the largest matrix."""
    return (4 + 4 * 2) * largest
