#!/usr/bin/env bash
# The test command: installs what is missing, then lint, import layering, the docs build and the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/server/core -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
export PATH="$PWD/.tools/bin:$PATH"

echo "== ruff"
ruff check .
ruff format --check .
echo "== import-linter"
bash scripts/lint-imports.sh
echo "== mkdocs"
# --strict: a broken link or anchor fails (never --quiet, which would hide the warnings it counts).
# NO_MKDOCS_2_WARNING silences mkdocs-material's banner about its successor.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
echo "== pytest"
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
