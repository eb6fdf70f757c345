#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), lint, then the whole test suite on two pytest-xdist workers,
# each test file on one worker (--dist loadfile: a module's fixtures, such as tests/test_wheel.py's build,
# are made once; loadgroup's xdist_group marks have no effect under pytest 9.2, whose items keep their id
# elsewhere than where pytest-xdist 3.8 writes the group), the files that hold a slow test first
# (tests/conftest.py), with the slowest tests' times and the reasons of those over 20 s at the end. Extra
# arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
began=$SECONDS
# The install's kernel libraries, kept by their build inputs (setup.py): tests/test_wheel.py's wheel, built
# from the same inputs, takes them instead of compiling them again (3 to 4 minutes on 2 cores).
export BERT_CLUSTER_KERNEL_CACHE="${BERT_CLUSTER_KERNEL_CACHE:-$PWD/build/kernel-cache}"
bash scripts/setup.sh dev
echo "test.sh: install $((SECONDS - began)) s"
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
ruff format --check .
set +e
python -m pytest -n 2 --dist loadfile --durations=30 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
