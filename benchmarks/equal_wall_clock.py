"""eagle3-train vs speculators 0.9.0 at equal wall-clock: both trainers train at the same time on this machine, one
core each, for the same minutes, from the same data pool; both drafts (and an earlier checkpoint of each) are judged by
the same vLLM build.

Why side by side, one thread each: both see the same machine load for the whole budget (these hosts are shared and
change speed within minutes), so neither gains from a quiet spell the other missed.

Data pool: `--limit` ShareGPT conversations tokenized for SmolLM2 (max 512 tokens), our prepared rows; speculators gets
the same rows through the anchor's `prepared_to_pretok.py` and makes its own hidden states with its HF script.
Budget: a probe (both trainers side by side, a few steps each) measures each one's throughput under the shared load;
each then gets the optimizer steps that fill `--minutes` at that rate (the learning-rate schedule of both decays over
them), so each uses its time as it likes. speculators runs with its defaults except what its CPU harness forces
(fp32, AdamW; speculators_harness/README.md); ours with `--ours` overrides (default: our best settings).

  .venv/bin/python benchmarks/equal_wall_clock.py --minutes 30
Results: benchmarks/out/equal_wall_clock.json, benchmarks/equal_wall_clock.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (
    MEASURES,
    WALL_CLOCK_BEST,
    build_data,
    curve_speculators,
    ours_command,
    ours_train_rows,
    serve,
    spec_train_steps,
)

from eagle3_train.utils.io import read_json, write_json

HERE = Path(__file__).resolve().parent
WORK = HERE / "out" / "wall_clock"
DATA = WORK / "data"
SPEC = WORK / "speculators"
RESULTS = HERE / "out" / "equal_wall_clock.json"


def spec_epochs(max_steps: int) -> int:
    """Epochs that hold `max_steps`: speculators trains on 90% of the rows (its train_data_ratio) in 2048-token packs,
    and with more epochs than that it keeps starting empty epochs, each with a validation pass, until the last."""
    tokens = read_json(DATA / "prepared" / "manifest.json")["counts"]["tokens"]["train"]
    per_epoch = max(1, int(0.9 * tokens / 2048))  # packing leaves gaps: at least this many steps per epoch
    return max(1, math.ceil(max_steps / per_epoch))


def spec_env(anchor: Path, venv: Path, run: str, max_steps: int, threads: int) -> dict[str, str]:
    rows = SPEC / "rows.jsonl"
    if not rows.is_file():
        SPEC.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(venv / "bin" / "python"), str(anchor / "prepared_to_pretok.py"),
                        str(DATA / "prepared"), str(rows)], check=True)
    return {**os.environ, "WORK": str(SPEC), "VENV": str(venv), "PRETOK": str(rows), "TTT": "3",
            "EPOCHS": str(spec_epochs(max_steps)), "MAX_STEPS": str(max_steps), "RUN": run, "THREADS": str(threads)}


def side_by_side(ours_cmd: list[str], ours_log: Path, spec_cmd: list[str], env: dict[str, str],
                 spec_log: Path) -> dict[str, dict]:
    """Start both at once (one thread each); wait for both; wall time and peak RSS of each process."""
    one = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLE3_TRAIN_NO_PROGRESS": "1"}
    ours_log.parent.mkdir(parents=True, exist_ok=True)
    spec_log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(ours_log, "w") as fo, open(spec_log, "w") as fs:
        procs = {"ours": subprocess.Popen(ours_cmd, env=one, stdout=fo, stderr=subprocess.STDOUT),
                 "speculators": subprocess.Popen(spec_cmd, env=env, stdout=fs, stderr=subprocess.STDOUT)}
        out: dict[str, dict] = {}
        while len(out) < 2:
            pid, status, usage = os.wait4(-1, 0)
            for name, p in procs.items():
                if p.pid == pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    out[name] = {"rc": p.returncode, "wall_s": round(time.time() - t0, 1),
                                 "peak_rss_gib": round(usage.ru_maxrss / 1024 ** 2, 2)}
    for name, r in out.items():
        if r["rc"] != 0:
            sys.exit(f"{name} failed (exit {r['rc']}); log: {ours_log if name == 'ours' else spec_log}")
    return out


def ours_rate(metrics: Path) -> tuple[float, float]:
    """(tokens/s over the logged train windows after the first, tokens per optimizer step)."""
    rows = ours_train_rows(metrics)
    first, last = rows[0], rows[-1]
    rate = (last["tokens_seen"] - first["tokens_seen"]) / (last["time"] - first["time"])
    return rate, last["tokens_seen"] / last["step"]


def spec_summary(run: str) -> dict:
    return read_json(SPEC / "runs" / run / "summary.json")


def spec_rate(run: str) -> tuple[float, float]:
    s = spec_summary(run)
    return s["train_tokens_per_s_excl_first_step"], s["tokens_trained"] / s["train_steps"]


def curve_ours_time(path: Path) -> tuple[list[float], list[int], list[float]]:
    rows = ours_train_rows(path)
    t0 = rows[0]["time"] - rows[0]["tokens_seen"] / max(rows[0].get("tokens_per_s", 1.0), 1e-9)
    return [r["time"] - t0 for r in rows], [r["tokens_seen"] for r in rows], [r["accept_len_k3"] for r in rows]


def spec_tokens_time(path: Path) -> tuple[list[float], list[int]]:
    steps = spec_train_steps(path)
    secs, toks, s, n = [], [], 0.0, 0.0
    for d in steps:
        s += d["profile"]["step_ms"] / 1000
        n += d["profile"]["tokens_per_s"] * d["profile"]["step_ms"] / 1000
        secs.append(s)
        toks.append(round(n))
    return secs, toks


def checkpoints_ours(run: Path, steps: int) -> list[tuple[int, Path, bool]]:
    """(step, exported speculators-format dir, is the final draft): the periodic step checkpoints (`save_every`, not
    the epoch-end ones) and final/."""
    from eagle3_train.export.exporter import export

    every = max(1, steps // 3)
    found = [(int(c.name.split("-")[1]), c) for c in (run / "checkpoints").glob("step-*")]
    chosen = [(s, c, False) for s, c in sorted(found) if s % every == 0 and s < steps] + [(steps, run / "final", True)]
    out = []
    for step, ckpt, last in chosen:
        dest = run.parent / f"export-ours-{step}"
        if not (dest / "config.json").is_file():
            export(ckpt, dest, fmt="speculators")
        out.append((step, dest, last))
    return out


def spec_epoch_ends(path: Path) -> dict[int, int]:
    """epoch -> index (in its train steps) of that epoch's last step."""
    steps = spec_train_steps(path)
    return {int(d["epoch"]): i for i, d in enumerate(steps) if "epoch" in d}


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    o, s = results["ours"], results["speculators"]
    secs, toks, est = curve_ours_time(Path(o["metrics"]))
    s_tok, s_est = curve_speculators(s["metrics"])
    s_secs, s_all_toks = spec_tokens_time(Path(s["metrics"]))

    def spec_secs_at(tokens: int) -> float:
        return next((t for t, n in zip(s_secs, s_all_toks) if n >= tokens), s_secs[-1] if s_secs else 0.0)
    for ax, xo, xs, xlabel in ((axes[0], [t / 60 for t in secs], [spec_secs_at(n) / 60 for n in s_tok],
                                "training time (minutes, one core each, side by side)"),
                               (axes[1], toks, s_tok, "training tokens")):
        ax.plot(xo, est, color="tab:blue", label="eagle3-train: training estimate (k=3, T=0)")
        ax.plot(xs, s_est, color="tab:orange", label="speculators 0.9.0: training estimate (k=3, T=0)")
        for key, color in (("ours", "tab:blue"), ("speculators", "tab:orange")):
            for point in results[key].get("vllm_points", []):
                x = point["train_s"] / 60 if ax is axes[0] else point["tokens"]
                ax.plot([x], [point["mtbench_t0"]], "*", ms=13, color=color)
        ax.set(xlabel=xlabel, ylabel="mean acceptance length (k=3)")
        ax.grid(alpha=0.3)
    axes[0].plot([], [], "*", color="gray", ms=10, label="vLLM, 80 MT-bench first turns, T=0")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Equal wall-clock ({results['minutes']} min each): eagle3-train vs speculators 0.9.0")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    global WORK, DATA, SPEC, RESULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--limit", type=int, default=1000, help="ShareGPT conversations in the pool")
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--ours", action="append", default=None, metavar="KEY=VALUE",
                   help=f"our train overrides (default: {' '.join(WALL_CLOCK_BEST)})")
    p.add_argument("--anchor", type=Path, default=HERE / "speculators_harness")
    p.add_argument("--venv", type=Path, default=Path("/tmp/anchors/specvenv"))
    p.add_argument("--serve-only", action="store_true", help="measure the drafts of an earlier run")
    p.add_argument("--prepare-only", action="store_true", help="build both trainers' data for the pool, then stop")
    p.add_argument("--work", type=Path, default=WORK, help="run directory (data, runs, vLLM logs)")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--png", type=Path, default=HERE / "equal_wall_clock.png")
    p.add_argument("--ours-steps", type=int, help="our optimizer steps (default: from the probe)")
    p.add_argument("--spec-steps", type=int, help="speculators' optimizer steps (default: from the probe)")
    args = p.parse_args()
    WORK, RESULTS = args.work.resolve(), args.results.resolve()
    DATA, SPEC = WORK / "data", WORK / "speculators"
    overrides = args.ours or WALL_CLOCK_BEST
    if not args.serve_only:
        build_data(args.limit, DATA)
    results = read_json(RESULTS) if args.serve_only else {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "minutes": args.minutes,
        "machine": {"cpu": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                                          capture_output=True, text=True).stdout.strip(), "nproc": os.cpu_count()},
        "data": read_json(DATA / "prepared" / "manifest.json").get("counts"), "ours_overrides": overrides}
    if not args.serve_only:
        # speculators' data (its prepare-data + HF hidden states) comes with a first 2-step run, alone on the machine
        if not (SPEC / "runs" / "data" / "summary.json").is_file():
            subprocess.run(["bash", str(args.anchor / "bench.sh")], check=True, capture_output=True,
                           env=spec_env(args.anchor, args.venv, "data", 2, os.cpu_count() or 1))
        if args.prepare_only:
            return
        print("probe: both trainers side by side ...", flush=True)
        if not ((WORK / "probe-ours" / "final").is_dir() and (SPEC / "runs" / "probe" / "summary.json").is_file()):
            side_by_side(ours_command(WORK / "probe-ours", overrides, args.probe_steps, None, log_every=2, data=DATA),
                         WORK / "probe-ours.log", ["bash", str(args.anchor / "bench.sh")],
                         spec_env(args.anchor, args.venv, "probe", args.probe_steps + 1, 1), WORK / "probe-spec.log")
        (o_rate, o_step), (s_rate, s_step) = ours_rate(WORK / "probe-ours" / "metrics.jsonl"), spec_rate("probe")
        budget = args.minutes * 60
        o_steps, s_steps = math.floor(budget * o_rate / o_step), math.floor(budget * s_rate / s_step)
        results["probe"] = {"ours_tokens_per_s": round(o_rate, 1), "speculators_tokens_per_s": round(s_rate, 1),
                            "ours_steps": o_steps, "speculators_steps": s_steps}
        # a short probe can misjudge a trainer's steady pace (warm-up of per-shape kernels): budgets set by hand
        if args.ours_steps or args.spec_steps:
            o_steps, s_steps = args.ours_steps or o_steps, args.spec_steps or s_steps
            results["probe"]["budgets_set_by_hand"] = {"ours_steps": o_steps, "speculators_steps": s_steps}
        print(f"probe: {results['probe']}", flush=True)
        write_json(RESULTS, results)
        spec_cmd = ["bash", str(args.anchor / "bench.sh")]
        if not (WORK / "runs.json").is_file():  # (wall time and peak RSS of each process; written by hand if the
            # two ran apart, e.g. ours restarted with a budget set by hand)
            write_json(WORK / "runs.json", side_by_side(
                ours_command(WORK / "ours", overrides, o_steps, max(1, o_steps // 3), data=DATA), WORK / "ours.log",
                spec_cmd, spec_env(args.anchor, args.venv, "wall", s_steps, 1), WORK / "spec.log"))
        runs = read_json(WORK / "runs.json")
        s = spec_summary("wall")
        train_meta = read_json(WORK / "ours" / "training_metadata.json")
        o_rate, _ = ours_rate(WORK / "ours" / "metrics.jsonl")
        results["ours"] = {**runs["ours"], "steps": o_steps, "tokens_per_s": round(o_rate, 1),
                           "metrics": str(WORK / "ours" / "metrics.jsonl"),
                           "command": " ".join(ours_command(WORK / "ours", overrides, o_steps,
                                                            max(1, o_steps // 3), data=DATA)),
                           "final": train_meta.get("final", {})}
        results["speculators"] = {**runs["speculators"], "steps": s["train_steps"],
                                  "tokens_per_s": s["train_tokens_per_s_excl_first_step"],
                                  "peak_rss_gib": round(s["peak_rss_mib"] / 1024, 2),
                                  "metrics": str(SPEC / "runs" / "wall" / "metrics.jsonl"),
                                  "command": (SPEC / "runs" / "wall" / "command.txt").read_text().strip(),
                                  "draft": s["checkpoint"]["dir"]}
        write_json(RESULTS, results)
    # vLLM: the last checkpoint of each on every measure, and earlier checkpoints on MT-bench T=0 only
    o_secs, o_toks, _ = curve_ours_time(Path(results["ours"]["metrics"]))
    s_secs, s_toks = spec_tokens_time(Path(results["speculators"]["metrics"]))
    ours_points = []
    for step, draft, last in checkpoints_ours(WORK / "ours", results["ours"]["steps"]):
        r = serve(str(draft), args.num_prompts, WORK / f"vllm-ours-{step}", measures=MEASURES if last else MEASURES[:1])
        i = min(len(o_toks), max(1, round(step / results["ours"]["steps"] * len(o_toks)))) - 1
        ours_points.append({"step": step, "tokens": o_toks[i], "train_s": round(o_secs[i]),
                            **{k: v["mean_acceptance_length"] for k, v in r.items()}})
        if last:
            results["ours"]["vllm"] = r
        results["ours"]["vllm_points"] = ours_points
        write_json(RESULTS, results)
    spec_points = []
    epoch_end = spec_epoch_ends(Path(results["speculators"]["metrics"]))
    ckpts = sorted((c for c in (SPEC / "runs" / "wall" / "ckpt").iterdir() if c.name.isdigit()),
                   key=lambda c: int(c.name))
    for ckpt in ckpts:
        last = ckpt == ckpts[-1]
        r = serve(str(ckpt), args.num_prompts, WORK / f"vllm-spec-{ckpt.name}",
                  measures=MEASURES if last else MEASURES[:1])
        i = len(s_toks) - 1 if last else epoch_end.get(int(ckpt.name), len(s_toks) - 1)
        spec_points.append({"epoch": int(ckpt.name), "tokens": s_toks[i], "train_s": round(s_secs[i]),
                            **{k: v["mean_acceptance_length"] for k, v in r.items()}})
        if last:
            results["speculators"]["vllm"] = r
        results["speculators"]["vllm_points"] = spec_points
        write_json(RESULTS, results)
    results["ratio"] = {m: round(results["ours"]["vllm"][m]["mean_acceptance_length"]
                                 / results["speculators"]["vllm"][m]["mean_acceptance_length"], 3)
                        for m, _, _ in MEASURES}
    write_json(RESULTS, results)
    plot(results, args.png)
    print(json.dumps({"ratio": results["ratio"], "probe": results.get("probe")}, indent=1))


if __name__ == "__main__":
    main()
