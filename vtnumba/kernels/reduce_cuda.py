"""CUDA row-block sums over peer buffers (``@cuda.jit``): the reference reduce-scatter's arithmetic.

This module imports ``numba.cuda``; :mod:`vtnumba.kernels.reduce` loads it only for device
arrays.  Contracts (host twins of the same signature in :mod:`vtnumba.kernels.reduce`,
``out`` first, ``row0``/``nrows`` select the source rows):

* :func:`copy_rows_kernel` -- ``out[i] = a[row0 + i]`` for ``i < nrows``, zeros below;
* :func:`add_rows_kernel` -- ``out[i] = a[row0 + i] + b[row0 + i]`` for ``i < nrows``, zeros below;
* :func:`accumulate_rows_kernel` -- ``out[i] += src[row0 + i]`` for ``i < nrows``; rows below
  are left alone.

They are one thread per element of ``out`` (a 1-D grid, :func:`launch`): the operation is
pure bandwidth, every element is independent, and consecutive threads touch consecutive
columns, so loads and stores coalesce.  On a real GPU ``a``/``b``/``src`` may be *another
GPU's* memory opened through CUDA IPC; the loads then travel over NVLink or PCIe.  (TPSP's
own exchange uses the wider, fused kernels of :mod:`vtnumba.kernels.peer_cuda`; these three
are the readable reference the collectives of :mod:`vtnumba.dist` are built from.)
"""

from __future__ import annotations

from numba import cuda

#: Threads per block of every launch in this module.
THREADS_PER_BLOCK = 128


@cuda.jit
def copy_rows_kernel(out, a, row0, nrows):
    """``out[:nrows] = a[row0:row0+nrows]`` and ``out[nrows:] = 0``, one thread per element of ``out``."""
    i = cuda.grid(1)
    h = out.shape[1]
    if i < out.shape[0] * h:
        r = i // h
        c = i - r * h
        if r < nrows:
            out[r, c] = a[row0 + r, c]
        else:
            out[r, c] = 0  # the zero padding of a block that runs past the last token


@cuda.jit
def add_rows_kernel(out, a, b, row0, nrows):
    """``out[:nrows] = a[rows] + b[rows]`` (``rows = row0:row0+nrows``) and ``out[nrows:] = 0``."""
    i = cuda.grid(1)
    h = out.shape[1]
    if i < out.shape[0] * h:
        r = i // h
        c = i - r * h
        if r < nrows:
            out[r, c] = a[row0 + r, c] + b[row0 + r, c]
        else:
            out[r, c] = 0


@cuda.jit
def accumulate_rows_kernel(out, src, row0, nrows):
    """``out[:nrows] += src[row0:row0+nrows]``; threads past ``nrows * H`` do nothing."""
    i = cuda.grid(1)
    h = out.shape[1]
    if i < nrows * h:
        r = i // h
        c = i - r * h
        out[r, c] += src[row0 + r, c]


#: The kernels by the name :func:`vtnumba.kernels.reduce.sum_rows` gives its steps.
KERNELS = {"copy_rows": copy_rows_kernel, "add_rows": add_rows_kernel, "accumulate_rows": accumulate_rows_kernel}


def launch(name: str, stream, out, *args) -> None:
    """Launch kernel ``name`` (a key of :data:`KERNELS`) with one thread per element of ``out`` on ``stream``."""
    n = int(out.shape[0]) * int(out.shape[1])
    if n == 0:
        return
    blocks = (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    KERNELS[name][blocks, THREADS_PER_BLOCK, stream](out, *args)


def _sig(n_arrays: int, t: str) -> str:
    return "void(" + ", ".join([f"{t}[:, ::1]"] * n_arrays) + ", int64, int64)"


#: (name, kernel, signature) for :mod:`vtnumba.kernels.ptx`: float32 (the collectives' usual
#: dtype) and float16 (half-precision data, such as the encoder cache's default).
PTX_SIGNATURES = [(name, kernel, _sig(3 if name == "add_rows" else 2, t))
                  for name, kernel in KERNELS.items() for t in ("float32", "float16")]

__all__ = ["copy_rows_kernel", "add_rows_kernel", "accumulate_rows_kernel", "KERNELS", "launch", "PTX_SIGNATURES",
           "THREADS_PER_BLOCK"]
