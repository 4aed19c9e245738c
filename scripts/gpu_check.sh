#!/usr/bin/env bash
# Entry point of the GPU check on the device machine (see scripts/gpu_check.py): installs the wheels carried in
# .whl/ (datasets, dill, multiprocess: not in the machine's image) into /tmp/site when python3 lacks `datasets`,
# then runs every part.
#   OUT=/some/dir bash scripts/gpu_check.sh [gpu_check.py flags, e.g. --budget-s 420]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpucheck-out}
mkdir -p "$OUT"
if ! python3 -c "import datasets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec python3 scripts/gpu_check.py --out "$OUT" "$@"
