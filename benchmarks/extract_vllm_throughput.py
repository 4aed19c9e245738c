"""Hidden-state extraction throughput: the HF backend (verifier run in-process) vs the vLLM backend (a hidden-state
server started by `hidden_states_server`, our KV connector, states read back from its files).

Builds the same prepared ShareGPT data as `extract_throughput.py` (real prepare stage, SmolLM2 chat template), starts
one vLLM hidden-state server (eager, start-up time reported apart), then extracts with each backend into its own
directory (bf16 shards) and reports wall-clock tokens/s of the extraction loop (model loading / server start-up
excluded) and tokens per CPU-second: for vLLM the CPU time of the client AND of every server process (read from
/proc), since the forward runs in the server. The two outputs are compared as a check (max abs difference).

Usage: .venv/bin/python benchmarks/extract_vllm_throughput.py [--samples 150] [--max-length 128]
       [--concurrency 8] [--token-budget 8192]
Writes benchmarks/out/extract_vllm_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import build_prepared, machine  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time of the live processes in a process group (the vLLM server and its workers)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after "(comm)": state ppid pgrp ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def run(backend: str, prepared: Path, out: Path, args, server=None) -> dict:
    from eagle3_train.hidden_states.extract import extract

    shutil.rmtree(out, ignore_errors=True)
    kw = {"backend": "vllm", "endpoints": [server.base_url],
          "vllm_options": {"concurrency": args.concurrency, "hidden_states_dir": server.hidden_states_dir}} \
        if backend == "vllm" else {"device": "cpu"}
    server_cpu0 = group_cpu_seconds(server.proc.pid) if server else 0.0
    t0 = time.perf_counter()
    m = extract(prepared, args.verifier, out, token_budget=args.token_budget, **kw)
    wall = time.perf_counter() - t0
    tp = m["throughput"]
    server_cpu = group_cpu_seconds(server.proc.pid) - server_cpu0 if server else 0.0
    cpu = tp["cpu_seconds"] + server_cpu
    return {"backend": backend, "tokens": m["counts"]["tokens"], "loop_s": tp["seconds"],
            "tokens_per_s": tp["tokens_per_s"], "client_cpu_s": tp["cpu_seconds"], "server_cpu_s": round(server_cpu, 2),
            "tokens_per_cpu_s": round(m["counts"]["tokens"] / cpu, 1), "load_s": tp["load_seconds"],
            "wall_s": round(wall, 2), "vllm": m.get("vllm")}


def max_difference(a: Path, b: Path) -> dict:
    """Per tensor: the largest |HF - vLLM|, the same in bf16 rounding steps of the larger value, and the share of
    values that are bit-identical."""
    import torch

    from eagle3_train.hidden_states.store import HiddenStatesReader

    worst = {k: {"max_abs": 0.0, "max_bf16_steps": 0.0, "identical": 0, "values": 0} for k in ("aux", "final")}
    for split in ("train", "validation"):
        ra, rb = HiddenStatesReader(a, split), HiddenStatesReader(b, split)
        for i in ra.sample_indices:
            x, y = ra.load(i), rb.load(i)
            for k, w in worst.items():
                p, q = x[k].float(), y[k].float()
                step = torch.maximum(p.abs(), q.abs()) * 2.0 ** -8  # bf16 keeps 8 significant bits
                steps = ((p - q).abs() / step.clamp_min(1e-30)).nan_to_num(0.0)
                w["max_abs"] = max(w["max_abs"], float((p - q).abs().max()))
                w["max_bf16_steps"] = max(w["max_bf16_steps"], round(float(steps.max()), 2))
                w["identical"] += int((p == q).sum())
                w["values"] += p.numel()
    for w in worst.values():
        w["identical_share"] = round(w.pop("identical") / max(1, w.pop("values")), 5)
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=150)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--work", default=str(HERE / "out" / "extract_vllm_work"))
    p.add_argument("--json", default=str(HERE / "out" / "extract_vllm_throughput.json"))
    args = p.parse_args()

    os.environ.setdefault("EAGLE3_TRAIN_NO_PROGRESS", "1")
    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.serving.vllm_server import hidden_states_server

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prepared = build_prepared(work, args.samples, args.max_length, args.verifier)
    load_before = os.getloadavg()
    rows = [run("hf", prepared, work / "hidden-hf", args)]
    server = hidden_states_server(resolve_verifier(args.verifier), storage_dir=work / "server-states",
                                  log_path=work / "vllm.log")
    with server:
        rows.append(run("vllm", prepared, work / "hidden-vllm", args, server))
        startup = round(server.startup_s or 0, 1)
    diff = max_difference(work / "hidden-hf", work / "hidden-vllm")

    prep = json.loads((prepared / "manifest.json").read_text())
    result = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "settings": vars(args), "prepared_counts": prep.get("counts"), "results": rows,
              "vllm_startup_s": startup, "max_abs_difference_bf16": diff,
              "loadavg_before_after": [list(load_before), list(os.getloadavg())]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    cols = ("backend", "tokens", "tokens_per_s", "tokens_per_cpu_s", "loop_s", "client_cpu_s", "server_cpu_s")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in cols))
    print(f"vLLM start-up {startup} s; max |HF - vLLM| (bf16): {diff}")
    print(f"machine: {result['machine']}; load average before/after: {result['loadavg_before_after']}")
    print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
