"""The regular forward: what TPSP replaces, what it falls back to, and what it is checked against.

Two ways a tensor-parallel layer finishes a row-parallel projection without TPSP:

* :func:`regular_matmul_rs_norm_ag` -- the *same contract* as the fused op (sharded residual
  in, ``(gathered [T, H], new_residual [R, H])`` out), built from separate stock steps::

      partial  = x @ W.T                       # kernels.linear (numpy BLAS on the host)
      y        = MPI_Reduce_scatter_block(partial)   # rank r gets rows r*R .. r*R+R-1
      normed, z = fused add + norm(y + bias + residual)
      gathered = MPI_Allgather(normed)[:T]

  Each step waits for the one before: nothing overlaps, and the reduced rows make a round
  trip through MPI's buffers.  This is the fallback whenever ``open``/``profile`` declines
  (every rank the same way), and the reference the fused op is tested against.

* :func:`regular_matmul_ar_norm` -- the classic tensor-parallel forward with a *replicated*
  residual: ``MPI_Allreduce`` of the whole ``[T, H]`` partial, then every rank normalises all
  ``T`` rows.  ``mpi/tpsp_model.py`` runs this as "the regular model".

MPI messages travel from host memory (the pip ``mpich`` is not CUDA-aware), so device
arrays are staged through the host; the collectives themselves are
:func:`vtnumba.dist.mpi_reduce_scatter` / :func:`vtnumba.dist.mpi_all_gather`, which also pad
``T`` up to ``tp * R`` rows.  ``timeout_s=None`` makes the plain blocking MPI calls (what a
benchmark should time); a number bounds every wait.

**The ranks agree first.**  MPI cannot tell that two ranks passed different shapes to one
``Reduce_scatter_block``: each rank gets *some* rows and returns.  And a rank whose own
arguments fail its checks raises before the collective, so the others' collective is
matched with its *next* call -- wrong rows, then a hang.  So before the first collective
every rank shares one small row -- ``[refused?, T, H, norm, eps, bias?, norm_bias?]`` -- in one
``Allgather``: a rank that refused raises its own error, the others say which ranks refused,
and different arguments are one ValueError on every rank (an eps or a bias on one rank only
would normalise each rank's rows differently, and nothing else would notice).  (The fused
op does the same through its peer flags; :func:`vtnumba.dist.comm.agree_on_call` serves other
collectives too, such as :class:`vtnumba.nn.RowParallelLinear`'s all-reduce.)  ``agree=False`` skips it, for a
benchmark that times the stock collectives alone.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from vtnumba import trace
from vtnumba.backend.arrays import array_kind, check_eps, empty, host_view
from vtnumba.dist import mpi_all_gather, mpi_reduce_scatter
from vtnumba.dist.comm import DEFAULT, agree_on_call, check_group, wait_request
from vtnumba.kernels import fused_add_layer_norm, fused_add_rms_norm, linear
from vtnumba.tpsp.norm_type import LAYER, get_tpsp_norm_type
from vtnumba.tpsp.pipeline import check_call, check_tpsp_array


def _empty_like_kind(ref, shape):
    """A new float32 array of ``shape`` in the same memory as ``ref`` (numpy or device)."""
    return empty(array_kind("ref", ref), shape, np.float32)


def add_norm(y, residual, weight, eps, bias, norm_bias, norm: str, out, new_residual):
    """``z = y + bias + residual``; ``out = norm(z)``: the kernels' fused add-norm for either norm."""
    if norm == LAYER:
        return fused_add_layer_norm(y, residual, weight, norm_bias, eps, bias=bias, out=out,
                                    new_residual=new_residual)
    return fused_add_rms_norm(y, residual, weight, eps, bias=bias, out=out, new_residual=new_residual)


#: What the ranks must agree on before a regular forward's collectives (bias and norm_bias:
#: given on every rank or on none).
_FORWARD_FIELDS = ("T", "H", "norm", "eps", "bias", "norm_bias")


def regular_matmul_rs_norm_ag(group, x, w, bias, residual, norm_weight, eps, norm_bias=None, *, norm="rms",
                              out=None, new_residual=None, timeout_s: float | None = DEFAULT, agree: bool = True):
    """The unfused forward with the fused op's contract; returns ``(gathered [T, H], new_residual [R, H])``.

    Collective over ``group`` (a :class:`vtnumba.dist.ProcessGroup`): every rank calls it
    with the same ``T`` and ``H``.  ``out``/``new_residual`` are filled when given (else
    allocated); ``new_residual`` may be ``residual`` itself.
    """
    check_group(group)  # (no group, no peers to tell: raised here, on this rank alone)

    def check():
        shape, checked_eps = check_call(x, w, bias, residual, norm_weight, eps, norm_bias, norm, group.size,
                                        out=out, new_residual=new_residual)
        return (shape, checked_eps), (shape.T, shape.H, shape.norm, checked_eps, bias is not None,
                                      norm_bias is not None)

    shape, eps = agree_on_call(group, "regular_matmul_rs_norm_ag", check, _FORWARD_FIELDS, timeout_s, agree)
    T, H, R = shape.T, shape.H, shape.R
    partial = linear(x, w)                                  # [T, H] partial sum of this rank's K shard
    y = _empty_like_kind(x, (R, H))
    # (agree=False: the ranks agreed on the shapes above, or were told not to)
    mpi_reduce_scatter(partial, y, group, timeout_s=timeout_s, agree=False)  # rank r keeps its R rows of the sum
    normed = _empty_like_kind(x, (R, H))
    if new_residual is None:
        new_residual = _empty_like_kind(x, (R, H))
    add_norm(y, residual, norm_weight, eps, bias, norm_bias, shape.norm, normed, new_residual)
    if out is None:
        out = _empty_like_kind(x, (T, H))
    mpi_all_gather(normed, out, group, timeout_s=timeout_s, agree=False)  # every rank gets all T normalised rows
    return out, new_residual


def mpi_all_reduce_(partial, group, timeout_s: float | None = DEFAULT):
    """In-place MPI sum of ``partial`` over ``group`` (device arrays staged through the host)."""
    host = host_view(partial)
    staged = host is None
    if staged:
        host = partial.copy_to_host()
    with trace.span("allreduce", "mpi", f"mpi:{group.name}", bytes=int(host.nbytes)):
        if timeout_s is None:
            group.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        else:
            wait_request(group.comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM), group, "allreduce", timeout_s)
    if staged:
        partial.copy_to_device(host)
    return partial


def regular_matmul_ar_norm(group, x, w, bias, residual, norm_weight, eps, norm_bias=None, *, norm="rms",
                           out=None, new_residual=None, timeout_s: float | None = DEFAULT, agree: bool = True):
    """Tensor parallelism without sequence parallelism; returns ``(normed [T, H], new_residual [T, H])``.

    ``residual`` is the *full* ``[T, H]`` residual, replicated on every rank.  The partial
    ``x @ W.T`` is all-reduced, then every rank adds bias + residual and normalises all rows.
    """
    if group is not None:
        check_group(group)

    def check():
        kind = get_tpsp_norm_type(norm)
        check_tpsp_array("x", x, (None, None))
        T, K = (int(s) for s in x.shape)
        check_tpsp_array("w", w, (None, K))
        H = int(w.shape[0])
        check_tpsp_array("residual", residual, (T, H))
        check_tpsp_array("norm_weight", norm_weight, (H,))
        if bias is not None:
            check_tpsp_array("bias", bias, (H,))
        if norm_bias is not None:
            if kind != LAYER:
                raise ValueError(f"norm_bias is given but norm={kind!r}: only LayerNorm has a bias")
            check_tpsp_array("norm_bias", norm_bias, (H,))
        checked_eps = check_eps(eps)
        return (kind, T, H, checked_eps), (T, H, kind, checked_eps, bias is not None, norm_bias is not None)

    norm, T, H, eps = agree_on_call(group, "regular_matmul_ar_norm", check, _FORWARD_FIELDS, timeout_s, agree)
    partial = linear(x, w)
    if group is not None and group.size > 1:
        mpi_all_reduce_(partial, group, timeout_s)
    if out is None:
        out = _empty_like_kind(x, (T, H))
    if new_residual is None:
        new_residual = _empty_like_kind(x, (T, H))
    add_norm(partial, residual, norm_weight, eps, bias, norm_bias, norm, out, new_residual)
    return out, new_residual


__all__ = ["regular_matmul_rs_norm_ag", "regular_matmul_ar_norm", "add_norm", "mpi_all_reduce_"]
