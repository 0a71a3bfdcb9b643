"""CUDA fused residual-add + RMSNorm / LayerNorm: one block per row, block reduction in shared memory.

This module imports ``numba.cuda``; :mod:`vtnumba.kernels.norm` loads it only for device
arrays.  The kernel contract (identical to the host reference
:func:`vtnumba.kernels.norm.add_norm_rows_host`), for every row ``r`` in ``[r0, r1)``::

    z               = y[r] (+ bias) (+ residual[r])          # float32
    new_residual[r] = z
    out[r]          = z * rsqrt(mean(z^2) + eps) * weight                       (RMSNorm)
    out[r]          = (z - mean(z)) * rsqrt(var(z) + eps) * weight (+ norm_bias)  (LayerNorm)

Rows outside ``[r0, r1)`` are not touched.

**One pass over DRAM.**  Block ``b`` handles row ``r0 + b``.  Pass 1 reads ``y`` and
``residual`` once, writes ``z`` to ``new_residual`` and keeps a per-thread partial sum
(of ``z^2`` for RMSNorm, of ``z`` for LayerNorm).  The block then reduces the partials in
shared memory (:func:`block_sum`).  The later passes re-read ``z`` from ``new_residual``:
each thread reads exactly the elements it wrote itself (same stride), so no barrier is
needed for visibility, and a row (``H * 4`` bytes) is still in L1/L2 -- DRAM sees each
input byte read once and each output byte written once.  LayerNorm takes a second
reduction for the variance, ``mean((z - mean)^2)``, instead of ``E[z^2] - mean^2``:
the latter cancels catastrophically in float32 when ``|mean| >> std``.

Because every element is read and written by the same thread, the outputs may alias the
inputs (``new_residual is residual`` updates the residual stream in place).

Reductions use shared memory and ``syncthreads`` only (no warp shuffles), which the
simulator supports; the block size is a power of two up to :data:`MAX_THREADS`, picked
from ``H`` by :func:`threads_for`.

:func:`normalize_row` is shared with the peer-reduce kernel (:mod:`vtnumba.kernels.peer_cuda`),
which differs only in how pass 1 builds ``z``.
"""

from __future__ import annotations

import math

from numba import cuda, float32

MAX_THREADS = 256  # threads per block (a power of two); the shared reduction buffer's size


def threads_for(h: int) -> int:
    """Threads per row-block: the next power of two >= ``h``, at most MAX_THREADS.

    Rows shorter than a warp get a block shorter than a warp: idle lanes would cost nothing
    measurable at such sizes, and fewer threads keep the simulator (one Python thread per
    CUDA thread) fast.
    """
    t = 1
    while t < h and t < MAX_THREADS:
        t *= 2
    return t


@cuda.jit(device=True)
def block_sum(value):
    """Sum ``value`` over the threads of the block; every thread gets the total.

    A tree reduction in shared memory: log2(blockDim.x) halving steps, a barrier after
    each so the next step reads finished sums.  Needs a power-of-two block size.
    """
    buf = cuda.shared.array(MAX_THREADS, float32)
    t = cuda.threadIdx.x
    buf[t] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if t < stride:
            buf[t] += buf[t + stride]
        cuda.syncthreads()
        stride //= 2
    total = buf[0]
    # Everyone must have read buf[0] before a following block_sum overwrites buf.
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def normalize_row(z, out, r, weight, norm_bias, has_norm_bias, eps, is_layer, partial):
    """Finish one row after pass 1 stored ``z`` in ``z[r]`` and left this thread's ``partial``
    (sum of its ``z^2`` for RMSNorm, of its ``z`` for LayerNorm)."""
    h = z.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    inv_h = float32(1.0) / float32(h)
    eps32 = float32(eps)  # keep every operation float32 (a float64 eps would promote them)
    total = block_sum(partial)
    if is_layer:
        mean = total * inv_h
        sq = float32(0.0)
        for i in range(t, h, nt):  # the same elements this thread wrote in pass 1
            d = z[r, i] - mean
            sq += d * d
        var = block_sum(sq) * inv_h
        inv = float32(1.0) / float32(math.sqrt(var + eps32))
        for i in range(t, h, nt):
            v = (z[r, i] - mean) * inv * weight[i]
            if has_norm_bias:
                v += norm_bias[i]
            out[r, i] = v
    else:
        inv = float32(1.0) / float32(math.sqrt(total * inv_h + eps32))
        for i in range(t, h, nt):
            out[r, i] = z[r, i] * inv * weight[i]


@cuda.jit
def fused_add_norm_kernel(y, bias, has_bias, residual, has_residual, weight, norm_bias, has_norm_bias, eps,
                          is_layer, out, new_residual, r0):
    """Block ``b`` normalises row ``r0 + b``; see the module docstring for the contract."""
    r = r0 + cuda.blockIdx.x
    h = y.shape[1]
    t = cuda.threadIdx.x
    partial = float32(0.0)
    # Pass 1: z = y + bias + residual, stored as the new residual; stride by the block so a
    # warp reads 32 consecutive floats (coalesced).
    for i in range(t, h, cuda.blockDim.x):
        z = y[r, i]
        if has_bias:
            z += bias[i]
        if has_residual:
            z += residual[r, i]
        new_residual[r, i] = z
        if is_layer:
            partial += z
        else:
            partial += z * z
    normalize_row(new_residual, out, r, weight, norm_bias, has_norm_bias, eps, is_layer, partial)


def launch_add_norm_rows(y, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1,
                         stream) -> None:
    """Launch :func:`fused_add_norm_kernel` over rows ``[r0, r1)`` (host twin:
    :func:`vtnumba.kernels.norm.add_norm_rows_host`)."""
    nrows = int(r1) - int(r0)
    if nrows <= 0 or y.shape[1] == 0:
        return
    # Kernels take no None: absent vectors are replaced by ``weight`` and an absent residual
    # by ``y`` (same types); the has_* flags guarantee the kernel never reads them.
    fused_add_norm_kernel[nrows, threads_for(y.shape[1]), stream](
        y, weight if bias is None else bias, int(bias is not None),
        y if residual is None else residual, int(residual is not None),
        weight, weight if norm_bias is None else norm_bias, int(norm_bias is not None),
        float(eps), int(bool(is_layer)), out, new_residual, int(r0))


_V = "float32[::1]"
_M = "float32[:, ::1]"
PTX_SIGNATURES = [
    ("fused_add_norm", fused_add_norm_kernel,
     f"void({_M}, {_V}, int64, {_M}, int64, {_V}, {_V}, int64, float64, int64, {_M}, {_M}, int64)"),
]
