#!/usr/bin/env bash
# The one prepared GPU run (a few minutes on one H200): build bert_cluster._C with CUDA in place against
# the machine's own torch, run the CUDA tests, then the attention benchmark on the GPU. Everything it
# writes goes under ${OUT:-results/gpu_check}: build.log, pytest.log, bench_attention_cuda.json.
#
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU, nvcc and a CUDA torch
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${OUT:-$ROOT/results/gpu_check}"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc >/dev/null; then CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"; else CUDA_HOME=/usr/local/cuda; fi
fi
export CUDA_HOME
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-8}"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
"$CUDA_HOME/bin/nvcc" --version | tail -2

echo "== build (CUDA, sm_${TORCH_CUDA_ARCH_LIST/./})"
start=$(date +%s)
rm -f bert_cluster/_C*.so
if ! BERT_CLUSTER_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace >"$DEST/build.log" 2>&1; then
  tail -80 "$DEST/build.log"
  echo "gpu_check: build FAILED" >&2
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
"$PY" - <<'PY'
import json
from bert_cluster import _loader
info = _loader.build_info()
print(json.dumps({k: info[k] for k in ("kernels_loaded", "kernels_reason", "kernels_with_cuda", "backends")}, indent=1))
assert info["kernels_loaded"] and info["kernels_with_cuda"], info["kernels_reason"]
PY

echo "== tests (-m cuda)"
status=0
"$PY" -m pytest -m cuda tests/ops -q -p no:cacheprovider 2>&1 | tee "$DEST/pytest.log" || status=1

echo "== benchmark (GPU)"
"$PY" scripts/bench_attention.py --device cuda --repeats 10 --output "$DEST/bench_attention_cuda.json" || status=1
exit $status
