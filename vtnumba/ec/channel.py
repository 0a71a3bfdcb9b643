"""ECChannel: the producer <-> consumer control messages, over mpi4py, that never hang.

Seed: the connector's control plane (vLLM sends its "ready" and index messages over
ZMQ between the encoder and prefill processes).  Here the processes are MPI ranks and
the messages are small pickled Python objects on a communicator you pass in (use a
``Dup()`` of your world so these messages cannot collide with anyone else's).

Two rules keep a multi-process run from hanging:

* **every wait has a deadline**: :meth:`ECChannel.recv` polls ``iprobe`` and raises
  :class:`ChannelTimeout` naming the peer and the tag; :meth:`ECChannel.send` polls its
  ``isend`` request the same way;
* **failures are messages too**: a rank that fails calls :meth:`ECChannel.send_error`
  (best effort, never blocking long) and the peer's next :meth:`~ECChannel.recv` raises
  :class:`PeerFailure` with the failing rank's message, so both sides reach their
  ``finally`` blocks and release their resources, instead of one waiting forever.

Each exchange is traced (``cat="mpi"``, track ``mpi:ec``) when tracing is on.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from vtnumba import trace

__all__ = ["ECChannel", "ChannelTimeout", "PeerFailure"]

_MSG, _ERR = "msg", "error"


class ChannelTimeout(RuntimeError):
    """A peer did not send (or accept) a message before the deadline."""


class PeerFailure(RuntimeError):
    """The peer reported that it failed; carries its message."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank} failed: {text}")
        self.rank = rank
        self.text = text


def _wait(test, deadline: float, what: str, timeout_s: float):
    """Poll ``test()`` until it returns (True, value), sleeping a little longer each time."""
    nap = 20e-6
    while True:
        done, value = test()
        if done:
            return value
        if time.monotonic() >= deadline:
            raise ChannelTimeout(f"{what}: nothing after {timeout_s:g} s (is the peer alive? it may have "
                                 "crashed, hung, or be waiting for something else)")
        time.sleep(nap)
        nap = min(nap * 2, 2e-3)


class ECChannel:
    """Producer <-> consumer control messages over one mpi4py communicator, every wait bounded.

    ``send``/``recv`` carry the scheduler-side messages (ready entries, pin requests and
    grants, releases); a rank that fails calls ``send_error`` so that a peer's ``recv``
    raises :class:`PeerFailure` at once instead of waiting for its timeout.
    """

    def __init__(self, comm: MPI.Comm, timeout_s: float = 60.0):
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout_s = float(timeout_s)

    def _check_peer(self, peer: int, name: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{name}={peer!r} must be another rank of this {self.size}-rank communicator "
                             f"(this is rank {self.rank})")

    def send(self, obj, dest: int, tag: int = 0, timeout_s: float | None = None) -> None:
        """Send a picklable object to ``dest``; raise ChannelTimeout if it is not taken in time."""
        self._check_peer(dest, "dest")
        t = self.timeout_s if timeout_s is None else timeout_s
        with trace.span("ec_send", "mpi", "mpi:ec", dest=dest, tag=tag):
            req = self.comm.isend((_MSG, obj), dest=dest, tag=tag)

            # A large message completes only when the peer receives it.  If the peer failed
            # instead, its error report is what arrives: stop waiting and raise it.
            def test():
                if req.Test():
                    return True, None
                if self.comm.iprobe(source=dest, tag=_ERROR_TAG):
                    _, text = self.comm.recv(source=dest, tag=_ERROR_TAG)
                    raise PeerFailure(dest, text)
                return False, None

            _wait(test, time.monotonic() + t, f"rank {self.rank}: send to rank {dest} (tag {tag})", t)

    def recv(self, source: int, tag: int = 0, timeout_s: float | None = None):
        """Receive the next object from ``source``; raise PeerFailure if it reported an error."""
        self._check_peer(source, "source")
        t = self.timeout_s if timeout_s is None else timeout_s
        with trace.span("ec_recv", "mpi", "mpi:ec", source=source, tag=tag):
            # An error report may come on any tag: look for it as well as for our message.
            def test():
                if self.comm.iprobe(source=source, tag=tag):
                    return True, self.comm.recv(source=source, tag=tag)
                if tag != _ERROR_TAG and self.comm.iprobe(source=source, tag=_ERROR_TAG):
                    return True, self.comm.recv(source=source, tag=_ERROR_TAG)
                return False, None

            kind, payload = _wait(test, time.monotonic() + t, f"rank {self.rank}: receive from rank {source} "
                                  f"(tag {tag})", t)
        if kind == _ERR:
            raise PeerFailure(source, payload)
        return payload

    def poll(self, source: int, tag: int = 0) -> bool:
        """Is a message (or an error report) from ``source`` waiting?  Never blocks."""
        self._check_peer(source, "source")
        return bool(self.comm.iprobe(source=source, tag=tag) or self.comm.iprobe(source=source, tag=_ERROR_TAG))

    def send_error(self, dest: int, text: str, timeout_s: float = 2.0) -> bool:
        """Tell ``dest`` this rank failed.  Best effort: returns False instead of raising."""
        try:
            self._check_peer(dest, "dest")
            req = self.comm.isend((_ERR, str(text)), dest=dest, tag=_ERROR_TAG)
            _wait(lambda: (req.Test(), None), time.monotonic() + timeout_s, "send_error", timeout_s)
            return True
        except Exception:
            return False

    def abort(self, text: str, code: int = 1) -> None:
        """Last resort when a peer does not answer at all: print why, then end the whole job."""
        import sys

        print(f"[rank {self.rank}] aborting the MPI job: {text}", file=sys.stderr, flush=True)
        self.comm.Abort(code)


_ERROR_TAG = 32000  # below MPI_TAG_UB's guaranteed minimum (32767)
