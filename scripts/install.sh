#!/usr/bin/env bash
# Install llm-fleet into the Python environment `python` runs in: the one install path of
# scripts/setup.sh (developers, CI) and of the Dockerfile (the released images), so CI tests the
# image's install steps even where no container engine runs.
#
#   bash scripts/install.sh torch                       # exactly torch==2.13.0, from $LLMFLEET_TORCH_INDEX
#   bash scripts/install.sh llm-fleet [--editable] [EXTRAS]   # the package, e.g. `llm-fleet --editable test,bench`
#   bash scripts/install.sh                             # both
#
# LLMFLEET_TORCH_INDEX: the index torch comes from (default PyTorch's CPU index;
# https://download.pytorch.org/whl/cu128 for the CUDA image).
# Every other distribution installs at the version constraints.txt pins (scripts/lock.sh writes
# it), so a new release upstream cannot change what CI tests or an image holds; LLMFLEET_UNPINNED=1
# installs the newest that pyproject.toml allows instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=(-c constraints.txt)
[[ "${LLMFLEET_UNPINNED:-0}" == 1 ]] && PINS=()

TORCH_VERSION=2.13.0
TORCH_INDEX=${LLMFLEET_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

install_torch() {
    # Exactly this torch, from the chosen index: PyPI's torch wheel for Linux x86-64 is the
    # multi-GB CUDA build. Then its dependencies from the usual index (the CUDA build's nvidia-*).
    if python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
        return
    fi
    python -m pip install -q --no-deps "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX"
    python -m pip install -q "${PINS[@]}" "torch==$TORCH_VERSION"  # its dependencies; the wheel above already satisfies it
}

install_package() {
    local editable=() extras=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --editable) editable=(-e) ;;
            *) extras="$1" ;;
        esac
        shift
    done
    python -m pip install -q "${PINS[@]}" "${editable[@]}" ".${extras:+[$extras]}"
    python -m llmfleet.cli --version  # the installed command answers
}

case "${1:-all}" in
    torch) install_torch ;;
    llm-fleet) shift; install_package "$@" ;;
    all) install_torch; install_package ;;
    *) echo "usage: bash scripts/install.sh [torch | llm-fleet [--editable] [EXTRAS]]" >&2; exit 2 ;;
esac
