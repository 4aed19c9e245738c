"""The draft a run starts from (scratch: `build_model`, and the training metadata's `init` record of it); a finetune
loads its source into the same structure (train/finetune.py). Used by the trainer, the finetune and the dry run."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.networks import build_draft
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.inputs import RunInputs
from eagle3_train.utils.io import Eagle3InputError


def build_model(cfg: TrainConfig, inputs: RunInputs, overrides: dict[str, Any] | None = None,
                vocab: tuple[torch.Tensor, torch.Tensor] | None = None, device: str = "cpu") -> Eagle3Draft:
    """`overrides` (DraftConfig fields) and `vocab` (d2t, t2d) come from a finetuning source; default: the run's.
    `device="meta"` (dry run) builds the structure without memory."""
    d2t, t2d = vocab if vocab is not None else (inputs.d2t, inputs.t2d)
    draft_cfg = DraftConfig.from_verifier(
        inputs.verifier.config, draft_vocab_size=d2t.shape[0], aux_layer_ids=inputs.layer_ids,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
        norm_before_residual=cfg.norm_before_residual, norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output, architecture=cfg.architecture, hidden_size=cfg.hidden_size, method=cfg.method,
        mask_token_id=run_mask_token(cfg, inputs),
        # a block method drafts ttt_steps mask slots after the verified token
        block_size=draft_method(cfg.method).block_size_for(cfg.ttt_steps))
    if overrides:
        draft_cfg = dataclasses.replace(draft_cfg, **overrides)
    draft_cfg.verifier["name_or_path"] = inputs.verifier.name
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = build_draft(draft_cfg)
    with torch.no_grad():
        if not draft_cfg.own_embedding:  # a draft of another width keeps its own, randomly initialised
            model.embed_tokens.weight.copy_(inputs.embed)
        model.set_vocab(d2t, t2d)
        if cfg.lm_head_init not in ("verifier", "random"):
            raise Eagle3InputError(f"train.lm_head_init must be 'verifier' or 'random', got '{cfg.lm_head_init}'")
        if cfg.lm_head_init == "verifier" and not draft_cfg.own_embedding:  # the verifier's rows: same width only
            model.lm_head.weight.copy_(inputs.lm_head[model.draft_token_ids()])
    return model


def run_mask_token(cfg: TrainConfig, inputs: RunInputs) -> int | None:
    """The run's mask token: train.mask_token_id, else the verifier tokenizer's choice, for a method that drafts from
    one (model/draft_methods.py); None otherwise."""
    if not draft_method(cfg.method).needs_mask_token:
        return cfg.mask_token_id  # DraftConfig refuses a mask token the method does not read
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    from eagle3_train.assets.tokenizer import choose_mask_token, load_tokenizer

    vocab_size = inputs.embed.shape[0]
    return choose_mask_token(load_tokenizer(inputs.verifier.path, cfg.trust_remote_code), vocab_size)


def init_record(cfg: TrainConfig) -> dict[str, Any]:
    """Where a run from scratch starts (the training metadata's `init`); a finetune replaces it with its source."""
    narrower = cfg.hidden_size is not None  # another width: own embedding, lm_head at random (build_model)
    return {"method": "random", "seed": cfg.seed, "lm_head_init": "random" if narrower else cfg.lm_head_init,
            **({"hidden_size": cfg.hidden_size, "embedding": "own, random"} if narrower else {})}

