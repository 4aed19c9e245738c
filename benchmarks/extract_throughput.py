"""Throughput and peak memory of hidden-state extraction vs the verifier's bare forward and a naive HF loop.

Builds ~100 prepared ShareGPT samples (150 conversations read, those without assistant tokens
after truncation dropped) with the real prepare stage (SmolLM2 chat template), then runs, each in its own
subprocess so that peak RSS (ru_maxrss) is per variant:
  extract  - `eagle3_train.hidden_states.extract.extract` (hooks on model.model, bf16 shards written to disk)
  bare     - model.model forward over the same batches: no hooks, no storage (the floor)
  naive    - model(..., output_hidden_states=True): all layers + full-vocab logits, the 4 tensors kept in memory
All three use the same length-sorted batches under the same token budget. Besides wall-clock tokens/s, tokens per
CPU-second of the process (all threads) is reported: on a shared machine it is the steadier number.

Usage: .venv/bin/python benchmarks/extract_throughput.py [--samples 150] [--max-length 128] [--token-budget 8192]
       [--device cpu] [--variants extract,bare,naive]
Writes benchmarks/out/extract_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import build_prepared, machine  # noqa: E402

VARIANTS = ("extract", "bare", "naive")


def peak_memory(device: str) -> dict:
    import torch

    out = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.startswith("cuda"):
        out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def batches(prepared: Path, token_budget: int):
    """The batches extract forms at this data size (one shard per split: its default shards hold ~58K tokens)."""
    import datasets

    from eagle3_train.hidden_states.hf_backend import plan_batches
    from eagle3_train.hidden_states.store import plan_shards

    ds = datasets.load_from_disk(str(prepared / "dataset"))
    out = []
    for split in ("train", "validation"):
        seqs = ds[split]["input_ids"]
        seqs = [list(s) for s in seqs]
        for shard in plan_shards([len(s) for s in seqs], 10**12):
            for b0, b1 in plan_batches(shard.lengths, token_budget):
                out.append([seqs[r] for r in shard.rows[b0:b1]])
    return out


def padded(batch, device):
    import torch

    longest = max(len(s) for s in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    return ids.to(device), mask.to(device)


def run_variant(args) -> dict:
    """Runs in the child process; returns one result row."""
    import torch

    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.hidden_states.extract import extract
    from eagle3_train.hidden_states.hf_backend import resolve_device
    from eagle3_train.model.aux_layers import default_layer_ids

    device = resolve_device(args.device)
    compute = torch.float32 if device == "cpu" else torch.bfloat16
    verifier = resolve_verifier(args.verifier)
    prepared = Path(args.prepared)
    if args.variant == "extract":
        out = Path(args.work) / "hidden"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        m = extract(prepared, args.verifier, out, device=device, token_budget=args.token_budget)
        wall = time.perf_counter() - t0
        tp = m["throughput"]
        return {"variant": "extract", "tokens": m["counts"]["tokens"], "loop_s": tp["seconds"],
                "tokens_per_s": tp["tokens_per_s"], "cpu_s": tp["cpu_seconds"],
                "tokens_per_cpu_s": round(m["counts"]["tokens"] / tp["cpu_seconds"], 1),
                "forward_s": tp["forward_seconds"],
                "write_s": tp["write_seconds"], "wall_s": round(wall, 2),
                "bytes_per_token": round(m["counts"]["bytes"] / m["counts"]["tokens"], 1),
                "disk_bytes": m["counts"]["bytes"], **peak_memory(device)}

    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=compute).to(device).eval()
    layer_ids = default_layer_ids(model.config.num_hidden_layers)
    work = batches(prepared, args.token_budget)
    rss_loaded = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    tokens = 0
    t1, c1 = time.perf_counter(), time.process_time()
    kept = 0
    with torch.inference_mode():
        for batch in work:
            ids, mask = padded(batch, device)
            if args.variant == "bare":
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            else:  # naive: what a straightforward script does
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                keep = mask.bool()
                aux = torch.cat([out.hidden_states[i][keep] for i in layer_ids], -1).to(torch.bfloat16).cpu()
                final = out.hidden_states[-1][keep].to(torch.bfloat16).cpu()
                kept += aux.numel() + final.numel()
            tokens += sum(len(s) for s in batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    loop, cpu = time.perf_counter() - t1, time.process_time() - c1
    return {"variant": args.variant, "tokens": tokens, "loop_s": round(loop, 3),
            "tokens_per_s": round(tokens / loop, 1), "cpu_s": round(cpu, 3),
            "tokens_per_cpu_s": round(tokens / cpu, 1), "wall_s": round(time.perf_counter() - t0, 2),
            "rss_after_load_mib": rss_loaded, **peak_memory(device)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=150,
                   help="ShareGPT conversations to read (about 100 keep assistant tokens at --max-length 128)")
    p.add_argument("--max-length", type=int, default=128, help="prepare's max tokens per sample (truncate)")
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--device", default="cpu")
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--work", default=str(HERE / "out" / "extract_work"))
    p.add_argument("--json", default=str(HERE / "out" / "extract_throughput.json"))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--prepared", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return 0

    os.environ.setdefault("EAGLE3_TRAIN_NO_PROGRESS", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prepared = build_prepared(work, args.samples, args.max_length, args.verifier)
    rows = []
    load_before = os.getloadavg()  # the machine may be shared: record how busy it was
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant, "--prepared", str(prepared), "--work", str(work),
               "--token-budget", str(args.token_budget), "--device", args.device, "--verifier", args.verifier]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"variant {variant} failed (rc {proc.returncode})")
        rows.append(json.loads(line[len("RESULT "):]))
        print(f"{variant}: done", file=sys.stderr)

    prep = json.loads((prepared / "manifest.json").read_text())
    result = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "settings": {"samples": args.samples, "max_length": args.max_length,
                           "token_budget": args.token_budget, "device": args.device, "verifier": args.verifier},
              "prepared_counts": prep.get("counts"), "results": rows,
              "loadavg_before_after": [list(load_before), list(os.getloadavg())]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    cols = ("variant", "tokens", "tokens_per_s", "tokens_per_cpu_s", "loop_s", "cpu_s", "peak_rss_mib",
            "rss_after_load_mib", "peak_cuda_mib", "bytes_per_token")
    present = [c for c in cols if any(c in r for r in rows)]
    print(" | ".join(present))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in present))
    print(f"machine: {result['machine']}; load average before/after: {result['loadavg_before_after']}")
    print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
