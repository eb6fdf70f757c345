#!/usr/bin/env bash
# Build bert_cluster._C with CUDA HERE (no GPU needed) against the GPU machine's torch, so that a lent GPU
# spends no minutes compiling: `gpu_check.sh correctness --skip-build` then loads this build.
#
#   bash scripts/prebuild_gpu.sh        # ~2 min of downloads, then the compile (long on 2 cores)
#
# Makes .venv-gpu (Python 3.12 when found, torch==2.11.0 from PyPI: 2.11.0+cu130, the very build the GPU
# machine runs; the loader refuses CUDA kernels built for any other torch build), compiles with
# /usr/local/cuda's nvcc 13.0 for sm_90 (the H200) and every x86-64 CPU library (the GPU machine's CPU level
# is not known here), into .gpu-build/bert_cluster/. Both folders are git-ignored: name .gpu-build in the
# device call's `carry` (4.9 MB); gpu_check.sh --skip-build copies it into bert_cluster/ there. Measured
# on the shared 2-core Zen 4: 9 min 20 s (the CUDA sources and three CPU libraries).
# BERT_CLUSTER_GPU_TORCH / BERT_CLUSTER_GPU_PYTHON / BERT_CLUSTER_GPU_VENV override the torch spec, the Python
# and the venv (e.g. scripts/test_gpu_software.sh's .venv-gpusw, which holds the same torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${BERT_CLUSTER_GPU_VENV:-$ROOT/.venv-gpu}"
TORCH_SPEC="${BERT_CLUSTER_GPU_TORCH:-torch==2.11.0}"
PYTHON="${BERT_CLUSTER_GPU_PYTHON:-python3}"
for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python "$(command -v python3.12 || true)"; do
  if [[ -z "${BERT_CLUSTER_GPU_PYTHON:-}" && -n "$candidate" ]] \
    && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PYTHON="$candidate"
    break
  fi
done
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [[ ! -f "$CUDA_HOME/lib64/libcudart.so" && -z "$(compgen -G "$CUDA_HOME/lib64/libcudart.so*")" ]]; then
  echo "prebuild_gpu: no lib64/libcudart.so under CUDA_HOME=$CUDA_HOME" >&2
  exit 1
fi
if ! "$VENV/bin/python" -c "import torch, ninja, setuptools; assert torch.version.cuda" 2>/dev/null; then
  echo "prebuild_gpu: creating $VENV ($PYTHON, $TORCH_SPEC)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" ninja setuptools wheel packaging numpy
fi
"$VENV/bin/python" -c "import torch; print('prebuild_gpu: torch', torch.__version__, 'cuda', torch.version.cuda)"
rm -rf .gpu-build
BERT_CLUSTER_BUILD_CUDA=1 "$VENV/bin/python" setup.py build_ext --build-lib .gpu-build --build-temp build/gpu-prebuild
ls -l .gpu-build/bert_cluster/
du -sh .gpu-build
echo "prebuild_gpu: carry .gpu-build; run: bash scripts/gpu_check.sh correctness --skip-build"
