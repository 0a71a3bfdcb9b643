"""``HostTPSPBackend``: TPSP on the ``cpu`` target -- numpy BLAS, njit kernels, shared memory between processes.

The same chunk pipeline as on a GPU (:mod:`vtnumba.tpsp.pipeline`), with host parts (the
:class:`HostChunkStrategy`):

* the projection is numpy's BLAS (``np.matmul(..., out=...)`` inside
  :func:`vtnumba.kernels.linear_rows_to`): *one* call for all ``T`` rows when the call is one
  chunk, else one per destination per chunk;
* the reduce + bias + residual + norm is the ``@numba.njit`` host twin of the CUDA kernel
  (:func:`vtnumba.kernels.peer_reduce_norm`), one pass over the rows;
* the slots live in shared-memory segments every rank maps (:class:`vtnumba.dist.PeerBuffers`:
  anonymous ``memfd`` memory, opened through ``/proc/<pid>/fd``, so nothing appears in
  ``/dev/shm``), so a peer's memory is a numpy view and the "exchange" is plain loads and stores.

**Pull, not push, by default.**  A GPU matmul's epilogue writes each destination's rows
straight into that rank's inbox (push).  A BLAS call writes one array, and every extra call
re-packs the whole ``[K, H]`` weight (milliseconds at ``K=2048, H=4096``), so the host
does the projection in *one* call either way:

* ``"pull"`` (default): the call writes this rank's own shared outbox, which holds the
  rows of every destination contiguously in token order; each rank then reads its row
  block from every peer.  No copy -- but the GEMM writes shared-memory pages, 4 KiB ones
  (shmem usually has no transparent huge pages), and writing its output tile by tile over
  many rows costs more TLB misses than numpy's huge-page private memory.
* ``"push"``: the call writes private scratch (huge pages) and a copy -- the host's
  epilogue -- moves each peer's rows into that peer's inbox; this rank's own rows never
  move (the reduce reads them from the scratch).  The GEMM runs at full speed, but one
  more ``[R, H]`` copy crosses memory.

Where memory bandwidth is the shared bottleneck (one core per rank, every rank streaming),
the copy costs more than the TLB misses: measured in alternating runs of ``vtnumba bench
tpsp --exchange pull`` and ``--exchange push`` (2 ranks with one core each, ``T=2048``), pull
spent 0.33-0.47x the unfused baseline's time above the matmul and push 0.50-0.76x.  So pull
is the default and push the comparison (and the GPU's mode).

**Where the time goes.**  Above the matmul everything is memory traffic: the reduce + norm
pass (reads the partials and the residual, writes the new residual and the normalised
rows), the gather copies, and in push mode the epilogue copy.  With one core per rank (no
spare core, no SMT) none of it can hide behind the matmul; it can only
be *less* traffic than the unfused path's MPI copies and numpy temporaries.
``vtnumba bench tpsp`` measures both in one run.

**Overlap.**  With ``threaded=True`` the matmuls run on a worker thread (a threaded
:class:`~vtnumba.backend.CPUBackend` queue; BLAS and the njit kernels release the GIL), so
chunk i+1's matmul runs beside chunk i's exchange.  Whether that pays depends on spare
cores: with one core per rank the two compete for the same core, so the default is the synchronous queue; the measured profile
(``profile(search=True)``) picks the chunk size that is fastest either way.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend import CPU, CPUBackend
from vtnumba.dist.comm import DEFAULT
from vtnumba.kernels.matmul import queue_linear_rows_to
from vtnumba.kernels.peer import queue_gather_rows
from vtnumba.tpsp.peer_backend import PeerTPSPBackend
from vtnumba.tpsp.pipeline import ChunkStrategy


class HostChunkStrategy(ChunkStrategy):
    """A chunk's partial sums on the host: as few BLAS calls as possible, in one queue operation.

    Pull mode: the matmul writes this rank's own outbox (with one chunk, the outbox *is* a
    contiguous ``[tp*R, H]`` array in token order: one BLAS call for every row).  Push mode:
    the matmul writes private ``scratch`` (two slot sets ``[2][tp][c][H]``) and then the
    host's "epilogue" copies each peer's rows into that peer's inbox; this rank's own rows
    stay in the scratch, where the reduce reads them (:meth:`own_partial`).
    """

    def __init__(self, scratch):
        self.scratch = scratch

    def _scratch(self, pipe):
        return self.scratch[:2 * pipe.tp * pipe.c * pipe.H].reshape(2, pipe.tp, pipe.c, pipe.H)

    def compute(self, pipe, i: int, s: int) -> None:
        call, tp, me, R, H = pipe.call, pipe.tp, pipe.me, pipe.R, pipe.H
        x, w, kind = call.x, call.w, pipe.kind
        r0, rows = pipe.chunk_rows(i)
        sc = None if self.scratch is None else self._scratch(pipe)
        targets = range(tp)

        def body(_stream) -> None:
            # One queue operation: inline on a synchronous queue, on the worker thread of a
            # threaded one; the kernels below therefore run directly (no queue of their own),
            # queued as checked, like the exchange's kernels (see ChunkPipeline).
            if sc is None:  # pull: straight into my outbox
                if pipe.n == 1:
                    queue_linear_rows_to(kind, x, w, None, [pipe.xfer[me][s].reshape(tp * R, H)], tp * R)
                    return
                for d in targets:
                    t0, v = pipe.valid_rows(d, r0, rows)
                    queue_linear_rows_to(kind, x[t0:t0 + v], w, None, [pipe.xfer[me][s, d][:rows]], rows)
                return
            if pipe.n == 1:  # push: sc[s] *is* [tp*R, H] in token order: every row in one call
                queue_linear_rows_to(kind, x, w, None, [sc[s].reshape(tp * R, H)], tp * R)
            else:
                for d in targets:
                    t0, v = pipe.valid_rows(d, r0, rows)
                    queue_linear_rows_to(kind, x[t0:t0 + v], w, None, [sc[s, d][:rows]], rows)
            for d in pipe.peers:  # each peer's rows into its inbox; mine stay in the scratch
                queue_gather_rows(kind, sc[s, d][:rows], [pipe.partial_slot(me, d, s)[:rows]], 0, None)

        pipe.backend.submit(pipe.compute_q, body, name="tpsp compute", chunk=pipe.base + i)

    def own_partial(self, pipe, s: int, rows: int):
        if self.scratch is None:
            return super().own_partial(pipe, s, rows)
        return self._scratch(pipe)[s, pipe.me][:rows]


class HostTPSPBackend(PeerTPSPBackend):
    """TPSP for numpy arrays (the ``cpu`` target)."""

    default_exchange = "pull"
    tpsp_chunk_granularity = 64

    def __init__(self, group_name: str = "tp", device=CPU, *, threaded: bool = False, exchange: str | None = None,
                 timeout_s: float = DEFAULT) -> None:
        if not isinstance(threaded, bool):  # ('no' is a true value)
            raise TypeError(f"threaded={threaded!r} must be True or False")
        super().__init__(group_name, device, exchange=exchange, timeout_s=timeout_s)
        # A private host backend: its queues are ours (threaded or not), and its memory is host
        # memory whatever the process target is (tests run with the simulator switched on).
        self._backend = CPUBackend(threaded=bool(threaded))
        self.threaded = bool(threaded)

    @property
    def data_backend(self):
        return self._backend

    def _check_array_kind(self, arrays: dict) -> None:
        for name, arr in arrays.items():
            if arr is not None and not isinstance(arr, np.ndarray):
                raise TypeError(f"{name} is a {type(arr).__module__}.{type(arr).__name__}; HostTPSPBackend takes "
                                "numpy arrays (use CudaTPSPBackend for device arrays)")

    def _to_target(self, host: np.ndarray):
        return host

    def _empty(self, shape):
        return np.empty(shape, dtype=np.float32)

    def chunk_strategy(self, handle) -> HostChunkStrategy:
        return HostChunkStrategy(handle.scratch)

    def _make_scratch(self, elements: int):
        if self.exchange != "push":
            return None  # pull: the outbox is contiguous, one BLAS call writes it directly
        # numpy asks the kernel for transparent huge pages on large allocations; touch every
        # page now so the first timed call does not pay the page faults.
        scratch = np.empty(elements, dtype=np.float32)
        scratch.fill(0)
        return scratch

    def close(self, handle=None) -> None:
        super().close(handle)
        if handle is None:
            self._backend.close()  # stop the worker threads of threaded queues


__all__ = ["HostTPSPBackend"]
