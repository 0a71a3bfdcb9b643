"""Faults that need whole processes: ``mpi/ec_disagg.py`` under mpiexec with a rank killed or stopped.

``--inject how:rank:point[@n]`` (:class:`vtnumba.ec.endpoints.FaultInjection`) makes one rank
``SIGKILL`` or ``SIGSTOP`` itself at an exact point of the endpoints' setup or of a
transfer.  Each test checks three things:

* the job ends -- well within its ``--timeout`` for a kill (mpiexec ends the others at once),
  within two timeouts for a stop (the others give up, then leave without ``MPI_Finalize``);
* what the surviving ranks print: which rank, and what they were waiting for;
* ``/dev/shm`` holds no vtnumba file afterwards -- the region never has a name, so even a
  rank killed in the middle of setting it up leaves none.  (MPICH's own ``mpich_shm_*``
  files are not ours.)

Kept short: tiny entries; ``--timeout 15`` for a kill (the job ends at once, so it only has to
outlast the first step's warm-up on a loaded machine) and :data:`TIMEOUT` for a stop; about a
minute in all.
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import shm_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "mpi", "ec_disagg.py")
TIMEOUT = 4  # a stop's: every wait's deadline, and the first step's warm-up must fit in it too
KILL_TIMEOUT = 15
SMALL = ["--target", "cpu", "--entries", "12", "--max-rows", "200", "--hidden", "32", "--quiet",
         "--timeout", str(TIMEOUT)]
STARTUP_S = 20  # starting the interpreters and importing numpy/numba, on a busy machine

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def run(n: int, *args) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    t0 = time.monotonic()
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, DEMO, *SMALL, *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=2 * KILL_TIMEOUT + 2 * STARTUP_S,
                          stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def said(proc, rank: int, pattern: str) -> bool:
    """Did ``rank`` print a message matching ``pattern``?  (mpiexec may run two ranks' lines
    together, so a message is taken to end where the next ``[rank`` begins.)"""
    return any(re.search(pattern, m) for m in re.findall(rf"\[rank {rank}\]([^\[]*)", proc.stderr))


@pytest.mark.parametrize("n, where", [
    (2, "0:created"),      # producer: region made, no consumer told yet
    (2, "1:opened"),       # consumer: region mapped, producer not told yet
    (3, "0:shared"),       # producer: every consumer mapped, its descriptor still open
    (3, "2:opened"),       # the second consumer rank, mid-setup
    (2, "0:saving@3"),     # producer: a batched save in flight
    (3, "1:loading@2"),    # consumer leader: a batched load in flight
    (3, "2:loading@2"),    # consumer TP rank: a batched load in flight
    (2, "1:loaded@2"),     # consumer leader: every rank has the entries, pins not yet released
])
def test_sigkill_at_any_point_ends_the_job_and_leaves_no_file(n, where):
    before = shm_files()
    proc, elapsed = run(n, "--inject", f"kill:{where}", "--timeout", str(KILL_TIMEOUT))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    rank = where.split(":")[0]
    # MPICH's mpiexec names the killed process and ends the others at once.
    assert "KILLED BY SIGNAL: 9" in out or "Killed (signal 9)" in out, out
    assert elapsed < STARTUP_S + 5, f"took {elapsed:.1f} s"  # (no wait ran out: mpiexec ended the job)
    assert "OK" not in proc.stdout.split(), f"rank {rank} was killed, yet the run reported success"
    assert shm_files() <= before, f"left in /dev/shm: {shm_files() - before}"


def test_stopped_consumer_is_named_by_the_producer_and_the_job_ends():
    before = shm_files()
    proc, elapsed = run(2, "--inject", "stop:1:loading@2")
    assert proc.returncode != 0
    gave_up = rf"rank 0 gave up waiting for rank 1 after {TIMEOUT} s \(the consumer's next requests"
    assert said(proc, 0, gave_up), proc.stderr
    assert said(proc, 0, "ending the job without MPI_Finalize"), proc.stderr
    assert said(proc, 0, r"rank 1 is stopped \(SIGSTOP\): ending it \(SIGKILL\)"), proc.stderr
    assert elapsed < 2 * TIMEOUT + STARTUP_S, f"took {elapsed:.1f} s"
    assert shm_files() <= before


def test_stopped_producer_is_named_by_the_consumer_leader_and_its_tp_rank_is_told():
    before = shm_files()
    proc, elapsed = run(3, "--inject", "stop:0:saving@2")
    assert proc.returncode != 0
    gave_up = rf"rank 1 gave up waiting for rank 0 after {TIMEOUT} s \(the encoder's ready entries"
    assert said(proc, 1, gave_up), proc.stderr
    # The TP rank waits for the leader, not the producer: it is *told* (it does not time out
    # and blame the leader) -- its own wait is twice as long, so the leader's ends first.
    assert said(proc, 2, "rank 1 failed.*gave up waiting for rank 0"), proc.stderr
    assert "rank 2 gave up" not in proc.stderr
    assert elapsed < 2 * TIMEOUT + STARTUP_S, f"took {elapsed:.1f} s"
    assert shm_files() <= before


def test_stopped_consumer_tp_rank_is_named_by_the_leader():
    before = shm_files()
    proc, elapsed = run(3, "--inject", "stop:2:loading@1")
    assert proc.returncode != 0
    assert said(proc, 1, rf"rank 1 gave up waiting for rank 2 after {TIMEOUT} s \(its load report"), proc.stderr
    assert said(proc, 0, "rank 1 failed"), proc.stderr  # the producer is told, not left waiting
    assert "rank 0 gave up" not in proc.stderr  # ... and does not blame the (innocent) leader
    assert elapsed < 2 * TIMEOUT + STARTUP_S, f"took {elapsed:.1f} s"
    assert shm_files() <= before


@pytest.mark.parametrize("where, failed, doing", [
    ("1:loaded@1", 1, "consumer leader, while returning \\d+ loaded entries"),
    ("0:shared", 0, "producer, while sharing the region \\(every consumer has opened it\\)"),
])
def test_a_failure_after_the_waits_names_what_the_rank_was_doing(where, failed, doing):
    # The last wait's text stayed: "while waiting for consumer rank 2's load report" -- an
    # innocent rank named, though every report was in (and every consumer had the region).
    proc, _ = run(3, "--inject", f"raise:{where}", "--timeout", str(KILL_TIMEOUT))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    others = [r for r in range(3) if r != failed]
    for r in others:
        assert said(proc, r, rf"because rank {failed} failed: {doing}: RuntimeError: injected failure"), proc.stderr
    assert "while waiting for consumer rank" not in proc.stderr, proc.stderr
