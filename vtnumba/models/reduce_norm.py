"""The seam between the model and TPSP: how a row-parallel projection's partial sums are finished.

In a tensor-parallel post-LayerNorm BERT layer, both the attention-output projection and
the FFN output projection are *row-parallel* (:class:`vtnumba.nn.RowParallelLinear`): rank r
holds the columns ``W[:, K_r]`` of the weight and the matching slice ``x[:, K_r]`` of the
activations, so ``x_r @ W_r.T`` is only a partial sum.  What follows each of them is always
the same recipe, with the :class:`vtnumba.nn.LayerNorm` after it::

    next_hidden = LayerNorm( sum_r (x_r @ W_r.T) + bias + residual )     # [T, H], every rank

The model calls it through one signature, so *how* the partial sums are combined can be
swapped without touching the model (:mod:`vtnumba.models.minilm`)::

    reduce_norm(x_local [T, K_local], w_shard [H, K_local], bias [H], residual [T, H],
                ln_weight [H], ln_bias [H], eps, *, name, out=None, buffers=None) -> next_hidden [T, H]

``name`` says which projection this is (``"layer3.attention_output"``, ``"layer3.output"``):
TPSP keeps one handle (prepared weights, workspace) per projection, so a strategy may pick a
different op per name.  ``out`` is where the model wants ``next_hidden`` (its other hidden
buffer); ``buffers`` (:class:`ReduceNormBuffers`) lends the strategy scratch memory and this
rank's residual shard, all from the model's per-forward arena and in the backend's memory --
so nothing is allocated or copied between the host and a device per call.  A strategy that
ignores both (a test's stand-in, say) may return any ``[T, H]`` array; the model copies it.

The two strategies are thin: the arithmetic and the exchanges are :mod:`vtnumba.tpsp`'s.

* :class:`RegularReduceNorm` -- the regular forward,
  :func:`vtnumba.tpsp.regular.regular_matmul_ar_norm`: local matmul, all-reduce of the whole
  ``[T, H]`` partial over the group, fused add + LayerNorm of all T rows on every rank.
* :class:`TPSPReduceNorm` -- the fused TPSP op (:class:`vtnumba.tpsp.TPSPOp`, one per
  projection name, which itself falls back to the regular reduce-scatter forward when the
  profile says a batch is not worth fusing): reduce-scatter over *token rows*, normalise
  only this rank's ``R = ceil(T / tp)`` rows, all-gather.  It wants the residual sharded by
  token rows (rank r owns rows ``r*R .. r*R+R-1``, zero-padded) -- the model's padded hidden
  buffers make that a view.  In a post-LayerNorm model the normalised output *is* the next
  hidden state (and the next residual), so the gathered rows are the result and the op's
  ``new_residual`` (the un-normalised sum) is scratch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from mpi4py import MPI

from vtnumba.backend.arrays import array_kind, empty, is_int
from vtnumba.dist import DEFAULT_TIMEOUT_S, ProcessGroup
from vtnumba.dist.comm import DEFAULT, resolve_timeout
from vtnumba.kernels import gather_rows
from vtnumba.tpsp import TPSPOp, regular_matmul_ar_norm, shard_residual


def as_mpi_comm(group):
    """The mpi4py communicator behind ``group`` (``None``, an ``MPI.Comm``, or an object with ``.comm``)."""
    if group is None:
        return None
    comm = getattr(group, "comm", group)
    if not all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "Iallreduce")):
        raise TypeError(f"comm={group!r} is not an mpi4py communicator (nor a group with a .comm that is one)")
    return comm


def as_process_group(group, name: str = "minilm") -> ProcessGroup | None:
    """``group`` as a :class:`vtnumba.dist.ProcessGroup` (``None`` stays ``None``: one process).

    A ProcessGroup is returned as it is.  A bare mpi4py communicator (what scripts and tests
    had before process groups existed) is *borrowed*: wrapped in a ProcessGroup that uses it
    for data and control messages alike, is not registered, and is never freed by vtnumba --
    its owner frees it.  No peer buffers are offered on such a group (``peer_access=False``).
    """
    if group is None or isinstance(group, ProcessGroup):
        return group
    comm = as_mpi_comm(group)
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:  # world ranks only label the group in error messages; translating them is local
        world_ranks = [int(r) for r in mine.Translate_ranks(list(range(comm.Get_size())), world)]
    finally:
        mine.Free()
        world.Free()
    return ProcessGroup(name, comm, comm, comm, world_ranks, peer_access=False)


class ReduceNormBuffers(NamedTuple):
    """Memory the model lends a reduce_norm strategy for one call (backend memory, valid for the call)."""

    residual_shard: Any      # [R, H]: this rank's zero-padded token rows of ``residual`` (a view, no copy)
    new_residual: Any        # [T, H] scratch for the un-normalised sum (the regular forward)
    new_residual_shard: Any  # [R, H] scratch for it (TPSP)


class RegularReduceNorm:
    """The regular forward: ``LayerNorm(allreduce(x @ W.T) + bias + residual)`` on every rank.

    ``group`` is ``None`` (one rank, no exchange), a :class:`vtnumba.dist.ProcessGroup`, or a
    bare mpi4py communicator (see :func:`as_process_group`).  Each call is
    :func:`vtnumba.tpsp.regular.regular_matmul_ar_norm`; the all-reduce is traced as ``mpi``.
    Without ``out`` the result is a new array.  ``timeout_s`` bounds each exchange (default:
    the process's default timeout, :func:`vtnumba.dist.comm.default_timeout`, looked up per wait).
    """

    def __init__(self, group=None, timeout_s: float = DEFAULT, name: str = "tp"):
        self.group = as_process_group(group, name)
        self.comm = None if self.group is None else self.group.comm
        self.tp = 1 if self.group is None else self.group.size
        self.timeout_s = timeout_s if timeout_s is DEFAULT else resolve_timeout(timeout_s)
        self.name = name

    def __call__(self, x_local, w_shard, bias, residual, ln_weight, ln_bias, eps, *, name: str = "row_parallel",
                 out=None, buffers: ReduceNormBuffers | None = None):
        normed, _ = regular_matmul_ar_norm(self.group, x_local, w_shard, bias, residual, ln_weight, eps, ln_bias,
                                           norm="layer", out=out,
                                           new_residual=None if buffers is None else buffers.new_residual,
                                           timeout_s=self.timeout_s)
        return normed


class TPSPReduceNorm:
    """The fused TPSP op behind the ``reduce_norm`` signature.

    ``ops`` is one op for every projection, or a mapping from projection name to op (TPSP
    keeps a handle per projection).  An op is called as
    ``op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=ln_bias) -> (gathered, new_residual)``
    -- TPSP with LayerNorm, ``gathered`` ``[>= T, H]`` the normalised rows of every rank in
    token order.  A :class:`vtnumba.tpsp.TPSPOp` also gets ``out`` and ``new_residual``, so it
    writes straight into the model's buffers; any other op's ``gathered`` is copied into
    ``out``.  ``rank`` and ``tp`` say which token rows this rank owns.

    The arrays are wherever the model computes (numpy on ``cpu``, device arrays on
    ``cuda``/``cudasim``), which is where the TPSP backend of the same target computes too:
    nothing is staged.  (``device=`` is accepted and ignored, with a DeprecationWarning.)
    """

    def __init__(self, ops, rank: int, tp: int, *, device: bool | None = None):
        if isinstance(ops, Mapping):
            bad = [k for k, op in ops.items() if not callable(op)]
            if not ops or bad:
                raise TypeError(f"ops must map projection names to callable TPSP ops; not callable: {bad or 'empty mapping'}")
        elif not callable(ops):
            raise TypeError(f"ops={ops!r} must be the callable TPSP op (or a mapping name -> op)")
        if not (is_int(tp) and tp >= 1 and is_int(rank) and 0 <= rank < tp):
            raise ValueError(f"rank={rank!r}, tp={tp!r}: expected integers with 0 <= rank < tp")
        if device is not None:
            warnings.warn("TPSPReduceNorm(device=...) is ignored: the model's arrays already live where its "
                          "backend computes, so nothing is staged", DeprecationWarning, stacklevel=2)
        self.ops, self.rank, self.tp = ops, int(rank), int(tp)

    def op_for(self, name: str) -> Callable:
        """The op for projection ``name`` (ValueError naming the known ones if there is none)."""
        if not isinstance(self.ops, Mapping):
            return self.ops
        try:
            return self.ops[name]
        except KeyError:
            raise ValueError(f"no TPSP op for projection {name!r}; the mapping has {sorted(self.ops)}") from None

    def __call__(self, x_local, w_shard, bias, residual, ln_weight, ln_bias, eps, *, name: str = "row_parallel",
                 out=None, buffers: ReduceNormBuffers | None = None):
        T, H = (int(s) for s in residual.shape)
        op = self.op_for(name)
        if buffers is not None:
            shard, new_residual = buffers.residual_shard, buffers.new_residual_shard
        else:  # called on its own: cut the padded shard (host arrays; the model lends a view instead)
            shard, new_residual = shard_residual(residual, self.tp, self.rank), None
        if isinstance(op, TPSPOp):
            gathered = op(x_local, w_shard, bias, shard, ln_weight, eps, ln_bias, out=out,
                          new_residual=new_residual)[0]
        else:
            gathered = op(x_local, w_shard, bias, shard, ln_weight, eps, norm_bias=ln_bias)[0]
        shape = tuple(int(s) for s in getattr(gathered, "shape", ()))
        if len(shape) != 2 or shape[0] < T or shape[1] != H:
            raise RuntimeError(f"the TPSP op for {name!r} returned gathered of shape {shape}; expected at least ({T}, {H})")
        if gathered is out:
            return out
        # Another op may hand back its own workspace, which its next call reuses: copy the rows out.
        if out is None:
            out = empty(array_kind("gathered", gathered), (T, H), gathered.dtype)
        gather_rows(gathered[:T], [out], 0)
        return out


__all__ = ["DEFAULT_TIMEOUT_S", "ReduceNormBuffers", "RegularReduceNorm", "TPSPReduceNorm", "as_mpi_comm",
           "as_process_group"]
