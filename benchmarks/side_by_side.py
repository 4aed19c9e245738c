"""eagle3-train vs speculators 0.9.0 on the same tokens, in one run: equal data and steps, both drafts judged by the
same vLLM build.

Both trainers read the same prepared rows (`train_throughput.py`'s data: ShareGPT conversations tokenized for SmolLM2,
max 512 tokens; speculators gets them through the anchor's `prepared_to_pretok.py`), draft vocab 8192, 2048-token
steps, TTT 3, the same number of epochs. speculators runs with its defaults except what its CPU harness forces (AdamW,
see ../shared/anchors/speculators/README.md); ours with `--ours` train overrides (default: our best settings).
Each draft is served in the speculators format by vLLM (`vllm serve DRAFT`) and measured on MT-bench first turns and
HumanEval at temperature 0 and MT-bench at temperature 1 (k=3, 128 tokens). A PNG shows the training-time acceptance
estimate (1 + Σ_j full_acc_j, temperature 0) of both against training tokens, with the vLLM figures at the end.

  .venv/bin/python benchmarks/side_by_side.py --epochs 3
  .venv/bin/python benchmarks/side_by_side.py --serve-only          # re-measure drafts trained earlier
Results: benchmarks/out/side_by_side.json, benchmarks/side_by_side.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import train_throughput as data
from equal_budget_acceptance import BASE

from eagle3_train.evaluate.pipeline_eval import acceptance_summary
from eagle3_train.evaluate.prompts import load_prompts
from eagle3_train.evaluate.served import evaluate_served
from eagle3_train.export.exporter import export
from eagle3_train.serving.vllm_server import VLLMServer
from eagle3_train.train.config import TrainConfig
from eagle3_train.train.trainer import train
from eagle3_train.utils.config import to_dataclass
from eagle3_train.utils.io import read_json, write_json
from eagle3_train.utils.settings import parse_set

HERE = Path(__file__).resolve().parent
WORK = HERE / "out" / "side_by_side"
RESULTS = HERE / "out" / "side_by_side.json"
OURS_BEST = "lr=0.002"  # benchmarks/README.md, "Acceptance at the speculators reference budget"
# (name, benchmark, temperature): what users serve with, greedy and sampled
MEASURES = (("mtbench_t0", "mtbench", 0.0), ("humaneval_t0", "humaneval", 0.0), ("mtbench_t1", "mtbench", 1.0))


def train_ours(epochs: int, overrides: list[str]) -> dict:
    out = WORK / "ours"
    settings = {**BASE, "epochs": epochs, "log_every": 5, **parse_set(overrides, TrainConfig, ("train",))}
    t0 = time.perf_counter()
    result = train(to_dataclass(TrainConfig, dict(prepared=str(data.OUT / "prepared"),
                                                  hidden_states=str(data.OUT / "hidden"), vocab=str(data.OUT / "vocab"),
                                                  out=str(out / "train"), **settings), "side-by-side"))
    export(out / "train", out / "export-speculators", fmt="speculators")
    return {"settings": settings, "steps": result["step"], "train_s": round(time.perf_counter() - t0, 1),
            "tokens_per_s": round(result["tokens_per_s"], 1), "draft": str(out / "export-speculators"),
            "metrics": str(out / "train" / "metrics.jsonl")}


def train_speculators(epochs: int, anchor: Path, venv: Path) -> dict:
    rows = HERE / "out" / "speculators" / "rows.jsonl"
    if not rows.is_file():
        rows.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(venv / "bin" / "python"), str(anchor / "prepared_to_pretok.py"),
                        str(data.OUT / "prepared"), str(rows)], check=True)
    run = f"side-by-side-e{epochs}"
    env = {**os.environ, "WORK": str(rows.parent), "VENV": str(venv), "PRETOK": str(rows), "TTT": "3",
           "EPOCHS": str(epochs), "RUN": run}
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", str(anchor / "bench.sh")], env=env, capture_output=True, text=True)
    out = rows.parent / "runs" / run
    if proc.returncode != 0:
        sys.exit(f"speculators training failed ({proc.returncode}): see {out / 'train.log'}\n{proc.stdout[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"command": (out / "command.txt").read_text().strip(), "steps": s["train_steps"],
            "train_s": round(time.perf_counter() - t0, 1), "tokens_per_s": s["train_tokens_per_s"],
            "peak_rss_gib": round(s["peak_rss_mib"] / 1024, 2), "draft": s["checkpoint"]["dir"],
            "metrics": str(out / "metrics.jsonl")}


def serve(draft: str, num_prompts: int, log_dir: Path, measures: tuple = MEASURES) -> dict:
    """One vLLM server per draft (speculators format: the config names the verifier), `measures` against it."""
    out = {}
    with VLLMServer(draft, startup_matters=True, log_path=log_dir / "vllm.log") as server:
        for name, bench, temperature in measures:
            prompts = load_prompts(bench, limit=num_prompts, turns=1)
            r = evaluate_served(server.base_url, server.model_name, prompts, max_tokens=128, concurrency=8,
                                temperature=temperature, seed=0)
            out[name] = {**acceptance_summary(r), "num_prompts": len(prompts), "temperature": temperature,
                         "first_outputs": [c["outputs"][0][:300] for c in r["completions"][:3] if c["outputs"]]}
            print(f"  {name}: {out[name]['mean_acceptance_length']:.3f}", flush=True)
    return out


def ours_train_rows(path: str | Path) -> list[dict]:
    """Our metrics.jsonl: the train-window records (each with `tokens_seen` and `time`)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("split") == "train" and "tokens_seen" in r]


def spec_train_steps(path: str | Path) -> list[dict]:
    """speculators' metrics.jsonl: one record per train step (its `data`: train metrics, profile, epoch)."""
    steps = [json.loads(x)["data"] for x in Path(path).read_text().splitlines() if x.strip()]
    return [d for d in steps if d.get("train") and d.get("profile")]


def curve_ours(path: str) -> tuple[list[int], list[float]]:
    train_rows = ours_train_rows(path)
    return [r["tokens_seen"] for r in train_rows], [r["accept_len_k3"] for r in train_rows]


def curve_speculators(path: str, window: int = 5) -> tuple[list[int], list[float]]:
    """Its per-step train metrics, averaged over `window` steps like our logging windows; tokens from its profile."""
    steps = spec_train_steps(path)
    tokens, est, seen = [], [], 0.0
    for i, d in enumerate(steps):
        seen += d["profile"]["tokens_per_s"] * d["profile"]["step_ms"] / 1000
        if (i + 1) % window == 0 or i + 1 == len(steps):
            chunk = steps[max(0, i + 1 - window):i + 1]
            tokens.append(round(seen))
            est.append(1 + sum(sum(c["train"].get(f"full_acc_{j}", 0.0) for c in chunk) / len(chunk)
                               for j in range(3)))
    return tokens, est


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve, color in (("eagle3-train", curve_ours, "tab:blue"), ("speculators 0.9.0", curve_speculators,
                                                                           "tab:orange")):
        key = "ours" if name == "eagle3-train" else "speculators"
        r = results.get(key)
        if not r:
            continue
        x, y = curve(r["metrics"])
        ax.plot(x, y, color=color, label=f"{name}: training estimate (train windows, k=3)")
        served = (r.get("vllm") or {}).get("mtbench_t0")
        if served and x:
            ax.plot([x[-1]], [served["mean_acceptance_length"]], "*", ms=14, color=color,
                    label=f"{name}: vLLM, MT-bench, T=0 ({served['mean_acceptance_length']:.3f})")
    ax.set(xlabel="training tokens", ylabel="mean acceptance length (k=3)",
           title="Same tokens, same steps: eagle3-train vs speculators 0.9.0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--limit", type=int, default=200, help="ShareGPT conversations")
    p.add_argument("--ours", action="append", default=None, metavar="KEY=VALUE",
                   help=f"our train overrides (default: {OURS_BEST})")
    p.add_argument("--anchor", type=Path, default=HERE.parent.parent / "shared" / "anchors" / "speculators")
    p.add_argument("--venv", type=Path, default=Path("/tmp/anchors/specvenv"))
    p.add_argument("--serve-only", action="store_true", help="measure the drafts trained by an earlier run")
    p.add_argument("--only", choices=("ours", "speculators"), help="train/measure one trainer only")
    args = p.parse_args()
    data.build_data(args.limit)
    # --serve-only and --only add to the results of earlier runs; a full run starts them over
    results = read_json(RESULTS) if RESULTS.is_file() and (args.serve_only or args.only) else {}
    results.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "epochs": args.epochs,
                    "machine": {"cpu": data.cpu_model(), "nproc": os.cpu_count()},
                    "data": read_json(data.OUT / "prepared" / "manifest.json").get("counts")})
    for key in ("ours", "speculators"):
        if args.only and key != args.only:
            continue
        if not args.serve_only:
            print(f"training {key} ...", flush=True)
            results[key] = (train_ours(args.epochs, args.ours or [OURS_BEST]) if key == "ours"
                            else train_speculators(args.epochs, args.anchor, args.venv))
            write_json(RESULTS, results)
        print(f"serving {key} ...", flush=True)
        results[key]["vllm"] = serve(results[key]["draft"], args.num_prompts, WORK / f"vllm-{key}")
        write_json(RESULTS, results)
    if "ours" in results and "speculators" in results:
        results["ratio"] = {m: round(results["ours"]["vllm"][m]["mean_acceptance_length"]
                                     / results["speculators"]["vllm"][m]["mean_acceptance_length"], 3)
                            for m, _, _ in MEASURES}
        write_json(RESULTS, results)
    plot(results, HERE / "side_by_side.png")
    print(json.dumps({k: results[k] for k in ("ratio",) if k in results}, indent=1))


if __name__ == "__main__":
    main()
