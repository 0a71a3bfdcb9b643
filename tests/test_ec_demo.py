"""The producer -> consumer demo as real processes: ``mpiexec -n N python mpi/ec_disagg.py``."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "mpi", "ec_disagg.py")
SMALL = ["--target", "cpu", "--entries", "16", "--max-rows", "400", "--hidden", "64", "--timeout", "30"]

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def _ec_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("vtnumba_ec_")}


def _run(n, *args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(["mpiexec", "-n", str(n), sys.executable, DEMO, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_help():
    out = subprocess.run([sys.executable, DEMO, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--region-fraction" in out.stdout and "--fail-at" not in out.stdout


@pytest.mark.parametrize("n, queues", [(2, "sync"), (3, "threaded")])
def test_round_trip_with_eviction_pressure(n, queues):
    before = _ec_files()
    p = _run(n, *SMALL, "--queues", queues)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert out.rstrip().endswith("OK")
    loaded = int(re.search(r"(\d+) loaded and verified byte-exact on rank 1", out).group(1))
    before_ask = int(re.search(r"(\d+) evicted before the consumer asked", out).group(1))
    assert loaded + before_ask == 16 and loaded > 0
    assert int(re.search(r"evictions: (\d+) entries", out).group(1)) > 0
    if n == 3:
        assert f"{loaded} on rank 2" in out  # the second TP rank verified every entry too
    assert "left behind: False" in out
    assert _ec_files() == before


def test_consumer_failure_exits_cleanly_everywhere():
    before = _ec_files()
    p = _run(2, *SMALL, "--fail-at", "3")
    assert p.returncode != 0
    assert "[rank 1] FAILED: RuntimeError: injected failure at consumer step 3" in p.stderr
    assert "[rank 0] FAILED: PeerFailure: rank 1 failed" in p.stderr  # told, not timed out
    assert "nothing after" not in p.stderr
    assert _ec_files() == before


def test_config_mismatch_is_reported_by_both_ranks():
    before = _ec_files()
    p = _run(2, *SMALL, "--consumer-hidden", "32")
    assert p.returncode != 0
    assert "this side expects dtype=float16, hidden_size=32" in p.stderr
    assert "[rank 0] FAILED: PeerFailure" in p.stderr
    assert _ec_files() == before
