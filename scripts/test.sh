#!/usr/bin/env bash
# The test command: installs what is missing, then lint, import layering and the whole test suite.
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
echo "== pytest"
python -m pytest -q -p no:cacheprovider "$@"
