#!/usr/bin/env bash
# Write constraints.txt, the versions CI and the images install, from the environment `python`
# runs in: every installed distribution but llm-fleet itself and torch (pinned apart, per index,
# by scripts/install.sh).
#
# To move to newer releases: in a fresh checkout (no .venv), `LLMFLEET_UNPINNED=1 bash
# scripts/test.sh` installs the newest that pyproject.toml allows and runs the tests; once they
# pass, `bash scripts/lock.sh` writes what was tested, and the change is committed with it.
set -euo pipefail
cd "$(dirname "$0")/.."
{
    echo "# The versions CI and the images install (scripts/install.sh applies them with pip's -c):"
    echo "# written by scripts/lock.sh from an environment whose tests passed. pyproject.toml keeps the"
    echo "# ranges llm-fleet works with; LLMFLEET_UNPINNED=1 installs without these pins."
    python -m pip freeze --exclude-editable | grep -v -E '^(#|torch==|llm-fleet==)' | LC_ALL=C sort -f
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
