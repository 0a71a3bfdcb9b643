"""Process-wide settings a program makes before it loads anything heavy, and its command line's checks.

Under ``mpiexec -n N`` on one machine, every rank's OpenBLAS would otherwise start one
thread per core, so N ranks run N x cores threads that fight for the same cores (two
ranks with a BLAS thread per core each ran the MiniLM encoder at about half the speed of
one thread each).  BLAS reads its thread count once, when numpy is first imported, so a
program calls :func:`share_cores_between_local_ranks` first thing -- the command line, the
tutorial helper, the ``mpi/`` scripts and the test suite's conftest do.  The library never
does it by itself: ``import vtnumba`` changes nothing in the process.  An explicit
``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` always wins.

Command lines under ``mpiexec``: :class:`RankZeroErrorsParser` prints a usage error once,
:func:`check_output_folder` refuses an output folder that cannot be written *before* the
run, not after minutes of it, and :func:`choose_target` refuses ``--target cuda`` on a
machine without a usable GPU before anything is loaded.
"""

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from vtnumba.faults import INTERRUPTED, say
from vtnumba.trace import world_rank


def share_cores_between_local_ranks() -> None:
    """Give each of the MPI ranks on this machine an equal share of its cores for BLAS."""
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if not local or any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return
    try:
        ranks = max(1, int(local))
    except ValueError:
        return
    if ranks > 1:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))


#: How long a rank other than 0 with a usage error waits for rank 0 to end the job with the
#: same message (the usual case: one command line, one environment) before saying its own.
USAGE_GRACE_S = 0.5


class RankZeroErrorsParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors and help only world rank 0 prints -- unless
    the error is another rank's alone.

    Under ``mpiexec -n N`` every rank parses the same command line, so a bad flag would print
    the same usage message N times: rank 0 says it, and the job ends with status 2.  But a
    rank may also fail alone -- its environment differs (a launcher that sets
    ``VTNUMBA_DEVICE`` per rank), or so does its command line (``mpiexec ... : ...``).  A rank
    that left before ``MPI_Init`` kept the others waiting there for good, and said nothing
    if rank 0 was fine.  So a failing rank joins MPI first and then leaves without
    ``MPI_Finalize``, which makes ``mpiexec`` end the whole job at once; a rank other than 0
    waits :data:`USAGE_GRACE_S` for rank 0 to do that (the same error everywhere: said
    once), and otherwise says its own error, naming itself.  Subcommand parsers made from it
    behave the same (argparse makes them of the parent's class)."""

    def error(self, message):
        rank = world_rank()
        if rank is None:
            super().error(message)  # (usage to stderr, status 2)
        from mpi4py import MPI  # (joins the job: the other ranks may be waiting in MPI_Init for this one)

        if MPI.COMM_WORLD.Get_size() == 1:
            super().error(message)
        if rank != 0:
            time.sleep(USAGE_GRACE_S)  # (rank 0 with the same error ends the job meanwhile: said once)
            message = f"[rank {rank}] {message}"
        try:
            if rank == 0:
                self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        finally:
            end_the_job(MPI.COMM_WORLD, 2)

    def print_help(self, file=None):
        """The help text, from world rank 0 only (``--help`` under ``mpiexec``: once, not once per rank)."""
        if world_rank() in (None, 0):
            super().print_help(file)


def end_the_job(comm, code: int):
    """End every rank of ``comm``'s job now, with exit status ``code``: ``MPI_Abort``, after
    what this rank wrote has left.

    (Leaving with ``os._exit`` also ends the job, but ``mpiexec`` then sometimes reports the
    ranks it killed -- status 9 and a banner -- instead of ``code``.  MPI_Abort's status is
    ``code`` every time; its own line, "application called MPI_Abort", adds nothing to the
    message just written, so stderr is closed first.)"""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.1)  # (mpiexec forwards the output before it takes the processes down)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    finally:
        comm.Abort(code)


def check_environment(parser: argparse.ArgumentParser) -> None:
    """Read now the ``VTNUMBA_*`` switches the library reads deep inside -- where a bad value
    was a traceback per rank as a module loaded (``VTNUMBA_CHECK_HAZARDS``), was taken for
    the default (``VTNUMBA_CPU_QUEUES``), was ignored off the GPU (``VTNUMBA_DEVICE``,
    ``VTNUMBA_MATMUL_VARIANT``) or failed mid-run on it: a usage error naming the variable,
    said once.  (Called by :func:`choose_target` and by
    ``vtnumba info``, after the target is chosen: these modules load numba.)"""
    try:
        from vtnumba.memory.hazards import mode_from_env  # (a bad value raises as it loads, too)

        mode_from_env()
        from vtnumba.backend.cpu import threaded_from_env

        threaded_from_env()
        from vtnumba.device_rule import requested_device

        requested_device()
        from vtnumba.kernels.matmul import variant_from_env  # (read at every device matmul, deep in a run)

        variant_from_env()
    except ValueError as exc:
        parser.error(str(exc))


def choose_target(parser: argparse.ArgumentParser, name: str | None, *, source: str = "--target"):
    """:func:`vtnumba.target.select_target` for a program: a bad name, or the ``cuda`` target
    (asked for by ``source`` or ``VTNUMBA_TARGET``) where a rank finds no usable GPU, is a
    usage error (status 2).  Returns the :class:`~vtnumba.target.TargetChoice`.

    Without the GPU check, every rank failed on its own when it made its backend -- after
    loading its model -- and printed the same error.  Under ``mpiexec`` the ranks agree on
    the answer first (:func:`_every_ranks_gpu`): ranks need not see the same GPUs, even on one
    machine (a launcher may set ``CUDA_VISIBLE_DEVICES`` per rank), and a rank leaving alone
    would keep the others waiting.  So all leave together: rank 0 says which ranks have
    none, each of those says why.
    """
    from vtnumba.target import TargetError, gpu_usable, select_target

    try:
        choice = select_target(name, source=source)
    except TargetError as exc:
        parser.error(str(exc))
    check_environment(parser)
    if choice.name == "cuda" and not choice.reason.startswith("auto"):
        usable, why = gpu_usable()
        answers = _every_ranks_gpu(usable)
        if answers is None or not any(answers):  # (one process, or no rank has one: the same reason)
            if not usable:
                parser.error(f"{choice.reason}, but this process finds no usable CUDA GPU ({why}); use --target cpu "
                             "or cudasim ('vtnumba info' says what this process finds)")
        elif not all(answers):
            if not usable:  # (before rank 0's usage message: each says its own reason)
                say(f"[rank {world_rank()}] no usable CUDA GPU: {why}")
            parser.error(f"{choice.reason}, but rank(s) {[r for r, ok in enumerate(answers) if not ok]} of "
                         f"{len(answers)} find no usable CUDA GPU; every rank needs one ('vtnumba info' under the "
                         "same mpiexec says what each finds)")
    return choice


def _every_ranks_gpu(usable: bool) -> list[bool] | None:
    """Every rank's ``usable``, gathered (None outside ``mpiexec``).  Non-blocking and polled:
    a rank that never gets here (it failed first) ends the wait after the process's default
    timeout (:data:`vtnumba.dist.DEFAULT_TIMEOUT_S`)."""
    if world_rank() is None:
        return None
    import numpy as np
    from mpi4py import MPI

    from vtnumba.dist.comm import wait_for_every_rank

    world = MPI.COMM_WORLD
    answers = np.zeros(world.Get_size(), np.uint8)
    wait_for_every_rank(world.Iallgather(np.array([usable], np.uint8), answers), "agreeing on the cuda target")
    return [bool(a) for a in answers]


def one_line_warnings(program: str) -> None:
    """Show warnings as one line each, ``PROGRAM: warning: Category: message`` (``[rank r]`` first
    under ``mpiexec``), instead of Python's two lines that point into vtnumba's source -- for
    a command line's user, not a library's (who keeps Python's format)."""
    import warnings

    rank = world_rank()
    who = f"[rank {rank}] " if rank is not None else ""

    def show(message, category, filename, lineno, file=None, line=None):
        stream = file if file is not None else sys.stderr
        try:
            stream.write(f"{who}{program}: warning: {category.__name__}: {message}\n")
        except (OSError, ValueError):  # (a closed stream: a warning is never worth a crash)
            pass

    warnings.showwarning = show


def exit_quietly_when_interrupted(main) -> int:
    """``main()``, except that a Ctrl-C it lets through -- one during startup, while numpy, numba
    and MPI load, before the program's own handling (:func:`vtnumba.dist.run_collectively`)
    begins -- prints one line instead of a traceback per rank, and leaves at once
    (:func:`leave_after_interrupt`)."""
    try:
        return main()
    except BaseException as exc:
        if not interrupted(exc):
            raise
        leave_after_interrupt()


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C: a KeyboardInterrupt, or an error an import raised *because*
    of one (numpy turns an interrupt inside its C-extension import into an ImportError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def leave_after_interrupt() -> None:
    """Say ``[rank r] interrupted (Ctrl-C ...)`` and leave now, skipping the interpreter's
    teardown (after an import of a compiled module was cut short it can crash).

    How it leaves is what makes ``mpiexec`` end the job: once MPI is initialized, an exit
    without ``MPI_Finalize`` (status 130, as a shell reports SIGINT) does; before, only a
    death by the signal itself does -- the other ranks may be inside ``MPI_Init``, which
    would wait for this one for good."""
    rank = world_rank()
    who = f"[rank {rank}] " if rank is not None else ""
    try:
        say(f"{who}{INTERRUPTED}")
        sys.stdout.flush()
    finally:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is None or not mpi.Is_initialized():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)


def quiet_interrupts_at_top_level() -> None:
    """For a script (no ``main()`` to wrap): an uncaught Ctrl-C at the top level is one line
    (:func:`leave_after_interrupt`) instead of a traceback -- until a later hook takes over."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if interrupted(exc):
            leave_after_interrupt()
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def check_output_folder(flag: str, folder) -> None:
    """ValueError naming ``flag`` unless ``folder`` exists or can be made, and a file can be
    written in it -- asked by trying (as root, ``os.access`` says yes to nearly anything)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{flag} {folder}: is a file, not a folder")
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {folder}: cannot write there ({exc.strerror or exc}); "
                         "expected a folder this user can create files in") from None


__all__ = ["RankZeroErrorsParser", "USAGE_GRACE_S", "end_the_job", "check_environment", "check_output_folder",
           "choose_target", "exit_quietly_when_interrupted", "interrupted", "leave_after_interrupt",
           "one_line_warnings", "quiet_interrupts_at_top_level", "share_cores_between_local_ranks"]
