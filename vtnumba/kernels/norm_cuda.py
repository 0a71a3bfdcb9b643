"""CUDA fused residual-add + RMSNorm / LayerNorm: one block per row, the row held in registers.

This module imports ``numba.cuda``; :mod:`vtnumba.kernels.norm` loads it only for device
arrays.  The kernel contract (identical to the host reference
:func:`vtnumba.kernels.norm.add_norm_rows_host`), for every row ``r`` in ``[r0, r1)``::

    z               = y[r] (+ bias) (+ residual[r])          # float32
    new_residual[r] = z
    out[r]          = z * rsqrt(mean(z^2) + eps) * weight                       (RMSNorm)
    out[r]          = (z - mean(z)) * rsqrt(var(z) + eps) * weight (+ norm_bias)  (LayerNorm)

Rows outside ``[r0, r1)`` are not touched.

**Bandwidth is the whole game.**  The arithmetic is a few operations per element; what
counts is that DRAM sees each byte once (read ``y`` and ``residual``, write
``new_residual`` and ``out``) and that enough bytes are in flight to cover the memory
latency.  :func:`fused_add_norm_kernel` does three things for that:

1. **The row stays in registers.**  Block ``b`` owns row ``r0 + b``; thread ``t`` owns the
   quads (4 consecutive elements) ``t, t + nt, t + 2 nt, ...`` and keeps the first
   :data:`CACHE_QUADS` of them in registers, so the normalisation after the reduction
   (and LayerNorm's variance pass) reads registers, not memory.  With 256 threads that is
   every row up to ``256 * 4 * CACHE_QUADS`` = 8192 elements; longer rows stream the rest
   through: stored in pass 1 and re-read (from L2, it was just written) in pass 2.
2. **Loads first, arithmetic and stores after.**  A thread issues all its loads of ``y``
   and ``residual`` before it uses any of them (:func:`load_cached`, into two register
   arrays), and before its first store.  A GPU issues a warp's instructions in order, and
   the first one that needs a loaded value waits for it: with ``z = y + residual`` written
   quad by quad, that add waited out a whole memory latency before the next quad's loads
   were even issued (in the sm_90 SASS, an ``FADD`` of the loaded registers sat between
   every quad's ``LDG.128`` and the next).  Nor could the compiler move a load above an
   earlier store -- ``new_residual`` may *be* ``residual``.  Batched, every load of the row
   is in flight at once, and the row pays one latency.  The same register array then takes
   ``weight``'s quads, loaded before the reduction (:func:`finish_row`), so they arrive
   while the block waits at its barriers.  The price is registers: 123 per thread instead
   of 84 (ptxas, sm_90), so an SM holds two 256-thread blocks instead of three -- 16 warps
   with 8 wide loads each in flight, instead of 24 with 2.
3. **128-bit accesses** (:mod:`vtnumba.kernels._wide_cuda`): one instruction per quad,
   when the launcher has checked alignment (``wide``); otherwise the same quads element by
   element.

The reduction is :func:`block_sum` (shared memory and ``syncthreads`` only -- no warp
shuffles, which the simulator lacks).  LayerNorm takes a second reduction for the
variance, ``mean((z - mean)^2)``, instead of ``E[z^2] - mean^2``: the latter cancels
catastrophically in float32 when ``|mean| >> std``.  Every element is read and written by
one thread, and all of a thread's reads come before its writes, so the outputs may alias
the inputs (``new_residual is residual`` updates the residual stream in place).

:func:`finish_row` (reduction + normalisation) is shared with the peer-reduce kernel
(:mod:`vtnumba.kernels.peer_cuda`), which differs only in how pass 1 builds ``z``.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from vtnumba.backend.arrays import cdiv
from vtnumba.kernels._wide_cuda import VEC, quad, store_quad, vquad, wide_ok

MAX_THREADS = 256  # threads per block (a power of two); the shared reduction buffer's size
#: Quads (of 4 float32) of its row each thread keeps in registers between the passes.
CACHE_QUADS = 8
CACHE_FLOATS = CACHE_QUADS * VEC


def threads_for(h: int) -> int:
    """Threads per block for ``h`` independent items: the next power of two >= ``h``, at most MAX_THREADS.

    Rows shorter than a warp get a block shorter than a warp: idle lanes would cost nothing
    measurable at such sizes, and fewer threads keep the simulator (one Python thread per
    CUDA thread) fast.
    """
    t = 1
    while t < h and t < MAX_THREADS:
        t *= 2
    return t


def threads_for_row(h: int) -> int:
    """Threads per row-block of the norm kernels: one per quad of the row, up to MAX_THREADS."""
    return threads_for(cdiv(h, VEC))


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
def keep_quad(zc, j, z0, z1, z2, z3):
    """Cache quad ``j`` of this thread's part of the row: ``zc[4j:4j+4] = z0..z3``."""
    zc[VEC * j] = z0
    zc[VEC * j + 1] = z1
    zc[VEC * j + 2] = z2
    zc[VEC * j + 3] = z3


@cuda.jit(device=True)
def load_cached(x, r, xc, wide):
    """Load this thread's cached quads of row ``r`` of ``x`` into ``xc`` (quad ``j`` at
    ``xc[4j:4j+4]``; zeros past the row's end).  Loads only: nothing here uses a loaded value,
    so the warp issues every one of them without waiting for the first."""
    h = x.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for j in range(CACHE_QUADS):
        c = VEC * (t + j * nt)
        if c < h:
            x0, x1, x2, x3 = quad(x, r, c, h, wide)
            keep_quad(xc, j, x0, x1, x2, x3)


@cuda.jit(device=True)
def plus_bias(z0, z1, z2, z3, bias, has_bias, c, h, wide):
    """``z + bias[c:c+4]`` when ``has_bias``, else ``z`` (zeros past the row's end)."""
    if has_bias:
        b0, b1, b2, b3 = vquad(bias, c, h, wide)
        z0 += b0
        z1 += b1
        z2 += b2
        z3 += b3
    return z0, z1, z2, z3


@cuda.jit(device=True)
def add_cached(zc, h, bias, has_bias, xc, has_x, wide):
    """``zc (+ bias) (+ xc)`` for this thread's cached quads of a row of ``h`` elements, in that
    order (the host reference's).  ``xc`` is already loaded (:func:`load_cached`); ``bias`` is
    one vector shared by every row, so its loads hit the caches."""
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for j in range(CACHE_QUADS):
        c = VEC * (t + j * nt)
        if c < h:
            z0, z1, z2, z3 = plus_bias(zc[VEC * j], zc[VEC * j + 1], zc[VEC * j + 2], zc[VEC * j + 3],
                                       bias, has_bias, c, h, wide)
            if has_x:
                z0 += xc[VEC * j]
                z1 += xc[VEC * j + 1]
                z2 += xc[VEC * j + 2]
                z3 += xc[VEC * j + 3]
            keep_quad(zc, j, z0, z1, z2, z3)


@cuda.jit(device=True)
def store_cached(zc, new_residual, r, is_layer, wide):
    """Pass 1's second half: write the cached quads to ``new_residual[r]``; return this thread's
    partial sum (of ``z`` for LayerNorm, of ``z^2`` for RMSNorm).  Elements past the row's end
    were loaded as 0 and add nothing."""
    h = new_residual.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    partial = float32(0.0)
    for j in range(CACHE_QUADS):
        c = VEC * (t + j * nt)
        if c < h:
            z0, z1, z2, z3 = zc[VEC * j], zc[VEC * j + 1], zc[VEC * j + 2], zc[VEC * j + 3]
            store_quad(new_residual, r, c, h, wide, z0, z1, z2, z3)
            if is_layer:
                partial += (z0 + z1) + (z2 + z3)
            else:
                partial += (z0 * z0 + z1 * z1) + (z2 * z2 + z3 * z3)
    return partial


@cuda.jit(device=True)
def _dev2(z, mean, ok):
    """``(z - mean)^2`` for an element inside the row, 0 for the padding past the row's end
    (whose cache slots may never have been written: no arithmetic on them)."""
    if not ok:
        return float32(0.0)
    d = z - mean
    return d * d


@cuda.jit(device=True)
def finish_row(zc, wc, r, partial, weight, norm_bias, has_norm_bias, eps, is_layer, out, new_residual, wide):
    """Reduce ``partial`` over the block and normalise row ``r`` into ``out[r]``.

    Expects pass 1 done: the thread's first CACHE_QUADS quads of ``z`` in ``zc`` (and stored
    in ``new_residual[r]``), any further quads stored in ``new_residual[r]`` only.  ``wc`` is
    a register array of ``zc``'s size that pass 1 no longer needs: it receives ``weight``'s
    quads before the reduction, so those loads travel while the block waits at its barriers.
    """
    h = out.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    first_streamed = VEC * (t + CACHE_QUADS * nt)  # this thread's first quad beyond the cache
    inv_h = float32(1.0) / float32(h)
    eps32 = float32(eps)  # keep every operation float32 (a float64 eps would promote them)
    for j in range(CACHE_QUADS):  # loads only (see "loads first" in the module docstring)
        c = VEC * (t + j * nt)
        if c < h:
            w0, w1, w2, w3 = vquad(weight, c, h, wide)
            keep_quad(wc, j, w0, w1, w2, w3)
    total = block_sum(partial)
    mean = float32(0.0)  # RMSNorm: out = (z - 0) * inv * weight
    if is_layer:
        mean = total * inv_h
        sq = float32(0.0)
        for j in range(CACHE_QUADS):  # from registers
            c = VEC * (t + j * nt)
            sq += (_dev2(zc[VEC * j], mean, c < h) + _dev2(zc[VEC * j + 1], mean, c + 1 < h)) + \
                (_dev2(zc[VEC * j + 2], mean, c + 2 < h) + _dev2(zc[VEC * j + 3], mean, c + 3 < h))
        for c in range(first_streamed, h, VEC * nt):  # long rows: the streamed part, re-read
            z0, z1, z2, z3 = quad(new_residual, r, c, h, wide)
            sq += (_dev2(z0, mean, True) + _dev2(z1, mean, c + 1 < h)) + \
                (_dev2(z2, mean, c + 2 < h) + _dev2(z3, mean, c + 3 < h))
        var = block_sum(sq) * inv_h
        inv = float32(1.0) / float32(math.sqrt(var + eps32))
    else:
        inv = float32(1.0) / float32(math.sqrt(total * inv_h + eps32))
    # Pass 2, cached quads: normalise in registers (weight's quads are in wc; norm_bias is loaded here) ...
    for j in range(CACHE_QUADS):
        c = VEC * (t + j * nt)
        if c < h:
            o0 = (zc[VEC * j] - mean) * inv * wc[VEC * j]
            o1 = (zc[VEC * j + 1] - mean) * inv * wc[VEC * j + 1]
            o2 = (zc[VEC * j + 2] - mean) * inv * wc[VEC * j + 2]
            o3 = (zc[VEC * j + 3] - mean) * inv * wc[VEC * j + 3]
            o0, o1, o2, o3 = plus_bias(o0, o1, o2, o3, norm_bias, has_norm_bias, c, h, wide)
            keep_quad(zc, j, o0, o1, o2, o3)
    # ... then store them (stores last, as in pass 1).
    for j in range(CACHE_QUADS):
        c = VEC * (t + j * nt)
        if c < h:
            store_quad(out, r, c, h, wide, zc[VEC * j], zc[VEC * j + 1], zc[VEC * j + 2], zc[VEC * j + 3])
    for c in range(first_streamed, h, VEC * nt):
        z0, z1, z2, z3 = quad(new_residual, r, c, h, wide)
        w0, w1, w2, w3 = vquad(weight, c, h, wide)
        o0 = (z0 - mean) * inv * w0
        o1 = (z1 - mean) * inv * w1
        o2 = (z2 - mean) * inv * w2
        o3 = (z3 - mean) * inv * w3
        o0, o1, o2, o3 = plus_bias(o0, o1, o2, o3, norm_bias, has_norm_bias, c, h, wide)
        store_quad(out, r, c, h, wide, o0, o1, o2, o3)


@cuda.jit(device=True)
def add_quad(y, bias, has_bias, residual, has_residual, r, c, wide):
    """``y[r, c:c+4] (+ bias[c:c+4]) (+ residual[r, c:c+4])`` as four float32 (zeros past the row)."""
    h = y.shape[1]
    y0, y1, y2, y3 = quad(y, r, c, h, wide)
    z0, z1, z2, z3 = plus_bias(y0, y1, y2, y3, bias, has_bias, c, h, wide)
    if has_residual:
        s0, s1, s2, s3 = quad(residual, r, c, h, wide)
        z0 += s0
        z1 += s1
        z2 += s2
        z3 += s3
    return z0, z1, z2, z3


@cuda.jit
def fused_add_norm_kernel(y, bias, has_bias, residual, has_residual, weight, norm_bias, has_norm_bias, eps,
                          is_layer, out, new_residual, r0, wide):
    """Block ``b`` normalises row ``r0 + b``, its part of the row cached in registers (module docstring)."""
    r = r0 + cuda.blockIdx.x
    h = y.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    zc = cuda.local.array(CACHE_FLOATS, float32)  # constant-indexed after unrolling -> registers
    rc = cuda.local.array(CACHE_FLOATS, float32)  # the residual's quads, until they are added
    # Pass 1a: every load of the cached part of y and residual, nothing in between that uses
    # one (all in flight together) ...
    load_cached(y, r, zc, wide)
    if has_residual:
        load_cached(residual, r, rc, wide)
    # ... then the adds.
    add_cached(zc, h, bias, has_bias, rc, has_residual, wide)
    # Pass 1b: z is the new residual stream; sum for the statistics.
    partial = store_cached(zc, new_residual, r, is_layer, wide)
    # Rows longer than the cache: the rest goes straight through (re-read in finish_row).
    for c in range(VEC * (t + CACHE_QUADS * nt), h, VEC * nt):
        z0, z1, z2, z3 = add_quad(y, bias, has_bias, residual, has_residual, r, c, wide)
        store_quad(new_residual, r, c, h, wide, z0, z1, z2, z3)
        if is_layer:
            partial += (z0 + z1) + (z2 + z3)
        else:
            partial += (z0 * z0 + z1 * z1) + (z2 * z2 + z3 * z3)
    finish_row(zc, rc, r, partial, weight, norm_bias, has_norm_bias, eps, is_layer, out, new_residual, wide)


def launch_add_norm_rows(y, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1,
                         stream) -> None:
    """Launch :func:`fused_add_norm_kernel` over rows ``[r0, r1)`` (host twin:
    :func:`vtnumba.kernels.norm.add_norm_rows_host`)."""
    nrows = int(r1) - int(r0)
    h = y.shape[1]
    if nrows <= 0 or h == 0:
        return
    wide = wide_ok(y, bias, residual, weight, norm_bias, out, new_residual)
    # Kernels take no None: absent vectors are replaced by ``weight`` and an absent residual
    # by ``y`` (same types); the has_* flags guarantee the kernel never reads them.
    fused_add_norm_kernel[nrows, threads_for_row(h), stream](
        y, weight if bias is None else bias, int(bias is not None),
        y if residual is None else residual, int(residual is not None),
        weight, weight if norm_bias is None else norm_bias, int(norm_bias is not None),
        float(eps), int(bool(is_layer)), out, new_residual, int(r0), int(wide))


_V = "float32[::1]"
_M = "float32[:, ::1]"
PTX_SIGNATURES = [
    ("fused_add_norm", fused_add_norm_kernel,
     f"void({_M}, {_V}, int64, {_M}, int64, {_V}, {_V}, int64, float64, int64, {_M}, {_M}, int64, int64)"),
]
