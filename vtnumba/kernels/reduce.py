"""Row-block sums over peer buffers: the arithmetic of the reference reduce-scatter.

A reduce-scatter over ``tp`` ranks leaves rank ``r`` with rows ``[r*R, r*R + R)`` of the
sum of every rank's ``[T, H]`` partial.  With peer buffers that sum is just "read the same
row block from every peer and add it up" -- three tiny kernels, each with a host reference
of the same signature (``out`` first, ``row0``/``nrows`` select the source rows)::

    copy_rows(out, a, row0, nrows)        out[i] = a[row0 + i]                 (i < nrows)
    add_rows(out, a, b, row0, nrows)      out[i] = a[row0 + i] + b[row0 + i]   (i < nrows)
    accumulate_rows(out, src, row0, nrows) out[i] += src[row0 + i]             (i < nrows)

``copy_rows`` and ``add_rows`` write zeros into rows ``nrows <= i < out.shape[0]`` -- the
zero padding a rank gets when ``T`` is not a multiple of ``tp`` (its block runs past the
last token); ``accumulate_rows`` leaves those rows alone.  :func:`sum_rows` strings them
together for any number of sources, in rank order (so every run adds in the same order
and float results are reproducible): ``add_rows`` for the first two sources (one pass
instead of copy-then-add), ``accumulate_rows`` for each further one.

The CUDA kernels (``copy_rows_kernel`` and its siblings) live in
:mod:`vtnumba.kernels.reduce_cuda`, one thread per output element; like every kernel module
of this package, it is imported only for device arrays (:func:`sum_rows` launches through
:func:`vtnumba.kernels._common.run`), so the ``cpu`` target never imports ``numba.cuda``.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import check_outputs_apart, common_kind, is_int
from vtnumba.kernels._common import run


# ---------------------------------------------------------------------------- host references
def copy_rows_host(out, a, row0, nrows):
    """``out[:nrows] = a[row0:row0+nrows]``, zeros below (host reference of ``copy_rows``)."""
    np.copyto(out[:nrows], a[row0:row0 + nrows])
    out[nrows:] = 0


def add_rows_host(out, a, b, row0, nrows):
    """``out[:nrows] = a[rows] + b[rows]``, zeros below (host reference of ``add_rows``)."""
    np.add(a[row0:row0 + nrows], b[row0:row0 + nrows], out=out[:nrows])
    out[nrows:] = 0


def accumulate_rows_host(out, src, row0, nrows):
    """``out[:nrows] += src[rows]``; rows below untouched (host reference of ``accumulate_rows``)."""
    np.add(out[:nrows], src[row0:row0 + nrows], out=out[:nrows])


HOST_REFERENCES = {"copy_rows": copy_rows_host, "add_rows": add_rows_host,
                   "accumulate_rows": accumulate_rows_host}


# ---------------------------------------------------------------------------- entry point
def _check_rows(out, sources, row0, nrows) -> None:
    if getattr(out, "ndim", None) != 2:
        raise ValueError(f"out must be a 2-D array [R, H], got shape {getattr(out, 'shape', None)}")
    if not sources:
        raise ValueError("sources is empty; sum_rows needs at least one source array")
    R, H = (int(s) for s in out.shape)
    if not is_int(row0) or row0 < 0:
        raise ValueError(f"row0={row0!r} must be a non-negative int")
    if not is_int(nrows) or not 0 <= nrows <= R:
        raise ValueError(f"nrows={nrows!r} must be an int in 0..{R} (out has {R} rows)")
    for j, s in enumerate(sources):
        if getattr(s, "ndim", None) != 2 or int(s.shape[1]) != H:
            raise ValueError(f"sources[{j}] has shape {tuple(getattr(s, 'shape', ()))}; expected [T, {H}]")
        if np.dtype(s.dtype) != np.dtype(out.dtype):
            raise TypeError(f"sources[{j}] has dtype {np.dtype(s.dtype).name}; expected out's "
                            f"{np.dtype(out.dtype).name}")
        if row0 + nrows > int(s.shape[0]):
            raise ValueError(f"rows [{row0}, {row0 + nrows}) run past sources[{j}]'s {int(s.shape[0])} rows")
    # Not in place: the sum runs one source after another, so an out inside a later source
    # would be read back after the first step overwrote it (2 * (s0 + s1) for out=sources[2]).
    check_outputs_apart({"out": out}, {f"sources[{j}]": s for j, s in enumerate(sources)})


def sum_rows(out, sources, row0: int, nrows: int, *, backend, queue) -> None:
    """``out[:nrows] = sum_j sources[j][row0:row0+nrows]`` in rank order; ``out[nrows:] = 0``.

    Submitted to ``queue`` of ``backend``: the host references for numpy arrays (a cpu
    backend), the kernels of :mod:`vtnumba.kernels.reduce_cuda` for device arrays (a cuda
    backend, real or simulated).  Does not synchronize the queue.
    """
    _check_rows(out, sources, row0, nrows)
    row0, nrows = int(row0), int(nrows)
    kind = common_kind({"out": out, **{f"sources[{j}]": s for j, s in enumerate(sources)}})
    steps = [("copy_rows", (sources[0],))] if len(sources) == 1 else \
        [("add_rows", (sources[0], sources[1]))] + [("accumulate_rows", (s,)) for s in sources[2:]]
    for name, srcs in steps:
        run(kind, name, queue, backend,
            lambda fn=HOST_REFERENCES[name], srcs=srcs: fn(out, *srcs, row0, nrows),
            lambda stream, name=name, srcs=srcs: _launch(name, stream, out, *srcs, row0, nrows),
            )


def _launch(name: str, stream, *args) -> None:
    from vtnumba.kernels import reduce_cuda  # imports numba.cuda: device arrays only

    reduce_cuda.launch(name, stream, *args)


__all__ = ["copy_rows_host", "add_rows_host", "accumulate_rows_host", "HOST_REFERENCES", "sum_rows"]
