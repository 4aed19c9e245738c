"""Measure vLLM server start-up time (to a ready /health and /v1/models) for SmolLM2 alone and with a random
EAGLE-3 draft, with and without --enforce-eager.

    .venv/bin/python benchmarks/vllm_startup.py [--out benchmarks/out/vllm_startup.json]

Compiled runs reuse ~/.cache/vllm/torch_compile_cache when it is warm; the result records that.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.vllm_helpers import write_random_eagle3_draft  # noqa: E402

from eagle3_train.assets.verifier import resolve_verifier  # noqa: E402
from eagle3_train.serving.vllm_options import speculative_config  # noqa: E402
from eagle3_train.serving.vllm_server import VLLMServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/out/vllm_startup.json")
    ap.add_argument("--cases", default="plain,plain-eager,eagle3,eagle3-eager")
    args = ap.parse_args()
    verifier = resolve_verifier("smollm2-135m-instruct")
    tmp = Path(tempfile.mkdtemp(prefix="vllm-startup-"))
    draft = write_random_eagle3_draft(tmp / "draft")
    cache = Path.home() / ".cache" / "vllm" / "torch_compile_cache"
    results = []
    for case in args.cases.split(","):
        spec = speculative_config(draft, 3) if case.startswith("eagle3") else None
        cache_warm = cache.exists() and any(cache.rglob("*"))
        server = VLLMServer(verifier, speculative=spec, enforce_eager=case.endswith("eager"),
                            log_path=tmp / f"{case}.log")
        with server:
            results.append({"case": case, "startup_s": round(server.startup_s, 1), "compile_cache_warm": cache_warm})
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
