"""The fused op as a chunk pipeline: matmul -> reduce-scatter -> bias + residual + norm -> all-gather.

Seed: ``tpsp_fused_matmul_reduce_scatter_norm_all_gather``.  With ``R = ceil(T / tp)`` rows
per rank and microchunk ``c`` (``n = ceil(R / c)`` chunks), chunk ``i`` covers rows
``i*c .. i*c + c - 1`` of *every* rank's shard, so every rank has its share of work in
every step.  Chunk ``i`` is global chunk ``g`` (chunks are numbered across calls, so no
flag is ever reset) and uses slot set ``s = g % 2`` of the workspace
(:mod:`vtnumba.tpsp.workspace` says which slot lives where in push and pull mode).

**The steps** (each a method of :class:`ChunkPipeline`; "queue" = the handle's compute or
exchange queue; every wait and signal is *queued*, so the queues order themselves across
ranks, :class:`~vtnumba.dist.QueueFlags`)::

    compute  (compute queue)   wait  gather_ready >= g-1 from every rank   # slot s is free again
                               partials: x[rows of shard d] @ W.T -> the exchange slot (me, d)
                               signal inbox_ready = g+1 to every rank
    reduce   (exchange queue)  wait  inbox_ready >= g+1 from every rank   # all partials are in
                               wait  consumed >= g-1 from every rank     # gather slot s was read
                               z = sum of partials + bias + residual; new_residual = z;
                               normed = norm(z) -> this rank's rows of out and the gather slots
                               signal gather_ready = g+1 to every rank
    collect  (exchange queue)  wait  gather_ready >= g+1 from every rank
                               copy every peer's normalised rows into out
                               signal consumed = g+1 to every rank

**What each flag means, who waits, and why nothing can deadlock.**  ``inbox_ready = g+1``
from rank k: k's partial rows of chunk g are in my inbox (or k's outbox).  ``gather_ready
= g+1`` from k: k has reduced chunk g -- it no longer reads the partial slots of chunk g
-- and published its normalised rows.  ``consumed = g+1`` from k: k has copied every
rank's normalised rows of chunk g out of the gather slots.  The *reuse* rule follows:
before chunk g+2 overwrites slot set s, its writer waits for ``gather_ready >= g+1`` (the
partial slots are free) and ``consumed >= g+1`` (the gather slots are free) -- which is
why there are two slot sets: chunk g+1 can be in flight meanwhile.  Every wait of step
``(g, compute)`` is satisfied by steps of chunk ``g-2``, every wait of ``(g, reduce)`` by
computes of chunk ``g`` and collects of ``g-2``, every wait of ``(g, collect)`` by reduces
of chunk ``g``: the dependencies only point to earlier chunks or to the step before in
the same chunk, and every rank queues the same steps in the same order, so by induction
on ``g`` every wait is eventually satisfied -- on synchronous queues (where each step
simply runs when queued), threaded host queues and GPU streams alike.

**The host's part** is small: it checks every rank called with the same shapes, eps and
norm (one handshake per call, on the host flags: :meth:`ChunkPipeline.agree`), queues the
steps in the order ``compute(0), compute(1), [reduce(0), collect(0), compute(2)],
[reduce(1), collect(1), compute(3)], ...`` -- chunk i+1's matmul queued before chunk i's
exchange, so on asynchronous queues they overlap -- and then :meth:`ChunkPipeline.finish`
waits for the queues with a deadline, failing fast (and releasing every queued wait) if a
peer gave up.  On a GPU the host is never between two chunks: the flags are stream memory
operations.

Rows past ``T`` (``T % tp != 0``, ``T < tp``) are zero partials, so ``z = bias + residual``
there (the residual shard's padding) and they are never copied into ``out``.

**What differs between host and GPU** is one object, the :class:`ChunkStrategy` the
backend supplies: how a chunk's partial sums are computed and where they land
(:mod:`vtnumba.tpsp.host`: one BLAS call into a contiguous outbox, or into private scratch
plus a copy; :mod:`vtnumba.tpsp.cuda`: the matmul kernel's epilogue writes every
destination's inbox), and how many rows one reduce launch may cover (the SM budget).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from vtnumba import trace
from vtnumba.backend.arrays import cdiv
from vtnumba.backend.polling import WaitTimeout
from vtnumba.dist.queue_flags import QueueFlagsError
from vtnumba.kernels import gather_rows, peer_reduce_norm
from vtnumba.tpsp._args import CallShape, check_call

_META_TAG = 0x7B5B
_NORM_CODES = {"rms": 1, "layer": 2}


class TPSPShapeMismatch(ValueError):
    """The ranks called the fused op with different arguments (raised on every rank alike)."""


# ---------------------------------------------------------------------------- the call
@dataclass(frozen=True)
class TPSPCall:
    """One fused call's arguments, validated once (``out``/``new_residual`` allocated)."""

    x: object
    w: object
    bias: object
    residual: object
    norm_weight: object
    eps: float
    norm_bias: object
    norm: str
    out: object
    new_residual: object
    shape: CallShape
    chunk: int            # rows of every rank's shard per step (c <= R)
    sm_limit: int | None  # GPU: the most rows (= blocks = SMs) one reduce launch may cover

    @classmethod
    def validate(cls, x, w, bias, residual, norm_weight, eps, norm_bias, norm, *, tp: int, hidden_size: int,
                 max_tokens: int, chunk: int, max_chunk_rows: int, sm_limit, out, new_residual, empty):
        """Check every argument (one contract with the regular forward); ``empty(shape)`` makes outputs."""
        shape, eps = check_call(x, w, bias, residual, norm_weight, eps, norm_bias, norm, tp,
                                hidden_size=hidden_size, max_tokens=max_tokens, out=out, new_residual=new_residual)
        rows = min(chunk, shape.R)  # a chunk beyond the shard is the whole shard
        if rows > max_chunk_rows:
            raise ValueError(f"a microchunk of {rows} rows per rank (chunk_tokens_per_rank={chunk}, R={shape.R}) "
                             f"exceeds the P2P workspace capacity of {max_chunk_rows} rows per rank")
        out = empty((shape.T, shape.H)) if out is None else out
        new_residual = empty((shape.R, shape.H)) if new_residual is None else new_residual
        return cls(x, w, bias, residual, norm_weight, eps, norm_bias, shape.norm, out, new_residual, shape, rows,
                   sm_limit)

    @property
    def num_chunks(self) -> int:
        return cdiv(self.shape.R, self.chunk)

    def meta(self) -> tuple[int, ...]:
        """What every rank must agree on: shapes, microchunk, norm type, eps (as its float64 bits)
        and whether bias / norm bias are present (8 int64 for the host flags' meta slots)."""
        eps_bits = struct.unpack("<q", struct.pack("<d", self.eps))[0]
        flags = int(self.bias is not None) | (int(self.norm_bias is not None) << 1)
        return (_META_TAG, self.shape.T, self.chunk, self.shape.H, _NORM_CODES[self.norm], eps_bits, flags, 0)


def _describe_meta(m: tuple) -> str:
    eps = struct.unpack("<d", struct.pack("<q", int(m[5])))[0]
    norm = {v: k for k, v in _NORM_CODES.items()}.get(int(m[4]), "?")
    return (f"T={m[1]} chunk={m[2]} H={m[3]} norm={norm} eps={eps:g} bias={'yes' if m[6] & 1 else 'no'} "
            f"norm_bias={'yes' if m[6] & 2 else 'no'}")


# ---------------------------------------------------------------------------- the host/GPU difference
class ChunkStrategy:
    """How a chunk's partial sums are computed and where they land (host vs GPU).

    The pipeline calls :meth:`compute` on the compute queue between its wait and its
    signal; :meth:`own_partial` says where the reduce finds this rank's own partial rows.
    """

    #: Most rows one reduce launch may cover (None: all): the GPU's SM budget, see TPSPConfig.
    def reduce_rows_per_launch(self, call: TPSPCall) -> int | None:
        return None

    def begin(self, pipe: "ChunkPipeline") -> None:
        """Order the compute queue after whatever produced the inputs (GPU); default: nothing."""

    def compute(self, pipe: "ChunkPipeline", i: int, s: int) -> None:
        raise NotImplementedError

    def own_partial(self, pipe: "ChunkPipeline", s: int, rows: int):
        return pipe.partial_slot(pipe.me, pipe.me, s)[:rows]


# ---------------------------------------------------------------------------- the pipeline
class ChunkPipeline:
    """One fused call on a workspace: named steps queued on two queues (see the module docstring)."""

    def __init__(self, ws, backend, compute_q, exchange_q, call: TPSPCall, strategy: ChunkStrategy):
        self.ws, self.backend, self.call, self.strategy = ws, backend, call, strategy
        self.compute_q, self.exchange_q = compute_q, exchange_q
        self.flags = ws.flags
        self.tp, self.me, self.H = ws.tp, ws.rank, ws.hidden_size
        self.T, self.R, self.c = call.shape.T, call.shape.R, call.chunk
        self.n = call.num_chunks
        self.push = ws.exchange == "push"
        self.xfer, self.gath = ws.views(self.c)
        self.peers = [k for k in range(self.tp) if k != self.me]
        self.base = 0  # the first global chunk number, fixed by agree()
        self.track = f"tpsp:{ws.group.name}"

    # -- where things are --------------------------------------------------------------
    def partial_slot(self, src: int, dst: int, s: int):
        """Where rank ``src``'s partial rows for rank ``dst`` are exchanged."""
        return self.xfer[dst][s, src] if self.push else self.xfer[src][s, dst]

    def gather_slot(self, owner: int, reader: int, s: int):
        """Where ``reader`` finds ``owner``'s normalised rows."""
        return self.gath[reader][s, owner] if self.push else self.gath[owner][s]

    def chunk_rows(self, i: int) -> tuple[int, int]:
        """(first row, row count) of chunk ``i`` within every rank's shard."""
        r0 = i * self.c
        return r0, min(self.c, self.R - r0)

    def valid_rows(self, owner: int, r0: int, rows: int) -> tuple[int, int]:
        """First token row and number of real (non-padding) rows of ``owner``'s chunk rows."""
        t0 = owner * self.R + r0
        return t0, max(0, min(rows, self.T - t0))

    # -- the steps ------------------------------------------------------------------------
    def compute(self, i: int) -> None:
        g = self.base + i
        s = g % 2
        # Slot set s last held chunk g-2: every reducer must be done reading its partial blocks.
        self.flags.wait(self.compute_q, "gather_ready", g - 1)
        self.strategy.compute(self, i, s)
        self.flags.signal(self.compute_q, "inbox_ready", g + 1)

    def reduce(self, i: int) -> None:
        call, q = self.call, self.exchange_q
        g = self.base + i
        s = g % 2
        r0, rows = self.chunk_rows(i)
        self.flags.wait(q, "inbox_ready", g + 1)
        # The gather slots of set s held chunk g-2: every reader must have copied them out.
        self.flags.wait(q, "consumed", g - 1)
        sources = [self.strategy.own_partial(self, s, rows) if k == self.me else self.partial_slot(k, self.me, s)[:rows]
                   for k in range(self.tp)]
        t0, v = self.valid_rows(self.me, r0, rows)
        mine = self.gather_slot(self.me, self.me, s)[:rows]
        normed = call.out[t0:t0 + rows] if v == rows else mine  # real tokens only: straight into out
        res, new_res = call.residual[r0:r0 + rows], call.new_residual[r0:r0 + rows]
        step = self.strategy.reduce_rows_per_launch(call) or rows
        for a in range(0, rows, step):
            peer_reduce_norm(sources, call.bias, res, call.norm_weight, call.norm_bias, call.eps, normed, new_res,
                             norm=call.norm, rows=(a, min(rows, a + step)), queue=q)
        if self.push and self.peers:
            gather_rows(normed, [self.gather_slot(self.me, d, s)[:rows] for d in self.peers], 0, queue=q)
        elif normed is not mine:
            gather_rows(normed, [mine], 0, queue=q)
        if normed is mine and v:
            gather_rows(mine[:v], [call.out], t0, queue=q)
        self.flags.signal(q, "gather_ready", g + 1)

    def collect(self, i: int) -> None:
        q = self.exchange_q
        g = self.base + i
        s = g % 2
        r0, rows = self.chunk_rows(i)
        self.flags.wait(q, "gather_ready", g + 1, sources=self.peers)
        for k in self.peers:
            t0, v = self.valid_rows(k, r0, rows)
            if v:
                gather_rows(self.gather_slot(k, self.me, s)[:v], [self.call.out], t0, queue=q)
        self.flags.signal(q, "consumed", g + 1)

    # -- the call -------------------------------------------------------------------------
    def agree(self) -> None:
        """Host handshake: every rank publishes the call's meta, then compares all of them.

        A mismatch raises the same TPSPShapeMismatch on every rank *before* anything is
        queued, so no queue waits for a peer that took another path.
        """
        mine = self.call.meta()
        with trace.span("wait call handshake", "peer", self.track):
            metas = self.flags.handshake(mine)
        if any(m != mine for m in metas):
            shown = "; ".join(f"rank {r}: {_describe_meta(m)}" for r, m in enumerate(metas))
            raise TPSPShapeMismatch(
                f"the ranks of group {self.ws.group.name!r} called the fused TPSP op with different shapes or "
                f"arguments ({shown}); every rank must pass the same T, hidden size, norm type and eps (and use "
                "the same config)")
        self.base = self.ws.chunks_done
        self.ws.chunks_done += self.n

    def run(self) -> None:
        with trace.span("tpsp pipeline", "tpsp", self.track, chunks=self.n):
            self.agree()
            queues = (self.compute_q, self.exchange_q)
            try:
                self.strategy.begin(self)
                self.compute(0)
                if self.n > 1:
                    self.compute(1)
                for i in range(self.n):
                    self.reduce(i)
                    self.collect(i)
                    if i + 2 < self.n:
                        self.compute(i + 2)
            except WaitTimeout as exc:  # an inline (synchronous-queue) wait ran out of time
                self.flags.fail(queues)
                raise QueueFlagsError(f"rank {self.me} of group {self.ws.group.name!r}: {exc}; missing flags: "
                                      f"{self.flags._missing()}") from exc
            except BaseException:
                self.flags.fail(queues)
                raise
            self.flags.finish(queues, what="the fused TPSP op")


__all__ = ["TPSPCall", "ChunkStrategy", "ChunkPipeline", "TPSPShapeMismatch"]
