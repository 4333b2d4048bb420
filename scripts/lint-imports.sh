#!/usr/bin/env bash
# import-linter (grimp) walks a package's directory tree, but llmfleet's sub-packages live in
# separate top-level folders (server/, operator/, bench/). Lint a built copy of the package,
# where they nest as installed, with the contracts from pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build  # stale copies from earlier builds would be linted too
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
python -m pip install -q --no-deps --no-build-isolation --target "$tree" . 2>&1 | grep -v '^WARNING' || true
# grimp needs a regular package; operator/ has no __init__.py in the source tree (see fleet/__init__.py)
touch "$tree/llmfleet/operator/__init__.py"
(cd "$tree" && PYTHONPATH="$tree" lint-imports "$OLDPWD/pyproject.toml")
