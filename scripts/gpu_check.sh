#!/usr/bin/env bash
# The prepared GPU run, as two calls that each fit one device command (10 minutes at most) with time left in
# a 15-minute lease to rerun one of them (docs/development.md, "The GPU run"):
#
#   bash scripts/gpu_check.sh correctness [--skip-build] [--dry-run]   # budget 280 s
#   bash scripts/gpu_check.sh speed       [--skip-build] [--dry-run]   # budget 260 s
#
# correctness: build bert_cluster._C with CUDA against the machine's torch (or, with --skip-build, load the
#   _C carried in the working tree: scripts/prebuild_gpu.sh makes it here), probe it, the GPU checks
#   (scripts/gpu_checks.py checks), and `pytest -m cuda` with -rs, FAILING when any test was skipped.
# speed: the same build unless the _C already there has CUDA kernels for this torch (a warm machine keeps
#   the first call's build), the benchmark (i-clustered, no growth: the kernels' own figures; i-clustered+
#   timed apart), and compute-sanitizer memcheck limited to the project's kernels.
#
# Each stage has a limit, and the limits of a call sum within its budget (GPU_CHECK_BUDGET overrides it;
# a stage that no longer fits is `skipped`, reported, and does not fail the call). A stage is passed,
# failed, timeout, skipped (not needed or not possible here: no compute-sanitizer, the device refused it)
# or stub (--dry-run: it needs a GPU). The exit status is 0 when no stage failed or timed out.
# --dry-run runs either call on a CPU-only machine with the CPU kernels standing in for CUDA (CI does), so
# that no error in these scripts reaches the GPU machine.
#
# Everything goes under ${OUT:-results/gpu_check/CALL} (at most 8 files: what the device tool brings back):
#   summary.json  build.log  checks.json  checks.log  pytest.json  pytest.log  bench.json  bench.log
#   (speed: sanitizer.log instead of the checks)
# GPU_CHECK_STAGES="checks pytest-cuda" runs only the stages named (the others are reported as skipped).
set -uo pipefail
usage() {
  echo "usage: gpu_check.sh correctness|speed [--skip-build] [--dry-run]" >&2
  exit 2
}
CALL="${1:-}"
[[ "$CALL" == correctness || "$CALL" == speed || "$CALL" == __build || "$CALL" == __memcheck ]] || usage
shift
DRY=0 SKIP_BUILD=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    *) usage ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST="${GPU_CHECK_DEST:-${OUT:-$ROOT/results/gpu_check/$CALL}}"
export GPU_CHECK_DEST="$DEST"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
# Only the CPU library of this machine's x86-64 level: a third of the CPU compile.
export BERT_CLUSTER_ONLY_THIS_CPU=1
# No compile hidden inside a stage: a _C for another torch, or without CUDA, fails the probe at once
# instead of building on first use (minutes of device time).
export BERT_CLUSTER_CPU_JIT=0 BERT_CLUSTER_CUDA_JIT=0
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# A kernel launched with too much shared memory, an illegal address: the error at the launch, not later.
export CUDA_LAUNCH_BLOCKING="${CUDA_LAUNCH_BLOCKING:-0}"
if [[ "$CALL" == speed ]]; then DEFAULT_BUDGET=260; else DEFAULT_BUDGET=280; fi
BUDGET="${GPU_CHECK_BUDGET:-$DEFAULT_BUDGET}"
KILL_AFTER=5 # a stage that ignores SIGTERM is killed this much later: inside its limit, inside the budget
START=$(date +%s)
STAGES="$(mktemp)"
NOTES="$(mktemp)"
trap 'rm -f "$STAGES" "$NOTES"' EXIT
note() { echo "$*" | tee -a "$NOTES"; }

# CUDA_HOME: the toolkit whose lib64 holds libcudart.so (nvcc may be a wrapper in /usr/local/bin, two
# folders above which no CUDA library lies: the link then fails with "cannot find -lcudart").
find_cuda_home() {
  local candidate nvcc_path
  local candidates=("${CUDA_HOME:-}" "${CUDA_PATH:-}")
  nvcc_path="$(command -v nvcc || true)"
  if [[ -n "$nvcc_path" ]]; then
    candidates+=("$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")" "$(dirname "$(dirname "$nvcc_path")")")
  fi
  candidates+=(/usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13 /opt/cuda)
  for candidate in "${candidates[@]}"; do
    [[ -n "$candidate" ]] || continue
    if [[ -x "$candidate/bin/nvcc" ]] && compgen -G "$candidate/lib64/libcudart.so*" >/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
if [[ $DRY == 0 ]]; then
  if CUDA_HOME="$(find_cuda_home)"; then
    export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
    note "CUDA_HOME=$CUDA_HOME (lib64/libcudart.so found)"
  else
    unset CUDA_HOME
    note "CUDA_HOME: no toolkit with bin/nvcc and lib64/libcudart.so found; a build cannot link"
  fi
fi
# ninja: without it torch's builder compiles one file at a time (~430 s on 16 cores instead of ~60 s).
if ! command -v ninja >/dev/null; then
  NINJA_DIR="$("$PY" -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null || true)"
  [[ -n "$NINJA_DIR" && -x "$NINJA_DIR/ninja" ]] && export PATH="$NINJA_DIR:$PATH"
fi
if command -v ninja >/dev/null; then
  note "ninja: $(command -v ninja) ($(ninja --version))"
else
  note "ninja: absent: a build compiles one file at a time and will not fit its stage"
fi

# Each call's stages and limits (seconds); they sum within the default budget.
if [[ "$CALL" == correctness ]]; then
  LIMITS=(build:150 probe:20 checks:60 pytest-cuda:45)
else
  LIMITS=(build:150 probe:20 bench:60 memcheck:25)
fi
# --dry-run: the CPU stand-in on a small shared CI machine is slower than the GPU: limits and budget x3.
SLACK=1
if [[ $DRY == 1 ]]; then
  SLACK=3
  BUDGET=$((BUDGET * SLACK))
fi
limit_of() {
  local item
  for item in "${LIMITS[@]}"; do [[ "${item%%:*}" == "$1" ]] && echo $((${item#*:} * SLACK)); done
}
record() { # name status seconds limit [why]
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$STAGES"
  echo "== $1: $2${5:+ ($5)}"
}
wanted() { [[ -z "${GPU_CHECK_STAGES:-}" || " $GPU_CHECK_STAGES " == *" $1 "* ]]; }

# stage NAME LOG COMMAND...: run COMMAND within the stage's limit (and never past the budget).
stage() {
  local name="$1" log="$2" limit
  shift 2
  limit="$(limit_of "$name")"
  if ! wanted "$name"; then
    record "$name" skipped 0 "$limit" "not in GPU_CHECK_STAGES"
    return 0
  fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if ((left < 15)); then
    record "$name" skipped 0 "$limit" "the call's budget of ${BUDGET} s is spent"
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit} s)"
  local t0 rc took status=passed
  t0=$(date +%s)
  timeout --kill-after=$KILL_AFTER $((limit - KILL_AFTER)) "$@" >>"$log" 2>&1
  rc=$?
  took=$(($(date +%s) - t0))
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  record "$name" "$status" "$took" "$limit"
  echo "   log: $(basename "$log")"
  tail -5 "$log" | sed 's/^/   | /'
  [[ $status == passed ]]
}

# The build, alone (called as `gpu_check.sh __build`, so that `timeout` can box it). The licence fallback
# runs only when the log shows an older setuptools refusing pyproject's PEP 639 licence string.
build() {
  rm -f bert_cluster/_C*.so
  local log="$1"
  if BERT_CLUSTER_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace; then return 0; fi
  if ! grep -qiE "project\.license.*(must be|valid)|license.*table|invalid pyproject" "$log"; then
    return 1
  fi
  echo "gpu_check: setuptools refused the licence string; retrying from a copy with license = {text = ...}"
  local copy
  copy="$(mktemp -d)"
  cp -r setup.py pyproject.toml README.md kernels bert_cluster "$copy"/
  sed -i 's/^license = "\(.*\)"/license = {text = "\1"}/' "$copy/pyproject.toml"
  (cd "$copy" && BERT_CLUSTER_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace) || return 1
  cp "$copy"/bert_cluster/_C*.so bert_cluster/
}
# memcheck on the project's kernels only (their names carry the bert_cluster namespace), not PyTorch's;
# on every kernel when this compute-sanitizer does not know --kernel-name.
memcheck() {
  local out rc
  out="$(mktemp)"
  "$SANITIZER" --tool memcheck --error-exitcode 3 --kernel-name kns=bert_cluster \
    "$PY" scripts/gpu_checks.py quick >"$out" 2>&1
  rc=$?
  cat "$out"
  if ((rc != 0)) && grep -qiE "unrecognized|unknown option|invalid (option|value|argument)" "$out"; then
    echo "gpu_check: this compute-sanitizer refused --kernel-name; memcheck on every kernel"
    "$SANITIZER" --tool memcheck --error-exitcode 3 "$PY" scripts/gpu_checks.py quick
    rc=$?
  fi
  rm -f "$out"
  return $rc
}
if [[ "$CALL" == __build ]]; then
  build "$DEST/build.log"
  exit $?
fi
if [[ "$CALL" == __memcheck ]]; then
  memcheck
  exit $?
fi

# Whether the _C here has CUDA kernels for this very torch (a carried or a reused build).
has_cuda_build() {
  "$PY" - <<'PY' >/dev/null 2>&1
import sys, torch
from bert_cluster import _loader, ops
state = ops.load_kernels()
sys.exit(0 if state["loaded"] and state["with_cuda"] and all(_loader.has_kernel(o, "CUDA") for o in ops.KERNEL_OPS) else 1)
PY
}

MACHINE="$(mktemp)"
{
  echo "call: $CALL$([[ $DRY == 1 ]] && echo ' --dry-run')$([[ $SKIP_BUILD == 1 ]] && echo ' --skip-build')"
  if [[ $DRY == 0 ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -2
  fi
  "$PY" -c "import sys, torch, setuptools; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| gpu', torch.cuda.is_available(), '| setuptools', setuptools.__version__)" 2>&1
  [[ $DRY == 0 && -n "${CUDA_HOME:-}" ]] && "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -1
  echo "cores: $(nproc)"
} >"$MACHINE"
echo "== machine"
cat "$MACHINE" "$NOTES"

DEVICE=cuda GPU_CHECK_KEY=CUDA
[[ $DRY == 1 ]] && DEVICE=cpu GPU_CHECK_KEY=CPU
export GPU_CHECK_KEY
PROBE='import json, os, torch
from bert_cluster import _loader, ops
s = ops.load_kernels()
key = os.environ["GPU_CHECK_KEY"]
missing = [o for o in ops.KERNEL_OPS if not _loader.has_kernel(o, key)]
print(json.dumps({"loaded": s["loaded"], "reason": s["reason"], "with_cuda": s["with_cuda"], "built_for": s["torch_version"], "path": s.get("path"), "dispatch_key": key, "missing": missing}))
assert s["loaded"] and not missing, (s["reason"], missing)'
if [[ $DRY == 1 ]]; then
  record build stub 0 "$(limit_of build)" "--dry-run: a CUDA build needs nvcc and a CUDA torch (CI's check_cuda_build.sh compiles it)"
elif [[ $SKIP_BUILD == 1 ]]; then
  # scripts/prebuild_gpu.sh's build, carried as .gpu-build (else the _C already in bert_cluster/).
  if compgen -G ".gpu-build/bert_cluster/_C*.so" >/dev/null; then
    rm -f bert_cluster/_C*.so
    cp .gpu-build/bert_cluster/_C*.so bert_cluster/
  fi
  record build skipped 0 "$(limit_of build)" "--skip-build: the _C carried in the working tree"
elif [[ "$CALL" == speed ]] && has_cuda_build; then
  record build skipped 0 "$(limit_of build)" "the _C here already has CUDA kernels for this torch"
else
  stage build "$DEST/build.log" bash "$0" __build
fi
BUILD_STATUS="$(awk -F'\t' '$1 == "build" {print $2}' "$STAGES")"
if [[ "$BUILD_STATUS" == failed || "$BUILD_STATUS" == timeout ]]; then
  for name in probe $([[ "$CALL" == correctness ]] && echo checks pytest-cuda || echo bench memcheck); do
    record "$name" skipped 0 "$(limit_of "$name")" "no build"
  done
else
  stage probe "$DEST/build.log" "$PY" -c "$PROBE"
  if [[ "$CALL" == correctness ]]; then
    stage checks "$DEST/checks.log" "$PY" scripts/gpu_checks.py checks --device "$DEVICE" --output "$DEST/checks.json"
    if [[ $DRY == 1 ]]; then
      record pytest-cuda stub 0 "$(limit_of pytest-cuda)" "--dry-run: every test marked cuda needs a GPU"
    else
      stage pytest-cuda "$DEST/pytest.log" "$PY" scripts/gpu_checks.py pytest --output "$DEST/pytest.json" -- \
        -m cuda -q ${GPU_CHECK_PYTEST_TARGETS:-tests/ops tests/test_dispatch.py tests/test_cuda_jit.py}
    fi
  else
    if [[ $DRY == 1 ]]; then
      stage bench "$DEST/bench.log" "$PY" scripts/gpu_checks.py bench --device cpu --lengths 512 --batches 1 2 \
        --plus-batches 1 --repeats 1 --output "$DEST/bench.json"
      record memcheck stub 0 "$(limit_of memcheck)" "--dry-run: compute-sanitizer needs a GPU"
    else
      # 4k to 16k tokens, batch 1 and 16 (q, k, v 0.4 GB at the largest); i-clustered+ at batch 1 and
      # 16 only where its (R, H, N, k, D) gather stays under 32 GB. Rows are written as they are measured.
      stage bench "$DEST/bench.log" "$PY" scripts/gpu_checks.py bench --lengths 4096 8192 16384 \
        --batches 1 16 --plus-batches 1 16 --repeats 5 --output "$DEST/bench.json"
      SANITIZER="$(command -v compute-sanitizer || true)"
      [[ -z "$SANITIZER" && -x "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" ]] && SANITIZER="$CUDA_HOME/bin/compute-sanitizer"
      if [[ -z "$SANITIZER" ]]; then
        record memcheck skipped 0 "$(limit_of memcheck)" "compute-sanitizer is not installed"
      else
        export SANITIZER
        stage memcheck "$DEST/sanitizer.log" bash "$0" __memcheck
        if grep -qE "Device not supported|error 999|Unable to find injection|not supported on this" "$DEST/sanitizer.log" 2>/dev/null \
          && [[ "$(awk -F'\t' '$1 == "memcheck" {s = $2} END {print s}' "$STAGES")" == failed ]]; then
          sed -i '$d' "$STAGES"
          record memcheck skipped 0 "$(limit_of memcheck)" "compute-sanitizer refused this device (see sanitizer.log)"
        fi
      fi
    fi
  fi
fi

"$PY" - "$STAGES" "$MACHINE" "$NOTES" "$DEST" "$BUDGET" "$CALL" "$DRY" "$(($(date +%s) - START))" <<'PY'
import json
import sys
from pathlib import Path

stages_file, machine_file, notes_file, dest, budget, call, dry, took = sys.argv[1:9]
dest = Path(dest)
stages = []
for line in Path(stages_file).read_text().splitlines():
    name, status, seconds, limit, why = (line.split("\t") + [""])[:5]
    entry = {"stage": name, "status": status, "seconds": int(seconds), "limit": int(limit or 0)}
    if why:
        entry["why"] = why
    stages.append(entry)
ok = not any(s["status"] in ("failed", "timeout") for s in stages)
summary = {
    "call": call,
    "dry_run": dry == "1",
    "ok": ok,
    "budget_s": int(budget),
    "seconds": int(took),
    "machine": Path(machine_file).read_text().splitlines() + Path(notes_file).read_text().splitlines(),
    "stages": stages,
}
checks = dest / "checks.json"
if checks.is_file():
    data = json.loads(checks.read_text())
    summary["checks_failed"] = data.get("failed", data.get("error"))
    summary["checks_stub"] = data.get("stubs", [])
    summary["checks_run"] = len(data.get("results", []))
pytest_file = dest / "pytest.json"
if pytest_file.is_file():
    data = json.loads(pytest_file.read_text())
    summary["pytest"] = {key: data.get(key) for key in ("passed", "skipped", "failures", "errors", "problems")}
bench = dest / "bench.json"
if bench.is_file():
    data = json.loads(bench.read_text())
    summary["speedup_vs_sdpa_flash_bf16 (i-clustered, C 25, k 32, no growth)"] = {
        f"batch {r['batch']} N {r['n']}": round(r["speedup_vs_sdpa"], 2) if "speedup_vs_sdpa" in r else r.get("error")
        for r in data["rows"]
    }
    summary["i_clustered_plus_ms (convert default, growth)"] = {
        f"batch {r['batch']} N {r['n']}": round(r["i_clustered_plus_ms"], 2)
        if "i_clustered_plus_ms" in r
        else r.get("skipped", r.get("error"))
        for r in data.get("i_clustered_plus", [])
    }
    summary["mixed_batch_memory"] = data.get("mixed_batch_memory")
(dest / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
sys.exit(0 if ok else 1)
PY
