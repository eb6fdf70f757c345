#!/usr/bin/env bash
# Install the peers scripts/bench_peers.py measures bert-cluster against into ./.venv-peers (created when
# missing): sentence-transformers' ONNX Runtime and OpenVINO backends. They cannot share ./.venv:
# optimum-onnx (0.1.0, the newest) needs transformers < 4.58, and bert-cluster needs transformers 5
# with sentence-transformers 6 (`pip install --dry-run` of both together: ResolutionImpossible).
# bert-cluster itself is not installed here; the benchmark runs its own methods in ./.venv and hands
# these environments the same documents and weights. Versions are pinned (what the results file records);
# torch is pinned in the same command so that nothing pulls another (multi-GB CUDA) torch.
#
# `bash scripts/setup_peers.sh infinity` installs Infinity (infinity-emb), the embeddings server
# `python -m benchmarks.serve` measures `bert-cluster serve` against, into ./.venv-infinity instead: it
# pins sentence-transformers < 4 and numpy < 2, beside bert-cluster's sentence-transformers 6 and
# transformers 5. The benchmark starts `infinity_emb v2 --model-id DIR --engine torch --device cpu`
# from it on the same model folder, with its usage statistics off (INFINITY_ANONYMOUS_USAGE_STATS=0,
# DO_NOT_TRACK=1).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
peers="${1:-onnx-openvino}"
case "$peers" in
  onnx-openvino) venv=.venv-peers ;;
  infinity) venv=.venv-infinity ;;
  *) echo "error: unknown peers '$peers': give onnx-openvino (the default) or infinity" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$peers" = infinity ]; then
  .venv-infinity/bin/pip install -q \
    torch==2.13.0 \
    "infinity-emb[server,torch]==0.0.78" \
    sentence-transformers==3.4.1 \
    transformers==4.57.6 \
    tokenizers==0.22.2 \
    numpy==1.26.4 \
    fastapi==0.165.0 \
    uvicorn==0.32.1
  INFINITY_ANONYMOUS_USAGE_STATS=0 DO_NOT_TRACK=1 .venv-infinity/bin/python -c "import importlib.metadata as m; print('infinity installed in .venv-infinity: infinity-emb', m.version('infinity-emb'), 'torch', m.version('torch'), 'sentence-transformers', m.version('sentence-transformers'))"
  exit 0
fi
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
