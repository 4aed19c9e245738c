"""Loading a draft to evaluate beside a loaded HF verifier: our checkpoints and run dirs or an export (EAGLE or
speculators format), refused when its shapes do not fit the verifier, with the verifier's frozen embedding copied in.

Python API: `load_draft_for_eval(path, verifier_model, verifier_dir) -> (Eagle3Draft, info)`,
`check_fits(draft, verifier_model, where)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.networks import build_draft
from eagle3_train.utils.io import Eagle3InputError


def load_draft_for_eval(path: str | Path, verifier_model, verifier_dir: Path | None = None
                        ) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Load a draft for the given (loaded) verifier: one of our checkpoints or run dirs, or an export in the EAGLE
    or speculators format. The frozen embedding is copied from the verifier. Returns (draft, info)."""
    from eagle3_train.checkpoints.formats import fill_default_aux_ids, load_draft_source
    from eagle3_train.checkpoints.native import load_draft, read_metadata, resolve_checkpoint

    path = Path(path).expanduser()
    if not path.exists():
        raise Eagle3InputError(f"draft not found: {path}")
    n_layers = verifier_model.config.get_text_config().num_hidden_layers
    try:
        ckpt = resolve_checkpoint(path)
    except Eagle3InputError:
        ckpt = None
    if ckpt is not None:
        draft = load_draft(ckpt)
        info = {"path": str(ckpt), "format": "eagle3-train", "metadata": read_metadata(ckpt), "notes": []}
    else:
        loaded = load_draft_source(path)
        config = fill_default_aux_ids(loaded.config, n_layers)
        draft = build_draft(config)
        missing, unexpected = draft.load_state_dict(loaded.tensors, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise Eagle3InputError(f"draft {path}: missing tensors {missing}, unexpected tensors {unexpected}")
        if "d2t" not in loaded.tensors:
            raise Eagle3InputError(f"draft {path} has no d2t tensor (the draft-to-verifier vocabulary map)")
        info = {"path": str(loaded.path), "format": loaded.format, "metadata": loaded.metadata,
                "notes": list(loaded.notes)}
    check_fits(draft, verifier_model, info["path"])
    verifier_embed = verifier_model.get_input_embeddings().weight
    if ckpt is None:  # an export: its own embedding, when it has one, is read apart from its weights
        draft.use_embedding(verifier_embed, loaded.extra.get("embed_tokens.weight"), info["path"])
    elif not draft.config.own_embedding:  # a checkpoint's own embedding came with its weights (load_draft)
        draft.use_embedding(verifier_embed)
    info["aux_layer_ids"] = list(draft.config.aux_layer_ids)
    info["draft_vocab_size"] = draft.config.draft_vocab_size
    return draft, info


def check_fits(draft: Eagle3Draft, verifier_model, where: str = "draft") -> None:
    """`checkpoints.fit.check_draft_fits_verifier` for a built draft and a loaded verifier."""
    from eagle3_train.checkpoints.fit import check_draft_fits_verifier

    check_draft_fits_verifier(draft.config, verifier_model.config.to_dict(), where,
                              verifier_name=str(getattr(verifier_model.config, "_name_or_path", "") or "the verifier"),
                              tensors=draft.state_dict())
