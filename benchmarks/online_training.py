"""Training tokens/s with hidden states from a vLLM server (online) vs from disk (offline), and where the time goes.

Builds prepared ShareGPT data for SmolLM2 (real prepare stage), a draft vocabulary, starts ONE vLLM hidden-state
server (`hidden_states_server`, eager; start-up timed apart), extracts the states from it (`extract --backend vllm`,
bf16: the offline input), then trains the same draft twice with the same seed and steps: offline on those shards and
online against the server (prefetch queue). Reports per mode: training tokens/s (the training loop), the seconds the
loop spent computing (`train_s`) and waiting for hidden states (`fetch_wait_s`), and for online the summed
per-request server time (`server_request_s`, HTTP + the verifier forward + the connector's write) and file reads
(`server_read_s`, the transfer) over the prefetch thread; plus the extraction time offline pays up front, and the
largest per-step loss difference between the two runs.

Usage: .venv/bin/python benchmarks/online_training.py [--samples 60] [--max-length 128] [--steps 20]
       [--token-budget 1024] [--prefetch 2] [--concurrency 8]
Writes benchmarks/out/online_training.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import build_prepared, machine  # noqa: E402


def losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--token-budget", type=int, default=1024)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--work", default=str(HERE / "out" / "online_training"))
    args = p.parse_args()

    from eagle3_train.assets.verifier import resolve_verifier
    from eagle3_train.hidden_states.extract import extract
    from eagle3_train.serving.vllm_server import hidden_states_server
    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.trainer import train
    from eagle3_train.vocab.build import build_vocab

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    verifier = resolve_verifier(args.verifier)
    prepared = build_prepared(work, args.samples, args.max_length, str(verifier))
    build_vocab(prepared, work / "vocab", size=8192)
    t0 = time.perf_counter()
    server = hidden_states_server(verifier, storage_dir=work / "states", max_model_len=2048,
                                  log_path=work / "vllm.log")
    results: dict = {"machine": machine(), "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                    time.gmtime())}
    with server:
        results["server_startup_s"] = round(time.perf_counter() - t0, 1)
        t1 = time.perf_counter()
        m = extract(prepared, verifier, work / "hidden", dtype="bfloat16", backend="vllm",
                    endpoints=[server.base_url], vllm_options={"concurrency": args.concurrency,
                                                               "hidden_states_dir": server.hidden_states_dir})
        results["extract"] = {"wall_s": round(time.perf_counter() - t1, 1), "tokens": m["counts"]["tokens"],
                              "bytes": m["counts"]["bytes"]}
        common = dict(prepared=str(prepared), vocab=str(work / "vocab"), max_steps=args.steps, seed=0,
                      token_budget=args.token_budget, ttt_steps=3, log_every=1, tensorboard=False,
                      max_eval_batches=1, device="cpu")
        for mode in ("offline", "online"):
            extra = dict(hidden_states=str(work / "hidden")) if mode == "offline" else dict(
                hidden_states_mode="online", endpoint=[server.base_url], prefetch=args.prefetch,
                hidden_states_dir=str(server.hidden_states_dir),
                online_concurrency=args.concurrency)
            t2 = time.perf_counter()
            r = train(TrainConfig(out=str(work / f"train-{mode}"), **common, **extra))
            results[mode] = {"tokens_per_s": round(r["tokens_per_s"], 1), "wall_s": round(time.perf_counter() - t2, 1),
                             **r["timing"], "skipped_samples": r["skipped_samples"]}
    a, b = losses(work / "train-offline"), losses(work / "train-online")
    results["max_loss_difference"] = max(abs(x - y) for x, y in zip(a, b))
    results["loss_first_last"] = [a[0], a[-1]]
    out = HERE / "out" / "online_training.json"
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print("\n| mode | tokens/s (train loop) | train_s | fetch_wait_s | server_request_s | server_read_s |")
    print("|---|---|---|---|---|---|")
    for mode in ("offline", "online"):
        r = results[mode]
        print(f"| {mode} | {r['tokens_per_s']} | {r['train_s']} | {r['fetch_wait_s']} | "
              f"{r.get('server_request_s', '—')} | {r.get('server_read_s', '—')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
