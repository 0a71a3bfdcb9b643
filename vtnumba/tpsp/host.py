"""``HostTPSPBackend``: TPSP on the ``cpu`` target -- numpy BLAS, njit kernels, POSIX shared memory.

The same pipeline as on a GPU (:mod:`vtnumba.tpsp.pipeline`), with host parts:

* the projection is numpy's BLAS (``np.matmul(..., out=...)`` inside
  :func:`vtnumba.kernels.linear_rows_to`): *one* call for all ``T`` rows;
* the reduce + bias + residual + norm is the ``@numba.njit`` host twin of the CUDA kernel
  (:func:`vtnumba.kernels.peer_reduce_norm`), one pass over the rows;
* the slots live in ``/dev/shm`` segments every rank maps (:class:`vtnumba.dist.PeerBuffers`),
  so a peer's memory is a numpy view and the "exchange" is plain loads and stores.

**Pull, not push, by default.**  A GPU matmul's epilogue writes each destination's rows
straight into that rank's inbox (push).  A BLAS call writes one array, and every extra call
re-packs the whole ``[K, H]`` weight (3-6 ms each at ``K=2048, H=4096`` here), so the host
does the projection in *one* call either way:

* ``"pull"`` (default): the call writes this rank's own shared outbox, which holds the
  rows of every destination contiguously in token order; each rank then reads its row
  block from every peer.  No copy -- but the GEMM writes ``/dev/shm`` pages, 4 KiB ones
  (tmpfs has no transparent huge pages here), and writing its output tile by tile over
  many rows costs more TLB misses than numpy's huge-page private memory.
* ``"push"``: the call writes private scratch (huge pages) and a copy -- the host's
  epilogue -- moves each peer's rows into that peer's inbox; this rank's own rows never
  move (the reduce reads them from the scratch).  The GEMM runs at full speed, but one
  more ``[R, H]`` copy crosses memory.

Measured with both in the same run, interleaved (2 ranks on this 2-core machine,
``T=2048``): pull spent 0.33-0.47x the unfused baseline's time above the matmul, push
0.50-0.76x -- when memory bandwidth is the shared bottleneck, the copy costs more than the
TLB misses.  So pull is the default and push the comparison (and the GPU's mode).

**Where the time goes.**  Above the matmul everything is memory traffic: the reduce + norm
pass (reads the partials and the residual, writes the new residual and the normalised
rows), the gather copies, and in push mode the epilogue copy.  With one core per rank (2
ranks on this 2-core machine, no SMT) none of it can hide behind the matmul; it can only
be *less* traffic than the unfused path's MPI copies and numpy temporaries.
``vtnumba bench tpsp`` measures both in one run.

**Overlap.**  With ``threaded=True`` the matmuls run on a worker thread (a threaded
:class:`~vtnumba.backend.CPUBackend` queue; BLAS and the njit kernels release the GIL), so
chunk i+1's matmul runs beside chunk i's exchange.  Whether that pays depends on spare
cores: with one core per rank (2 ranks on this 2-core machine) the two compete for the
same core, so the default is the synchronous queue; the measured profile
(``profile(search=True)``) picks the chunk size that is fastest either way.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend import CPU, CPUBackend
from vtnumba.dist import DEFAULT_TIMEOUT_S
from vtnumba.tpsp.peer_backend import PeerTPSPBackend


class HostTPSPBackend(PeerTPSPBackend):
    """TPSP for numpy arrays (the ``cpu`` target)."""

    default_exchange = "pull"
    tpsp_chunk_granularity = 64

    def __init__(self, group_name: str = "tp", device=CPU, *, threaded: bool = False, exchange: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
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
