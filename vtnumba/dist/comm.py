"""Control-plane helpers on a group's CPU communicator: agreement, barrier, raw-bytes allgather.

Upstream concept: ``open()`` of vLLM's ``CudaTPSPBackend`` asks every rank "can you?" and all-reduces the answers
with MIN, so either every rank goes down the fast path or none does.  That *agreement* is
the rule that keeps a collective program from deadlocking: a rank that fails must not
simply raise and leave its peers blocked in the next collective -- it reports the failure
through a collective that every rank is already making, and then *all* ranks raise (or
fall back) together.

Everything here runs on ``group.cpu_comm`` -- a communicator of its own, so these small
control messages never interleave with data traffic on ``group.comm`` -- except
:func:`agree_on_call`, which runs on ``group.comm`` itself, just before the data collectives
it guards.

Every wait is non-blocking underneath (``Ibarrier``/``Iallreduce``/``Iallgather`` plus
polling; only ``agree_on_call(timeout_s=None)`` asks for a blocking wait), so a peer that
never arrives produces a clear ``RuntimeError`` after ``timeout_s`` instead of a hang.  MPI cannot cancel a collective that a peer never joined,
so after such a timeout the communicator is unusable: the error says so, and the right
reaction is to abort the job (``python -m mpi4py`` does that for an uncaught exception).
The group remembers it (``ProcessGroup.unusable``): every later collective on it raises at
once, so a teardown's chain of barriers after a lost peer takes one timeout, not one each.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from vtnumba import trace
from vtnumba.backend.arrays import check_seconds
from vtnumba.backend.polling import WaitTimeout, poll_until

#: How long any wait for another rank may take before it raises, unless a program says otherwise.
DEFAULT_TIMEOUT_S = 60.0


class _ProcessDefault:
    """The ``timeout_s`` default of every wait: "the process's default timeout", looked up when the
    wait starts -- so a program's ``--timeout`` flag (:func:`set_default_timeout`) reaches every
    wait of the library, not only the ones it passes a number to."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _ProcessDefault()
_default_timeout_s = DEFAULT_TIMEOUT_S


def set_default_timeout(seconds: float) -> None:
    """Make ``seconds`` the timeout of every wait that is not given one (programs' ``--timeout``)."""
    global _default_timeout_s
    _default_timeout_s = check_seconds("seconds", seconds)


def default_timeout() -> float:
    """The process's current default timeout, in seconds."""
    return _default_timeout_s


def resolve_timeout(timeout_s) -> float:
    """``timeout_s`` as a number of seconds: :data:`DEFAULT` means the process's default."""
    return _default_timeout_s if timeout_s is DEFAULT else check_seconds("timeout_s", timeout_s)


def _describe(group) -> str:
    if group is None:  # a bare communicator (e.g. the encoder's), not a ProcessGroup
        return "the communicator"
    return f"group {group.name!r} (rank {group.rank} of {group.size}, world ranks {group.world_ranks})"


def wait_request(req: MPI.Request, group, what: str, timeout_s: float = DEFAULT) -> None:
    """Poll a non-blocking MPI request until it completes; raise RuntimeError after ``timeout_s``.

    ``group`` only names the ranks in the error message (``None`` for a bare communicator).

    Polling follows :func:`vtnumba.backend.polling.poll_until`: a busy loop first
    (collectives between ranks of one node finish in microseconds, and MPI only progresses
    inside MPI calls such as ``Test``), occasional yields next (a machine may have fewer
    cores than ranks), then short sleeps so a long wait does not burn a core.
    """
    timeout_s = resolve_timeout(timeout_s)
    earlier = getattr(group, "unusable", None)
    if earlier:
        # A teardown runs one collective step after another (close: barrier, unmap, barrier...):
        # each waiting out its own timeout for a peer that is gone made it take minutes.
        raise WaitTimeout(f"{what} on {_describe(group)} was not attempted: {earlier}, so the group's "
                          "communicators can no longer match up; abort the job.")
    try:
        poll_until(req.Test, timeout_s,
                   lambda waited: f"{what} on {_describe(group)} timed out after {timeout_s:g} s: at least one peer "
                                  "rank never joined (it crashed, hangs, or took another code path). The MPI request "
                                  "cannot be cancelled, so this communicator is unusable; abort the job.",
                   error=WaitTimeout)
    except WaitTimeout:
        if group is not None:
            group.unusable = f"an earlier {what} on it timed out after {timeout_s:g} s"
        raise


def arrive(comm: MPI.Comm, what: str, timeout_s: float = DEFAULT) -> None:
    """Wait, polling, until every rank of ``comm`` has called this: the step before setup
    collectives that block in C (``Split``, ``Dup``, a blocking ``allgather``).  Inside those
    nothing of Python runs -- neither a Ctrl-C (the ``SIGINT`` ``mpiexec`` sends every rank)
    nor the failure board's watch -- so a rank that failed or was interrupted before getting
    there would leave the others inside them for good.  Here they hear of it, or give up
    after ``timeout_s`` (naming ``what``); once all have arrived, the blocking calls return
    at once."""
    timeout_s = resolve_timeout(timeout_s)  # (before the request: see barrier)
    wait_for_every_rank(comm.Ibarrier(), what, timeout_s)


def dup_comm(comm: MPI.Comm, what: str, timeout_s: float = DEFAULT) -> MPI.Comm:
    """``comm.Dup()`` without blocking in C: ``Idup``, polled as :func:`arrive` is."""
    timeout_s = resolve_timeout(timeout_s)
    new, req = comm.Idup()
    wait_for_every_rank(req, what, timeout_s)
    return new


def wait_for_every_rank(req: MPI.Request, what: str, timeout_s: float = DEFAULT) -> None:
    """Poll a setup collective's request (:func:`arrive`, :func:`dup_comm`, any other every rank
    must join before anything else runs); after ``timeout_s``, WaitTimeout naming ``what``."""
    poll_until(req.Test, resolve_timeout(timeout_s),
               lambda waited: f"{what}: not every rank arrived within {waited:.3g} s (one failed, was "
                              "stopped, or took another code path)")


def barrier(group, timeout_s: float = DEFAULT) -> None:
    """A barrier over ``group`` that raises RuntimeError (naming group and rank) after ``timeout_s``."""
    check_group(group)
    # Checked before the request is posted: a rank that refused a bad timeout after posting
    # had already let its peers through the barrier, or left them a collective to wait out.
    timeout_s = resolve_timeout(timeout_s)
    with trace.span("barrier", "mpi", f"mpi:{group.name}"):
        wait_request(group.cpu_comm.Ibarrier(), group, "barrier", timeout_s)


def all_ranks_ready(ok: bool, group, timeout_s: float = DEFAULT) -> bool:
    """True on every rank if ``ok`` is true on every rank, else False on every rank.

    The agreement of vLLM's ``CudaTPSPBackend.open()``: an all-reduce with MIN of 0/1.  Every rank must call it.
    """
    check_group(group)
    timeout_s = resolve_timeout(timeout_s)  # (before the request: see barrier)
    send = np.array([1 if ok else 0], dtype=np.int32)
    recv = np.zeros(1, dtype=np.int32)
    with trace.span("all_ranks_ready", "mpi", f"mpi:{group.name}", ok=bool(ok)):
        wait_request(group.cpu_comm.Iallreduce(send, recv, op=MPI.MIN), group, "all_ranks_ready", timeout_s)
    return bool(recv[0])


def allreduce_max(value: float, group, what: str, timeout_s: float = DEFAULT) -> float:
    """The largest ``value`` over the group's ranks (e.g. the slowest rank's time), with a deadline;
    NaN if any rank's is NaN.

    A blocking ``comm.allreduce`` would wait forever for a stopped rank, where the failure
    board cannot reach it; this one is a non-blocking all-reduce polled by :func:`wait_request`
    (``what`` names it in the timeout's message).
    """
    check_group(group)
    timeout_s = resolve_timeout(timeout_s)  # (before the request: see barrier)
    # NaN reaches every rank as NaN: MPI's MAX compares, and every comparison with NaN is
    # false, so a NaN on one rank would be dropped there and kept elsewhere -- ranks that
    # agree on nothing.  It travels as a flag of its own.
    nan = value != value
    send = np.array([float("-inf") if nan else value, 1.0 if nan else 0.0], dtype=np.float64)
    recv = np.zeros(2, dtype=np.float64)
    wait_request(group.cpu_comm.Iallreduce(send, recv, op=MPI.MAX), group, what, timeout_s)
    return float("nan") if recv[1] else float(recv[0])


def allgather_bytes(data: bytes, group, timeout_s: float = DEFAULT) -> list[bytes]:
    """Every rank contributes ``data`` (any length); every rank gets the list, indexed by group rank.

    Raw bytes, never pickles: what travels is exactly what the caller packed (a shm name, a
    64-byte CUDA IPC handle), which keeps the wire format explicit and version-proof.
    """
    check_group(group)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    timeout_s = resolve_timeout(timeout_s)  # (before the request: see barrier)
    payload = np.frombuffer(bytes(data), dtype=np.uint8)
    n = group.size
    with trace.span("allgather_bytes", "mpi", f"mpi:{group.name}", bytes=payload.size):
        lengths = np.zeros(n, dtype=np.int64)
        wait_request(group.cpu_comm.Iallgather(np.array([payload.size], dtype=np.int64), lengths), group,
                     "allgather_bytes (lengths)", timeout_s)
        displs = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=displs[1:])
        out = np.zeros(max(int(lengths.sum()), 1), dtype=np.uint8)
        wait_request(group.cpu_comm.Iallgatherv(payload, [out, (lengths, displs), MPI.BYTE]), group,
                     "allgather_bytes (payload)", timeout_s)
    return [out[int(d):int(d) + int(c)].tobytes() for d, c in zip(displs, lengths, strict=True)]


_RAISABLE = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError,
             "KeyError": KeyError, "IndexError": IndexError}


def agree_errors(error: BaseException | str | None, group, *, context: str = "",
                 default_type: type = RuntimeError, exc_type: type | None = None,
                 timeout_s: float = DEFAULT) -> None:
    """Collective: if any rank passes an error, raise the *same* exception on every rank.

    Each rank passes the exception it caught (or a message, or None when it is fine).  The
    messages are allgathered, so every rank builds an identical text naming each failing
    rank, and raises it with the type of the lowest failing rank's exception when that is
    ValueError, TypeError, RuntimeError, KeyError or IndexError (so bad input reads as bad
    input everywhere; other types become ``default_type``), or always with ``exc_type`` when
    given.  Returns normally on every
    rank when no rank failed.
    """
    if error is None:
        mine = b""
    elif isinstance(error, BaseException):
        mine = f"{type(error).__name__}\x00{error}".encode()
    else:
        mine = f"{default_type.__name__}\x00{error}".encode()
    everyone = allgather_bytes(mine, group, timeout_s)
    failures = [(r, m.decode().split("\x00", 1)) for r, m in enumerate(everyone) if m]
    if not failures:
        return
    if exc_type is None:
        exc_type = _RAISABLE.get(failures[0][1][0], default_type)
    parts = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in failures)
    prefix = f"{context}: " if context else ""
    raise exc_type(f"{prefix}failed on {len(failures)} of {group.size} ranks of group {group.name!r} -- {parts}")


def _encode(value) -> int:
    """One agreed value as an int64: ints as they are, floats by their bits (the ranks must agree
    exactly), a short str by its bytes."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, str):
        return int.from_bytes(value.encode()[:8].ljust(8, b"\0"), "little", signed=True)
    if isinstance(value, (float, np.floating)):
        return int(np.float64(value).view(np.int64))
    return int(value)


def _decode(code: int, like) -> str:
    if isinstance(like, (bool, np.bool_)):
        return "given" if code else "None"
    if isinstance(like, str):
        return int(code).to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace")
    if isinstance(like, (float, np.floating)):
        return f"{float(np.int64(code).view(np.float64)):g}"
    return str(int(code))


def agree_on_call(group, what: str, check, fields: tuple[str, ...], timeout_s=DEFAULT, agree: bool = True):
    """Run this rank's argument checks, then -- over ``group``, unless ``agree`` is false --
    learn every rank's outcome before any collective (see the module docstring).

    ``check()`` returns ``(result, values)``: ``values`` are what every rank must agree on,
    one per name in ``fields`` (ints, floats -- compared bit for bit --, bools for "given or
    None", short strs).  Returns ``result``.  A rank whose check raised raises its own error;
    the others raise ValueError naming the ranks that refused; values that differ are one
    ValueError on every rank, listing each rank's.  (Collective over ``group``: every rank
    calls it, or the others wait out ``timeout_s``.)
    """
    error = result = None
    values = None
    try:
        result, values = check()
        if len(values) != len(fields):
            raise AssertionError(f"{what}: check() gave {len(values)} values for {len(fields)} fields")
    except Exception as exc:  # any failure, not only a refused argument: the peers must hear of it, or they hang
        error, values = exc, None
    if agree and group is not None and group.size > 1:
        mine = np.array([int(error is not None)] + ([_encode(v) for v in values] if values is not None
                                                    else [0] * len(fields)), np.int64)
        rows = np.empty((group.size, mine.size), np.int64)
        if timeout_s is None:
            group.comm.Allgather(mine, rows)
        else:
            wait_request(group.comm.Iallgather(mine, rows), group, f"{what}: every rank's arguments",
                         timeout_s)
        refused = [r for r in range(group.size) if rows[r, 0]]
        if error is not None:
            raise error
        if refused:
            raise ValueError(f"{what}: rank(s) {refused} of group {group.name!r} refused their arguments (their "
                             "own errors say why); no rank ran the collectives")
        if (rows[:, 1:] != rows[0, 1:]).any():
            shown = "; ".join(f"rank {r}: " + ", ".join(f"{name}={_decode(code, like)}" for name, code, like
                                                         in zip(fields, row[1:], values))
                              for r, row in enumerate(rows))
            raise ValueError(f"{what}: the ranks of group {group.name!r} called it with different arguments "
                             f"({shown}); every rank must pass the same {', '.join(fields)}")
    elif error is not None:
        raise error
    return result


def check_group(group) -> None:
    """TypeError unless ``group`` is a :class:`~vtnumba.dist.ProcessGroup`; RuntimeError once it
    was freed.  (Duck-typed on ``cpu_comm``: :mod:`vtnumba.dist.groups` imports this module.)
    Every collective calls it first, so a wrong ``group`` is named here instead of failing
    inside mpi4py with an "invalid communicator"."""
    if getattr(group, "cpu_comm", None) is None:
        raise TypeError(f"group must be a vtnumba ProcessGroup (init_distributed(), new_group()), "
                        f"got {type(group).__name__}")
    if getattr(group, "freed", False):
        raise RuntimeError(f"group {group.name!r} was freed (destroy_distributed() ran); call init_distributed() "
                           "again and use the group it returns")
    if getattr(group, "unusable", None):  # (checked again by wait_request: a request posted without this check)
        raise WaitTimeout(f"no collective on {_describe(group)} was attempted: {group.unusable}, so the "
                          "group's communicators can no longer match up; abort the job.")


__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT", "set_default_timeout", "default_timeout", "resolve_timeout", "wait_request",
           "arrive", "dup_comm", "wait_for_every_rank", "barrier", "all_ranks_ready", "allgather_bytes", "agree_errors",
           "agree_on_call", "check_group"]
