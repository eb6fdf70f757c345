#!/usr/bin/env bash
# CI compile gate for the CUDA kernels (no GPU needed): builds bert_cluster._C with CUDA for sm_90 against
# the CUDA build of torch (a separate venv, .venv-cuda, reused when present), into a temporary folder,
# then imports it and checks that every op registered a CUDA kernel; then the same sources through the
# first-use build (bert_cluster._cuda_jit) from a package copy laid out as a wheel.
#
# Facts this relies on: torch==2.14.1 (+cu130) matches /usr/local/cuda's nvcc 13.0; the system toolkit
# lacks cusparse.h, which the pip wheels ship under site-packages/nvidia/cu13/include (setup.py adds it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BERT_CLUSTER_CUDA_VENV:-$ROOT/.venv-cuda}"
TORCH_SPEC="${BERT_CLUSTER_CUDA_TORCH:-torch==2.14.1}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"

if [[ ! -x "$CUDA_HOME/bin/nvcc" ]]; then
  echo "check_cuda_build: no nvcc under CUDA_HOME=$CUDA_HOME" >&2
  exit 1
fi
if ! "$VENV/bin/python" -c "import torch, ninja, setuptools; assert torch.version.cuda" 2>/dev/null; then
  echo "check_cuda_build: creating $VENV with $TORCH_SPEC (large; reused next time)"
  python3 -m venv "$VENV"
fi
# The build requirements at least at pyproject's minimums (a new venv keeps the setuptools its Python
# ships), and packaging and numpy (tests/test_wheel.py's user's torch). No bytecode: pip compiles it on one
# core, and nothing here runs most of it.
bash "$ROOT/scripts/build_requirements.sh" |
  xargs -d '\n' "$VENV/bin/pip" install -q --no-compile "$TORCH_SPEC" packaging numpy
PY="$VENV/bin/python"
"$PY" -c "import torch; print('check_cuda_build: torch', torch.__version__, 'cuda', torch.version.cuda)"

# BERT_CLUSTER_CUDA_WORK=DIR keeps the build folder (ninja then recompiles only what changed).
if [[ -n "${BERT_CLUSTER_CUDA_WORK:-}" ]]; then
  WORK="$BERT_CLUSTER_CUDA_WORK"
  mkdir -p "$WORK"
  rm -rf "$WORK/pkg"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi
cd "$ROOT"
# The CUDA kernels, and the one CPU kernel library of this CPU's level (the other two, and every one for
# the suite's torch, are built by scripts/setup.sh and tests/test_wheel.py).
BERT_CLUSTER_BUILD_CUDA=1 BERT_CLUSTER_ONLY_THIS_CPU=1 "$PY" setup.py build_ext --build-lib "$WORK/lib" \
  --build-temp "$WORK/tmp" >"$WORK/build.log" 2>&1 || {
  tail -60 "$WORK/build.log" >&2
  echo "check_cuda_build: FAILED to compile" >&2
  exit 1
}
if grep -E "\.cu.*warning|warning #" "$WORK/build.log" >/dev/null; then
  echo "check_cuda_build: nvcc warnings:" >&2
  grep -E -A3 "\.cu.*warning|warning #" "$WORK/build.log" >&2 || true
fi
# Import the fresh build next to a copy of the Python package (the checkout's own _C is left alone).
mkdir -p "$WORK/pkg"
cp -r "$ROOT/bert_cluster" "$WORK/pkg/bert_cluster"
rm -f "$WORK/pkg/bert_cluster"/_C*.so
cp "$WORK/lib/bert_cluster"/_C*.so "$WORK/pkg/bert_cluster/"
cd "$WORK"
PYTHONPATH="$WORK/pkg" "$PY" - <<'PY'
import torch

from bert_cluster import _loader, ops

state = ops.load_kernels()
assert state["loaded"], state["reason"]
assert state["with_cuda"], "built without CUDA"
missing = {key: [op for op in ops.OPS if not _loader.has_kernel(op, key)] for key in ("CPU", "CUDA")}
assert not any(missing.values()), f"ops without a kernel: {missing}"
print(f"check_cuda_build: OK, {len(ops.OPS)} ops registered for CPU ({state['cpu_isa']}) and CUDA "
      f"(torch {torch.__version__}, cuda {torch.version.cuda}, GPU visible: {torch.cuda.is_available()})")
PY

# The first-use build, a wheel's way to CUDA kernels (bert_cluster._cuda_jit): a package copy with no _C at
# all and the CUDA sources where a wheel carries them (bert_cluster/kernels), compiled by torch's extension
# builder into a fresh cache, loaded, and every op's CUDA kernel registered.
mkdir -p "$WORK/jit"
cp -r "$ROOT/bert_cluster" "$WORK/jit/bert_cluster"
rm -f "$WORK/jit/bert_cluster"/_C*.so
mkdir -p "$WORK/jit/bert_cluster/kernels"
cp -r "$ROOT/kernels/cuda" "$ROOT/kernels/checks.h" "$WORK/jit/bert_cluster/kernels/"
cd "$WORK"
BERT_CLUSTER_CACHE_DIR="$WORK/jit-cache" PYTHONPATH="$WORK/jit" "$PY" - <<'PY' 2>"$WORK/jit.log" || {
import os
from pathlib import Path

from bert_cluster import _cuda_jit, _cuda_sources, _loader, ops

assert _cuda_sources.kernels_dir() == Path(os.environ["PYTHONPATH"]) / "bert_cluster" / "kernels"
assert _cuda_jit.why_not() == "", _cuda_jit.why_not()
result = _cuda_jit.build()
assert result["ok"], result["reason"]
missing = [op for op in ops.KERNEL_OPS if not _loader.has_kernel(op, "CUDA")]
assert not missing, f"the first-use build registered no CUDA kernel for {missing}"
print(f"check_cuda_build: OK, first-use build of {len(ops.KERNEL_OPS)} CUDA ops for {result['arch_list']} "
      f"in {result['seconds']} s")
PY
  tail -40 "$WORK/jit.log" >&2
  for log in "$WORK"/jit-cache/cuda-kernels/*/build-error.log; do [[ -f "$log" ]] && tail -60 "$log" >&2; done
  echo "check_cuda_build: FAILED, the first-use CUDA build" >&2
  exit 1
}
