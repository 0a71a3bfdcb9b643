#!/usr/bin/env bash
# Every test stage, in order; every stage runs, and the run fails if any stage failed (the
# failed ones are listed at the end).  No stage may hang: pytest-timeout bounds each test,
# `timeout` bounds each stage, and `python -m mpi4py` aborts all ranks when one raises.
# Called by `bash scripts/bootstrap.sh test`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export VTNUMBA_TARGET=${VTNUMBA_TARGET:-cpu}
# thread method: a test stuck inside a blocking MPI call (where a signal cannot reach Python)
# still ends its process, and mpiexec then ends the others.
PYTEST_ARGS=(-p no:cacheprovider -q -rs --timeout=300 --timeout-method=thread)
FAILED=()

stage() {  # stage NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo
  echo "================ stage: $name"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -eq 5 ] && [[ " $* " == *" -m pytest "* ]]; then  # (another program's 5 means what it says)
    echo "(stage $name collected no tests: pytest exit code 5, treated as success)"
    rc=0
  fi
  echo "---------------- stage $name: exit $rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || FAILED+=("$name (exit $rc)")
}

# vtnumba's own segments only: MPICH itself leaves mpich_shm_* files when a job is aborted.
ls /dev/shm 2>/dev/null | grep -i vtnumba > /tmp/vtnumba-shm-before.$$ || true
ls /dev/shm 2>/dev/null | grep '^mpich_shm_' > /tmp/vtnumba-mpich-before.$$ || true

stage "serial tests (cpu + simulator)" 1500 python -m pytest "${PYTEST_ARGS[@]}" tests --ignore=tests/mpi
stage "MPI tests, 2 ranks" 900 mpiexec -n 2 python -m mpi4py -m pytest "${PYTEST_ARGS[@]}" --with-mpi tests/mpi
stage "MPI tests, 3 ranks" 900 mpiexec -n 3 python -m mpi4py -m pytest "${PYTEST_ARGS[@]}" --with-mpi tests/mpi
stage "tutorials under mpiexec -n 2" 900 python scripts/run_tutorials.py
stage "docs build (sphinx -W)" 600 python -m sphinx -W --keep-going -q -b html docs docs/_build/html

ls /dev/shm 2>/dev/null | grep -i vtnumba > /tmp/vtnumba-shm-after.$$ || true
# Only files that appeared are a leak (one that went away was some other job's, or an
# earlier run's that a janitor removed).
LEFT=$(comm -13 <(sort /tmp/vtnumba-shm-before.$$) <(sort /tmp/vtnumba-shm-after.$$))
if [ -n "$LEFT" ]; then
  echo "vtnumba files left in /dev/shm by the test run:"; echo "$LEFT"
  FAILED+=("/dev/shm leak")
fi
rm -f /tmp/vtnumba-shm-before.$$ /tmp/vtnumba-shm-after.$$

# The fault tests kill and stop ranks on purpose; a job that ends that way cannot unlink
# MPICH's own shared-memory segment.  Remove the ones this run made that no live process
# still maps (a running MPI job's segment is in its processes' /proc/PID/maps).
orphans=0
for f in $(ls /dev/shm 2>/dev/null | grep '^mpich_shm_' | grep -vxF -f /tmp/vtnumba-mpich-before.$$ || true); do
  if ! grep -qsF "/dev/shm/$f" /proc/[0-9]*/maps; then
    rm -f "/dev/shm/$f" && orphans=$((orphans + 1))
  fi
done
[ $orphans -eq 0 ] || echo "removed $orphans MPICH segment(s) left by the jobs the fault tests ended on purpose"
rm -f /tmp/vtnumba-mpich-before.$$

echo
if [ ${#FAILED[@]} -ne 0 ]; then
  echo "FAILED stages: ${FAILED[*]}"
  exit 1
fi
echo "all test stages passed"
