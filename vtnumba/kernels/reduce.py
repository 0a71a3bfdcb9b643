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

The CUDA kernels are one thread per output element (``R*H`` threads, a 1-D grid): the
operation is pure bandwidth, every element is independent, and consecutive threads touch
consecutive columns, so loads and stores coalesce.  On a real GPU ``a``/``b``/``src`` may
be *another GPU's* memory opened through CUDA IPC; the loads then travel over NVLink/PCIe.
The kernels are compiled on first use (:func:`cuda_kernels`) so that importing this module
never imports ``numba.cuda`` -- the ``cpu`` target does not need it.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import is_int

THREADS_PER_BLOCK = 128


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


# ---------------------------------------------------------------------------- CUDA kernels
# ``cuda`` is bound to ``numba.cuda`` on first use (see :func:`_bind_cuda`), not at import:
# the cpu target never imports numba.cuda.  It must be a *module global* (not a closure
# variable) because the simulator runs a kernel by swapping the ``numba.cuda`` it finds in
# the kernel function's globals for its fake per-thread module.
cuda = None
_KERNELS: dict | None = None


def _bind_cuda() -> None:
    global cuda
    if cuda is None:
        from numba import cuda as _cuda

        cuda = _cuda


def copy_rows(out, a, row0, nrows):
    """Kernel source: ``out[:nrows] = a[row0:row0+nrows]`` and ``out[nrows:] = 0``.

    One thread per element of ``out``; compiled by :func:`cuda_kernels`, launched by :func:`launch`.
    Host twin: :func:`copy_rows_host`.
    """
    i = cuda.grid(1)
    h = out.shape[1]
    if i < out.shape[0] * h:
        r = i // h
        c = i - r * h
        if r < nrows:
            out[r, c] = a[row0 + r, c]
        else:
            out[r, c] = 0


def add_rows(out, a, b, row0, nrows):
    """Kernel source: ``out[:nrows] = a[rows] + b[rows]`` (``rows = row0:row0+nrows``) and ``out[nrows:] = 0``.

    One thread per element of ``out``.  Host twin: :func:`add_rows_host`.
    """
    i = cuda.grid(1)
    h = out.shape[1]
    if i < out.shape[0] * h:
        r = i // h
        c = i - r * h
        if r < nrows:
            out[r, c] = a[row0 + r, c] + b[row0 + r, c]
        else:
            out[r, c] = 0


def accumulate_rows(out, src, row0, nrows):
    """Kernel source: ``out[:nrows] += src[row0:row0+nrows]``; ``out[nrows:]`` is left alone.

    Launched with one thread per element of ``out`` (threads past ``nrows * H`` do nothing).
    Host twin: :func:`accumulate_rows_host`.
    """
    i = cuda.grid(1)
    h = out.shape[1]
    if i < nrows * h:
        r = i // h
        c = i - r * h
        out[r, c] += src[row0 + r, c]


def kernel_sources() -> dict:
    """The kernels as plain Python functions (what ``cuda.jit`` compiles; used by PTX tests)."""
    _bind_cuda()
    return {"copy_rows": copy_rows, "add_rows": add_rows, "accumulate_rows": accumulate_rows}


def cuda_kernels() -> dict:
    """``{"copy_rows": kernel, "add_rows": kernel, "accumulate_rows": kernel}`` (``@cuda.jit``)."""
    global _KERNELS
    if _KERNELS is None:
        sources = kernel_sources()
        _KERNELS = {name: cuda.jit(fn) for name, fn in sources.items()}
    return _KERNELS


def launch(name: str, stream, out, *args) -> None:
    """Launch kernel ``name`` with one thread per element of ``out`` on ``stream``."""
    n = int(out.shape[0]) * int(out.shape[1])
    if n == 0:
        return
    blocks = (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    cuda_kernels()[name][blocks, THREADS_PER_BLOCK, stream](out, *args)


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


def sum_rows(out, sources, row0: int, nrows: int, *, backend, queue) -> None:
    """``out[:nrows] = sum_j sources[j][row0:row0+nrows]`` in rank order; ``out[nrows:] = 0``.

    Submitted to ``queue`` of ``backend``: host references on a cpu backend, the CUDA
    kernels on a cuda backend (real or simulated).  Does not synchronize the queue.
    """
    _check_rows(out, sources, row0, nrows)
    row0, nrows = int(row0), int(nrows)
    on_host = backend.capabilities.kernel_arrays == "numpy"
    steps = [("copy_rows", (sources[0],))] if len(sources) == 1 else \
        [("add_rows", (sources[0], sources[1]))] + [("accumulate_rows", (s,)) for s in sources[2:]]
    for name, srcs in steps:
        if on_host:
            fn = HOST_REFERENCES[name]
            backend.submit(queue, lambda _s, fn=fn, srcs=srcs: fn(out, *srcs, row0, nrows), name=name)
        else:
            backend.submit(queue, lambda stream, name=name, srcs=srcs: launch(name, stream, out, *srcs, row0, nrows),
                           name=name)


__all__ = ["copy_rows", "add_rows", "accumulate_rows", "copy_rows_host", "add_rows_host", "accumulate_rows_host",
           "HOST_REFERENCES", "kernel_sources",
           "cuda_kernels", "launch", "sum_rows", "THREADS_PER_BLOCK"]
