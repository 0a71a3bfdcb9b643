"""ECChannel: the producer <-> consumer control messages, over mpi4py, that never hang.

Upstream: the connector's control plane (vLLM sends its "ready" and index messages over
ZMQ between the encoder and prefill processes).  Here the processes are MPI ranks and
the messages are small pickled Python objects on a communicator you pass in (use a
``Dup()`` of your world so these messages cannot collide with anyone else's).

Two rules keep a multi-process run from hanging:

* **every wait has a deadline**: :meth:`ECChannel.recv` and :meth:`ECChannel.send` poll
  with :func:`vtnumba.backend.polling.poll_until` (the one wait loop of vtnumba) and raise
  :class:`ChannelTimeout` after ``timeout_s`` -- by default the process's default timeout
  (:func:`vtnumba.dist.comm.default_timeout`: :data:`vtnumba.dist.DEFAULT_TIMEOUT_S`
  unless a program's ``--timeout`` changed it), the deadline of every other wait for
  another rank -- naming this rank, the peer and what was awaited;
* **failures are messages too**: a rank that fails calls :meth:`ECChannel.report_failure`
  (best effort, never blocking long), and *every* wait of *every* other rank -- whatever
  peer it is waiting for -- raises :class:`PeerFailure` with the failing rank's message.
  So all ranks reach their cleanup at once, instead of some waiting for a peer that is
  itself waiting for the rank that failed.

mpi4py is imported when a channel is made, not when this module is: importing
``mpi4py.MPI`` initialises MPI, and ``import vtnumba.ec`` must not (a single process using
only the region and the worker never needs MPI).  Whoever makes a channel already holds a
communicator, so MPI is running by then anyway.

Each exchange is traced (``cat="mpi"``, track ``mpi:ec``) when tracing is on.
"""

from __future__ import annotations

from vtnumba import trace
from vtnumba.backend.arrays import check_seconds, is_int
from vtnumba.backend.polling import poll_until
from vtnumba.ec.errors import ChannelTimeout, PeerFailure

__all__ = ["ECChannel", "ChannelTimeout", "PeerFailure", "ERROR_TAG"]

_MSG, _ERR = "msg", "error"
ERROR_TAG = 32000  # failure reports; below MPI_TAG_UB's guaranteed minimum (32767)


class ECChannel:
    """Producer <-> consumer control messages over one mpi4py communicator, every wait bounded.

    ``send``/``recv`` carry the scheduler-side messages (ready entries, pin requests and
    grants, releases); a rank that fails calls ``report_failure`` so that every other
    rank's next (or current) wait raises :class:`PeerFailure` at once instead of waiting
    for its timeout.
    """

    def __init__(self, comm, timeout_s: float | None = None):
        from mpi4py import MPI

        from vtnumba.dist.comm import DEFAULT, resolve_timeout

        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout_s = resolve_timeout(DEFAULT if timeout_s is None else timeout_s)

    def _check_peer(self, peer: int, name: str) -> None:
        if not is_int(peer) or not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{name}={peer!r} must be another rank of this {self.size}-rank communicator "
                             f"(this is rank {self.rank})")

    def _failure_report(self):
        """A failure report from any rank, if one is waiting: raise it as PeerFailure."""
        status = self._MPI.Status()
        if self.comm.iprobe(source=self._MPI.ANY_SOURCE, tag=ERROR_TAG, status=status):
            kind, text = self.comm.recv(source=status.Get_source(), tag=ERROR_TAG)
            raise PeerFailure(status.Get_source(), text)

    def _wait(self, done, peer: int, what: str, tag: int, timeout_s: float | None) -> None:
        t = self.timeout_s if timeout_s is None else check_seconds("timeout_s", timeout_s)

        def describe(waited: float) -> str:
            return (f"rank {self.rank} gave up waiting for rank {peer} after {t:g} s ({what}, tag {tag}): is rank "
                    f"{peer} alive? It may have crashed, be stopped, or be waiting for something else")

        try:
            poll_until(done, t, describe, error=ChannelTimeout)
        except ChannelTimeout as exc:
            exc.rank, exc.peer, exc.what = self.rank, peer, what
            raise

    def send(self, obj, dest: int, tag: int = 0, *, what: str = "a message", timeout_s: float | None = None) -> None:
        """Send a picklable object to ``dest``; raise ChannelTimeout if it is not taken in time."""
        self._check_peer(dest, "dest")
        with trace.span("ec_send", "mpi", "mpi:ec", dest=dest, tag=tag):
            req = self.comm.isend((_MSG, obj), dest=dest, tag=tag)

            # A large message completes only when the peer receives it.  If a rank failed
            # instead, its report is what arrives: stop waiting and raise it.
            def done() -> bool:
                if req.Test():
                    return True
                self._failure_report()
                return False

            self._wait(done, dest, f"to take {what}", tag, timeout_s)

    def recv(self, source: int, tag: int = 0, *, what: str = "a message", timeout_s: float | None = None):
        """Receive the next object from ``source``; raise PeerFailure if any rank reported a failure."""
        self._check_peer(source, "source")
        box = []
        with trace.span("ec_recv", "mpi", "mpi:ec", source=source, tag=tag):
            def done() -> bool:
                # Our message first: a rank that sent it and failed afterwards still sent it.
                if self.comm.iprobe(source=source, tag=tag):
                    box.append(self.comm.recv(source=source, tag=tag))
                    return True
                self._failure_report()
                return False

            self._wait(done, source, what, tag, timeout_s)
        kind, payload = box[0]
        if kind == _ERR:  # a report sent on our tag (tag == ERROR_TAG): still a failure
            raise PeerFailure(source, payload)
        return payload

    def poll(self, source: int, tag: int = 0) -> bool:
        """Is a message from ``source`` (or a failure report from anyone) waiting?  Never blocks."""
        self._check_peer(source, "source")
        return bool(self.comm.iprobe(source=source, tag=tag)
                    or self.comm.iprobe(source=self._MPI.ANY_SOURCE, tag=ERROR_TAG))

    def send_error(self, dest: int, text: str, timeout_s: float = 1.0) -> bool:
        """Tell ``dest`` this rank failed.  Best effort: returns False instead of raising."""
        try:
            self._check_peer(dest, "dest")
            req = self.comm.isend((_ERR, str(text)), dest=dest, tag=ERROR_TAG)
            # Small messages go out eagerly, so this is normally done at once -- even when
            # ``dest`` is stopped or dead.  Never wait long: we are on a failure path.
            poll_until(req.Test, timeout_s, lambda waited: "send_error")
            return True
        except Exception:
            return False

    def report_failure(self, text: str, ranks=None, timeout_s: float = 1.0) -> list[int]:
        """Tell every other rank (or ``ranks``) that this rank failed; returns the ranks told."""
        targets = [r for r in (range(self.size) if ranks is None else ranks) if r != self.rank]
        return [r for r in targets if self.send_error(r, text, timeout_s)]
