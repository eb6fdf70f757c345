#!/usr/bin/env bash
# The one prepared GPU session (sized for one H200 and the device tool's 10-minute command limit): build
# bert_cluster._C with CUDA against the machine's own torch, then the checks the CPU suite cannot make, the
# CUDA tests, the benchmark and compute-sanitizer. Every stage is time-boxed (a global budget, default
# 540 s, caps each one; stages that no longer fit are skipped and say so) and keeps its log. Everything goes
# under ${OUT:-results/gpu_check}, at most 8 files (what the device tool brings back):
#   summary.json  machine facts, each stage's status / seconds / limit, the failed checks, the speedups
#   build.log  checks.json  checks.log  pytest.log  bench.json  bench.log  sanitizer.log
#
#   bash scripts/gpu_check.sh                    # on a machine with a CUDA GPU, nvcc and a CUDA torch
#   GPU_CHECK_BUDGET=900 bash scripts/gpu_check.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${OUT:-$ROOT/results/gpu_check}"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc >/dev/null; then CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"; else CUDA_HOME=/usr/local/cuda; fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
BUDGET="${GPU_CHECK_BUDGET:-540}"
START=$(date +%s)
STAGES="$(mktemp)"

# The build, alone (called as `gpu_check.sh __build`, so that `timeout` can box it).
if [[ "${1:-}" == "__build" ]]; then
  rm -f bert_cluster/_C*.so
  if BERT_CLUSTER_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace; then exit 0; fi
  # An older setuptools refuses pyproject's PEP 639 licence string: build from a copy with the table form.
  echo "gpu_check: build failed; retrying from a copy with license = {text = ...} in pyproject.toml"
  copy="$(mktemp -d)"
  cp -r setup.py pyproject.toml README.md kernels bert_cluster "$copy"/
  sed -i 's/^license = "\(.*\)"/license = {text = "\1"}/' "$copy/pyproject.toml"
  (cd "$copy" && BERT_CLUSTER_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace) || exit 1
  cp "$copy"/bert_cluster/_C*.so bert_cluster/
  exit 0
fi

# stage NAME LIMIT LOG COMMAND...: run COMMAND with at most LIMIT seconds (and never past the budget).
stage() {
  local name="$1" limit="$2" log="$3"
  shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  if ((left < 20)); then
    echo "== $name: skipped (budget spent)"
    printf '%s\tskipped\t0\t0\n' "$name" >>"$STAGES"
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit} s)"
  local t0=$(date +%s) rc
  timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local took=$(($(date +%s) - t0)) status=passed
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$took" "$limit" >>"$STAGES"
  echo "   $status in ${took} s (log: $(basename "$log"))"
  tail -5 "$log" | sed 's/^/   | /'
  [[ $status == passed ]]
}

MACHINE="$(mktemp)"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -2
  "$PY" -c "import sys, torch, setuptools; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| gpu', torch.cuda.is_available(), '| setuptools', setuptools.__version__)" 2>&1
  "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -1
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  nproc
} >"$MACHINE"
echo "== machine"
cat "$MACHINE"

if stage build 300 "$DEST/build.log" bash "$0" __build; then
  stage checks 150 "$DEST/checks.log" "$PY" scripts/gpu_checks.py checks --output "$DEST/checks.json"
  stage pytest-cuda 150 "$DEST/pytest.log" "$PY" -m pytest -m cuda tests/ops tests/test_dispatch.py -q \
    -p no:cacheprovider -o addopts=""
  stage bench 150 "$DEST/bench.log" "$PY" scripts/gpu_checks.py bench --output "$DEST/bench.json"
  SANITIZER="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
  stage memcheck 120 "$DEST/sanitizer.log" "$SANITIZER" --tool memcheck --error-exitcode 3 "$PY" \
    scripts/gpu_checks.py quick
  stage racecheck 90 "$DEST/sanitizer.log" "$SANITIZER" --tool racecheck --error-exitcode 3 "$PY" \
    scripts/gpu_checks.py quick
fi

"$PY" - "$STAGES" "$MACHINE" "$DEST" "$BUDGET" <<'PY'
import json, sys
from pathlib import Path

stages_file, machine_file, dest, budget = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
stages = []
for line in Path(stages_file).read_text().splitlines():
    name, status, seconds, limit = line.split("\t")
    stages.append({"stage": name, "status": status, "seconds": int(seconds), "limit": int(limit)})
summary = {"machine": Path(machine_file).read_text().splitlines(), "budget_s": budget, "stages": stages}
checks = dest / "checks.json"
if checks.is_file():
    data = json.loads(checks.read_text())
    summary["checks_failed"] = data.get("failed", data.get("error"))
    summary["checks_run"] = len(data.get("results", []))
bench = dest / "bench.json"
if bench.is_file():
    data = json.loads(bench.read_text())
    summary["speedup_vs_sdpa_flash_bf16"] = {
        f"batch {r['batch']} N {r['n']}": round(r["speedup_vs_sdpa"], 2) if "speedup_vs_sdpa" in r else r.get("error")
        for r in data["rows"]
    }
    summary["mixed_batch_memory"] = data.get("mixed_batch_memory")
(dest / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
rm -f "$STAGES" "$MACHINE"
"$PY" -c "import json,sys; s=json.load(open('$DEST/summary.json')); sys.exit(0 if all(x['status']=='passed' for x in s['stages']) else 1)"
