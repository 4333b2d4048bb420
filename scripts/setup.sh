#!/usr/bin/env bash
# Create (or reuse) .venv and install llm-fleet with the CPU torch wheel pinned.
# Usage: bash scripts/setup.sh [--test]   (--test adds test deps, helm/kubectl and prometheus)
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true

# Exactly this torch, and its CPU build: PyPI's torch wheel for Linux x86-64 is the multi-GB CUDA
# build, so the wheel comes from PyTorch's CPU index (LLMFLEET_TORCH_INDEX picks another, e.g.
# https://download.pytorch.org/whl/cu128), and then its dependencies from the usual index.
TORCH_INDEX=${LLMFLEET_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if ! python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    python -m pip install -q --no-deps "torch==2.13.0" --index-url "$TORCH_INDEX"
    python -m pip install -q "torch==2.13.0"  # its dependencies; the wheel above already satisfies it
fi

if [[ $want_test == 1 ]]; then
    python -m pip install -q -e ".[test,bench]"
    bash scripts/install-tools.sh
else
    python -m pip install -q -e ".[bench]"
fi
echo "setup done: $(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
