#!/usr/bin/env bash
# import-linter (grimp) walks a package's directory tree, but llmfleet's sub-packages live in
# separate top-level folders (server/, operator/, bench/). Lint a built copy of the package,
# where they nest as installed, with the contracts from pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
python -m pip install -q --no-deps --no-build-isolation --target "$tree" . 2>&1 | grep -v '^WARNING' || true
(cd "$tree" && PYTHONPATH="$tree" lint-imports --config "$OLDPWD/pyproject.toml")
