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

# torch (pinned, CPU build unless LLMFLEET_TORCH_INDEX says otherwise), then the package: the
# same script the Dockerfile runs, so CI exercises the image's install steps.
bash scripts/install.sh torch
if [[ $want_test == 1 ]]; then
    bash scripts/install.sh llm-fleet --editable test,bench
    bash scripts/install-tools.sh
else
    bash scripts/install.sh llm-fleet --editable bench
fi
echo "setup done: $(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
