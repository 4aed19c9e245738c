"""`eagle3-train export`: write a trained draft in a format vLLM and SGLang load, and validate it by reloading.

Python API: `export(checkpoint, out_dir, fmt="eagle", dtype="bfloat16", speculative_tokens=3) -> dict`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3_train.export.layouts import (
    eagle_config_json,
    expected_shapes,
    export_key,
    speculators_config_json,
)
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.formats import load_draft_source
from eagle3_train.train.checkpoint import METADATA, load_draft
from eagle3_train.utils.io import Eagle3InputError, atomic_dir, read_json, sha256_file, write_json
from eagle3_train.utils.provenance import now_iso

log = logging.getLogger(__name__)
FORMATS = ("eagle", "speculators")
DEFAULT_SPECULATIVE_TOKENS = 3  # k written into exports (and served); training ranks checkpoints/best at this k
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a run directory (uses final/ or the latest checkpoint) or a checkpoint directory."""
    p = Path(path)
    if (p / "draft_config.json").is_file():
        return p
    if (p / "final" / "draft_config.json").is_file():
        return p / "final"
    pointer = p / "checkpoints" / "latest.json"
    if pointer.is_file():
        return p / "checkpoints" / read_json(pointer)["dir"]
    raise Eagle3InputError(f"{p} is neither an eagle3-train checkpoint nor a training run directory")


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


@torch.no_grad()
def check_roundtrip(model: Eagle3Draft, out_dir: Path, dtype: torch.dtype) -> float:
    """Reload the export with the format reader and compare logits with the training module (cast to `dtype`)."""
    loaded = load_draft_source(out_dir)
    if loaded.unknown:
        raise Eagle3InputError(f"export {out_dir} holds tensors the reader does not know: {loaded.unknown}")
    ref = Eagle3Draft(model.config)
    ref.load_state_dict({k: v.to(dtype).float() if v.is_floating_point() else v
                         for k, v in model.state_dict().items()})
    again = Eagle3Draft(loaded.config)
    missing, unexpected = again.load_state_dict({**loaded.tensors, "embed_tokens.weight": ref.embed_tokens.weight},
                                                strict=False)
    if missing or unexpected:
        raise Eagle3InputError(f"export {out_dir} does not reload: missing {missing}, unexpected {unexpected}")
    again.float()
    g = torch.Generator().manual_seed(0)
    L = 16
    aux = torch.randn(1, L, 3 * model.config.aux_hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (1, L), generator=g)
    pos = torch.arange(L)[None]
    a, _, _ = ref.eval().forward_cached(ref.fuse(aux), ids, pos, None)
    b, _, _ = again.eval().forward_cached(again.fuse(aux), ids, pos, None)
    err = (a - b).abs().max().item()
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
        raise Eagle3InputError(f"export {out_dir}: reloaded draft's logits differ from the trained module by {err}")
    return err


def export(checkpoint: str | Path, out_dir: str | Path, fmt: str = "eagle", dtype: str = "bfloat16",
           speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS, verifier: str | None = None,
           include_embed: bool = False) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise Eagle3InputError(f"--format must be one of {FORMATS}, got '{fmt}'")
    if dtype not in DTYPES:
        raise Eagle3InputError(f"--dtype must be one of {list(DTYPES)}, got '{dtype}'")
    ckpt_dir = resolve_checkpoint(checkpoint)
    model = load_draft(ckpt_dir)
    cfg = model.config
    metadata = read_json(ckpt_dir / METADATA, "training metadata") if (ckpt_dir / METADATA).is_file() else {}
    verifier_path = verifier or (metadata.get("verifier") or {}).get("path") or cfg.verifier.get("name_or_path")
    tensors = {k: v for k, v in model.trainable_state_dict().items()}
    validate_tensors(model, tensors)
    torch_dtype = DTYPES[dtype]
    out_tensors = {export_key(k, fmt): (v.to(torch_dtype) if v.is_floating_point() else v).contiguous()
                   for k, v in tensors.items()}
    if include_embed:
        if not verifier_path:
            raise Eagle3InputError("--include-embed needs the verifier (none recorded; pass --verifier)")
        from eagle3_train.assets.verifier import resolve_verifier
        from eagle3_train.model.verifier_head import load_verifier_head

        embed, _, _ = load_verifier_head(resolve_verifier(verifier_path))
        out_tensors["embed_tokens.weight"] = embed.to(torch_dtype).contiguous()
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    if fmt == "eagle":
        config = eagle_config_json(cfg, dtype)
        if cfg.num_layers > 1:
            log.warning("SGLang serves only one-layer EAGLE-3 drafts; this %d-layer draft loads in vLLM only",
                        cfg.num_layers)
        if cfg.norm_before_residual or cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output:
            log.warning("SGLang ignores norm_before_residual/norm_before_fc/fc_norm/norm_output; only vLLM serves "
                        "this draft as trained")
    else:
        if not verifier_path:
            raise Eagle3InputError("the speculators format records the verifier: pass --verifier")
        config = speculators_config_json(cfg, dtype, speculative_tokens, str(verifier_path))
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_file(out_tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        err = check_roundtrip(model, tmp, torch_dtype)
        record = {"format": fmt, "dtype": dtype, "source_checkpoint": str(ckpt_dir), "time": now_iso(),
                  "speculative_tokens": speculative_tokens, "max_logit_error_after_reload": err,
                  "weights_sha256": sha256_file(tmp / "model.safetensors"), "includes_embed_tokens": include_embed}
        write_json(tmp / METADATA, {**metadata, "export": record})
    log.info("exported %s draft to %s (reload check: max logit error %.2e)", fmt, out, err)
    return {"out": str(out), **record, "serve": serve_command(out, fmt, verifier_path, speculative_tokens)}


def serve_command(out: Path, fmt: str, verifier: str | None, k: int) -> str:
    if fmt == "speculators":
        return f"vllm serve {out}"
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": k})
    return f"vllm serve {verifier or 'VERIFIER'} --speculative-config '{spec}'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="training run dir (uses final/) or a checkpoint dir")
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="eagle", choices=FORMATS)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("-k", "--speculative-tokens", type=int, default=3)
    p.add_argument("--verifier", help="verifier name/path recorded in a speculators export (default: from metadata)")
    p.add_argument("--include-embed", action="store_true", help="also store the verifier's embedding")


def main(args: argparse.Namespace) -> int:
    r = export(args.checkpoint, args.out, args.format, args.dtype, args.speculative_tokens, args.verifier,
               args.include_embed)
    print(json.dumps(r, indent=2))
    return 0
