#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), lint, then the whole test suite on two pytest-xdist workers
# (the test files that hold a slow test start first: tests/conftest.py), with the slowest tests' times and
# the reasons of those over 20 s at the end. Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
began=$SECONDS
bash scripts/setup.sh dev
echo "test.sh: install $((SECONDS - began)) s"
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
ruff format --check .
set +e
python -m pytest -n 2 --dist loadgroup --durations=30 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
