"""fp8 (e4m3, per-row scale) vs bf16 hidden-state storage: size, reconstruction error, and the draft trained on each
(same data, same steps, same seed): training estimate and, with --vllm, acceptance in a real vLLM server.

Data: ShareGPT conversations tokenized for SmolLM2-135M-Instruct (max 512 tokens), vocab 8192, hidden states in
bf16 from `extract`. The fp8 copy is made from those bf16 shards with `fp8.encode_rows`, exactly what
`extract --store-dtype float8_e4m3` does (it collects bf16 states and encodes each shard as it writes it), so the
verifier runs once.

  cd benchmarks && nice ../.venv/bin/python fp8_storage.py [--limit 100] [--epochs 2] [--vllm --num-prompts 40]
Results: benchmarks/out/fp8_storage.json (written after each step) and a printed summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_train.hidden_states import fp8
from eagle3_train.utils.io import read_json, sha256_file, write_json

OUT = Path(__file__).resolve().parent / "out" / "fp8-bench"
RESULTS = OUT.parent / "fp8_storage.json"
TRAIN = dict(ttt_steps=3, token_budget=2048, lr=2e-3, warmup_ratio=0.05, grad_clip=0.5, seed=0, log_every=20,
             tensorboard=False)


def build_data(limit: int) -> None:
    from eagle3_train.data.prepare import prepare
    from eagle3_train.hidden_states.extract import extract
    from eagle3_train.vocab.build import build_vocab

    if not (OUT / "prepared" / "manifest.json").is_file():
        prepare("sharegpt", "smollm2-135m-instruct", OUT / "prepared", max_length=512, limit=limit, val_count=8)
    if not (OUT / "vocab" / "vocab.safetensors").is_file():
        build_vocab(OUT / "prepared", OUT / "vocab", size=8192)
    extract(OUT / "prepared", "smollm2-135m-instruct", OUT / "hidden-bf16", dtype="bfloat16",
            compute_dtype="float32")  # resumes (float32 compute, as when the figures were measured)


def fp8_copy(src: Path, dst: Path) -> dict:
    """Encode every bf16 shard of `src` to fp8 in `dst` (manifest and indexes updated); return error statistics."""
    manifest = read_json(src / "manifest.json")
    hidden = int(manifest["hidden_size"])
    errs: dict[str, list[torch.Tensor]] = {"aux_rel_l2": [], "final_rel_l2": [], "aux_cos": [], "final_cos": []}
    peak_ratio = 0.0
    shutil.rmtree(dst, ignore_errors=True)
    for split in manifest["splits"]:
        (dst / split).mkdir(parents=True)
        index = read_json(src / split / "index.json")
        for entry in index["shards"]:
            tensors = load_file(str(src / split / entry["file"]))
            for name, groups in (("aux", len(manifest["layer_ids"])), ("final", 1)):
                x = tensors[name]
                q, scale = fp8.encode_rows(x, groups)
                back = fp8.decode_rows(q, scale, torch.float32)
                xf = x.float()
                for g in range(groups):  # per layer: each aux layer, then final
                    sl = slice(g * hidden, (g + 1) * hidden)
                    a, b = back[:, sl], xf[:, sl]
                    errs[f"{name}_rel_l2"].append((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12))
                    errs[f"{name}_cos"].append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
                if name == "aux":
                    peak_ratio = max(peak_ratio, float((xf.abs().amax(-1) / xf.abs().median(-1).values).max()))
                tensors[name], tensors[name + fp8.SCALE_SUFFIX] = q, scale
            path = dst / split / entry["file"]
            save_file(tensors, str(path), metadata={"format": manifest["format"], "dtype": fp8.STORE_NAME})
            entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
        write_json(dst / split / "index.json", index)
        manifest["splits"][split]["bytes"] = sum(e["bytes"] for e in index["shards"])
    manifest.update(dtype=fp8.STORE_NAME, bytes_per_token=4 * hidden + 16, converted_from=str(src))
    write_json(dst / "manifest.json", manifest)
    stats = {k: {"mean": round(float(torch.cat(v).mean()), 5), "max" if "l2" in k else "min":
                 round(float(torch.cat(v).max() if "l2" in k else torch.cat(v).min()), 5)} for k, v in errs.items()}
    return {"reconstruction": stats, "aux_peak_to_median_max": round(peak_ratio, 1),
            "bytes": {"bf16": sum(s["bytes"] for s in read_json(src / "manifest.json")["splits"].values()),
                      "fp8": sum(s["bytes"] for s in manifest["splits"].values())}}


def train_variant(name: str, hidden: Path, epochs: float) -> dict:
    from eagle3_train.export.exporter import export
    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.trainer import train

    run = OUT / name
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    r = train(TrainConfig(prepared=str(OUT / "prepared"), hidden_states=str(hidden), vocab=str(OUT / "vocab"),
                          out=str(run / "train"), epochs=epochs, **TRAIN))
    export(run / "train", run / "export-eagle", fmt="eagle")
    return {"steps": r["step"], "train_s": round(time.perf_counter() - t0, 1),
            "train": {k: v for k, v in r["train"].items() if k.startswith(("loss", "acc_", "accept_len"))},
            "validation": r["validation"]}


def serve_variant(name: str, args) -> dict:
    from eagle3_train.evaluate.pipeline_eval import acceptance_summary, served_acceptance
    from eagle3_train.evaluate.prompts import load_prompts

    verifier = Path(read_json(OUT / "hidden-bf16" / "manifest.json")["verifier"]["path"])
    prompts = load_prompts("mtbench", limit=args.num_prompts, turns=1)
    return acceptance_summary(served_acceptance(verifier, OUT / name / "export-eagle", prompts, k=3,
                                                max_tokens=args.max_tokens, concurrency=8, log_dir=OUT / name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=100, help="ShareGPT conversations")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--vllm", action="store_true", help="also measure acceptance in vLLM")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    results = read_json(RESULTS) if RESULTS.is_file() else {}
    results["settings"] = {**vars(args), "train": TRAIN, "date": time.strftime("%Y-%m-%d")}
    build_data(args.limit)
    results["storage"] = fp8_copy(OUT / "hidden-bf16", OUT / "hidden-fp8")
    write_json(RESULTS, results)
    for name in ("bf16", "fp8"):
        results[name] = train_variant(name, OUT / f"hidden-{name}", args.epochs)
        write_json(RESULTS, results)
    if args.vllm:
        for name in ("bf16", "fp8"):
            results[name]["vllm"] = serve_variant(name, args)
            write_json(RESULTS, results)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
