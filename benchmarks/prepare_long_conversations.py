"""CPU time of `prepare` on conversations of many turns (the loss mask probes the chat template once per reply).

Writes one conversation of N user/assistant turn pairs (short turns, as an agentic trace has) per size, runs the real
`prepare` on it with the SmolLM2 tokenizer and template at the default max_length, and reports process CPU seconds.
Before the bound on probed replies and the binary-search mask, the cost grew with the square of the turns (issue
27.12: 2,000 turns 33 s, 20,000 turns ~40 CPU-minutes).

Usage: .venv/bin/python benchmarks/prepare_long_conversations.py [--turns 2000,20000] [--max-length 2048]
Writes benchmarks/out/prepare_long_conversations.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", default="2000,20000", help="comma-separated numbers of turn pairs")
    p.add_argument("--max-length", type=int, default=2048)
    args = p.parse_args()
    from eagle3_train.data.prepare import prepare

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.turns.split(",")):
            src = Path(tmp) / f"long-{n}.jsonl"
            messages = [m for i in range(n) for m in ({"role": "user", "content": f"step {i}: run the tool"},
                                                      {"role": "assistant", "content": f"done {i}."})]
            src.write_text(json.dumps({"id": f"long-{n}", "messages": messages}) + "\n")
            c0, t0 = cpu_s(), time.perf_counter()
            m = prepare(src, "smollm2-135m-instruct", Path(tmp) / f"out-{n}", max_length=args.max_length,
                        val_fraction=0.0)
            rows.append({"turn_pairs": n, "cpu_s": round(cpu_s() - c0, 2), "wall_s": round(time.perf_counter() - t0, 2),
                         "tokens_kept": m["counts"]["tokens"]["train"], "truncated": m["counts"]["truncated"]})
            print(rows[-1], flush=True)
    out = {"command": "benchmarks/prepare_long_conversations.py " + f"--turns {args.turns} --max-length "
                      f"{args.max_length}", "machine": f"{platform.processor() or platform.machine()}, "
                      f"{platform.node()}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "prepare_long_conversations.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
