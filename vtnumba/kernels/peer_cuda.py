"""CUDA peer reduce fused with the norm, and the gather copy (``@cuda.jit``).

This module imports ``numba.cuda``; :mod:`vtnumba.kernels.peer` loads it only for device
arrays.  Contracts (host twins in :mod:`vtnumba.kernels.peer`):

* :func:`peer_reduce_norm_kernel` -- for each row ``r`` in ``[r0, r1)``: ``z = sum of the
  sources' row r (+ bias) (+ residual[r])``, ``new_residual[r] = z``, ``out[r] =
  norm(z)``.  Pass 1 differs from :func:`vtnumba.kernels.norm_cuda.fused_add_norm_kernel`
  only in summing several sources; the reduction and normalisation are the shared
  :func:`~vtnumba.kernels.norm_cuda.normalize_row`.
* :func:`gather_rows_kernel` -- ``dest[row_offset + i] = src[i]`` for every destination.

**Why a fixed number of source arguments.**  The sources are the rank's own partial and
the peers' inbox slots: separate allocations (IPC mappings of other processes' buffers on
a GPU), so they cannot be stacked into one array, and a kernel cannot take a Python list.
A kernel with :data:`MAX_SOURCES` = 8 array parameters plus a count covers every
tensor-parallel size inside one NVLink node in a single launch; unused slots repeat the
first source and are never read (the ``nsrc`` tests are uniform across the block, so they
cost no divergence).  Larger ``tp`` stays correct: :func:`launch_peer_reduce_norm` first
folds the extra sources into ``new_residual`` with :func:`sum_sources_kernel` -- the
residual is just one more term of the sum, so it is the natural accumulator -- then runs
the fused kernel over the last ones.  The gather uses the same scheme for destinations.
"""

from __future__ import annotations

from numba import cuda, float32

from vtnumba.backend.arrays import cdiv
from vtnumba.kernels.norm_cuda import normalize_row, threads_for

MAX_SOURCES = 8
MAX_DESTS = 8
_ELEMENTWISE_THREADS = 256


@cuda.jit(device=True)
def _sum8(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, r, i):
    """Sum element (r, i) of the first ``nsrc`` sources, in order."""
    z = s0[r, i]
    if nsrc > 1:
        z += s1[r, i]
    if nsrc > 2:
        z += s2[r, i]
    if nsrc > 3:
        z += s3[r, i]
    if nsrc > 4:
        z += s4[r, i]
    if nsrc > 5:
        z += s5[r, i]
    if nsrc > 6:
        z += s6[r, i]
    if nsrc > 7:
        z += s7[r, i]
    return z


@cuda.jit
def peer_reduce_norm_kernel(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, bias, has_bias, residual, has_residual, weight,
                            norm_bias, has_norm_bias, eps, is_layer, out, new_residual, r0):
    """Block ``b`` reduces and normalises row ``r0 + b`` (one block per row, as in norm_cuda)."""
    r = r0 + cuda.blockIdx.x
    h = new_residual.shape[1]
    t = cuda.threadIdx.x
    partial = float32(0.0)
    for i in range(t, h, cuda.blockDim.x):
        z = _sum8(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, r, i)
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


@cuda.jit
def sum_sources_kernel(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, residual, has_residual, acc, r0, r1):
    """``acc[r] = sum of nsrc sources' row r (+ residual[r])`` for r in [r0, r1); elementwise."""
    idx = cuda.grid(1)
    h = acc.shape[1]
    r = r0 + idx // h
    i = idx % h
    if r < r1:
        z = _sum8(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, r, i)
        if has_residual:
            z += residual[r, i]
        acc[r, i] = z


@cuda.jit
def gather_rows_kernel(src, d0, d1, d2, d3, d4, d5, d6, d7, ndst, row_offset):
    """``d_k[row_offset + i, :] = src[i, :]`` for the first ``ndst`` destinations; elementwise.

    Each thread reads its element once and writes it to every destination, so the source
    crosses DRAM once however many ranks receive it.
    """
    idx = cuda.grid(1)
    h = src.shape[1]
    i = idx // h
    j = idx % h
    if i < src.shape[0]:
        v = src[i, j]
        r = row_offset + i
        d0[r, j] = v
        if ndst > 1:
            d1[r, j] = v
        if ndst > 2:
            d2[r, j] = v
        if ndst > 3:
            d3[r, j] = v
        if ndst > 4:
            d4[r, j] = v
        if ndst > 5:
            d5[r, j] = v
        if ndst > 6:
            d6[r, j] = v
        if ndst > 7:
            d7[r, j] = v


def _pad(arrays: list, n: int) -> list:
    """``arrays`` padded to ``n`` entries by repeating the first (never read: see the count)."""
    return list(arrays) + [arrays[0]] * (n - len(arrays))


def launch_peer_reduce_norm(sources, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1,
                            stream) -> None:
    """Launch the reduce + norm over rows ``[r0, r1)`` (host twin:
    :func:`vtnumba.kernels.peer.peer_reduce_norm_rows_host`)."""
    nrows = int(r1) - int(r0)
    h = new_residual.shape[1]
    if nrows <= 0 or h == 0:
        return
    sources = list(sources)
    has_residual = residual is not None
    # More than MAX_SOURCES: fold the surplus into new_residual first (see module docstring).
    while len(sources) > MAX_SOURCES:
        head, sources = sources[:MAX_SOURCES], sources[MAX_SOURCES:]
        blocks = cdiv(nrows * h, _ELEMENTWISE_THREADS)
        sum_sources_kernel[blocks, _ELEMENTWISE_THREADS, stream](
            *_pad(head, MAX_SOURCES), len(head), residual if has_residual else new_residual, int(has_residual),
            new_residual, int(r0), int(r1))
        residual, has_residual = new_residual, True  # the running sum now lives in new_residual
    peer_reduce_norm_kernel[nrows, threads_for(h), stream](
        *_pad(sources, MAX_SOURCES), len(sources),
        weight if bias is None else bias, int(bias is not None),
        residual if has_residual else new_residual, int(has_residual),
        weight, weight if norm_bias is None else norm_bias, int(norm_bias is not None),
        float(eps), int(bool(is_layer)), out, new_residual, int(r0))


def launch_gather_rows(src, dests, row_offset, stream) -> None:
    """Launch the gather copy into every destination (host twin: :func:`vtnumba.kernels.peer.gather_rows_host`)."""
    n, h = src.shape
    if n == 0 or h == 0:
        return
    blocks = cdiv(n * h, _ELEMENTWISE_THREADS)
    dests = list(dests)
    for k in range(0, len(dests), MAX_DESTS):
        chunk = dests[k:k + MAX_DESTS]
        gather_rows_kernel[blocks, _ELEMENTWISE_THREADS, stream](src, *_pad(chunk, MAX_DESTS), len(chunk),
                                                                int(row_offset))


_V = "float32[::1]"
_M = "float32[:, ::1]"
_S8 = ", ".join([_M] * 8)
PTX_SIGNATURES = [
    ("peer_reduce_norm", peer_reduce_norm_kernel,
     f"void({_S8}, int64, {_V}, int64, {_M}, int64, {_V}, {_V}, int64, float64, int64, {_M}, {_M}, int64)"),
    ("sum_sources", sum_sources_kernel, f"void({_S8}, int64, {_M}, int64, {_M}, int64, int64)"),
    ("gather_rows", gather_rows_kernel, f"void({_M}, {_S8}, int64, int64)"),
]
