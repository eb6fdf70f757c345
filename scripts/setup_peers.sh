#!/usr/bin/env bash
# Install the peers scripts/bench_peers.py measures bert-cluster against into ./.venv-peers (created when
# missing): sentence-transformers' ONNX Runtime and OpenVINO backends. They cannot share ./.venv:
# optimum-onnx (0.1.0, the newest) needs transformers < 4.58, and bert-cluster needs transformers 5
# with sentence-transformers 6 (`pip install --dry-run` of both together: ResolutionImpossible).
# bert-cluster itself is not installed here; the benchmark runs its own methods in ./.venv and hands
# these environments the same documents and weights. Versions are pinned (what the results file records);
# torch is pinned in the same command so that nothing pulls another (multi-GB CUDA) torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv-peers/bin/python ]; then
  "$python" -m venv .venv-peers
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv-peers/bin/pip install -q \
  torch==2.13.0 \
  numpy==2.4.6 \
  transformers==4.57.6 \
  tokenizers==0.22.2 \
  sentence-transformers==5.7.0 \
  optimum==2.1.0 \
  "optimum-onnx[onnxruntime]==0.1.0" \
  onnx==1.23.2 \
  onnxruntime==1.32.0 \
  "optimum-intel[openvino]==1.27.0" \
  openvino==2026.4.1 \
  openvino-tokenizers==2026.4.1.0 \
  nncf==3.4.0
.venv-peers/bin/python -c "import onnxruntime, openvino, optimum.intel, optimum.onnxruntime, sentence_transformers as st; print('peers installed in .venv-peers: sentence-transformers', st.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__)"
