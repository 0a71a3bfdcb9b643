"""The producer -> consumer demo as real processes: ``mpiexec -n N python mpi/ec_disagg.py``."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import shm_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "mpi", "ec_disagg.py")
SMALL = ["--target", "cpu", "--entries", "16", "--max-rows", "400", "--hidden", "64", "--timeout", "30"]

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def _run(n, *args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(["mpiexec", "-n", str(n), sys.executable, DEMO, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_help():
    out = subprocess.run([sys.executable, DEMO, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--region-fraction" in out.stdout and "--fail-at" not in out.stdout


@pytest.mark.parametrize("n, queues", [(2, "sync"), (3, "threaded")])
def test_round_trip_with_eviction_pressure(n, queues):
    before = shm_files()
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
    assert "no file in /dev/shm at any time" in out
    assert shm_files() <= before


def test_float32_entries_one_per_step_in_a_small_region():
    # The flags the round trip above leaves at their defaults: float32 entries, one save and
    # one load a step, another seed, a region of 0.25 MiB (about a third of the entries' bytes).
    before = shm_files()
    p = _run(2, *SMALL, "--dtype", "float32", "--saves-per-step", "1", "--loads-per-step", "1", "--seed", "3",
             "--region-mib", "0.25", "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "x float32)," in p.stdout, p.stdout
    # (an entry saved while the consumer asks for another may be evicted before it is asked for)
    loaded = int(re.search(r"(\d+) loaded and verified byte-exact on rank 1", p.stdout).group(1))
    before_ask = int(re.search(r"(\d+) evicted before the consumer asked", p.stdout).group(1))
    assert loaded + before_ask == 16 and loaded > 0, p.stdout
    assert int(re.search(r"evictions: (\d+) entries", p.stdout).group(1)) > 0
    assert p.stdout.rstrip().endswith("OK")
    assert shm_files() <= before


def test_max_steps_stops_a_run_that_is_not_done():
    p = _run(2, *SMALL, "--max-steps", "3", "--quiet")
    assert p.returncode != 0
    # (each side counts its own steps; the one that gets there second may be told first)
    assert re.search(r"\[rank [01]\] failed while running: RuntimeError: (producer|consumer): not done after "
                     r"--max-steps=3 steps", p.stderr), p.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_consumer_failure_exits_cleanly_everywhere(n):
    before = shm_files()
    p = _run(n, *SMALL, "--fail-at", "3")
    assert p.returncode != 0
    assert "[rank 1] failed while running: RuntimeError: injected failure at consumer step 3" in p.stderr
    # Every other rank is told at once (no timeout) and says who failed and what it was doing.
    for r in [0] + list(range(2, n)):
        assert re.search(rf"\[rank {r}\][^\[]*rank 1 failed[^\[]*injected failure at consumer step 3", p.stderr), \
            p.stderr
    assert "gave up waiting" not in p.stderr and "without MPI_Finalize" not in p.stderr
    assert shm_files() <= before


def test_a_fail_at_past_the_last_step_fails_the_run_instead_of_passing_it():
    # --fail-at 100000 printed "OK" with status 0: a fault test that tested nothing.
    p = _run(2, *SMALL, "--fail-at", "100000", "--quiet")
    assert p.returncode != 0
    assert re.search(r"\[rank 1\] failed while running: RuntimeError: --fail-at 100000 never fired: the consumer "
                     r"finished after \d+ step\(s\)", p.stderr), p.stderr
    assert _run(2, *SMALL, "--fail-at", "-1").returncode == 2


def test_config_mismatch_is_reported_by_both_ranks():
    before = shm_files()
    p = _run(2, *SMALL, "--consumer-hidden", "32")
    assert p.returncode != 0
    assert "this side expects dtype=float16, hidden_size=32" in p.stderr
    # Rank 0 says it stopped because of rank 1, and what rank 1 was doing (not a traceback of its own).
    assert re.search(r"\[rank 0\] stopped [^\[]*because rank 1 failed: consumer, while opening the region", p.stderr), \
        p.stderr
    assert shm_files() <= before


@pytest.mark.parametrize("flag, value, words", [
    ("--region-fraction", "nan", "'nan' must be a positive, finite number"),
    ("--region-fraction", "inf", "'inf' must be a positive, finite number"),
    ("--region-fraction", "-0.5", "'-0.5' must be a positive, finite number"),
    ("--region-mib", "0", "'0' must be a positive, finite number"),
    ("--timeout", "nan", "'nan' must be a positive, finite number"),
    ("--entries", "0", "0 must be >= 1"),
    ("--max-rows", "1.5", "'1.5' is not a whole number"),
    ("--inject", "explode:0:created", "expected (raise|kill|stop|interrupt):RANK:"),
    ("--seed", "-1", "-1 must be >= 0"),  # (numpy's "expected non-negative integer" on every rank, at run time)
])
def test_bad_command_line_values_are_clear_errors(flag, value, words, capsys):
    # Refused while parsing, before any rank waits for another: exit status 2 and one line.
    with pytest.raises(SystemExit) as ei:
        _demo_module().build_parser().parse_args([flag, value])
    err = capsys.readouterr().err
    assert ei.value.code == 2
    assert f"argument {flag}: " in err and words in err, err


@pytest.mark.parametrize("spec, words", [
    ("kill:1:saving@2", "rank 1 is the consumer leader, which never passes 'saving'"),
    ("stop:0:loading", "rank 0 is the producer, which never passes 'loading'"),
    ("raise:3:opened", "rank 3 does not exist; the job has ranks 0..2"),
    ("raise:0:created@2", "rank 0 (the producer) passes 'created' at most 1 time(s), so @2 would never fire"),
    ("kill:0:saving@17", "passes 'saving' at most 16 time(s)"),  # (16 entries: at most 16 steps)
])
def test_a_fault_that_could_never_fire_is_refused_once_under_mpiexec(spec, words):
    # Only the job knows its size and so which rank is what: the check runs after parsing,
    # yet still before any rank waits for another -- rank 0 says it once, every rank exits 2.
    p = _run(3, *SMALL, "--inject", spec, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count(words) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "OK" not in p.stdout


@pytest.mark.parametrize("ranks, args, words", [
    (2, ["--region-mib", "0.0001"], "--region-mib=0.0001 is smaller than the largest entry"),  # was enlarged silently
    (1, [], "needs at least 2 ranks (an encoder and a consumer)"),  # was '[rank 0] failed while running'
    # A region the fraction or --max-rows makes too large failed on a rank, naming region_bytes:
    (2, ["--region-fraction", "1e6"], "--region-fraction=1e+06 of the entries' "),
    (2, ["--max-rows", "1000000000"], "--max-rows=1000000000 rows of --hidden=64 x float16): more than this machine"),
    (2, ["--entries", "1000000000"], "--entries=1000000000: at most 100000"),  # (was a MemoryError)
])
def test_a_job_that_cannot_run_is_a_usage_error_said_once(ranks, args, words):
    p = _run(ranks, *SMALL, *args, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count(words) == 1 and "Traceback" not in p.stderr and "failed" not in p.stderr, p.stderr


def test_a_fault_the_run_never_reached_fails_the_job_at_its_end():
    # 16 entries may take fewer than 16 save steps: the spec is legal, the run decides -- and a
    # fault that never fired must not let a fault test pass without testing anything.
    p = _run(2, *SMALL, "--inject", "raise:0:saving@16", timeout=60)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "never fired: this run passed 'saving'" in p.stderr and "choose a smaller @N" in p.stderr, p.stderr
    assert "without MPI_Finalize" not in p.stderr  # the others were waiting at the end, not gone


def _demo_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ec_disagg_cli", DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_verify_refuses_a_load_that_came_back_short_or_shifted():
    # The expected data was rebuilt with the *loaded* row count, and the generator's rows do
    # not depend on the count: a load of the first 3 of 50 rows passed as byte-exact.
    import types

    d = _demo_module()
    args = types.SimpleNamespace(seed=0, hidden=32, dtype="float16")
    full = d.entry_data(0, 7, 50, 32, np.dtype("float16"))
    d.verify(args, "h", 7, 50, full, "consumer")  # the real thing passes
    with pytest.raises(RuntimeError, match=r"entry h \(index 7\) loaded with shape \(3, 32\); the encoder "
                                           r"produced \(50, 32\)"):
        d.verify(args, "h", 7, 50, full[:3], "consumer")
    shifted = np.concatenate([full[1:], full[:1]])
    with pytest.raises(RuntimeError, match="differs from what the encoder produced"):
        d.verify(args, "h", 7, 50, shifted, "consumer")
