"""Resolve and cross-check a training run's inputs: prepared data, hidden states, vocabulary and verifier."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.families import family_of, text_config
from eagle3_train.assets.verifier import Verifier, as_verifier
from eagle3_train.hidden_states.modes import states_mode
from eagle3_train.hidden_states.store import check_hidden_states
from eagle3_train.model.aux_layers import check_layer_order
from eagle3_train.model.verifier_head import (
    LogitTransform,
    load_verifier_head,
    logit_transform,
    verifier_head_shapes,
)
from eagle3_train.utils.finite import check_finite
from eagle3_train.utils.io import Eagle3InputError, read_json, sha256_file

log = logging.getLogger(__name__)


@dataclass
class RunInputs:
    prepared_dir: Path
    prepared_manifest: dict[str, Any]
    prepared_manifest_sha256: str
    hidden_dir: Path
    hidden_manifest: dict[str, Any]
    hidden_manifest_sha256: str
    vocab_path: Path | None  # None: a finetune that keeps its source's vocabulary and was given none of its own
    vocab_sha256: str
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None
    verifier: Verifier  # resolved once: its name as the user gave it, its local directory, its config
    verifier_identity: dict[str, Any]  # what the run records (the hidden states' record, or the verifier's identity)
    embed: torch.Tensor
    lm_head: torch.Tensor
    layer_ids: tuple[int, ...]
    logit_transform: LogitTransform = field(default_factory=LogitTransform)  # the verifier's softcap/scale/bias
    _on_device: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def lm_head_on(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.lm_head.to(device)
        return self._on_device[key]


def vocab_file(path: str | Path) -> Path:
    p = Path(path)
    return p / "vocab.safetensors" if p.is_dir() else p


def _keeps_source_vocab(cfg) -> bool:
    return bool(getattr(cfg, "finetune_from", None)) and getattr(cfg, "finetune_vocab", "keep") == "keep"


def _run_vocab(cfg, vocab_size: int) -> tuple[Path | None, str, torch.Tensor | None, torch.Tensor | None]:
    """(path, sha256, d2t, t2d) of the run's vocabulary; none when a finetune keeps its source's and got no --vocab."""
    from eagle3_train.vocab.build import check_vocab_fits, load_vocab

    if not cfg.vocab and _keeps_source_vocab(cfg):
        return None, "", None, None
    vpath = vocab_file(cfg.vocab)
    d2t, t2d = load_vocab(vpath)
    check_vocab_fits(t2d, vocab_size, vpath)
    return vpath, sha256_file(vpath), d2t, t2d


def resolve_inputs(cfg, head_shapes_only: bool = False, verifier: Verifier | None = None) -> RunInputs:
    """`head_shapes_only` (dry run): the verifier's embedding and lm_head as meta tensors, no weight data read.
    `verifier`: already resolved by the caller (else from `cfg.verifier` or the inputs' records)."""
    mode = states_mode(getattr(cfg, "hidden_states_mode", "offline"))
    needed = ("prepared", "hidden_states") if mode.reads_stored else ("prepared",)
    if not _keeps_source_vocab(cfg):  # finetune_vocab keep uses the source's: --vocab is then optional
        needed = (*needed, "vocab")
    for name in needed:
        if not getattr(cfg, name):
            raise Eagle3InputError(f"train.{name} is required (the output directory of that stage)")
    prepared = Path(cfg.prepared)
    pm_path = prepared / "manifest.json"
    prepared_manifest = read_json(pm_path, "prepared data manifest")
    prepared_sha = sha256_file(pm_path)

    if mode.served:
        return _served_inputs(cfg, prepared, prepared_manifest, prepared_sha, head_shapes_only, verifier)
    hidden = mode.states_dir(cfg.hidden_states, cfg.out)
    hm_path = hidden / "manifest.json"
    hidden_manifest = read_json(hm_path, "hidden-states manifest")

    recorded_verifier = hidden_manifest.get("verifier", {})
    # The name stays what the user gave (a hub id, not this machine's cache): the draft and its exports record it.
    need = "tokenizer" if head_shapes_only else "weights"  # a dry run reads headers: no hub weights downloaded
    verifier = verifier or (as_verifier(cfg.verifier, need) if cfg.verifier
                            else Verifier.from_record(recorded_verifier, str(hm_path), need))
    # Made from this prepared data by this verifier (sizes only: hashing a large verifier's weights is slow).
    check_hidden_states(hidden_manifest, prepared, verifier if recorded_verifier else None, hash_weights=False,
                        require_complete=False, where=f"the hidden states in {hidden}")
    embed, lm_head, vcfg = _verifier_head(verifier.path, head_shapes_only)
    vpath, vsha, d2t, t2d = _run_vocab(cfg, text_config(vcfg)["vocab_size"])
    fixed = ",".join(map(str, sorted(set(hidden_manifest["layer_ids"]))))
    layer_ids = check_layer_order(hidden_manifest["layer_ids"], f"hidden states {hm_path}",
                                  f"Extract again: `eagle3-train extract --layer-ids {fixed} --overwrite ...`")
    return RunInputs(prepared, prepared_manifest, prepared_sha, hidden, hidden_manifest, sha256_file(hm_path),
                     vpath, vsha, d2t, t2d, verifier, {**recorded_verifier, "name": verifier.name}, embed, lm_head,
                     layer_ids, logit_transform(verifier.path, read_bias=not head_shapes_only))


def _verifier_head(verifier_dir: Path, head_shapes_only: bool):
    """(embedding, lm_head, config): the tensors, or (dry run) meta tensors of their shapes, no weight data read."""
    if head_shapes_only:
        return verifier_head_shapes(verifier_dir)[:3]
    embed, lm_head, vcfg = load_verifier_head(verifier_dir)
    check_finite((("embed_tokens", embed), ("lm_head", lm_head)), f"verifier {verifier_dir}",
                 "the training targets would be NaN: use an intact copy of the verifier's weights")
    return embed, lm_head, vcfg


def _served_inputs(cfg, prepared: Path, prepared_manifest: dict, prepared_sha: str,
                   head_shapes_only: bool = False, verifier: Verifier | None = None) -> RunInputs:
    """Online/hybrid: the states come from servers, so the verifier and layers come from the settings and the
    prepared data (the servers' identity is checked and recorded when the source opens)."""
    from eagle3_train.model.aux_layers import parse_layer_ids, validate_layer_ids

    if not cfg.endpoint:
        raise Eagle3InputError(f"train.hidden_states_mode {cfg.hidden_states_mode} needs --endpoint URL (a server "
                               f"started with `eagle3-train serve --extract-hidden-states`)")
    need = "tokenizer" if head_shapes_only else "weights"
    verifier = verifier or (as_verifier(cfg.verifier, need) if cfg.verifier else Verifier.from_record(
        prepared_manifest.get("verifier"), f"the prepared data {prepared}", need))
    embed, lm_head, vcfg = _verifier_head(verifier.path, head_shapes_only)
    text = text_config(vcfg)
    layer_ids = validate_layer_ids(parse_layer_ids(cfg.layer_ids), int(text["num_hidden_layers"]),
                                   f"verifier {verifier.name}", family_of(vcfg).first_aux_layer)
    vpath, vsha, d2t, t2d = _run_vocab(cfg, text["vocab_size"])
    hidden = states_mode(cfg.hidden_states_mode).states_dir(cfg.hidden_states, cfg.out)  # hybrid's store, or none
    manifest = {"layer_ids": list(layer_ids), "dtype": cfg.hidden_states_dtype, "mode": cfg.hidden_states_mode}
    # No manifest hash: online states are not stored, hybrid ones are still being written (resume checks the
    # prepared data, vocab and settings).
    return RunInputs(prepared, prepared_manifest, prepared_sha, hidden, manifest, "", vpath, vsha,
                     d2t, t2d, verifier, verifier.identity(), embed, lm_head, tuple(layer_ids))
