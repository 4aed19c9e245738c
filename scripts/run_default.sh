#!/usr/bin/env bash
# The README's main job: set up, then run the whole pipeline on the embedded default (SmolLM2-135M-Instruct verifier,
# ShareGPT data) with configs/smollm2-sharegpt.yaml. Extra arguments go to `eagle3-train run` (e.g. --set train.epochs=1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --vllm
exec .venv/bin/eagle3-train run --config configs/smollm2-sharegpt.yaml "$@"
