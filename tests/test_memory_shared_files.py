"""Named shared-memory files are not left behind when their creator is killed.

``atexit`` covers exits and exceptions; a kill runs nothing of the process, so the files
it created are removed by the janitor process of :mod:`vtnumba.memory.shared_files`, which
lives in a session of its own (``mpiexec`` kills a failed job's process groups).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_child(body: str) -> subprocess.CompletedProcess:
    code = "import os, signal, sys\nsys.path.insert(0, %r)\n" % ROOT + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.fixture
def shm_paths():
    """The /dev/shm names a test uses, removed after it whatever happened (a list to fill)."""
    paths: list[str] = []
    yield paths
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def _gone_soon(path: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_killed_creator_leaves_no_file(sig, shm_paths):
    path = f"/dev/shm/vtnumba-test-janitor-{os.getpid()}-{sig}"
    shm_paths.append(path)
    proc = _run_child(f"""
        from vtnumba.memory.shared_files import create_private_file
        create_private_file({path!r})
        assert os.path.exists({path!r})
        os.kill(os.getpid(), signal.{sig})   # no exit hook runs
    """)
    assert proc.returncode == -getattr(signal, sig), proc.stderr
    assert _gone_soon(path), f"{path} was left behind by a creator killed with {sig}"


def test_the_janitor_spares_a_file_that_took_the_name_since(shm_paths):
    # The creator's file was removed behind its back and someone else made a file of the same
    # name: that one is not ours, and must survive the creator's death.
    path = f"/dev/shm/vtnumba-test-janitor-{os.getpid()}-reused"
    shm_paths.append(path)
    proc = _run_child(f"""
        from vtnumba.memory.shared_files import create_private_file
        create_private_file({path!r})
        os.unlink({path!r})
        with open({path!r}, "w") as f:
            f.write("someone else's")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    time.sleep(1.0)  # the janitor has seen the pipe close by now
    assert os.path.exists(path), "the janitor removed a file it did not make"


def test_unlinked_files_are_forgotten_and_exit_stops_the_janitor():
    proc = _run_child("""
        from vtnumba.memory import shared_files
        p = "/dev/shm/vtnumba-test-janitor-%d-done" % os.getpid()
        os.close(shared_files.create_private_file(p))
        shared_files.unlink_private_file(p)
        assert not os.path.exists(p) and not shared_files._linked
        janitor = shared_files._janitor
        shared_files._unlink_leftovers()        # what runs at exit
        assert janitor.wait(timeout=10) == 0    # it finished at once, with nothing to remove
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("then", ["create", "unlink"])
def test_a_janitor_that_died_is_replaced_and_told_every_file_still_listed(then, shm_paths):
    # The janitor is killed; the creator's next create (or unlink) finds its pipe broken and
    # starts another.  The new one must cover the files made before, not only the next one:
    # when the creator is killed after that, nothing of it is left.
    base = f"/dev/shm/vtnumba-test-janitor-{os.getpid()}-{then}"
    shm_paths.extend([base + "-a", base + "-b", base + "-c"])
    proc = _run_child(f"""
        from vtnumba.memory import shared_files
        a, b, c = {shm_paths!r}
        for p in (a, b):
            os.close(shared_files.create_private_file(p))
        first = shared_files._janitor
        first.kill()
        first.wait()
        if {then!r} == "create":
            os.close(shared_files.create_private_file(c))
        else:
            shared_files.unlink_private_file(b)
        assert shared_files._janitor is not first and shared_files._janitor.poll() is None
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    for p in shm_paths:
        assert _gone_soon(p), f"{p} was left behind: the replacement janitor was not told of it"


def test_a_forked_child_leaves_its_parents_files_alone(shm_paths):
    # A child forked after the parent made a file did not make it: the child's normal exit
    # (atexit runs) must not remove it, and the parent still removes it at its own exit.
    path = f"/dev/shm/vtnumba-test-janitor-{os.getpid()}-fork"
    shm_paths.extend([path, path + "-child"])
    proc = _run_child(f"""
        from vtnumba.memory import shared_files
        os.close(shared_files.create_private_file({path!r}))
        pid = os.fork()
        if pid == 0:
            assert not shared_files._linked        # the child lists none of its parent's files
            os.close(shared_files.create_private_file({path!r} + "-child"))
            sys.exit(0)                             # atexit: removes the child's file only
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists({path!r}), "the child's exit removed its parent's file"
        assert not os.path.exists({path!r} + "-child"), "the child's own file was left behind"
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert _gone_soon(path), "the parent's exit left its file behind"


def test_a_forked_child_does_not_keep_its_parents_janitor_waiting(shm_paths):
    # The janitor acts once every holder of its pipe has ended.  A child forked by the creator
    # must not be one: when the creator is killed while the child lives on, the creator's
    # file goes at once, not when the child ends.
    path = f"/dev/shm/vtnumba-test-janitor-{os.getpid()}-held"
    shm_paths.append(path)
    proc = _run_child(f"""
        import time
        from vtnumba.memory import shared_files
        os.close(shared_files.create_private_file({path!r}))
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (1, 2):                   # (the test reads the creator's output until it closes)
                os.dup2(devnull, fd)
            time.sleep(30)                      # a long-lived worker that makes no files
            os._exit(0)
        print(pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    try:
        assert _gone_soon(path, 5.0), "the creator's file stayed while its forked child lived"
        os.kill(child, 0)  # (the child was still alive all along)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_exit_hook_starts_no_janitor_to_replace_one_that_died(shm_paths):
    base = f"/dev/shm/vtnumba-test-janitor-{os.getpid()}-exit"
    shm_paths.extend([base + "-a", base + "-b"])
    proc = _run_child(f"""
        from vtnumba.memory import shared_files
        for p in {shm_paths!r}:
            os.close(shared_files.create_private_file(p))
        shared_files._janitor.kill()
        shared_files._janitor.wait()

        def no_janitor(*args, **kwargs):
            raise AssertionError("a janitor was started at exit")

        shared_files.subprocess.Popen = no_janitor
        shared_files._unlink_leftovers()        # what runs at exit
        assert not any(os.path.exists(p) for p in {shm_paths!r}) and not shared_files._linked
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _run_script(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_a_dropped_owners_finalizer_never_waits_for_the_files_lock():
    # Garbage collection -- and a finalizer -- can run inside any allocation, also in this
    # module's code while it holds its (plain) lock: the finalizer waited for it for good.
    proc = _run_script("""
        import faulthandler, gc, os
        from vtnumba.memory import shared_files
        from vtnumba.dist.shm import ShmSegment
        faulthandler.dump_traceback_later(20, exit=True)
        first = ShmSegment.create(4096, "a", named=True)
        gc.disable()
        seg = ShmSegment.create(4096, "b", named=True)
        path = seg.path
        seg.cycle = seg          # only the cyclic collector frees it
        del seg
        real = shared_files._tell_janitor
        def tell(message):       # runs with the lock held: a collection here runs the finalizer
            gc.collect()
            return real(message)
        shared_files._tell_janitor = tell
        other = ShmSegment.create(4096, "c", named=True)
        shared_files._tell_janitor = real
        assert not os.path.exists(path), "the dropped segment's file is still there"
        assert path not in shared_files._linked, "it is still tracked after the lock's next holder"
        first.close(); other.close()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_a_forked_child_dropping_its_copy_leaves_the_parents_file():
    proc = _run_script("""
        import gc, os, warnings
        from vtnumba.dist.shm import ShmSegment
        warnings.simplefilter("ignore", ResourceWarning)
        seg = ShmSegment.create(4096, "fork", named=True)   # the parent's: peers still to attach
        pid = os.fork()
        if pid == 0:
            del seg; gc.collect()                          # the child's copy goes
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.path.exists(seg.path))
        seg.close()
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stdout + proc.stderr
