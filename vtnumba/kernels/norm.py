"""Fused residual add + RMSNorm / LayerNorm: one pass over memory, float32 accumulation.

After every attention and MLP block a transformer adds the block's output (plus its bias)
to the residual stream and normalises the sum.  Done with separate numpy operations that
is five or six passes over ``[rows, H]`` arrays (add, add, square, mean, scale, scale);
fused it is one: read ``y`` and ``residual``, write ``new_residual`` and ``out``::

    z            = y + bias + residual          # the new residual stream
    RMSNorm:   out = z * rsqrt(mean(z^2) + eps) * weight
    LayerNorm: out = (z - mean(z)) * rsqrt(var(z) + eps) * weight + norm_bias

``residual`` may be None (then ``z = y + bias``) and so may ``bias`` / ``norm_bias``.
``new_residual`` may be the ``residual`` array itself (in-place update of the stream), and
``out`` may be ``y``: each element is read before it is written, by the same thread.

Two implementations with one contract, :func:`add_norm_rows_host` (the host reference, a
``@numba.njit`` loop) and :func:`vtnumba.kernels.norm_cuda.launch_add_norm_rows` (one
CUDA block per row, block reduction in shared memory -- see that module).  The public
functions pick one from the array type (numpy -> host, device array -> CUDA).

**Why njit for the host.**  A row of ``H`` floats fits in L1, so a loop that builds ``z``
for one row in a scratch row, keeps the running sum in a register, then writes ``z`` and the
normalised row (computed on the fly from the scratch row, :func:`row_stats` and
:func:`~vtnumba.kernels._streaming.store_norm_row`) touches DRAM once per input and output
byte -- numpy cannot express that without full-size temporaries (five or six passes over
memory).
Fast-math reassociation lets LLVM reorder the float32 sums so they vectorise (SIMD lanes
keep separate partial sums) -- without assuming "no NaNs", so a NaN in a row propagates as
on a GPU (:data:`vtnumba.kernels._common.HOST_JIT`); ``nogil`` lets a threaded queue run it
beside other work.  Large
outputs are written with non-temporal stores (:mod:`vtnumba.kernels._streaming`), which
skip the read-for-ownership a normal store to an uncached line costs.  And large calls split
their rows over this process's share of the cores
(:func:`vtnumba.kernels._common.split_rows`): rows are independent, and one core cannot keep
enough cache misses in flight to use the memory bus alone (on the 2-core cpu target, 2
threads run 8192 x 4096 about 1.6x faster than one on an otherwise idle machine).
"""

from __future__ import annotations

import numba
import numpy as np

from vtnumba.kernels._common import (
    HOST_JIT,
    check_array,
    check_eps,
    check_not_partly_overlapping,
    common_kind,
    drop_stale_numba_cache,
    empty,
    run,
    split_rows,
)
from vtnumba.kernels._streaming import STREAM_MIN_BYTES, store_fence, store_norm_row, store_row

# Cached kernels below call jitted helpers from these files (see drop_stale_numba_cache).
drop_stale_numba_cache(__file__, "_streaming.py", "_common.py")

_F32 = (np.float32,)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float32, about 1.18e-38


# ---------------------------------------------------------------------------- host reference
@numba.njit(**HOST_JIT, inline="always")
def _rsqrt(s):
    # 1 / sqrt(s) with 1 / sqrt(inf) = 0, as a GPU's rsqrt gives: the "arcp" fast-math flag
    # lets the compiler rewrite the division into a form that yields NaN there -- and a row
    # whose sum of squares overflows would come out all NaN instead of 0 (a NaN in z still
    # gives NaN in its own element: NaN * 0).
    #
    # And below float32's smallest normal (an eps under 1.2e-38, which check_eps allows, on a
    # row of tiny values) the same rewrite -- an approximate reciprocal square root that takes
    # subnormals for 0 -- gave -inf or NaN; the GPU's IEEE division and sqrt give 1 / sqrt(s)
    # there, which float32 holds (at most ~2.6e22), so work it out in float64 instead.
    if s == np.inf:
        return np.float32(0.0)
    if s < _F32_TINY:
        return np.float32(1.0 / np.sqrt(np.float64(s)))
    return np.float32(1.0) / np.sqrt(s)


@numba.njit(**HOST_JIT)
def row_stats(z, partial, eps, is_layer):
    """``(mean, inv)`` of the scratch row ``z`` given pass 1's sum (of ``z^2`` for RMSNorm, of
    ``z`` for LayerNorm): ``out = (z - mean) * inv * weight (+ norm_bias)``, with ``mean = 0``
    for RMSNorm.  Mirrors the statistics half of the CUDA ``finish_row``."""
    h = z.shape[0]
    inv_h = np.float32(1.0) / np.float32(h)
    if not is_layer:
        return np.float32(0.0), _rsqrt(partial * inv_h + eps)
    mean = partial * inv_h
    sq = np.float32(0.0)
    for i in range(h):  # var = mean((z - mean)^2): no cancellation when |mean| >> std
        d = z[i] - mean
        sq += d * d
    return mean, _rsqrt(sq * inv_h + eps)


@numba.njit(**HOST_JIT)
def _add_norm_rows(y, bias, has_bias, residual, has_residual, weight, norm_bias, has_norm_bias, eps, is_layer,
                   out, new_residual, r0, r1, stream):
    h = y.shape[1]
    eps32 = np.float32(eps)
    z = np.empty(h, np.float32)  # scratch row: stays in L1 between the passes
    for r in range(r0, r1):
        s = np.float32(0.0)
        # The flags are loop-invariant; LLVM unswitches the loop into branch-free copies.
        for i in range(h):
            v = y[r, i]
            if has_bias:
                v += bias[i]
            if has_residual:
                v += residual[r, i]
            z[i] = v
            s += v if is_layer else v * v
        mean, inv = row_stats(z, s, eps32, is_layer)
        # Inputs of row r are fully read before its outputs are written: in-place is safe.
        store_row(new_residual, r, z, stream)
        store_norm_row(out, r, z, mean, inv, weight, norm_bias, has_norm_bias, stream)
    if stream:
        store_fence()  # streaming stores visible before the caller reports completion


def add_norm_rows_host(y, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1) -> None:
    """Host reference of the fused add + norm over rows ``[r0, r1)`` (same arguments as
    :func:`vtnumba.kernels.norm_cuda.launch_add_norm_rows`, minus the stream)."""
    # numba functions take no None: pass same-typed placeholders that the flags never read.
    written = 2 * (int(r1) - int(r0)) * y.shape[1] * 4
    stream = written >= STREAM_MIN_BYTES
    args = (y, weight if bias is None else bias, bias is not None,
            y if residual is None else residual, residual is not None,
            weight, weight if norm_bias is None else norm_bias, norm_bias is not None,
            float(eps), bool(is_layer), out, new_residual)
    # Large calls split their rows over this process's cores (see split_rows).
    read = written // 2 * (1 + (residual is not None))
    split_rows(lambda a, b: _add_norm_rows(*args, a, b, stream), r0, r1, nbytes=written + read)


def _launch(y, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1, stream):
    from vtnumba.kernels.norm_cuda import launch_add_norm_rows

    launch_add_norm_rows(y, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, r0, r1, stream)


# ---------------------------------------------------------------------------- public API
def _fused_add_norm(name, y, residual, weight, norm_bias, eps, bias, out, new_residual, is_layer, queue, backend):
    kind = common_kind({"y": y, "residual": residual, "weight": weight, "bias": bias, "norm_bias": norm_bias,
                        "out": out, "new_residual": new_residual})
    check_array("y", y, ndim=2, dtypes=_F32)
    rows, h = y.shape
    if h == 0:
        raise ValueError(f"y has shape {tuple(y.shape)}: a norm over zero elements is undefined; expected a hidden "
                         "size H >= 1")
    if residual is not None:
        check_array("residual", residual, ndim=2, dtypes=_F32, shape=(rows, h))
    check_array("weight", weight, ndim=1, dtypes=_F32, shape=(h,))
    if bias is not None:
        check_array("bias", bias, ndim=1, dtypes=_F32, shape=(h,))
    if norm_bias is not None:
        check_array("norm_bias", norm_bias, ndim=1, dtypes=_F32, shape=(h,))
    eps = check_eps(eps)
    if out is None:
        out = empty(kind, (rows, h), np.float32)
    if new_residual is None:
        new_residual = empty(kind, (rows, h), np.float32)
    check_array("out", out, ndim=2, dtypes=_F32, shape=(rows, h), writable=True)
    check_array("new_residual", new_residual, ndim=2, dtypes=_F32, shape=(rows, h), writable=True)
    # Row i of the inputs is read before row i of the outputs is written, so an output may *be*
    # an input (in place); out and new_residual never share memory (z is re-read after out
    # is written), and no output may overlap an input shifted by some rows.
    check_not_partly_overlapping("out", out, "new_residual", new_residual, same_ok=False)
    for o_name, o in (("out", out), ("new_residual", new_residual)):
        for i_name, i in (("y", y), ("residual", residual)):
            if i is not None:
                check_not_partly_overlapping(o_name, o, i_name, i)
    args = (y, bias, residual, weight, norm_bias, eps, is_layer, out, new_residual, 0, rows)
    run(kind, name, queue, backend, uses=(y, bias, residual, weight, norm_bias, out, new_residual),
        host_fn=lambda: add_norm_rows_host(*args),
        launch_fn=lambda stream: _launch(*args, stream),
        bytes=(4 if residual is not None else 3) * rows * h * 4)
    return out, new_residual


def fused_add_rms_norm(y, residual, weight, eps, bias=None, out=None, new_residual=None, queue=None, backend=None):
    """``z = y + bias + residual``; ``out = z * rsqrt(mean(z^2) + eps) * weight``.

    ``y``, ``residual``, ``out``, ``new_residual``: float32 ``[rows, H]``; ``weight``, ``bias``:
    float32 ``[H]``.  ``residual``/``bias`` may be None; ``out``/``new_residual`` are allocated
    when None.  Returns ``(out, new_residual)``.
    """
    return _fused_add_norm("fused_add_rms_norm", y, residual, weight, None, eps, bias, out, new_residual, False,
                           queue, backend)


def fused_add_layer_norm(y, residual, weight, norm_bias, eps, bias=None, out=None, new_residual=None, queue=None,
                         backend=None):
    """``z = y + bias + residual``; ``out = (z - mean) * rsqrt(var + eps) * weight + norm_bias``.

    Same arrays as :func:`fused_add_rms_norm` plus ``norm_bias [H]`` (may be None).
    Returns ``(out, new_residual)``.
    """
    return _fused_add_norm("fused_add_layer_norm", y, residual, weight, norm_bias, eps, bias, out, new_residual,
                           True, queue, backend)


__all__ = ["fused_add_rms_norm", "fused_add_layer_norm", "add_norm_rows_host"]
