"""mpi/tpsp_model.py end to end: two ranks, small shapes, TPSP must match the regular forward.

    python -m pytest tests/test_tpsp_model_script.py -q      (starts its own mpiexec -n 2)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "mpi" / "tpsp_model.py"


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the script's --target decides
    return env


def test_help_lists_the_options():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60,
                          env=_env())
    assert proc.returncode == 0, proc.stderr
    for flag in ("--target", "--layers", "--tokens", "--hidden", "--ffn", "--norm", "--chunk", "--search"):
        assert flag in proc.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [["--norm", "rms", "--chunk", "4"], ["--norm", "layer", "--search", "--budget", "3"]])
def test_two_ranks_tpsp_matches_regular(extra):
    cmd = ["mpiexec", "-n", "2", sys.executable, str(SCRIPT), "--target", "cpu", "--layers", "2", "--tokens", "33",
           "--hidden", "32", "--ffn", "48", "--repeat", "1", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170, env=_env(),
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "OK: TPSP matches the regular forward" in out, out
    assert "time ratio TPSP / regular:" in out
    assert "max |hidden difference|" in out


def test_bad_arguments_are_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--layers", "0"], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 2 and "--layers must be >= 1" in proc.stderr
