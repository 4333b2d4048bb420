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
# In two processes (pytest-xdist): most tests wait on servers, kopf and Prometheus more than they
# compute, so two halve the run on a 2-core machine. Tests marked `timed` take turns (a lock in
# tests/conftest.py). LLMFLEET_TEST_WORKERS sets the count; an argument `-n 0` runs everything in
# this process (for -s, or pdb). Not xdist's group modes (loadgroup, loadscope): they key tests by
# node id, schemathesis gives every operation of a parametrized test the same one, and all but
# one of those would never run.
python -m pytest -q -p no:cacheprovider -n "${LLMFLEET_TEST_WORKERS:-2}" --durations=25 "$@"
