"""The two ways a wait on another encoder-cache process ends badly: a timeout, or the peer's own failure.

They live apart from :mod:`vtnumba.ec.channel` (which needs mpi4py) so that code catching
them -- and ``from vtnumba.ec import *`` -- never has to import MPI.
"""

from __future__ import annotations

__all__ = ["ChannelTimeout", "PeerFailure"]


class ChannelTimeout(RuntimeError):
    """A peer did not send (or accept) a message before the deadline.

    ``rank`` is the rank that waited, ``peer`` the one it waited for, ``what`` what it was
    waiting for (set by the channel; None when raised elsewhere).
    """

    rank: int | None = None  #: the rank that waited
    peer: int | None = None  #: the rank it waited for
    what: str | None = None  #: what it waited for


class PeerFailure(RuntimeError):
    """Another rank reported that it failed; carries its rank and its message."""

    #: This rank failed because a peer did: :func:`vtnumba.dist.failures.report` then blames the
    #: peer and does not post a failure of its own.
    caused_by_peer = True

    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank} failed: {text}")
        self.rank = rank
        self.text = text

    def __reduce__(self):  # picklable with its two arguments (exceptions pickle their args)
        return (PeerFailure, (self.rank, self.text))
