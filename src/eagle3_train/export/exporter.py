"""`eagle3-train export`: write a trained draft in a format vLLM and SGLang load, and validate it by reloading.

Python API: `export(checkpoint, out_dir, fmt=..., dtype=..., speculative_tokens=..., verifier=None,
include_embed=False, overwrite=False) -> dict` (defaults from `ExportSettings`, docs/CONFIG.md). An existing export
in `out_dir` made from another checkpoint or with other settings is replaced only with `overwrite`.
"""

from __future__ import annotations

import argparse
import json
import logging
import typing
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.verifier import Verifier, as_verifier, servable_verifier
from eagle3_train.checkpoints.formats import load_draft_source
from eagle3_train.checkpoints.layouts import (
    eagle_config_json,
    expected_shapes,
    export_key,
    speculators_config_json,
)
from eagle3_train.checkpoints.native import METADATA, WEIGHTS, load_draft, read_metadata, resolve_checkpoint
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.draft_methods import draft_method
from eagle3_train.model.engines import ENGINES, check_target, engine_support
from eagle3_train.model.networks import build_draft
from eagle3_train.settings import ExportFormat, ExportSettings
from eagle3_train.utils.io import Eagle3InputError, read_json, save_safetensors, sha256_file, write_json
from eagle3_train.utils.outputs import atomic_dir, claim_output_dir, holds_files
from eagle3_train.utils.provenance import now_iso
from eagle3_train.utils.settings import add_settings_arguments, settings_from_args

log = logging.getLogger(__name__)
FORMATS = typing.get_args(ExportFormat)
DEFAULT_SPECULATIVE_TOKENS = ExportSettings.speculative_tokens  # k of exports; training ranks checkpoints/best at it
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def validate_tensors(model: Eagle3Draft, tensors: dict[str, torch.Tensor]) -> None:
    """Every required tensor present with the right shape, nothing extra, d2t/t2d consistent."""
    expected = expected_shapes(model.config)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise Eagle3InputError(f"export would be incomplete: missing {missing}, unexpected {extra}")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise Eagle3InputError(f"tensor {k} has shape {tuple(tensors[k].shape)}, expected {shape}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise Eagle3InputError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    targets = torch.arange(d2t.shape[0]) + d2t
    if int(t2d.sum()) != d2t.shape[0] or not bool(t2d[targets].all()):
        raise Eagle3InputError("d2t and t2d disagree: t2d must be True exactly at i + d2t[i]")


def full_vocabulary_layout(model: Eagle3Draft, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A draft whose vocabulary is the whole verifier vocabulary: vLLM (0.32 checked) then keeps no draft-to-target
    map and fails to load a d2t. Write the lm_head rows in token order (the same distribution) and no d2t/t2d."""
    if model.config.draft_vocab_size != model.config.vocab_size:
        return tensors
    lm_head = tensors["lm_head.weight"]
    in_token_order = torch.empty_like(lm_head)
    in_token_order[model.draft_token_ids().cpu()] = lm_head
    return {**{k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, "lm_head.weight": in_token_order}


def _token_logits(model: Eagle3Draft, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocab logits placed at their token ids (-inf elsewhere): comparable whatever the draft rows' order."""
    out = logits.new_full((*logits.shape[:-1], model.config.vocab_size), float("-inf"))
    out[..., model.draft_token_ids()] = logits
    return out


@torch.no_grad()
def check_roundtrip(model: Eagle3Draft, out_dir: Path, dtype: torch.dtype) -> float:
    """Reload the export with the format reader and compare logits with the training module (cast to `dtype`)."""
    loaded = load_draft_source(out_dir)
    if loaded.unknown:
        raise Eagle3InputError(f"export {out_dir} holds tensors the reader does not know: {loaded.unknown}")
    ref = build_draft(model.config)
    ref.load_state_dict({k: v.to(dtype).float() if v.is_floating_point() else v
                         for k, v in model.state_dict().items()})
    again = build_draft(loaded.config)
    embed = loaded.extra.get("embed_tokens.weight") if model.config.own_embedding else ref.embed_tokens.weight
    missing, unexpected = again.load_state_dict({**loaded.tensors, "embed_tokens.weight": embed}, strict=False)
    if missing or unexpected:
        raise Eagle3InputError(f"export {out_dir} does not reload: missing {missing}, unexpected {unexpected}")
    again.float()
    g = torch.Generator().manual_seed(0)
    L = 16
    aux = torch.randn(1, L, 3 * model.config.aux_hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g)
    k = model.config.block_size - 1 if model.config.block_size else 3

    def drafts(draft: Eagle3Draft) -> torch.Tensor:
        """k drafts' logits from every context length, as the engines draft them (the method's own proposal): the
        first of each is the logits at that position over the whole context."""
        draft.eval()
        return torch.cat([torch.stack(draft.method.propose(draft, draft.fuse(aux[:, :n]), ids[:, 1:n + 1],
                                                           torch.arange(n)[None], None, k,
                                                           draft.draft_token_ids())[0]) for n in range(1, L)])

    with torch.no_grad():
        a, b = _token_logits(ref, drafts(ref)), _token_logits(again, drafts(again))
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        raise Eagle3InputError(f"export {out_dir}: the reloaded draft proposes other tokens than the trained module")
    a, b = a[finite], b[finite]
    err = (a - b).abs().max().item()
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
        raise Eagle3InputError(f"export {out_dir}: reloaded draft's logits differ from the trained module by {err}")
    return err


_SAME_EXPORT_KEYS = ("format", "dtype", "speculative_tokens", "includes_embed_tokens", "source_checkpoint",
                     "source_weights_sha256")


def _check_replace(out: Path, record: dict[str, Any]) -> None:
    """Refuse to replace an existing export made from another checkpoint or with other settings (--overwrite)."""
    if not holds_files(out):
        return
    old = out / METADATA
    prev = (read_json(old, "export metadata").get("export") or {}) if old.is_file() else {}
    differs = [k for k in _SAME_EXPORT_KEYS if prev.get(k) != record.get(k)]
    if differs:
        raise Eagle3InputError(f"{out} already holds " + (f"an export with other {', '.join(differs)}" if prev else
                                                           "something that is not an export of this checkpoint")
                               + "; pass --overwrite to replace it, or choose another --out")


_D = ExportSettings  # keyword defaults below are the settings dataclass's


def export(checkpoint: str | Path, out_dir: str | Path, fmt: str = _D.format, dtype: str = _D.dtype,
           speculative_tokens: int = _D.speculative_tokens, verifier: str | Verifier | None = _D.verifier,
           include_embed: bool = _D.include_embed, overwrite: bool = _D.overwrite,
           engine: str | None = _D.engine) -> dict[str, Any]:
    """`engine`: one that must serve the draft as trained (vllm, sglang), else nothing is written. `verifier`: as
    the user named it (default: the one the checkpoint records); the speculators config records that name."""
    if fmt not in FORMATS:
        raise Eagle3InputError(f"--format must be one of {FORMATS}, got '{fmt}'")
    if engine is not None and engine not in ENGINES:
        raise Eagle3InputError(f"--for must be one of {ENGINES}, got '{engine}'")
    if dtype not in DTYPES:
        raise Eagle3InputError(f"--weight-dtype must be one of {list(DTYPES)}, got '{dtype}'")
    ckpt_dir = resolve_checkpoint(checkpoint)
    # even with --overwrite: never a foreign directory
    out = claim_output_dir(out_dir, "export", "export directory", is_export_dir, replaces=True, create=False)
    source = {"format": fmt, "dtype": dtype, "speculative_tokens": speculative_tokens,
              "includes_embed_tokens": include_embed, "source_checkpoint": str(ckpt_dir),
              "source_weights_sha256": sha256_file(ckpt_dir / WEIGHTS) if (ckpt_dir / WEIGHTS).is_file() else None}
    if not overwrite:
        _check_replace(out, source)
    model = load_draft(ckpt_dir)
    cfg = model.config
    if cfg.block_size:  # a block method drafts its block, whatever was asked (vLLM is told exactly that)
        speculative_tokens = cfg.block_size - 1
    metadata = read_metadata(ckpt_dir) or {}
    # What the user named (hub id, embedded name, path), never the machine-local directory it resolved to.
    recorded = metadata.get("verifier") or {}
    verifier_name = (verifier.name if isinstance(verifier, Verifier) else verifier) or \
        cfg.verifier.get("name_or_path") or recorded.get("name") or recorded.get("path")
    tensors = {k: v for k, v in model.trainable_state_dict().items()}
    validate_tensors(model, tensors)
    tensors = full_vocabulary_layout(model, tensors)
    torch_dtype = DTYPES[dtype]
    layout = draft_method(cfg.method).layout
    out_tensors = {export_key(k, fmt, layout): (v.to(torch_dtype) if v.is_floating_point() else v).contiguous()
                   for k, v in tensors.items()}
    if cfg.own_embedding:  # a draft of another width ships its own (trainable_state_dict holds it)
        source["includes_embed_tokens"] = True
    elif include_embed:
        if not verifier_name:
            raise Eagle3InputError("--include-embed needs the verifier (none recorded; pass --verifier)")
        from eagle3_train.model.verifier_head import load_verifier_head

        embed, _, _ = load_verifier_head(as_verifier(verifier or verifier_name).path)
        out_tensors["embed_tokens.weight"] = embed.to(torch_dtype).contiguous()
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    engines = engine_support(cfg, fmt)
    if engine:
        check_target(engines, engine)
    for engine, verdict in engines.items():
        if not verdict["serves_as_trained"]:
            log.warning("%s would serve this draft wrong: %s", engine, "; ".join(verdict["reasons"]))
    if fmt == "eagle":
        config = eagle_config_json(cfg, dtype)
    else:
        if not verifier_name:
            raise Eagle3InputError("the speculators format records the verifier: pass --verifier")
        config = speculators_config_json(cfg, dtype, speculative_tokens, servable_verifier(verifier_name))
    with atomic_dir(out, "export", "export directory", is_export_dir) as tmp:
        save_safetensors(out_tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        err = check_roundtrip(model, tmp, torch_dtype)
        record = {**source, "time": now_iso(), "max_logit_error_after_reload": err,
                  "weights_sha256": sha256_file(tmp / "model.safetensors"), "engines": engines}
        write_json(tmp / METADATA, {**metadata, "export": record})
    log.info("exported %s draft to %s (reload check: max logit error %.2e)", fmt, out, err)
    # a verifier that needed its own code to train needs it to serve (Kimi's config and tokenizer)
    remote_code = bool((metadata.get("settings") or {}).get("trust_remote_code"))
    notes = [] if include_embed else [
        "pipeline parallelism: vLLM gives a draft the verifier's embedding only at --pipeline-parallel-size 1; "
        "to serve this draft beside a verifier split over pipeline stages, export it with --include-embed"]
    sglang = sglang_command(out, fmt, verifier_name, speculative_tokens, remote_code)
    trained_slots = (metadata.get("settings") or {}).get("ttt_steps", speculative_tokens)
    if not draft_method(cfg.method).chained and speculative_tokens > trained_slots:
        notes.append(f"this {cfg.method} draft trained {trained_slots} parallel slots: served "
                     f"with more than that ({speculative_tokens}), the extra slots draft untrained")
    if sglang and not engines["sglang"]["serves_as_trained"]:
        notes.append("SGLang would serve this draft otherwise than it was trained: "
                     + "; ".join(engines["sglang"]["reasons"]))
    return {"out": str(out), **record,
            "serve": serve_command(out, fmt, verifier_name, speculative_tokens, remote_code, cfg.method),
            "serve_sglang": sglang, "serve_notes": notes}


def is_export_dir(path: Path) -> bool:
    """An earlier export (ours to replace): its training metadata carries an `export` record."""
    try:
        return "export" in json.loads((path / METADATA).read_text())
    except (OSError, ValueError, TypeError):
        return False


def serve_command(out: Path, fmt: str, verifier: str | None, k: int, trust_remote_code: bool = False,
                  method: str = "eagle3") -> str:
    """vLLM's launch line; a P-EAGLE draft (`method`) with `parallel_drafting`, which vLLM adds by itself only on the
    `vllm serve DIR` path of the speculators format."""
    flag = " --trust-remote-code" if trust_remote_code else ""
    if fmt == "speculators":
        return f"vllm serve {out}{flag}"
    spec = json.dumps(draft_method(method).speculative_config(str(out), k))
    return f"vllm serve {servable_verifier(verifier) if verifier else 'VERIFIER'} --speculative-config '{spec}'{flag}"


def sglang_command(out: Path, fmt: str, verifier: str | None, k: int, trust_remote_code: bool = False) -> str | None:
    """SGLang's launch line for an EAGLE-format draft: a chain of k drafted tokens (top-k 1, k + 1 tokens verified),
    as vLLM drafts it; None for the speculators format, which SGLang does not read."""
    if fmt != "eagle":
        return None
    return (f"python -m sglang.launch_server --model-path {servable_verifier(verifier) if verifier else 'VERIFIER'} "
            f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {out} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
            + (" --trust-remote-code" if trust_remote_code else ""))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, ExportSettings)


def main(args: argparse.Namespace) -> int:
    s = settings_from_args(ExportSettings, args)
    r = export(s.checkpoint, s.out, s.format, s.dtype, s.speculative_tokens, s.verifier, s.include_embed,
               overwrite=s.overwrite, engine=s.engine)
    print(json.dumps(r, indent=2))
    return 0
