#!/usr/bin/env bash
# Download the wheels that `scripts/gpu_check.sh` installs on a GPU machine without network.
#
#   bash scripts/gpu_wheels.sh          # fills .whl/ (git-ignored), prints the total size
#   bash scripts/gpu_wheels.sh --list   # prints the pinned list below, one per line
#
# A machine image made for GPU work typically has numba, cuda-bindings, pytest, hypothesis,
# CuPy and torch, but not MPI, not the pytest plugins vtnumba's tests use, and a numpy newer
# than numba-cuda accepts.  Without network there, the missing pieces travel as wheels: this
# script fetches, on a machine with network, exactly those wheels for the GPU machine's
# interpreter (CPython 3.12 on manylinux x86_64), binary wheels only and without their
# dependencies (those are the ones the image already has; anything else pip resolved would
# be a wheel nobody meant to carry).  The folder travels with the working tree, which is
# capped at 64 MiB, so the script fails above LIMIT_MIB.
#
# The MiniLM weights wheel is deliberately not here: it is larger than the whole cap.  The
# model tests skip without it.
set -euo pipefail
cd "$(dirname "$0")/.."

# One list, pinned: keep the versions equal to the ones the developer .venv was tested with.
WHEELS=(
  numpy==2.4.6          # numba-cuda 0.30.4 cannot be imported with numpy >= 2.5
  mpich==5.0.2          # libmpi and mpiexec (no system MPI is assumed)
  mpi4py==4.1.2
  pytest-mpi==0.6       # pytest --with-mpi
  pytest-timeout==2.4.0 # bounds every test, so a hung collective cannot stall the run
  numba-cuda==0.30.4    # the CUDA target numba.cuda is redirected to
  safetensors==0.8.0    # the MiniLM loader reads weights with it
  tokenizers==0.23.3    # the MiniLM tokenizer
)
PY_VERSION=3.12
# pip matches a wheel's platform tag literally, so every manylinux level up to the GPU
# machine's glibc is named (a wheel tagged only manylinux1 is not found under manylinux_2_28).
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64
           manylinux1_x86_64)
LIMIT_MIB=60
DEST=.whl

if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "${WHEELS[@]}"
  exit 0
fi

PY=${PYTHON:-}
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
PY=${PY:-python3}

# Start from an empty folder so a wheel left over from an older pin is never carried.
rm -rf "$DEST"
mkdir -p "$DEST"
echo "== downloading ${#WHEELS[@]} wheels for CPython $PY_VERSION / manylinux x86_64 into $DEST/"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
"$PY" -m pip download --quiet --dest "$DEST" --no-deps --only-binary=:all: \
  --implementation cp --python-version "$PY_VERSION" "${platform_args[@]}" \
  "${WHEELS[@]}"

ls -l "$DEST"
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "error: expected ${#WHEELS[@]} wheels in $DEST/, found $count" >&2
  exit 1
fi
total_kib=$(du -sk "$DEST" | cut -f1)
total_mib=$(( (total_kib + 1023) / 1024 ))
echo "total: ${total_mib} MiB in ${count} wheels (limit ${LIMIT_MIB} MiB)"
if [ "$total_mib" -gt "$LIMIT_MIB" ]; then
  echo "error: $DEST/ is ${total_mib} MiB, over the ${LIMIT_MIB} MiB that can travel with the working tree" >&2
  exit 1
fi
