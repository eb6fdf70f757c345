#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), lint, then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
ruff format --check .
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
