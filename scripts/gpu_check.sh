#!/usr/bin/env bash
# The GPU check in one call, for a machine with one NVIDIA GPU and no network.
#
#   bash scripts/gpu_check.sh            # results under $OUT, or ./gpu-results
#
# 1. installs packages from wheels carried in the working tree (.whl/) if any are missing;
# 2. prints `vtnumba info`;
# 3. runs the cuda-target test suite;
# 4. runs the MPI tests with 2 ranks on the one GPU (CUDA IPC between two processes);
# 5. runs the benchmark suite (quick sizes) and writes JSON + plots;
# and prints a short summary table last.  Every log lands in the results directory.
# Without a GPU it says "no GPU" and exits 0 (a dry run that still checks the script).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RESULTS=${OUT:-$ROOT/gpu-results}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
[ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
declare -a SUMMARY

note() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); }

# 1. Packages: install carried wheels only for what is missing (no network there).
if ! "$PY" -c "import numba, numba.cuda, mpi4py, numpy, pytest" 2>/dev/null; then
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    echo "== installing carried wheels from .whl/"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/vtnumba-site "$ROOT"/.whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/vtnumba-site"
  else
    echo "missing Python packages and no .whl/ directory to install from" | tee "$RESULTS/install.log"
  fi
fi
export PATH="$(dirname "$PY"):/tmp/vtnumba-site/bin:$PATH"

# 2. Is there a GPU at all?
if ! "$PY" - <<'PYEOF' > "$RESULTS/gpu_probe.txt" 2>&1
import sys
from vtnumba.target import gpu_usable
ok, why = gpu_usable()
print(why)
sys.exit(0 if ok else 1)
PYEOF
then
  echo "no GPU: $(cat "$RESULTS/gpu_probe.txt" | tail -1) -- nothing to check (dry run ok)"
  echo "no GPU" > "$RESULTS/summary.txt"
  exit 0
fi
export VTNUMBA_TARGET=cuda

"$PY" -m vtnumba info --target cuda 2>&1 | tee "$RESULTS/info.txt"
[ ${PIPESTATUS[0]} -eq 0 ] && note "vtnumba info" ok || note "vtnumba info" FAILED

t0=$SECONDS
timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rs --timeout=120 tests --ignore=tests/mpi \
  --junitxml="$RESULTS/tests.xml" > "$RESULTS/tests.log" 2>&1
rc=$?; note "cuda tests (serial)" "exit $rc, $((SECONDS - t0)) s: $(tail -1 "$RESULTS/tests.log")"

t0=$SECONDS
timeout 180 mpiexec -n 2 "$PY" -m mpi4py -m pytest -p no:cacheprovider -q -rs --timeout=120 --with-mpi tests/mpi \
  > "$RESULTS/mpi_tests.log" 2>&1
rc=$?; note "cuda MPI tests (2 ranks, 1 GPU)" "exit $rc, $((SECONDS - t0)) s: $(tail -1 "$RESULTS/mpi_tests.log")"

t0=$SECONDS
timeout 150 mpiexec -n 2 "$PY" -m vtnumba bench all --quick --json "$RESULTS/bench.json" --plot "$RESULTS" \
  > "$RESULTS/bench.log" 2>&1
rc=$?; note "benchmarks (quick)" "exit $rc, $((SECONDS - t0)) s"
grep -E "ratio" "$RESULTS/bench.log" | head -20 > "$RESULTS/bench_ratios.txt"

echo
echo "================ GPU check summary ($RESULTS)"
printf '%s\n' "${SUMMARY[@]}" | tee "$RESULTS/summary.txt"
cat "$RESULTS/bench_ratios.txt"
