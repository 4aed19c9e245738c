#!/usr/bin/env bash
# Create .venv with pinned dependencies, the package (editable) and the embedded assets. Idempotent.
# Usage: scripts/setup.sh [--dev] [--vllm]   (--dev: the test tools and the trackers of requirements-trackers.txt;
#   --vllm: scripts/setup_vllm.sh, the vLLM CPU build on hosts without a CUDA GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dev=0; vllm=0
for a in "$@"; do case "$a" in --dev) dev=1;; --vllm) vllm=1;; *) echo "unknown option $a" >&2; exit 2;; esac; done
source scripts/pipq.sh
ensure_venv "$PY" .venv
pipq .venv/bin/pip install -r requirements.txt
if [ "$dev" = 1 ]; then
  pipq .venv/bin/pip install -r requirements-dev.txt
  # the optional trackers (train.report_to: wandb, mlflow, trackio), which the tests run offline; -c: never a new pin
  pipq .venv/bin/pip install -r requirements-trackers.txt -c requirements.txt
fi
pipq .venv/bin/pip install --no-deps -r requirements-assets.txt
pipq .venv/bin/pip install --no-deps -e .
# transformers imports these when present and they fail beside the CPU torch wheel.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, transformers, eagle3_train; print('eagle3-train env ok: torch', torch.__version__)"
# tcmalloc: train/extract/run re-execute under it (~1.5x faster CPU training, src/eagle3_train/utils/host_memory.py).
# Optional: installed where apt can (root or passwordless sudo), else everything runs on glibc's malloc.
if ! .venv/bin/python -c "import sys; from eagle3_train.utils.host_memory import tcmalloc_library as t; sys.exit(t() is None)"; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  if command -v apt-get >/dev/null && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }; then
    $SUDO apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "note: could not install libtcmalloc-minimal4; training uses glibc's malloc (slower on CPU)" >&2
  else
    echo "note: libtcmalloc-minimal4 not installed (needs apt as root); training uses glibc's malloc (slower on CPU)" >&2
  fi
fi
if [ "$vllm" = 1 ]; then scripts/setup_vllm.sh; fi
