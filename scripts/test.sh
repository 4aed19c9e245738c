#!/usr/bin/env bash
# The README's test command: set up both environments (ours + the vLLM CPU server's) and run the whole test suite,
# including the integration tests that start real vLLM servers. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev --vllm
.venv/bin/ruff check src tests benchmarks scripts
exec .venv/bin/pytest -ra "$@"
