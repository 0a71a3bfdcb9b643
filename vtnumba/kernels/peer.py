"""TPSP's exchange arithmetic: peer reduce fused with the norm, and the gather copy.

In TPSP (seed: ``tpsp_cuda.py``) every rank computes a partial ``x @ W.T`` over its K
shard and writes the rows of rank r's token shard into rank r's *inbox* (see
:func:`vtnumba.kernels.linear_rows_to`).  Once the peers have signalled, rank r owns
``tp`` partial copies of its ``R`` rows -- its own partial plus one inbox slot per peer --
and finishes the layer in one pass::

    z               = sum_k sources[k][rows] (+ bias) (+ residual[rows])   # reduce-scatter result + residual
    new_residual    = z
    out             = RMSNorm(z) or LayerNorm(z)

then copies ``out`` into every rank's *gather slot* (the all-gather), :func:`gather_rows`.

Fusing the sum into the norm saves a full write and re-read of the reduced rows: each
source is read once, ``new_residual`` and ``out`` are written once.  ``rows=(start, stop)``
restricts the work to a row range -- TPSP's microchunks, where chunk i+1's matmul overlaps
chunk i's exchange; rows outside the range are not touched.

Host reference: :func:`peer_reduce_norm_rows_host` (``@numba.njit``, row by row: the row
being built stays in an L1 scratch row while each source is added, then it is normalised
and written exactly as :mod:`vtnumba.kernels.norm` does).  CUDA: :mod:`vtnumba.kernels.peer_cuda`, whose docstring
explains the fixed maximum of 8 source arguments per launch.
"""

from __future__ import annotations

import numba
import numpy as np

from vtnumba.backend.arrays import is_int
from vtnumba.kernels._common import (
    HOST_JIT,
    check_array,
    check_eps,
    check_not_partly_overlapping,
    check_outputs_apart,
    common_kind,
    drop_stale_numba_cache,
    run,
    split_rows,
)
from vtnumba.kernels._streaming import STREAM_MIN_BYTES, store_fence, store_norm_row, store_row
from vtnumba.kernels.norm import row_stats

# Cached kernels below call jitted helpers from these files (see drop_stale_numba_cache).
drop_stale_numba_cache(__file__, "_streaming.py", "_common.py", "norm.py")

_F32 = (np.float32,)
NORMS = ("rms", "layer")


# ---------------------------------------------------------------------------- host reference
@numba.njit(**HOST_JIT)
def _reduce_add_norm_rows(sources, bias, has_bias, residual, has_residual, weight, norm_bias, has_norm_bias, eps,
                          is_layer, out, new_residual, r0, r1, stream):
    h = new_residual.shape[1]
    eps32 = np.float32(eps)
    z = np.empty(h, np.float32)  # scratch row, L1-resident (see vtnumba.kernels.norm)
    s0 = sources[0]
    for r in range(r0, r1):
        # Build z: the first source with bias and residual, ...
        for i in range(h):
            v = s0[r, i]
            if has_bias:
                v += bias[i]
            if has_residual:
                v += residual[r, i]
            z[i] = v
        # ... then each further source (each read once from DRAM; z stays in L1).
        for k in range(1, len(sources)):
            src = sources[k]
            for i in range(h):
                z[i] += src[r, i]
        s = np.float32(0.0)
        for i in range(h):
            s += z[i] if is_layer else z[i] * z[i]
        mean, inv = row_stats(z, s, eps32, is_layer)
        store_row(new_residual, r, z, stream)
        store_norm_row(out, r, z, mean, inv, weight, norm_bias, has_norm_bias, stream)
    if stream:
        store_fence()


def peer_reduce_norm_rows_host(sources, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual,
                               r0, r1) -> None:
    """Host reference over rows ``[r0, r1)`` (same arguments as
    :func:`vtnumba.kernels.peer_cuda.launch_peer_reduce_norm`, minus the stream)."""
    if int(r1) <= int(r0):
        return
    # A tuple of same-typed arrays compiles to a homogeneous tuple numba can index in a loop.
    written = 2 * (int(r1) - int(r0)) * new_residual.shape[1] * 4
    stream = written >= STREAM_MIN_BYTES
    args = (tuple(sources), weight if bias is None else bias, bias is not None,
            new_residual if residual is None else residual, residual is not None,
            weight, weight if norm_bias is None else norm_bias, norm_bias is not None,
            float(eps), bool(is_layer), out, new_residual)
    read = written // 2 * (len(sources) + (residual is not None))
    split_rows(lambda a, b: _reduce_add_norm_rows(*args, a, b, stream), r0, r1, nbytes=written + read)


def sum_sources_rows_host(sources, residual, acc, r0, r1) -> None:
    """Host reference of :func:`vtnumba.kernels.peer_cuda.launch_sum_sources` (its arguments, minus
    the stream): ``acc[r] = sources[0][r] + ... (+ residual[r])`` over rows ``[r0, r1)``, added in
    the kernel's order -- the sources first, the residual last -- so float32 rounds alike."""
    r0, r1 = int(r0), int(r1)
    if r1 <= r0:
        return
    z = sources[0][r0:r1].copy()
    for src in sources[1:]:
        z += src[r0:r1]
    if residual is not None:
        z += residual[r0:r1]
    acc[r0:r1] = z  # (last: acc may be residual itself)


def gather_rows_host(src, dests, row_offset: int) -> None:
    """``dest[row_offset : row_offset + n] = src`` for every destination (numpy copies)."""
    n = src.shape[0]
    for dest in dests:
        np.copyto(dest[row_offset:row_offset + n], src)


def _launch_reduce(*args, max_blocks=None):
    from vtnumba.kernels.peer_cuda import launch_peer_reduce_norm

    launch_peer_reduce_norm(*args, max_blocks=max_blocks)


def _launch_gather(*args, max_blocks=None):
    from vtnumba.kernels.peer_cuda import launch_gather_rows

    launch_gather_rows(*args, max_blocks=max_blocks)


def _check_max_blocks(max_blocks) -> int | None:
    if max_blocks is None:
        return None
    if not is_int(max_blocks) or max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks!r} must be a positive int (the most thread blocks, ~SMs, the "
                         "kernel may occupy) or None")
    return int(max_blocks)


# ---------------------------------------------------------------------------- validation
def _check_rows(rows, nrows: int) -> tuple[int, int]:
    if rows is None:
        return 0, nrows
    try:
        start, stop = rows
    except (TypeError, ValueError):
        raise TypeError(f"rows={rows!r} must be None or a (start, stop) pair of ints") from None
    for v in (start, stop):
        if not is_int(v):
            raise TypeError(f"rows={rows!r} must be None or a (start, stop) pair of ints")
    start, stop = int(start), int(stop)
    if not 0 <= start <= stop <= nrows:
        raise ValueError(f"rows=({start}, {stop}) is not a valid row range; expected 0 <= start <= stop <= {nrows}")
    return start, stop


def _check_list(name: str, value) -> list:
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        raise TypeError(f"{name} must be a non-empty list of arrays, got "
                        f"{type(value).__name__}{' (empty)' if isinstance(value, (list, tuple)) else ''}")
    return list(value)


# ---------------------------------------------------------------------------- public API
def peer_reduce_norm(sources, bias, residual, weight, norm_bias, eps, out, new_residual, norm: str = "rms",
                     rows=None, queue=None, backend=None, max_blocks: int | None = None):
    """Sum the same rows of ``sources``, add ``bias`` and ``residual``, normalise; one pass.

    ``sources``: list of ``tp`` float32 ``[R, H]`` arrays (own partial + peers' inbox
    slots).  ``bias``, ``weight``, ``norm_bias``: float32 ``[H]`` (``bias``/``norm_bias`` may
    be None; ``norm_bias`` only with ``norm="layer"``).  ``residual``: ``[R, H]`` or None.
    ``out``, ``new_residual``: ``[R, H]``, written only in ``rows`` (default: all R rows);
    ``new_residual`` may be ``residual`` (in-place update).  Returns ``(out, new_residual)``.
    ``max_blocks`` (GPU): at most this many thread blocks -- so at most that many SMs -- work
    on the rows, each taking several; the host reference ignores it.
    """
    max_blocks = _check_max_blocks(max_blocks)
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} is not supported; expected 'rms' or 'layer'")
    sources = _check_list("sources", sources)
    arrays = {f"sources[{k}]": s for k, s in enumerate(sources)}
    arrays.update(bias=bias, residual=residual, weight=weight, norm_bias=norm_bias, out=out,
                  new_residual=new_residual)
    kind = common_kind(arrays)
    check_array("sources[0]", sources[0], ndim=2, dtypes=_F32)
    R, h = sources[0].shape
    if h == 0:
        raise ValueError(f"sources[0] has shape {tuple(sources[0].shape)}: a norm over zero elements is undefined; "
                         "expected a hidden size H >= 1")
    for k, src in enumerate(sources[1:], start=1):
        check_array(f"sources[{k}]", src, ndim=2, dtypes=_F32, shape=(R, h))
    if residual is not None:
        check_array("residual", residual, ndim=2, dtypes=_F32, shape=(R, h))
    check_array("weight", weight, ndim=1, dtypes=_F32, shape=(h,))
    if bias is not None:
        check_array("bias", bias, ndim=1, dtypes=_F32, shape=(h,))
    if norm_bias is not None:
        if norm != "layer":
            raise ValueError("norm_bias is only used by norm='layer'; pass None for norm='rms'")
        check_array("norm_bias", norm_bias, ndim=1, dtypes=_F32, shape=(h,))
    if out is None or new_residual is None:
        raise ValueError("out and new_residual are required [R, H] float32 arrays (TPSP owns these buffers)")
    check_array("out", out, ndim=2, dtypes=_F32, shape=(R, h), writable=True)
    check_array("new_residual", new_residual, ndim=2, dtypes=_F32, shape=(R, h), writable=True)
    # By address (out=buf[:] is not buf): z is re-read after out is written, and a row the
    # outputs write must not be one another row still reads.  new_residual may be residual
    # exactly (the in-place update).
    inputs = {**{f"sources[{k}]": s for k, s in enumerate(sources)}, "bias": bias, "weight": weight,
              "norm_bias": norm_bias}
    check_outputs_apart({"out": out}, {"new_residual": new_residual, "residual": residual, **inputs})
    if residual is not None:
        check_not_partly_overlapping("new_residual", new_residual, "residual", residual)
    check_outputs_apart({"new_residual": new_residual}, inputs)
    eps = check_eps(eps)
    r0, r1 = _check_rows(rows, R)
    queue_peer_reduce_norm(kind, sources, bias, residual, weight, norm_bias, eps, norm == "layer", out, new_residual,
                           r0, r1, queue, backend, max_blocks)
    return out, new_residual


def gather_rows(src, dests, row_offset: int = 0, queue=None, backend=None, max_blocks: int | None = None):
    """Copy ``src [n, H]`` into rows ``[row_offset, row_offset + n)`` of every array in ``dests``.

    The all-gather's copy: every rank's gather slot receives this rank's normalised rows.
    ``dests``: list of float32 ``[T, H]`` arrays with ``row_offset + n <= T``; other rows are
    not touched.  Returns ``dests``.  ``max_blocks`` (GPU): at most this many thread blocks.
    """
    max_blocks = _check_max_blocks(max_blocks)
    dests = _check_list("dests", dests)
    kind = common_kind({"src": src, **{f"dests[{k}]": d for k, d in enumerate(dests)}})
    check_array("src", src, ndim=2, dtypes=_F32)
    n, h = src.shape
    if not is_int(row_offset) or row_offset < 0:
        raise ValueError(f"row_offset={row_offset!r} must be a non-negative int")
    row_offset = int(row_offset)
    for k, dest in enumerate(dests):
        check_array(f"dests[{k}]", dest, ndim=2, dtypes=_F32, shape=(None, h), writable=True)
        if row_offset + n > dest.shape[0]:
            raise ValueError(f"dests[{k}] has {dest.shape[0]} rows; rows [{row_offset}, {row_offset + n}) "
                             f"do not fit (row_offset={row_offset}, src has {n} rows)")
    # (By address: a destination over src's own memory copies rows another thread still reads.)
    check_outputs_apart({f"dests[{k}]": d for k, d in enumerate(dests)}, {"src": src})
    queue_gather_rows(kind, src, dests, row_offset, queue, backend, max_blocks)
    return dests


# ---------------------------------------------------------------------------- queued as checked once
# The two calls above check every argument, every time -- about 10-20 microseconds on the
# host, as long as the work itself for a small chunk.  A caller that checked a whole call's
# arrays once and then queues the same kernels chunk by chunk, over slices it derived itself,
# does not need them again: the TPSP pipeline (vtnumba.tpsp.pipeline) checks the call in
# TPSPCall.validate, and its workspace slots were checked when it was opened.  These take
# the checked values as they are (``kind``: "host" or "device", see common_kind; rows
# ``[r0, r1)``) and only queue the work -- a wrong argument here is not named, it is a bug.
def queue_peer_reduce_norm(kind: str, sources, bias, residual, weight, norm_bias, eps: float, is_layer: bool, out,
                           new_residual, r0: int, r1: int, queue, backend=None, max_blocks: int | None = None) -> None:
    """:func:`peer_reduce_norm` of rows ``[r0, r1)`` without its argument checks (see above)."""
    args = (sources, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1)
    run(kind, "peer_reduce_norm", queue, backend,
        uses=(*sources, bias, residual, weight, norm_bias, out, new_residual),
        host_fn=lambda: peer_reduce_norm_rows_host(*args),
        launch_fn=lambda stream: _launch_reduce(*args, stream, max_blocks=max_blocks),
        sources=len(sources), rows=r1 - r0)


def queue_gather_rows(kind: str, src, dests: list, row_offset: int, queue, backend=None,
                      max_blocks: int | None = None) -> None:
    """:func:`gather_rows` without its argument checks (see above)."""
    n, h = src.shape
    run(kind, "gather_rows", queue, backend, uses=(src, *dests),
        host_fn=lambda: gather_rows_host(src, dests, row_offset),
        launch_fn=lambda stream: _launch_gather(src, dests, row_offset, stream, max_blocks=max_blocks),
        bytes=n * h * 4 * (1 + len(dests)), dests=len(dests))


__all__ = ["NORMS", "peer_reduce_norm", "gather_rows", "queue_peer_reduce_norm", "queue_gather_rows",
           "peer_reduce_norm_rows_host", "sum_sources_rows_host", "gather_rows_host"]
