"""The fused op as a chunk pipeline: matmul -> reduce-scatter -> bias + residual + norm -> all-gather.

Upstream: vLLM's ``tpsp_fused_matmul_reduce_scatter_norm_all_gather``.  With ``R = ceil(T / tp)`` rows
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
    collect  (exchange queue)  wait  gather_ready >= g+1 from every peer
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
simply runs when queued), threaded host queues and GPU streams alike.  The synchronous
case also answers a GPU hazard: two streams that share one hardware work queue run their
work in the order the host queued it, as if they were one queue -- and in that order
(below) every wait comes after the local signal it needs, as the synchronous queues
show on every run, so a flag wait can hold up the other stream but never wait for work
queued behind it.

**The host's part** is small: it checks every rank called with the same shapes, eps and
norm (one handshake per call, on the host flags: :meth:`ChunkPipeline.agree`), queues the
steps in the order ``compute(0), compute(1), [reduce(0), collect(0), compute(2)],
[reduce(1), collect(1), compute(3)], ...`` -- chunk i+1's matmul queued before chunk i's
exchange, so on asynchronous queues they overlap -- and then :meth:`vtnumba.dist.QueueFlags.finish`
waits for the queues with a deadline, failing fast (and releasing every queued wait) if a
peer gave up.  On a GPU the host is never between two chunks: the flags are stream memory
operations.

Rows past ``T`` (``T % tp != 0``, ``T < tp``) are zero partials, so ``z = bias + residual``
there (the residual shard's padding) and they are never copied into ``out``.

**What differs between host and GPU** is one object, the :class:`ChunkStrategy` the
backend supplies: how a chunk's partial sums are computed and where they land
(:mod:`vtnumba.tpsp.host`: one BLAS call into a contiguous outbox, or into private scratch
plus a copy; :mod:`vtnumba.tpsp.cuda`: the matmul kernel's epilogue writes every
destination's inbox), and how many SMs the exchange's kernels may occupy (the SM budget).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from vtnumba import trace
from vtnumba.backend.arrays import (array_kind, cdiv, check_array, check_eps, check_not_partly_overlapping,
                                    check_outputs_apart)
from vtnumba.backend.polling import WaitTimeout
from vtnumba.dist.queue_flags import RELEASED, QueueFlagsError
from vtnumba.kernels.peer import queue_gather_rows, queue_peer_reduce_norm
from vtnumba.tpsp.norm_type import LAYER, get_tpsp_norm_type

_META_TAG = 0x7B5B
_NORM_CODES = {"rms": 1, "layer": 2}


class TPSPShapeMismatch(ValueError):
    """The ranks called the fused op with different arguments (raised on every rank alike)."""


# ---------------------------------------------------------------------------- the contract
@dataclass(frozen=True)
class CallShape:
    """The sizes of one call: ``x [T, K]``, ``w [H, K]``, residual shard ``[R, H]`` with ``R = ceil(T / tp)``."""

    T: int     #: token rows of ``x`` (the same on every rank)
    K: int     #: this rank's slice of the reduction dimension
    H: int     #: hidden size, the columns of the output and the norm
    R: int     #: rows of this rank's residual shard, ``ceil(T / tp)``
    norm: str  #: ``"rms"`` or ``"layer"``


def check_tpsp_array(name: str, arr, shape: tuple) -> None:
    """One TPSP array argument: float32, C-contiguous, ``shape`` (entries None are free)."""
    if not (hasattr(arr, "shape") and hasattr(arr, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(arr).__name__}")
    check_array(name, arr, ndim=len(shape), dtypes=(np.float32,), shape=shape)


def check_call(x, w, bias, residual, norm_weight, eps, norm_bias, norm, tp: int, *, hidden_size: int | None = None,
               max_tokens: int | None = None, out=None, new_residual=None) -> tuple[CallShape, float]:
    """Validate one call of the fused op or of the regular forward (one contract, one set of messages).

    Looks only at ``shape``/``dtype``/contiguity, so it works on numpy and device arrays alike,
    and never communicates: every rank checks its own arguments (the pipeline's handshake then
    compares them across ranks).  Returns the sizes and ``eps`` as a float.
    """
    norm = get_tpsp_norm_type(norm)
    check_tpsp_array("x", x, (None, None))
    T, K = (int(s) for s in x.shape)
    if T < 1:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected at least one token row")
    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"x has T={T} token rows, more than max_batched_tokens={max_tokens} this TPSP handle "
                         "was opened for (its workspace is sized for that)")
    check_tpsp_array("w", w, (None, K))
    H = int(w.shape[0])
    if hidden_size is not None and H != hidden_size:
        raise ValueError(f"w has shape {tuple(w.shape)}: H={H}, but this TPSP handle was opened for "
                         f"hidden_size={hidden_size}")
    R = cdiv(T, tp)
    if bias is not None:
        check_tpsp_array("bias", bias, (H,))
    try:
        check_tpsp_array("residual", residual, (R, H))
    except ValueError as exc:
        raise ValueError(f"{exc} -- the residual is this rank's token shard: R = ceil(T={T} / tp={tp}) = {R} "
                         "rows (use shard_residual() to cut it from the full [T, H] residual)") from None
    check_tpsp_array("norm_weight", norm_weight, (H,))
    eps = check_eps(eps)
    if norm_bias is not None:
        if norm != LAYER:
            raise ValueError(f"norm_bias is given but norm={norm!r}: only LayerNorm has a bias; pass norm='layer' "
                             "or norm_bias=None")
        check_tpsp_array("norm_bias", norm_bias, (H,))
    if out is not None:
        check_tpsp_array("out", out, (T, H))
    if new_residual is not None:
        check_tpsp_array("new_residual", new_residual, (R, H))
    # By address, not identity: out=buf and new_residual=buf[:R] are different arrays over the
    # same bytes.  The outputs are written chunk by chunk while later chunks still read the
    # inputs, so neither may share memory with an input -- except new_residual with residual,
    # exactly (the update in place).
    inputs = {"x": x, "w": w, "bias": bias, "norm_weight": norm_weight, "norm_bias": norm_bias}
    check_outputs_apart({"out": out}, {"new_residual": new_residual, "residual": residual, **inputs})
    if new_residual is not None:
        check_not_partly_overlapping("new_residual", new_residual, "residual", residual)
        check_outputs_apart({"new_residual": new_residual}, inputs)
    return CallShape(T, K, H, R, norm), eps


@dataclass(frozen=True)
class CallLimits:
    """What a TPSP handle and its config allow one call (the fixed side of the contract)."""

    tp: int                #: ranks in the group
    hidden_size: int       #: H the handle was opened for
    max_tokens: int        #: ``max_batched_tokens``, the token count the workspace is sized for
    chunk: int             #: microchunk, the rows of every rank's shard per pipeline step
    max_chunk_rows: int    #: the most rows one exchange slot holds
    sm_limit: int | None   #: on a GPU, the most rows (= blocks = SMs) one reduce launch may cover
    empty: object          #: ``empty(shape)`` makes a new float32 array in the target's memory


# ---------------------------------------------------------------------------- the call
@dataclass(frozen=True)
class TPSPCall:
    """One fused call's arguments, validated once (``out``/``new_residual`` allocated)."""

    x: object              #: ``[T, K]`` this rank's activations
    w: object              #: ``[H, K]`` this rank's shard of the projection
    bias: object           #: ``[H]`` or None, added once (after the reduction)
    residual: object       #: ``[R, H]`` this rank's residual shard
    norm_weight: object    #: ``[H]``
    eps: float             #: the norm's epsilon
    norm_bias: object      #: ``[H]`` or None (LayerNorm only)
    norm: str              #: ``"rms"`` or ``"layer"``
    out: object            #: ``[T, H]`` the gathered, normalised rows (every rank)
    new_residual: object   #: ``[R, H]`` ``reduced + bias + residual`` for this rank's rows
    shape: CallShape       #: the sizes, checked once
    chunk: int             #: rows of every rank's shard per step (``c <= R``)
    sm_limit: int | None   #: on a GPU, the most rows (= blocks = SMs) one reduce launch may cover

    @classmethod
    def validate(cls, limits: CallLimits, x, w, bias, residual, norm_weight, eps, norm_bias, norm, *, out=None,
                 new_residual=None) -> "TPSPCall":
        """Check every argument against the contract and the handle's limits; allocate missing outputs."""
        shape, eps = check_call(x, w, bias, residual, norm_weight, eps, norm_bias, norm, limits.tp,
                                hidden_size=limits.hidden_size, max_tokens=limits.max_tokens, out=out,
                                new_residual=new_residual)
        # A chunk beyond the shard is the whole shard (one step), and one beyond the workspace
        # slot is the slot: a step moves at most what a slot holds.  (Refused here, a chunk a
        # profile or set_config had accepted failed the first large call and broke the handle.)
        rows = min(limits.chunk, shape.R, limits.max_chunk_rows)
        out = limits.empty((shape.T, shape.H)) if out is None else out
        new_residual = limits.empty((shape.R, shape.H)) if new_residual is None else new_residual
        return cls(x, w, bias, residual, norm_weight, eps, norm_bias, shape.norm, out, new_residual, shape, rows,
                   limits.sm_limit)

    @property
    def num_chunks(self) -> int:
        """How many pipeline steps the call takes, ``ceil(R / chunk)``."""
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

    def exchange_max_blocks(self, call: TPSPCall) -> int | None:
        """The most thread blocks the exchange's kernels may occupy, or None for no bound (this default).

        The GPU strategy returns the SM budget (``TPSPConfig.sm_count_target``): the reduce and
        gather kernels then leave the other SMs to the next chunk's matmul.
        """
        return None

    def begin(self, pipe: "ChunkPipeline") -> None:
        """Order the compute queue after whatever produced the inputs (GPU); default: nothing."""

    def compute(self, pipe: "ChunkPipeline", i: int, s: int) -> None:
        """Queue chunk ``i``'s partial sums on ``pipe.compute_q`` into the exchange slots of set ``s``.

        Every strategy must implement it; the pipeline has already queued the wait before it.
        """
        raise NotImplementedError

    def own_partial(self, pipe: "ChunkPipeline", s: int, rows: int):
        """The first ``rows`` of this rank's own partial in slot set ``s``; default: the exchange slot ``(me, me)``."""
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
        # The exchange's kernels are queued without their argument checks: the call's arrays
        # were checked once (TPSPCall.validate), the workspace's slots when it was opened, and
        # every array below is a slice of those (see vtnumba.kernels.peer).
        self.kind = array_kind("x", call.x)
        self.is_layer = call.norm == LAYER

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
        """Queue the *compute* step of chunk ``i`` on the compute queue (wait, partials, signal ``inbox_ready``)."""
        g = self.base + i
        s = g % 2
        # Slot set s last held chunk g-2: every reducer must be done reading its partial blocks.
        self.flags.wait(self.compute_q, "gather_ready", g - 1)
        self.strategy.compute(self, i, s)
        self.flags.signal(self.compute_q, "inbox_ready", g + 1)

    def reduce(self, i: int) -> None:
        """Queue the *reduce* step of chunk ``i`` on the exchange queue: sum the partials, add bias and
        residual, normalise, publish this rank's rows to the gather slots, signal ``gather_ready``."""
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
        blocks = self.strategy.exchange_max_blocks(call)  # one launch, on at most this many SMs
        kind = self.kind
        queue_peer_reduce_norm(kind, sources, call.bias, res, call.norm_weight, call.norm_bias, call.eps,
                               self.is_layer, normed, new_res, 0, rows, q, max_blocks=blocks)
        if self.push and self.peers:
            queue_gather_rows(kind, normed, [self.gather_slot(self.me, d, s)[:rows] for d in self.peers], 0, q,
                              max_blocks=blocks)
        elif normed is not mine:
            queue_gather_rows(kind, normed, [mine], 0, q, max_blocks=blocks)
        if normed is mine and v:
            queue_gather_rows(kind, mine[:v], [call.out], t0, q, max_blocks=blocks)
        self.flags.signal(q, "gather_ready", g + 1)

    def collect(self, i: int) -> None:
        """Queue the *collect* step of chunk ``i`` on the exchange queue: copy every peer's normalised
        rows into ``out``, then signal ``consumed``."""
        q = self.exchange_q
        g = self.base + i
        s = g % 2
        r0, rows = self.chunk_rows(i)
        self.flags.wait(q, "gather_ready", g + 1, sources=self.peers)
        for k in self.peers:
            t0, v = self.valid_rows(k, r0, rows)
            if v:
                queue_gather_rows(self.kind, self.gather_slot(k, self.me, s)[:v], [self.call.out], t0, q,
                                  max_blocks=self.strategy.exchange_max_blocks(self.call))
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
        # Each microchunk raises the flags to its own epoch, a 32-bit counter that waits compare
        # cyclically: a handle can count RELEASED - 1 of them (about a billion) in its life.
        # Said here, the same on every rank (the count is), before anything is queued -- past it
        # the flags refused the epoch mid-call, naming flags, not the handle.
        if self.ws.chunks_done + self.n >= RELEASED:
            raise RuntimeError(f"this TPSP handle has run {self.ws.chunks_done} microchunks; its queue flags count "
                               f"at most {RELEASED - 1} (32-bit epochs, compared cyclically): close the handle "
                               "and open a new one (or profile again) to start counting afresh")
        self.base = self.ws.chunks_done
        self.ws.chunks_done += self.n

    def run(self) -> None:
        """The whole call: :meth:`agree`, queue every step in pipeline order, then wait for both queues.

        Returns once the queued work is done on this rank; on any failure (here or a peer's) it
        releases every queued wait, so no queue is left blocked, and raises.
        """
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
                                      f"{self.flags.missing()}") from exc
            except BaseException:
                self.flags.fail(queues)
                raise
            self.flags.finish(queues, what="the fused TPSP op")


def run_fused(ws, backend, compute_q, exchange_q, strategy: ChunkStrategy, limits: CallLimits, x, w, bias, residual,
              norm_weight, eps, norm_bias=None, *, norm="rms", out=None, new_residual=None):
    """The fused op on one workspace: validate the call once, run its chunk pipeline, return the outputs.

    ``(out [T, H], new_residual [R, H])``, ready to read: the pipeline ends by waiting for
    both queues (with a deadline, watching the peers; :meth:`~vtnumba.dist.QueueFlags.finish`).
    """
    call = TPSPCall.validate(limits, x, w, bias, residual, norm_weight, eps, norm_bias, norm, out=out,
                             new_residual=new_residual)
    with trace.span("tpsp_matmul_rs_norm_ag", "tpsp", f"tpsp:{ws.group.name}", T=call.shape.T, K=call.shape.K,
                    H=call.shape.H, chunk=call.chunk):
        ChunkPipeline(ws, backend, compute_q, exchange_q, call, strategy).run()
    return call.out, call.new_residual


__all__ = ["CallShape", "CallLimits", "check_call", "check_tpsp_array", "TPSPCall", "ChunkStrategy", "ChunkPipeline",
           "TPSPShapeMismatch", "run_fused"]
