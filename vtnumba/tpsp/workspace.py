"""The P2P workspace of one TPSP handle: exchange slots in peer memory, and the flags between ranks.

Upstream: the workspace vLLM's ``init_tpsp_p2p`` allocates (``max_chunk_rows x hidden_size`` per slot).
Every rank owns one :class:`~vtnumba.dist.PeerBuffers` buffer that every peer can read and
write, laid out as two *slot sets* (double buffering: while chunk ``i`` is being exchanged
in slot ``i % 2``, chunk ``i + 1``'s matmul can already fill the other)::

    xfer   [2][tp][c][H]   partial sums of the projection, one block per (source, destination) pair
    gather [2][c][H]       (pull)  this rank's normalised rows, read by every peer
           [2][tp][c][H]   (push)  every rank's normalised rows, written by their owners

``c`` is the call's microchunk (token rows of each shard per step), at most
``max_chunk_rows``; the views are cut for each ``c`` from the same bytes.

Who writes a block and who reads it -- the ``exchange`` mode:

* ``"push"`` (vLLM's design; the CUDA default): rank ``s``'s matmul writes the rows owned by rank
  ``d`` into ``d``'s ``xfer[.][s]`` (*inbox* slot, indexed by source) and ``d`` reduces its
  own memory; after the norm, ``d`` writes its rows into every rank's ``gather[.][d]``.
  Remote *writes*: what a GPU epilogue does well over NVLink.
* ``"pull"`` (the host default): rank ``s``'s matmul writes *all* its partial rows into its
  own ``xfer[.][d]`` (outbox, indexed by destination) and ``d`` reads ``xfer[.][d]`` from
  every peer; after the norm, ``d`` puts its rows once into its own ``gather`` and every
  rank copies them from there.  Same bytes moved, but with one chunk the outbox
  ``xfer[.][0..tp-1]`` is one contiguous ``[tp*R, H]`` array in token order, so numpy's BLAS
  writes the whole projection there in *one* call (:mod:`vtnumba.tpsp.host` has the
  measurements).

The flags (:class:`~vtnumba.dist.QueueFlags`: 32-bit epoch counters in peer memory of the
same backend, raised and awaited *by the queues*) carry the global chunk number ``g + 1``
(chunks are numbered across calls, so nothing is reset):

* ``inbox_ready``  -- source has written its partial rows of chunk ``g``;
* ``gather_ready`` -- owner has reduced chunk ``g`` (so it no longer reads those partial
  slots) and its normalised rows are in place;
* ``consumed``     -- reader has copied every rank's normalised rows of chunk ``g`` out
  (so the gather slot may be overwritten by chunk ``g + 2``).
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import host_view
from vtnumba.dist import DEFAULT_NAMES, PeerAccessError, PeerBuffers, QueueFlags

SLOTS = 2
EXCHANGE_MODES = ("push", "pull")
_F32 = np.dtype(np.float32)


class TPSPWorkspace:
    """Peer memory + flags for one handle (collective construction; see the module docstring)."""

    def __init__(self, pb: PeerBuffers, flags: QueueFlags, hidden_size: int, max_chunk_rows: int,
                 exchange: str):
        self.pb = pb
        self.flags = flags
        self.group = pb.group
        self.tp = pb.group.size
        self.rank = pb.group.rank
        self.hidden_size = hidden_size
        self.max_chunk_rows = max_chunk_rows
        self.exchange = exchange
        self.chunks_done = 0  # global chunk counter: identical on every rank (same calls, same T)
        self._views: dict[int, tuple[list, list]] = {}

    @staticmethod
    def nbytes_for(tp: int, hidden_size: int, max_chunk_rows: int, exchange: str) -> tuple[int, int]:
        """(xfer bytes, gather bytes) per rank."""
        xfer = SLOTS * tp * max_chunk_rows * hidden_size * _F32.itemsize
        gather = xfer if exchange == "push" else SLOTS * max_chunk_rows * hidden_size * _F32.itemsize
        return xfer, gather

    @classmethod
    def try_create(cls, group, hidden_size: int, max_chunk_rows: int, *, exchange: str, backend,
                   timeout_s: float, why: list | None = None) -> "TPSPWorkspace | None":
        """The workspace, or ``None`` on *every* rank if any rank cannot map peer memory (the
        reason, the same on every rank, appended to ``why`` if given)."""
        if exchange not in EXCHANGE_MODES:
            raise ValueError(f"exchange={exchange!r} must be one of {EXCHANGE_MODES}")
        xfer, gather = cls.nbytes_for(group.size, hidden_size, max_chunk_rows, exchange)
        pb = PeerBuffers.try_create(xfer + gather, group, backend, timeout_s=timeout_s, why=why)
        if pb is None:
            return None
        # Pre-fault *before* the next collective step: once a peer is past it, it may write
        # into our slots, and a late zero-fill would wipe its partial sums.
        cls._prefault(pb)
        try:
            flags = QueueFlags(group, DEFAULT_NAMES, backend, timeout_s=timeout_s)
        except PeerAccessError as exc:  # raised on every rank alike
            pb.close()
            if why is not None:
                why.append(str(exc))
            return None
        except BaseException:
            pb.close()
            raise
        return cls(pb, flags, hidden_size, max_chunk_rows, exchange)

    @property
    def signals(self):
        """The host-side flags of this workspace (the per-call handshake and abort stamps)."""
        return self.flags.host

    @staticmethod
    def _prefault(pb: PeerBuffers) -> None:
        """Touch every page of the local buffer once now, not inside the first timed call.

        tmpfs pages are allocated on first write; zeros also make a debugging dump readable.
        (Device memory on a real GPU has no such first-touch cost.)
        """
        host = host_view(pb.local)
        if host is not None:
            host.fill(0)

    def views(self, rows: int) -> tuple[list, list]:
        """Per-rank views for microchunk ``rows``: ``xfer[rank]`` ``[2, tp, rows, H]`` and
        ``gather[rank]`` ``[2, rows, H]`` (pull) or ``[2, tp, rows, H]`` (push)."""
        if not 1 <= rows <= self.max_chunk_rows:
            raise ValueError(f"microchunk of {rows} rows does not fit the workspace (1..{self.max_chunk_rows})")
        cached = self._views.get(rows)
        if cached is not None:
            return cached
        tp, H = self.tp, self.hidden_size
        xfer_shape = (SLOTS, tp, rows, H)
        gather_shape = (SLOTS, tp, rows, H) if self.exchange == "push" else (SLOTS, rows, H)
        xfer_bytes, _ = self.nbytes_for(tp, H, self.max_chunk_rows, self.exchange)
        xfer = self.pb.views(_F32, xfer_shape, 0)
        gather = self.pb.views(_F32, gather_shape, xfer_bytes)
        if len(self._views) >= 8:  # a handful of chunk sizes at most (profiling tries several)
            self._views.clear()
        self._views[rows] = (xfer, gather)
        return xfer, gather

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has released the peer memory; the views must not be used after that."""
        return self.pb.closed

    def close(self) -> None:
        """Collective: release the flags and the peer memory (each synchronizes and barriers)."""
        self._views.clear()
        try:
            self.flags.close()
        finally:
            self.pb.close()


__all__ = ["TPSPWorkspace", "SLOTS", "EXCHANGE_MODES"]
