#!/usr/bin/env bash
# Provide the vLLM server env (idempotent): src/eagle3_train/serving/vllm_env.py says where it is and how it is made
# ($EAGLE3_VLLM_PYTHON, else .venv-vllm; nothing installed on a CUDA host; else .venv-vllm with the vLLM CPU build).
# It imports only the standard library, so any python3 runs it before our env exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=src exec "${PYTHON:-python3}" -m eagle3_train.serving.vllm_env .venv-vllm
