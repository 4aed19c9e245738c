#!/usr/bin/env bash
# The README's main job: set up, then run the whole pipeline on the embedded default (SmolLM2-135M-Instruct verifier,
# ShareGPT data) with configs/smollm2-sharegpt.yaml. Extra arguments go to `eagle3-train run` (e.g. --set train.epochs=1).
set -euo pipefail
cd "$(dirname "$0")/.."
# A vLLM the user already has (the python3 on PATH imports it, e.g. on a GPU host) is used as is; otherwise
# scripts/setup_vllm.sh installs the CPU build, but only on a host without a CUDA GPU.
if [ -z "${EAGLE3_VLLM_PYTHON:-}" ] && PYV=$(command -v python3) && "$PYV" -c "import vllm" >/dev/null 2>&1; then
  export EAGLE3_VLLM_PYTHON="$PYV"
fi
scripts/setup.sh --vllm
exec .venv/bin/eagle3-train run --config configs/smollm2-sharegpt.yaml "$@"
