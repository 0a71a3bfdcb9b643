"""CUDA peer reduce fused with the norm, and the gather copy (``@cuda.jit``).

This module imports ``numba.cuda``; :mod:`vtnumba.kernels.peer` loads it only for device
arrays.  Contracts (host twins in :mod:`vtnumba.kernels.peer`):

* :func:`peer_reduce_norm_kernel` -- for each row ``r`` in ``[r0, r1)``: ``z = sum of the
  sources' row r (+ bias) (+ residual[r])``, ``new_residual[r] = z``, ``out[r] =
  norm(z)``.  Pass 1 differs from :func:`vtnumba.kernels.norm_cuda.fused_add_norm_kernel`
  only in summing several sources; everything that makes that kernel run at bandwidth
  (row cached in registers, each operand's loads all issued before the first add, all
  loads before the first store, 128-bit accesses) holds here too, and the reduction and
  normalisation are the shared :func:`~vtnumba.kernels.norm_cuda.finish_row`.  Holding a
  source's quads until they are added costs registers: ptxas (sm_90) gives it 168, one
  256-thread block per SM (capping it at 128 spills); each warp then keeps 8 wide loads in
  flight, not one.
* :func:`gather_rows_kernel` -- ``dest[row_offset + i] = src[i]`` for every destination;
  :func:`sum_sources_kernel` -- the elementwise sum for more sources than one launch takes.

**The copies are wide and grid-strided.**  A copy does no arithmetic; its speed is bytes in
flight.  Each thread moves quads of 4 floats with 128-bit loads and stores (when the
launcher's :func:`~vtnumba.kernels._wide_cuda.wide_ok` allows; element by element
otherwise), and the grid is capped at :data:`MAX_COPY_BLOCKS` blocks that stride over the
whole range, so a 64 MiB exchange is a few quads per thread instead of one launch-sized
grid of one-element threads.  On a GPU the sources and destinations may be a peer's
memory (CUDA IPC); the loads or stores then cross NVLink, which rewards wide accesses all
the more.

**Why a fixed number of source arguments.**  The sources are the rank's own partial and
the peers' inbox slots: separate allocations (IPC mappings of other processes' buffers on
a GPU), so they cannot be stacked into one array, and a kernel cannot take a Python list.
A kernel with :data:`MAX_SOURCES` = 8 array parameters plus a count covers every
tensor-parallel size inside one NVLink node in a single launch; unused slots repeat the
first source and are never read (the ``nsrc`` tests are uniform across the block, so they
cost no divergence).  Larger ``tp`` stays correct: :func:`launch_peer_reduce_norm` first
folds the first :data:`MAX_SOURCES` sources (and the residual) into ``new_residual`` with
:func:`sum_sources_kernel` -- the residual is just one more term of the sum, so it is the
natural accumulator -- then runs the fused kernel over the rest.  The terms are then added in
another order than the host reference's (bias joins after the first eight sources), so the
last bits may differ.  The gather uses the same scheme for destinations.
"""

from __future__ import annotations

from numba import cuda, float32

from vtnumba.backend.arrays import cdiv
from vtnumba.kernels._wide_cuda import VEC, quad, store_quad, wide_ok
from vtnumba.kernels.norm_cuda import (
    CACHE_FLOATS,
    CACHE_QUADS,
    add_cached,
    add_quad,
    finish_row,
    load_cached,
    store_cached,
    threads_for_row,
)

MAX_SOURCES = 8
MAX_DESTS = 8
_COPY_THREADS = 256
#: At most this many blocks per copy launch; larger copies stride (a few quads per thread).
MAX_COPY_BLOCKS = 4096


@cuda.jit(device=True)
def _acc(z0, z1, z2, z3, src, r, c, h, wide):
    """``z + src[r, c:c+4]``, quad-wise."""
    s0, s1, s2, s3 = quad(src, r, c, h, wide)
    return z0 + s0, z1 + s1, z2 + s2, z3 + s3


@cuda.jit(device=True)
def _acc_sources(z0, z1, z2, z3, s1, s2, s3, s4, s5, s6, s7, nsrc, r, c, wide):
    """``z + s1[r, c:c+4] + ... + s_{nsrc-1}[r, c:c+4]``, in order (the first source is already in z)."""
    h = s1.shape[1]
    if nsrc > 1:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s1, r, c, h, wide)
    if nsrc > 2:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s2, r, c, h, wide)
    if nsrc > 3:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s3, r, c, h, wide)
    if nsrc > 4:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s4, r, c, h, wide)
    if nsrc > 5:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s5, r, c, h, wide)
    if nsrc > 6:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s6, r, c, h, wide)
    if nsrc > 7:
        z0, z1, z2, z3 = _acc(z0, z1, z2, z3, s7, r, c, h, wide)
    return z0, z1, z2, z3


@cuda.jit(device=True)
def _sum8(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, r, c, wide):
    """Quad ``[r, c:c+4]`` summed over the first ``nsrc`` sources, in order (zeros past the row)."""
    z0, z1, z2, z3 = quad(s0, r, c, s0.shape[1], wide)
    return _acc_sources(z0, z1, z2, z3, s1, s2, s3, s4, s5, s6, s7, nsrc, r, c, wide)


@cuda.jit(device=True)
def _reduce_quad(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, bias, has_bias, residual, has_residual, r, c, wide):
    """Pass 1 of the peer kernel for one quad, in the host reference's order:
    ``s0 (+ bias) (+ residual) + s1 + ... + s_{nsrc-1}`` -- the fused add+norm's first step
    (:func:`~vtnumba.kernels.norm_cuda.add_quad`) followed by the other sources."""
    z0, z1, z2, z3 = add_quad(s0, bias, has_bias, residual, has_residual, r, c, wide)
    return _acc_sources(z0, z1, z2, z3, s1, s2, s3, s4, s5, s6, s7, nsrc, r, c, wide)


@cuda.jit(device=True)
def _add_cached(zc, xc, src, r, bias, wide):
    """``zc += src[r]``'s quads of this thread (the cached part of the row): every load first,
    into ``xc``, then the adds (see norm_cuda's "loads first").  ``bias`` only gives
    :func:`add_cached` an argument of the right type: it is not added here."""
    load_cached(src, r, xc, wide)
    add_cached(zc, src.shape[1], bias, 0, xc, 1, wide)


@cuda.jit
def peer_reduce_norm_kernel(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, bias, has_bias, residual, has_residual, weight,
                            norm_bias, has_norm_bias, eps, is_layer, out, new_residual, r0, r1, wide):
    """Block ``b`` reduces and normalises rows ``r0 + b``, ``r0 + b + gridDim``, ... below ``r1``,
    each cached in registers as in norm_cuda.

    One block per row when the grid has a block per row; fewer blocks -- a bound on the SMs
    the exchange may occupy while the next chunk's matmul runs (``TPSPConfig.sm_count_target``)
    -- walk the rows in strides, in one launch instead of many small ones.
    """
    h = new_residual.shape[1]
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    zc = cuda.local.array(CACHE_FLOATS, float32)
    xc = cuda.local.array(CACHE_FLOATS, float32)  # one source's quads, loaded before they are added
    for r in range(r0 + cuda.blockIdx.x, r1, cuda.gridDim.x):  # uniform in the block: syncs stay legal
        # Pass 1a, source by source (a short loop per source keeps every loop unrolled, and zc in
        # registers): each source's loads all issued before the first add that needs one of
        # them, and all loads before the first store.  The sum runs in the host reference's order
        # (up to MAX_SOURCES sources: see the module docstring for more).
        load_cached(s0, r, zc, wide)
        if has_residual:
            load_cached(residual, r, xc, wide)
        add_cached(zc, h, bias, has_bias, xc, has_residual, wide)
        if nsrc > 1:
            _add_cached(zc, xc, s1, r, bias, wide)
        if nsrc > 2:
            _add_cached(zc, xc, s2, r, bias, wide)
        if nsrc > 3:
            _add_cached(zc, xc, s3, r, bias, wide)
        if nsrc > 4:
            _add_cached(zc, xc, s4, r, bias, wide)
        if nsrc > 5:
            _add_cached(zc, xc, s5, r, bias, wide)
        if nsrc > 6:
            _add_cached(zc, xc, s6, r, bias, wide)
        if nsrc > 7:
            _add_cached(zc, xc, s7, r, bias, wide)
        partial = store_cached(zc, new_residual, r, is_layer, wide)
        for c in range(VEC * (t + CACHE_QUADS * nt), h, VEC * nt):
            z0, z1, z2, z3 = _reduce_quad(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, bias, has_bias, residual, has_residual,
                                          r, c, wide)
            store_quad(new_residual, r, c, h, wide, z0, z1, z2, z3)
            if is_layer:
                partial += (z0 + z1) + (z2 + z3)
            else:
                partial += (z0 * z0 + z1 * z1) + (z2 * z2 + z3 * z3)
        finish_row(zc, xc, r, partial, weight, norm_bias, has_norm_bias, eps, is_layer, out, new_residual, wide)
        # The next row's block reduction reuses the shared scratch: no thread may start it
        # while another still reads this row's total.
        cuda.syncthreads()


@cuda.jit
def sum_sources_kernel(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, residual, has_residual, acc, r0, r1, wide):
    """``acc[r] = sum of nsrc sources' row r (+ residual[r])`` for r in [r0, r1); a grid-strided quad per step."""
    h = acc.shape[1]
    qpr = (h + VEC - 1) // VEC  # quads per row; the last one partial when h % 4 != 0
    total = (r1 - r0) * qpr
    g = cuda.grid(1)
    while g < total:
        r = r0 + g // qpr
        c = VEC * (g % qpr)
        z0, z1, z2, z3 = _sum8(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, r, c, wide)
        if has_residual:
            z0, z1, z2, z3 = _acc(z0, z1, z2, z3, residual, r, c, h, wide)
        store_quad(acc, r, c, h, wide, z0, z1, z2, z3)
        g += cuda.gridDim.x * cuda.blockDim.x


@cuda.jit
def gather_rows_kernel(src, d0, d1, d2, d3, d4, d5, d6, d7, ndst, row_offset, wide):
    """``d_k[row_offset + i, :] = src[i, :]`` for the first ``ndst`` destinations; a grid-strided quad per step.

    Each thread reads its quad once and writes it to every destination, so the source
    crosses DRAM once however many ranks receive it.
    """
    n = src.shape[0]
    h = src.shape[1]
    qpr = (h + VEC - 1) // VEC
    g = cuda.grid(1)
    while g < n * qpr:
        i = g // qpr
        c = VEC * (g % qpr)
        r = row_offset + i
        v0, v1, v2, v3 = quad(src, i, c, h, wide)
        store_quad(d0, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 1:
            store_quad(d1, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 2:
            store_quad(d2, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 3:
            store_quad(d3, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 4:
            store_quad(d4, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 5:
            store_quad(d5, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 6:
            store_quad(d6, r, c, h, wide, v0, v1, v2, v3)
        if ndst > 7:
            store_quad(d7, r, c, h, wide, v0, v1, v2, v3)
        g += cuda.gridDim.x * cuda.blockDim.x


def _pad(arrays: list, n: int) -> list:
    """``arrays`` padded to ``n`` entries by repeating the first (never read: see the count)."""
    return list(arrays) + [arrays[0]] * (n - len(arrays))


def copy_blocks(nrows: int, h: int, max_blocks: int | None = None) -> int:
    """Blocks for a grid-strided copy over ``nrows x h`` elements (one quad per thread and step),
    at most ``max_blocks`` when given."""
    cap = MAX_COPY_BLOCKS if max_blocks is None else min(MAX_COPY_BLOCKS, int(max_blocks))
    return max(1, min(cap, cdiv(nrows * cdiv(h, VEC), _COPY_THREADS)))


def launch_peer_reduce_norm(sources, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1,
                            stream, max_blocks: int | None = None) -> None:
    """Launch the reduce + norm over rows ``[r0, r1)`` on at most ``max_blocks`` blocks (None: one
    per row; host twin: :func:`vtnumba.kernels.peer.peer_reduce_norm_rows_host`)."""
    nrows = int(r1) - int(r0)
    h = new_residual.shape[1]
    if nrows <= 0 or h == 0:
        return
    sources = list(sources)
    has_residual = residual is not None
    # More than MAX_SOURCES: fold the surplus into new_residual first (see module docstring).
    while len(sources) > MAX_SOURCES:
        head, sources = sources[:MAX_SOURCES], sources[MAX_SOURCES:]
        launch_sum_sources(head, residual if has_residual else None, new_residual, r0, r1, stream, max_blocks)
        residual, has_residual = new_residual, True  # the running sum now lives in new_residual
    wide = wide_ok(*sources, bias, residual, weight, norm_bias, out, new_residual)
    blocks = nrows if max_blocks is None else max(1, min(nrows, int(max_blocks)))
    peer_reduce_norm_kernel[blocks, threads_for_row(h), stream](
        *_pad(sources, MAX_SOURCES), len(sources),
        weight if bias is None else bias, int(bias is not None),
        residual if has_residual else new_residual, int(has_residual),
        weight, weight if norm_bias is None else norm_bias, int(norm_bias is not None),
        float(eps), int(bool(is_layer)), out, new_residual, int(r0), int(r1), int(wide))


def launch_sum_sources(sources, residual, acc, r0, r1, stream, max_blocks: int | None = None) -> None:
    """Launch ``acc[r] = sources[0][r] + ... + sources[n-1][r] (+ residual[r])`` over rows ``[r0, r1)``,
    for up to :data:`MAX_SOURCES` sources (``acc`` may be ``residual`` itself); the fold of
    :func:`launch_peer_reduce_norm` (host twin: :func:`vtnumba.kernels.peer.sum_sources_rows_host`)."""
    sources = list(sources)
    nrows, h = int(r1) - int(r0), acc.shape[1]
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"sources: {len(sources)} arrays; one launch sums 1..{MAX_SOURCES}")
    if nrows <= 0 or h == 0:
        return
    has_residual = residual is not None
    wide = wide_ok(*sources, residual, acc)
    sum_sources_kernel[copy_blocks(nrows, h, max_blocks), _COPY_THREADS, stream](
        *_pad(sources, MAX_SOURCES), len(sources), residual if has_residual else acc, int(has_residual),
        acc, int(r0), int(r1), int(wide))


def launch_gather_rows(src, dests, row_offset, stream, max_blocks: int | None = None) -> None:
    """Launch the gather copy into every destination on at most ``max_blocks`` blocks (host twin:
    :func:`vtnumba.kernels.peer.gather_rows_host`)."""
    n, h = src.shape
    if n == 0 or h == 0:
        return
    dests = list(dests)
    # Destination rows start at row_offset: with h % 4 == 0 and an aligned base they are aligned too.
    for k in range(0, len(dests), MAX_DESTS):
        chunk = dests[k:k + MAX_DESTS]
        gather_rows_kernel[copy_blocks(n, h, max_blocks), _COPY_THREADS, stream](
            src, *_pad(chunk, MAX_DESTS), len(chunk), int(row_offset), int(wide_ok(src, *chunk)))


_V = "float32[::1]"
_M = "float32[:, ::1]"
_S8 = ", ".join([_M] * 8)
PTX_SIGNATURES = [
    ("peer_reduce_norm", peer_reduce_norm_kernel,
     f"void({_S8}, int64, {_V}, int64, {_M}, int64, {_V}, {_V}, int64, float64, int64, {_M}, {_M}, int64, int64, "
     "int64)"),
    ("sum_sources", sum_sources_kernel, f"void({_S8}, int64, {_M}, int64, {_M}, int64, int64, int64)"),
    ("gather_rows", gather_rows_kernel, f"void({_M}, {_S8}, int64, int64, int64)"),
]
