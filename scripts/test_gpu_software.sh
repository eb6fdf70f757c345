#!/usr/bin/env bash
# The suite's CPU part on the GPU machine's software (CI, after the main suite): Python 3.12 when found,
# torch==2.11.0 from PyPI (2.11.0+cu130: the lent H200's build) and the oldest transformers pyproject.toml
# claims, in .venv-gpusw (reused when it holds them), with the CPU kernels built for that torch in a copy
# of the checkout (this checkout's own kernels are left alone). About 2 min of installs on a fresh
# machine, ~3 min of compile, then the tests. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${BERT_CLUSTER_GPUSW_VENV:-$ROOT/.venv-gpusw}"
TORCH_VERSION="${BERT_CLUSTER_GPUSW_TORCH:-2.11.0}"
PYTHON=python3
for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python "$(command -v python3.12 || true)"; do
  if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PYTHON="$candidate"
    break
  fi
done
# The oldest transformers claimed: the floor of pyproject's "transformers>=X,..." dependency.
FLOOR="$(sed -n 's/^ *"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml | head -1)"
[[ -n "$FLOOR" ]] || { echo "test_gpu_software: no transformers>=X in pyproject.toml" >&2; exit 1; }
# The kernels' build requirements at least at pyproject's minimums: a new venv keeps the setuptools its
# Python ships (65.5 with Python 3.11, the fallback), which refuses pyproject's licence string.
requires="$(bash scripts/build_requirements.sh | tr '\n' ' ')"
want="torch $TORCH_VERSION, transformers $FLOOR, ${requires}pytest-xdist"
if [[ "$(cat "$VENV/.tested-with" 2>/dev/null)" != "$want" ]]; then
  echo "test_gpu_software: making $VENV ($PYTHON; $want)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  # Every dependency but torch from pyproject.toml, then torch and transformers pinned to what is tested.
  mapfile -t DEPS < <("$VENV/bin/python" -c '
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith(("torch", "transformers"))))')
  # No bytecode compiled at install (the suite's imports compile what they use).
  bash scripts/build_requirements.sh | xargs -d '\n' "$VENV/bin/pip" install -q --no-compile \
    "torch==$TORCH_VERSION" "transformers==$FLOOR" "${DEPS[@]}" "pytest>=8" "pytest-timeout>=2.3" \
    "pytest-xdist>=3.5" "hypothesis>=6.100"
  echo "$want" >"$VENV/.tested-with"
fi
"$VENV/bin/python" -c 'import sys, torch, transformers; print("test_gpu_software: python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__)'
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$WORK"
cd "$WORK"
BERT_CLUSTER_ONLY_THIS_CPU=1 MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" setup.py build_ext --inplace >build.log 2>&1 || {
  tail -40 build.log >&2
  echo "test_gpu_software: the CPU kernels did not build against torch $TORCH_VERSION" >&2
  exit 1
}
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 -m "not data" \
  tests/ops tests/test_reference.py tests/test_properties.py tests/test_dispatch.py tests/test_hf.py \
  tests/test_cuda_jit.py tests/test_lean_import.py tests/test_gpu_check.py "$@"
status=$?
set -e
if [[ $status == 5 ]]; then
  echo "test_gpu_software: pytest collected no tests" >&2
  exit 1
fi
exit $status
