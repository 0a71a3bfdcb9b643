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


def _run_model(ranks: int, *extra: str) -> str:
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, str(SCRIPT), "--target", "cpu", "--layers", "2",
           "--tokens", "33", "--hidden", "32", "--ffn", "48", "--repeat", "1", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170, env=_env(),
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "max |hidden difference|" in out
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("act", [None, "silu"])
def test_two_ranks_tpsp_matches_regular(act):
    out = _run_model(2, "--norm", "rms", "--chunk", "4", *(["--act", act] if act else []))
    assert f"norm=rms act={act or 'gelu'}" in out, out
    assert "OK: TPSP matches the regular forward" in out and "(4 fused calls, 0 regular" in out, out
    assert "time ratio TPSP / regular:" in out and "speed-up of TPSP" in out


@pytest.mark.timeout(180)
def test_a_measured_profile_is_reported_for_what_it_chose():
    # At these tiny shapes the search may find the fused op no faster and turn it off: then
    # the script must say so -- with the reason -- instead of timing the regular forward
    # against itself and calling the ratio TPSP's speed-up.
    out = _run_model(2, "--norm", "layer", "--search", "--budget", "3")
    assert "profile (measured" in out, out
    if "TPSP disabled (" in out:
        assert "(0 fused calls" in out and "no TPSP speed-up to report" in out, out
        assert "speed-up of TPSP" not in out and "OK: the fallback (sharded residual, regular calls) matches" in out
    else:
        assert "OK: TPSP matches the regular forward" in out and "speed-up of TPSP" in out, out


@pytest.mark.timeout(120)
def test_one_rank_says_tpsp_did_not_run():
    out = _run_model(1)
    assert "TPSP disabled (the fused backend is unavailable" in out and "(0 fused calls" in out, out
    assert "TPSP needs 2 or more ranks" in out and "speed-up of TPSP" not in out, out
    assert out.count("TPSPDisabledWarning") == 0, "the reason is said once, in the profile line"


def test_bad_arguments_are_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--layers", "0"], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == 2 and "--layers must be >= 1" in proc.stderr


def test_an_ffn_narrower_than_the_ranks_is_a_usage_error():
    # Every rank failed while building the model ("cannot split total=2 into parts=3"), status 1.
    proc = subprocess.run(["mpiexec", "-n", "3", sys.executable, str(SCRIPT), "--target", "cpu", "--ffn", "2"],
                          capture_output=True, text=True, timeout=60, env=_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("--ffn=2 is smaller than the 3 ranks") == 1, proc.stderr
