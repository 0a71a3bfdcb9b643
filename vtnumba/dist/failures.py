"""Failures are messages: one rank's error reaches every rank in milliseconds, and the job always ends.

Collective programs deadlock in two ways when one rank fails.  A rank that raises simply
stops taking part, and its peers wait for it in the next collective -- until a timeout, if
they have one.  And a rank that is *stopped* (``SIGSTOP``, a debugger, a hung driver call)
keeps even the others' ``MPI_Finalize`` waiting, because finalizing is collective too.  Two
mechanisms make every vtnumba program end:

**The failure board.**  :func:`install` (called by :func:`vtnumba.dist.init_distributed`)
opens a communicator of its own over the world and registers a *watch* with
:mod:`vtnumba.backend.polling`, which every wait calls every few milliseconds.  A rank that
fails calls :func:`report` -- non-blocking sends of "rank r failed while <phase>: <error>"
to every other rank -- and the watch on every other rank, wherever it is waiting (an MPI
collective, a peer flag, a queue's finish), receives it and raises :class:`PeerFailed`
with that text.  So a failure travels in milliseconds instead of a timeout, and the error
each rank prints names the rank that failed first and what it was doing (:func:`phase`).

**The exit protocol.**  :func:`exit_after_failure` is how a failed rank leaves: it waits
(bounded) in a barrier of a communicator of its own (opened with the first board, and kept
after :func:`uninstall`: a rank that finished and closed its board meets a late-failing
peer there); when every rank arrives --
they all failed, or gave up after the report, or (under :func:`run_collectively`, which
ends a *successful* run with the same barrier) finished their part -- it returns and the
program exits normally (``MPI_Finalize`` completes).  If some rank never arrives (stopped, or stuck where no watch
runs), it leaves *without* ``MPI_Finalize`` (``os._exit``): ``mpiexec`` then sees a rank
gone and ends the whole job -- what ``MPI_Abort`` would do, but only when agreement was
impossible.  A *watchdog* makes even that certain: from the moment a rank starts failing,
a timer of :mod:`faulthandler` (a C thread, which needs neither the GIL nor a working MPI)
prints every thread's stack and ends the process if it is still there
``timeout_s + EXIT_GRACE_S`` later -- so a failing rank that got stuck anywhere on its way
out (in a driver or MPI call) still leaves, and says where it was stuck.  And before it
leaves that way, it ends the peers on its machine that are *stopped* (:func:`end_stopped_peers`):
nothing else would.

**Ctrl-C** is a failure too.  ``mpiexec`` passes the ``SIGINT`` to every rank, and each stops
wherever it is -- at different points of their collective calls -- so the cleanup each
runs on its way out would wait for the others'.  While the board is open, vtnumba's
``SIGINT`` handler posts "rank r was interrupted" *before* it raises ``KeyboardInterrupt``,
and the rank's own later waits raise too (``_interrupted``).

:func:`run_collectively` wraps a program's ``main`` with both; ``docs/failure_model``
lists what each program does when a rank raises, is killed or stops.
"""

from __future__ import annotations

import atexit
import faulthandler
import math
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

from mpi4py import MPI

from vtnumba.backend import polling
from vtnumba.dist.comm import DEFAULT, arrive, resolve_timeout
from vtnumba.faults import INTERRUPTED, failure_text, say

_TAG = 31990  # below MPI_TAG_UB's guaranteed minimum (32767)
EXIT_GRACE_S = 10.0  # how long past its exit barrier's deadline a failing rank may take to leave
#: How long an interrupted rank waits in the exit barrier (at most): the user asked to stop, and a
#: peer that is not there by then is stuck in a blocking MPI call, where nothing of Python runs --
#: leaving without MPI_Finalize makes mpiexec end it, instead of after the whole --timeout.
INTERRUPT_EXIT_S = 3.0


class PeerFailed(RuntimeError):
    """Another rank reported a failure (its text names the rank and what it was doing)."""

    #: This rank stopped because of a peer (see :func:`report`).
    caused_by_peer = True

    def __init__(self, rank: int, text: str):
        super().__init__(text)
        self.rank = rank
        self.text = text


class PeerAborted(RuntimeError):
    """A peer abandoned a step this rank shares with it (its abort stamp in the flags): this
    rank stops *because of* that peer -- it did not fail itself (see :func:`report`)."""

    #: This rank stopped because of a peer (see :func:`report`).
    caused_by_peer = True


#: How long a rank that saw a peer's abort stamp waits for that peer's own report on the board,
#: which names the rank that failed first and what it was doing.  (The stamp comes first: the
#: failing rank stamps, releases every wait and drains its queues, then reports.)
PEER_REPORT_GRACE_S = 0.5


_peers_report = False  # set by the programs whose failing ranks post their failure (run_collectively)


def expect_peer_reports() -> None:
    """Say that this program's ranks post their failures on the board (every rank runs the
    same program): :func:`run_collectively` and the tutorials' hook call it.  Only then does
    :func:`raise_peer_report` wait for a report -- elsewhere (a test catching a peer's error
    and going on) none would come."""
    global _peers_report
    _peers_report = True


def raise_peer_report(grace_s: float = PEER_REPORT_GRACE_S) -> None:
    """Raise the :class:`PeerFailed` a peer posts within ``grace_s`` seconds; return if none
    comes (or no board is installed, or the program's ranks do not post failures).  Called by
    a rank that saw an abort stamp, before it raises :class:`PeerAborted`: with three ranks, a
    healthy rank that saw only another healthy rank's relayed stamp said it had failed
    itself, naming no culprit."""
    board = _board
    if board is None or not _peers_report:
        return
    deadline = time.monotonic() + grace_s
    while True:
        board.check()  # PeerFailed once a note is in (KeyboardInterrupt if this rank was interrupted)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)


_phases: list[str] = []
_phase_lock = threading.Lock()


@contextmanager
def phase(what: str):
    """Say what this rank is doing (for failure messages): ``with phase("TPSP forward, run 2"): ...``.

    An exception leaving the block remembers the phase it left (the innermost one), so the
    report made further up still says where it happened.
    """
    with _phase_lock:
        _phases.append(str(what))
    try:
        yield
    except BaseException as exc:
        if not hasattr(exc, "vtnumba_phase"):
            try:
                exc.vtnumba_phase = current_phase()
            except AttributeError:  # an exception type that refuses new attributes
                pass
        raise
    finally:
        with _phase_lock:
            _phases.pop()


def current_phase() -> str:
    """What this rank is doing: the open :func:`phase` blocks, outermost first, joined by " / " (or "running")."""
    with _phase_lock:
        return " / ".join(_phases) if _phases else "running"


class FailureBoard:
    """A communicator of its own (so failure notes never match anybody's data), and the notes."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.failed_peer: PeerFailed | None = None  #: the first peer failure seen (kept, so later checks raise it again)
        self.interrupted = False  #: this rank got a Ctrl-C (SIGINT) while the board was open (see _interrupted)
        mine = _state_and_start(os.getpid())
        #: Every rank's (host, pid, process start time): who to end if a peer is stopped (see
        #: :func:`end_stopped_peers`).  Gathered now, while every rank is known to be alive.
        self.processes: list = self.comm.allgather((socket.gethostname(), os.getpid(), mine and mine[1]))

    def post(self, text: str) -> None:
        """Tell every other rank.  Non-blocking and fire-and-forget: a note is small, so MPI sends
        it eagerly, and a peer that already left simply never reads it."""
        for r in range(self.size):
            if r != self.rank:
                self.comm.isend(text, dest=r, tag=_TAG).Free()

    def check(self) -> None:
        """Raise PeerFailed if a peer has posted a failure (the watch every wait calls) --
        KeyboardInterrupt again if this rank was interrupted: it is leaving, and the waits of
        its own teardown must not wait for peers that are leaving too."""
        global _deferred
        if self.interrupted:
            _deferred = False  # (delivered now: a SIGINT put off in a C callback, arriving later, is ignored)
            raise KeyboardInterrupt
        if self.failed_peer is None and self.comm.iprobe(source=MPI.ANY_SOURCE, tag=_TAG):
            status = MPI.Status()
            text = self.comm.recv(source=MPI.ANY_SOURCE, tag=_TAG, status=status)
            self.failed_peer = PeerFailed(status.Get_source(), text)
        if self.failed_peer is not None:
            raise PeerFailed(self.failed_peer.rank, self.failed_peer.text)

    def close(self) -> None:
        """Stop watching the board and free its communicator (freeing is collective: every rank closes)."""
        polling.remove_watch(self.check)
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


_board: FailureBoard | None = None
#: The exit barrier's communicator: a Dup of the first world-wide board's, kept for the process's life.
#: Not the board's own -- a rank that finished closes its board (destroy_distributed) before
#: it leaves, and a peer that fails later must find it in the same barrier -- and not the
#: world, where the barrier could match a collective the application still has pending.
_exit_comm: MPI.Comm | None = None
_previous_sigint = None  # the SIGINT handler install() replaced (restored by uninstall)
_deferred = False  # a SIGINT landed in a callback from C: raised again shortly (see _interrupted)
_REDELIVER_S = 0.05  # how soon a SIGINT that landed in a callback from C is raised again


def _inside_c_callback(frame) -> bool:
    """Whether Python is running code that C called back -- llvmlite's object-cache and
    diagnostic callbacks, while numba compiles.  An exception raised there never reaches
    the program: ctypes prints "Exception ignored on calling ctypes callback" with a
    traceback, and drops it.  (Told by the frames' files: any frame under llvmlite's
    ``binding`` package, the one place our processes enter Python from C.)"""
    binding = sys.modules.get("llvmlite.binding")
    if binding is None:
        return False
    folder = os.path.dirname(binding.__file__) + os.sep
    while frame is not None:
        if frame.f_code.co_filename.startswith(folder):
            return True
        frame = frame.f_back
    return False


def _raise_again_soon() -> None:
    """Deliver SIGINT to the main thread again in ``_REDELIVER_S`` seconds -- after the C callback
    it landed in has returned, as a rule (else it is put off once more) -- unless it has been
    delivered meanwhile (a wait raised it: :meth:`FailureBoard.check`) or the rank is already
    leaving (:func:`_leave_together`): a late one would raise in whatever runs then."""
    import _thread

    def again():
        if _deferred:
            _thread.interrupt_main(signal.SIGINT)

    timer = threading.Timer(_REDELIVER_S, again)
    timer.daemon = True
    timer.start()


def _interrupted(signum, frame) -> None:
    """SIGINT (Ctrl-C; ``mpiexec`` sends it to every rank) while the board is open: tell the
    peers first, then raise KeyboardInterrupt as Python would.

    Interrupted ranks stop at different points of their collective calls, and the cleanup
    that runs on the way out (``finally`` blocks closing peer buffers, with barriers) would
    match the others' cleanup wrongly and wait out the timeout.  With the note posted at
    once, every wait of the others raises; :meth:`FailureBoard.check` makes this rank's own
    waits raise too.  (Python runs this handler between bytecodes of the main thread, never
    inside an MPI call, so posting here is safe; no lock is taken.)

    Where the signal lands in a callback from C (numba compiling: :func:`_inside_c_callback`),
    a raise would be printed and dropped; the handler is run again a moment later instead."""
    global _deferred
    board = _board
    # (Alone -- one rank, a notebook -- there is nobody to tell, and a session that goes on
    # after the Ctrl-C must not find every later wait raising.  After MPI_Finalize, nobody
    # can be told.)
    if board is not None and board.size > 1 and not MPI.Is_finalized():
        if board.interrupted and not _deferred:
            # A second SIGINT -- a terminal sends one to mpiexec and one to each rank, in one
            # process group -- must not cut into the way out the first one started: this rank
            # is leaving already, and its exit watchdog bounds how long that takes.
            return
        if not board.interrupted:
            board.interrupted = True
            try:
                board.post(f"rank {board.rank} was {INTERRUPTED}")
            except MPI.Exception:
                pass
    if _inside_c_callback(frame):
        _deferred = True
        _raise_again_soon()
        return
    _deferred = False
    raise KeyboardInterrupt


def install(comm: MPI.Comm | None = None, timeout_s: float = DEFAULT) -> FailureBoard:
    """Open the failure board over ``comm`` (default: the world) and watch it in every wait.

    Opening it is a ``Dup`` and an ``allgather``, which block in C: every rank arrives first,
    in a barrier that polls up to ``timeout_s`` (:func:`vtnumba.dist.comm.arrive`)."""
    global _board, _previous_sigint, _exit_comm
    if _board is None:
        comm = MPI.COMM_WORLD if comm is None else comm
        arrive(comm, "opening the failure board", timeout_s)
        _board = FailureBoard(comm)
        if _exit_comm is None and comm.Get_size() == MPI.COMM_WORLD.Get_size():
            _exit_comm = comm.Dup()  # (collective, as the board's: every rank is here)
        polling.add_watch(_board.check)
        # A Ctrl-C tells the peers at once (see _interrupted) -- where Python's own handler is
        # in place (a program's or a test runner's own is left alone) and signals can be set.
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _previous_sigint = signal.signal(signal.SIGINT, _interrupted)
    else:
        # (Watched again: a run's exit protocol stops watching the board it leaves open, and a
        # second run in the same process -- a test -- would otherwise wait unwatched.)
        polling.add_watch(_board.check)
    return _board


def uninstall() -> None:
    """Close the board :func:`install` opened, if any (:func:`vtnumba.dist.destroy_distributed` calls it)."""
    global _board, _previous_sigint
    board, _board = _board, None
    if _previous_sigint is not None and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is _interrupted:
            signal.signal(signal.SIGINT, _previous_sigint)
        _previous_sigint = None
    if board is not None:
        board.close()


def report(exc: BaseException) -> str:
    """Tell every other rank that this one failed (unless it failed *because* a peer did);
    returns the one line to print about it."""
    board = _board
    rank = board.rank if board is not None else MPI.COMM_WORLD.Get_rank()
    where = getattr(exc, "vtnumba_phase", None) or current_phase()
    # A rank that failed *because* a peer did says so and posts nothing: the peer already has.
    # Other layers' "a peer failed" errors (the encoder cache's PeerFailure, which must not
    # import MPI) mark themselves with ``caused_by_peer = True``.
    if isinstance(exc, PeerFailed):
        return f"[rank {rank}] stopped while {where}, because {exc.text}"
    if getattr(exc, "caused_by_peer", False):
        return f"[rank {rank}] stopped while {where}, because {exc}"
    what = f"failed while {where}: {failure_text(exc)}"
    if board is not None and not (board.interrupted and isinstance(exc, KeyboardInterrupt)):  # (told already)
        try:
            board.post(f"rank {rank} {what}")
        except MPI.Exception:  # the report is best effort: the exit protocol still ends the job
            pass
    return f"[rank {rank}] {what}"


def _state_and_start(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (``T``: stopped) and start time (clock ticks since boot) from
    /proc/<pid>/stat, fields 3 and 22 -- or None if there is no such process (or no /proc).
    The start time and the pid together name one process, even if pids are reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold anything
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0], int(fields[19])


def end_stopped_peers(board: FailureBoard | None = None, announce=None) -> list[int]:
    """SIGKILL the peers on this machine that are *stopped* (SIGSTOP, state ``T``); returns their ranks.
    ``announce(rank)``, if given, is called just *before* each kill: once the killed rank is
    reaped, ``mpiexec`` ends the whole job -- this process included -- so a line printed after
    the kill may never be written.  Its errors are ignored (a closed stderr): the kill matters
    more than the line.

    The exit protocol's last step.  ``mpiexec`` ends a job whose rank left without
    ``MPI_Finalize`` by killing the other ranks -- but our fault tests twice saw a job wait
    forever after that, its only other rank stopped; and a stopped process can neither hear
    a failure report nor leave by itself.  So the rank that leaves ends it first, as
    ``MPI_Abort`` would.  Only stopped peers, only on this machine, and only the very
    process seen at start-up (pid *and* start time): a peer that is merely slow or being
    traced by a debugger (state ``t``) is left to ``mpiexec``.
    """
    board = board if board is not None else _board
    if board is None:
        return []
    here = socket.gethostname()
    ended = []
    for r, (host, pid, started) in enumerate(board.processes):
        if r == board.rank or host != here or started is None:
            continue
        if _state_and_start(pid) != ("T", started):
            continue
        if announce is not None:
            try:
                announce(r)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(r)
        except OSError:  # it went away meanwhile
            pass
    return ended


def arm_exit_watchdog(timeout_s: float = DEFAULT) -> None:
    """Make sure this process ends: unless :func:`exit_after_failure` sees every rank agree
    first, dump every thread's stack to stderr and ``_exit(1)`` in ``timeout_s +``
    :data:`EXIT_GRACE_S` seconds.  Call it first thing when a rank starts failing."""
    # (Capped at a week: faulthandler's timer overflows somewhere past 1e9 s, and a --timeout
    # that large would then turn every failure report into an OverflowError traceback.)
    faulthandler.dump_traceback_later(min(resolve_timeout(timeout_s) + EXIT_GRACE_S, 7 * 86400.0), exit=True)


def exit_after_failure(timeout_s: float = DEFAULT, code: int = 1, *, interrupted: bool = False) -> int:
    """Leave after a failure so that the job ends (see the module docstring).  Returns ``code``
    when every rank agreed to leave; otherwise does not return (``os._exit``).  A rank that
    was ``interrupted`` (Ctrl-C) waits at most :data:`INTERRUPT_EXIT_S` for its peers."""
    if interrupted:
        timeout_s = min(resolve_timeout(timeout_s), INTERRUPT_EXIT_S)
    return _leave_together(timeout_s, code)


def _leave_together(timeout_s, code: int, succeeded: bool = False) -> int:
    """Every rank's last collective step, after a failure or a success alike: one barrier of
    the exit communicator (``_exit_comm``, duplicated with the first board; without one, the
    board's own or the world).  (A rank that succeeds joins it too: a peer that fails after
    the others finished -- in its last check, or its report -- then finds them in the barrier,
    instead of waiting out its timeout for ranks already inside ``MPI_Finalize``.)"""
    global _deferred
    board = _board
    # (A board over part of the world -- a test's -- keeps its own barrier, as before.)
    comm = _exit_comm if _exit_comm is not None else board.comm if board is not None else MPI.COMM_WORLD
    if board is not None:
        polling.remove_watch(board.check)  # we are leaving anyway: peers' notes change nothing
    _deferred = False  # (nor may a Ctrl-C put off in a compile cut into the exit barrier now)
    timeout_s = resolve_timeout(timeout_s)
    arm_exit_watchdog(timeout_s)  # (again: the barrier's own deadline starts now)
    req = comm.Ibarrier()
    try:
        polling.poll_until(req.Test, timeout_s, lambda waited: "exit barrier")
        # Every rank arrived -- but one that arrived early may have been stopped since, while it
        # waited here for the others (bench: for rank 0's report).  MPI_Finalize would then wait
        # for it for good, with no deadline and no word: end it now, and the job with it.
        _leave_if_a_peer_stopped_after_the_barrier(board, comm.Get_rank(), code or 1)
        # The program leaves normally (and a caller that goes on -- a test -- must not be killed
        # later).  But a rank may still be stopped between this check and MPI_Finalize: the
        # process's last Python code bounds MPI_Finalize too (see _bound_mpi_finalize).
        faulthandler.cancel_dump_traceback_later()
        _ignore_ctrl_c_while_exiting()
        global _finalize_bounded
        if not _finalize_bounded:
            _finalize_bounded = True
            atexit.register(_bound_mpi_finalize, timeout_s)
        return code
    except polling.WaitTimeout:
        if succeeded:
            code = code or 1  # this rank's part went well, the job's did not
        try:  # (whatever goes wrong while saying so -- a closed stderr -- this rank still leaves)
            try:  # (... and still ends the stopped peers first)
                say(f"[rank {comm.Get_rank()}] a rank did not leave within {timeout_s:g} s (stopped or hung); "
                    "ending the job without MPI_Finalize")
            finally:
                end_stopped_peers(board, announce=lambda r: say(
                    f"[rank {comm.Get_rank()}] rank {r} is stopped (SIGSTOP): ending it (SIGKILL)"))
            sys.stdout.flush()
        finally:
            os._exit(code)


_finalize_bounded = False


def _leave_if_a_peer_stopped_after_the_barrier(board, rank, code: int) -> None:
    """End (SIGKILL) the peers seen stopped, saying so, and leave with ``code`` -- or return
    if none is: such a peer would keep MPI_Finalize waiting for good."""
    if end_stopped_peers(board, announce=lambda r: say(
            f"[rank {rank}] rank {r} was stopped (SIGSTOP) after it reached the exit barrier, where "
            "MPI_Finalize would wait for it for good: ending it (SIGKILL)")):
        sys.stdout.flush()
        os._exit(code)


def _bound_mpi_finalize(timeout_s: float) -> None:
    """For a process that passed the exit barrier, at exit (an atexit hook; run before the
    hooks registered earlier -- writing the trace, removing shared files): ``MPI_Finalize``
    comes after all of them (mpi4py calls it from C as Python shuts down), and it waits for
    every rank with no deadline -- for good, if one was stopped after it reached the barrier.
    So a stopped peer is ended now; and failing that (one stopped a moment later), an alarm
    ends this process ``timeout_s +`` :data:`EXIT_GRACE_S` from now -- time for the other exit
    hooks and a healthy MPI_Finalize, which takes milliseconds -- and ``mpiexec`` the job.  (An alarm left to
    its default action: no Python code runs inside MPI_Finalize, and Python's own timers --
    faulthandler's -- are shut down before it.)"""
    rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else "?"
    _leave_if_a_peer_stopped_after_the_barrier(_board, rank, 1)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, math.ceil(min(resolve_timeout(timeout_s) + EXIT_GRACE_S, 7 * 86400.0))))


def ignore_ctrl_c() -> None:
    """From now on this process ignores SIGINT: it is on its way out (a failure's exit protocol,
    or the end of a run), where a Ctrl-C could only cut in -- the exit watchdog, and ``mpiexec``'s
    own second Ctrl-C, still end it.  (Main thread only: the only one that may set handlers.)"""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ignore_ctrl_c_while_exiting() -> None:
    """After the exit barrier the job is over: a Ctrl-C now would land in ``MPI_Finalize``, which
    runs after the interpreter has put back the signal's default action -- the rank died of
    it, and ``mpiexec`` called a run that had finished a "BAD TERMINATION".  So from the
    interpreter's exit on, SIGINT is ignored (registered now, run at exit: a caller that goes
    on, a test, keeps its Ctrl-C until then; :func:`end_together`, a script's last act,
    ignores it at once)."""
    atexit.register(ignore_ctrl_c)


def end_together(timeout_s: float = DEFAULT, code: int = 0) -> int:
    """A *successful* rank's way out, for a script that has no ``main()`` for
    :func:`run_collectively` (a tutorial): the exit barrier, returning ``code`` when every
    rank arrives -- else, a peer being stopped or hung, which would keep this rank's
    ``MPI_Finalize`` waiting for good, it ends the stopped peers and leaves without it.  Call
    it last: from here, an alarm ends the process ``timeout_s +`` :data:`EXIT_GRACE_S` later
    (see ``_bound_mpi_finalize``)."""
    code = _leave_together(timeout_s, code, succeeded=True)
    ignore_ctrl_c()  # (the script is ending: see _ignore_ctrl_c_while_exiting)
    # The script is ending (a tutorial calls this from its atexit hook, where a hook registered
    # now may never run): bound MPI_Finalize from here.
    _bound_mpi_finalize(timeout_s)
    return code


def reader_gone(exc: BaseException) -> bool:
    """Is ``exc`` the reader of this process's output going away (``vtnumba bench ... | head``)?
    Then stdout is pointed at /dev/null -- nothing more can reach the reader, and Python's
    flush at exit must not fail again -- and the rank leaves without a word: the reader asked
    for no more, and a "failed" line (or a traceback) would say the program went wrong."""
    if not isinstance(exc, BrokenPipeError):
        return False
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # (no stdout file at all: nothing to point elsewhere)
        pass
    return True


def run_collectively(main, *, timeout_s: float = DEFAULT) -> int:
    """Run ``main()`` -> exit code on every rank; on any failure, report it to the peers, print
    one line naming the rank and the phase, and leave with :func:`exit_after_failure`.

    A rank that fails before the board is open (a Ctrl-C while the ranks arrive) can tell
    nobody, and the others may be inside a blocking setup collective where nothing of ours
    runs: it leaves at once, without ``MPI_Finalize``, and ``mpiexec`` ends the job."""
    resolve_timeout(timeout_s)  # (a bad one is the caller's error, said here -- not again inside the failure path)
    expect_peer_reports()
    board_open = False
    try:
        install(timeout_s=timeout_s)
        board_open = True
        try:
            code = int(main() or 0)
        except SystemExit as stop:
            # sys.exit() on one rank (argparse's error, say) is a failure the peers must hear of,
            # unless it says success; its message, if any, is this rank's to print.
            status = stop.code
            if status is None or status == 0:
                code = 0
            else:
                exited = RuntimeError(f"exited with status {status}" if isinstance(status, int) else f"exited: {status}")
                exited.exit_status = status if isinstance(status, int) else 1  # (kept: a usage error's 2 stays 2)
                raise exited from None
    except (KeyboardInterrupt, Exception) as exc:  # noqa: BLE001 - every failure must reach the peers
        arm_exit_watchdog(timeout_s)  # from here on, nothing may keep this process alive
        ignore_ctrl_c()  # (nor cut into the way out: the watchdog bounds it)
        quiet = reader_gone(exc)
        line = report(exc)  # (the peers are told all the same: this rank stops here)
        if not quiet:
            say(line)
        if not board_open:
            sys.stdout.flush()
            os._exit(0 if quiet else 1)
        return exit_after_failure(timeout_s, 0 if quiet else getattr(exc, "exit_status", 1),
                                  interrupted=isinstance(exc, KeyboardInterrupt))
    return _leave_together(timeout_s, code, succeeded=True)


__all__ = ["EXIT_GRACE_S", "INTERRUPT_EXIT_S", "PEER_REPORT_GRACE_S", "PeerFailed", "PeerAborted", "raise_peer_report",
           "expect_peer_reports", "FailureBoard", "phase", "current_phase", "install",
           "uninstall", "report", "say", "ignore_ctrl_c", "end_stopped_peers", "arm_exit_watchdog",
           "exit_after_failure", "end_together", "reader_gone", "run_collectively"]
