"""The fused op itself: matmul -> reduce-scatter -> bias + residual + norm -> all-gather, in microchunks.

Seed: ``tpsp_fused_matmul_reduce_scatter_norm_all_gather``.  With ``R = ceil(T / tp)`` rows
per rank and microchunk ``c`` (``n = ceil(R / c)`` chunks), chunk ``i`` covers rows
``i*c .. i*c + c - 1`` of *every* rank's shard, so every rank has its share of work in
every step.  One chunk goes through four steps (slot ``s = g % 2``, ``g`` the global chunk
number; :mod:`vtnumba.tpsp.workspace` says which slot lives where in push/pull mode):

1. **compute** (compute queue): ``x[rows of shard d] @ W.T`` for every destination ``d``,
   and each destination's rows land in the exchange slot for ``(me, d)``.  On a GPU the
   matmul's epilogue writes them there directly (push); on the host in pull mode one BLAS
   call writes the rank's contiguous outbox.  Host push mode computes into private
   *scratch* memory with one BLAS call and then copies the peers' rows out (own rows stay
   put: the reduce reads them from the scratch).  A host function queued right behind
   raises ``inbox_ready = g + 1`` on every rank: the flag goes up the moment the data is
   complete, whatever the host thread is doing (on a GPU that is a stream callback).
2. **reduce + norm** (exchange queue), once ``inbox_ready >= g + 1`` from every rank:
   ``z = sum of the tp partial blocks + bias + residual``; ``new_residual = z``;
   ``normed = norm(z)`` -- one pass (:func:`vtnumba.kernels.peer_reduce_norm`), written
   straight into this rank's rows of ``out`` when they are all real tokens -- and the
   normalised rows published for the peers (push: copied into every peer's gather slot;
   pull: copied once into this rank's own gather slot, which the peers read).  Then ``gather_ready = g + 1``.
3. **collect**, once ``gather_ready >= g + 1`` from every rank: copy the other ranks'
   normalised rows into ``out`` at their token rows; then ``consumed = g + 1``.
4. **reuse**: before chunk ``g + 2`` writes the slots of chunk ``g``, its writer waits for
   ``gather_ready >= g + 1`` (the reducers are done with the partial slots) and
   ``consumed >= g + 1`` (the readers are done with the gather slots).

Order on one rank: ``compute(0), compute(1), [exchange(0), compute(2)], [exchange(1),
compute(3)], ...``.  On a queue that runs asynchronously (a CUDA stream; a threaded host
queue) chunk i+1's matmul runs while the host thread exchanges chunk i; on a synchronous
host queue the same order is simply executed in turn.

Rows past ``T`` (``T % tp != 0``, ``T < tp``) are zero partials, so ``z = bias + residual``
there (the residual shard's padding) and they are never copied into ``out``.  Every rank
publishes ``(T, c, H)`` with its first flag; a rank that finds a peer with different
values raises the same ValueError as every other rank (each compares all of them).
"""

from __future__ import annotations

from vtnumba import trace
from vtnumba.kernels import gather_rows, linear_rows_to, peer_reduce_norm

_META_TAG = 0x7B5B


class TPSPShapeMismatch(ValueError):
    """The ranks called the fused op with different shapes (raised on every rank alike)."""


def run_fused(ws, backend, compute_q, exchange_q, x, w, bias, residual, norm_weight, eps, norm_bias, norm: str,
              chunk: int, out, new_residual, *, sm_limit: int | None = None, scratch=None) -> None:
    """One fused call on workspace ``ws`` (arguments validated, ``out``/``new_residual`` allocated).

    ``scratch``: ``None`` (the matmul writes the exchange slots itself), or a flat float32
    array of private memory, at least ``2 * tp * c * H`` elements, that the matmul writes
    instead (host backend): two slot sets ``[2][tp][c][H]``, like the exchange slots.
    """
    sig = ws.signals
    tp, me, H = ws.tp, ws.rank, ws.hidden_size
    T = int(x.shape[0])
    R = -(-T // tp)
    c = min(chunk, R)
    n = -(-R // c)
    base = ws.chunks_done
    ws.chunks_done += n
    push = ws.exchange == "push"
    xfer, gath = ws.views(c)
    sc = None if scratch is None else scratch[:2 * tp * c * H].reshape(2, tp, c, H)
    on_host = backend.device_type.value == "cpu"
    everyone = range(tp)
    peers = [k for k in everyone if k != me]
    track = f"tpsp:{ws.group.name}"

    def partial_slot(src: int, dst: int, s: int):
        """Where rank ``src``'s partial rows for rank ``dst`` are exchanged."""
        return xfer[dst][s, src] if push else xfer[src][s, dst]

    def gather_slot(owner: int, reader: int, s: int):
        """Where ``reader`` finds ``owner``'s normalised rows."""
        return gath[reader][s, owner] if push else gath[owner][s]

    def valid_rows(owner: int, r0: int, rows: int) -> tuple[int, int]:
        """First token row and number of real (non-padding) rows of ``owner``'s chunk rows."""
        t0 = owner * R + r0
        return t0, max(0, min(rows, T - t0))

    def chunk_rows(i: int) -> tuple[int, int]:
        r0 = i * c
        return r0, min(c, R - r0)

    def compute(i: int) -> None:
        g = base + i
        s = g % 2
        r0, rows = chunk_rows(i)
        # Slot s last held chunk g-2: every reducer must be done reading its partial blocks.
        sig.wait("gather_ready", g - 1)
        if not on_host:
            # Device: the launches go into the compute stream; a stream callback raises the flag.
            if n == 1 and push:  # one queue op, one launch per destination's inbox
                linear_rows_to(x, w, None, [partial_slot(me, d, s) for d in everyone], R, queue=compute_q)
            elif n == 1:  # pull, one chunk: my outbox xfer[me][s] *is* [tp*R, H] in token order
                linear_rows_to(x, w, None, [xfer[me][s].reshape(tp * R, H)], tp * R, queue=compute_q)
            else:
                for d in everyone:
                    t0, v = valid_rows(d, r0, rows)
                    linear_rows_to(x[t0:t0 + v], w, None, [partial_slot(me, d, s)[:rows]], rows, queue=compute_q)
            backend.launch_host_func(compute_q, lambda: sig.set_all("inbox_ready", g + 1, include_self=True),
                                     name="signal inbox_ready")
            return

        def body() -> None:
            # Host: the whole step is one queue operation (inline on a synchronous queue, on the
            # worker thread of a threaded one), so a failure can stamp an abort at once -- the
            # ranks waiting for this chunk, this one included, fail fast instead of timing out.
            try:
                if sc is None:  # pull: straight into my outbox
                    if n == 1:
                        linear_rows_to(x, w, None, [xfer[me][s].reshape(tp * R, H)], tp * R)
                    else:
                        for d in everyone:
                            t0, v = valid_rows(d, r0, rows)
                            linear_rows_to(x[t0:t0 + v], w, None, [xfer[me][s, d][:rows]], rows)
                else:  # push: one BLAS call into private scratch, then the epilogue copies
                    if n == 1:  # sc[s] *is* [tp*R, H] in token order: every row in one call
                        linear_rows_to(x, w, None, [sc[s].reshape(tp * R, H)], tp * R)
                    else:
                        for d in everyone:
                            t0, v = valid_rows(d, r0, rows)
                            linear_rows_to(x[t0:t0 + v], w, None, [sc[s, d][:rows]], rows)
                    for d in peers:  # each peer's rows into its inbox; mine stay in the scratch
                        gather_rows(sc[s, d][:rows], [partial_slot(me, d, s)[:rows]], 0)
                sig.set_all("inbox_ready", g + 1, include_self=True)
            except BaseException:
                sig.abort()
                raise

        backend.submit(compute_q, lambda _stream: body(), name="tpsp compute", chunk=g)

    def exchange(i: int) -> None:
        g = base + i
        s = g % 2
        r0, rows = chunk_rows(i)
        with trace.span("wait inbox_ready", "peer", track, chunk=g):
            sig.wait("inbox_ready", g + 1, source=everyone)
        if i == 0:
            _check_meta(sig, tp, (T, c, H))
        # The gather slot s held chunk g-2: every reader must have copied it out.
        sig.wait("consumed", g - 1)
        sources = [sc[s, me][:rows] if (k == me and sc is not None) else partial_slot(k, me, s)[:rows]
                   for k in everyone]
        t0, v = valid_rows(me, r0, rows)
        mine = gather_slot(me, me, s)[:rows]
        normed = out[t0:t0 + rows] if v == rows else mine  # real tokens only: straight into out
        res, new_res = residual[r0:r0 + rows], new_residual[r0:r0 + rows]
        step = rows if not sm_limit else max(1, int(sm_limit))
        # One block per row on a GPU: launching at most sm_limit rows at a time keeps the
        # exchange on at most that many SMs, leaving the others to the next chunk's matmul.
        for a in range(0, rows, step):
            peer_reduce_norm(sources, bias, res, norm_weight, norm_bias, eps, normed, new_res, norm=norm,
                             rows=(a, min(rows, a + step)), queue=exchange_q)
        if push and peers:
            gather_rows(normed, [gather_slot(me, d, s)[:rows] for d in peers], 0, queue=exchange_q)
        elif normed is not mine:
            gather_rows(normed, [mine], 0, queue=exchange_q)
        if normed is mine and v:
            gather_rows(mine[:v], [out], t0, queue=exchange_q)
        backend.synchronize(exchange_q)
        sig.set_all("gather_ready", g + 1, include_self=True)
        with trace.span("wait gather_ready", "peer", track, chunk=g):
            sig.wait("gather_ready", g + 1, source=everyone)
        for k in peers:
            t0, v = valid_rows(k, r0, rows)
            if v:
                gather_rows(gather_slot(k, me, s)[:v], [out], t0, queue=exchange_q)
        backend.synchronize(exchange_q)
        sig.set_all("consumed", g + 1)

    sig.set_meta((_META_TAG, T, c, H))  # ordered before the first inbox_ready by its release store
    try:
        compute(0)
        if n > 1:
            compute(1)
        for i in range(n):
            exchange(i)
            if i + 2 < n:
                compute(i + 2)
    except BaseException as exc:
        # A matmul that failed on a queue's worker thread shows up here only as "this rank
        # aborted"; report the failure itself (synchronize re-raises the queue's error).
        try:
            backend.synchronize(compute_q)
        except Exception as queued:
            raise queued from exc
        raise
    backend.synchronize(compute_q)  # sticky errors of the compute queue surface here


def _check_meta(sig, tp: int, mine: tuple) -> None:
    metas = [sig.meta(r)[:4] for r in range(tp)]
    if any(m[0] != _META_TAG or tuple(m[1:]) != mine for m in metas):
        shown = "; ".join(f"rank {r}: T={m[1]} chunk={m[2]} H={m[3]}" for r, m in enumerate(metas))
        raise TPSPShapeMismatch(f"the ranks called the fused TPSP op with different shapes ({shown}); every rank "
                                "of the group must pass the same T and hidden size (and use the same config)")


__all__ = ["run_fused", "TPSPShapeMismatch"]
