"""The seam between the model and TPSP: "row-parallel projection + residual + LayerNorm".

In a tensor-parallel post-LayerNorm BERT layer, both the attention-output projection and
the FFN output projection are *row-parallel*: rank r holds the columns ``W[:, K_r]`` of the
weight and the matching slice ``x[:, K_r]`` of the activations, so ``x_r @ W_r.T`` is only a
partial sum.  What follows each of them is always the same recipe::

    next_hidden = LayerNorm( sum_r (x_r @ W_r.T) + bias + residual )     # [T, H], every rank

The model calls it through one signature, so the way the partial sums are combined can be
swapped without touching the model (:mod:`vtnumba.models.minilm`)::

    reduce_norm(x_local [T, K_local], w_shard [H, K_local], bias [H], residual [T, H],
                ln_weight [H], ln_bias [H], eps, *, name) -> next_hidden [T, H]

``name`` says which projection this is (``"layer3.attention_output"``, ``"layer3.output"``):
TPSP keeps one handle (prepared weights, workspace) per projection, so an adapter may pick
a different op per name; the regular forward only uses it to label its trace spans.

Two implementations:

* :class:`RegularReduceNorm` -- the regular forward: local matmul, ``MPI_Allreduce`` of the
  whole ``[T, H]`` partial, then the fused add + LayerNorm of :mod:`vtnumba.kernels.norm`
  (every rank normalises all T rows).
* :class:`TPSPReduceNorm` -- an adapter around the fused TPSP op (one for every projection,
  or one per projection name, e.g. :class:`vtnumba.tpsp.TPSPOp` objects)
  ``op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=)``
  ``-> (gathered, new_residual)``, which reduce-scatters over *token rows*, normalises only
  its ``R = ceil(T / tp)`` rows, and all-gathers the result.  That op wants the residual
  sharded by token rows (rank r owns rows ``r*R .. r*R+R-1``, zero-padded), so the adapter
  cuts this rank's rows out of the full residual.  In a post-LayerNorm model the normalised
  output *is* the next hidden state (and the next residual), so ``gathered[:T]`` is what
  the adapter returns and the op's ``new_residual`` (the un-normalised sum) is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from vtnumba import trace
from vtnumba.kernels import fused_add_layer_norm
from vtnumba.models._scratch import Scratch

#: How long an MPI exchange may take before it is declared hung (seconds).
DEFAULT_TIMEOUT_S = 120.0


def as_mpi_comm(group):
    """The mpi4py communicator behind ``group`` (``None``, an ``MPI.Comm``, or an object with ``.comm``)."""
    if group is None:
        return None
    comm = getattr(group, "comm", group)
    if not all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "Iallreduce")):
        raise TypeError(f"comm={group!r} is not an mpi4py communicator (nor a group with a .comm that is one)")
    return comm


def _wait(request, timeout_s: float, what: str) -> None:
    """Wait for a non-blocking MPI request, raising instead of hanging past ``timeout_s``
    (:func:`vtnumba.dist.comm.wait_request`: spin on ``Test`` first, then back off to sleeps)."""
    from vtnumba.dist.comm import wait_request

    wait_request(request, None, what, timeout_s)


def _allreduce(comm, buf: np.ndarray, op=None, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "MPI all-reduce") -> np.ndarray:
    """In-place all-reduce of a contiguous numpy array with a timeout (``op`` defaults to SUM)."""
    from mpi4py import MPI

    if not buf.flags.c_contiguous:
        raise ValueError(f"{what}: the buffer must be C-contiguous")
    _wait(comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM if op is None else op), timeout_s, what)
    return buf


class RegularReduceNorm:
    """The regular forward: ``LayerNorm(allreduce(x @ W.T) + bias + residual)`` on every rank.

    ``group`` is ``None`` (one rank, no exchange) or the tensor-parallel group's mpi4py
    communicator.  The all-reduce is traced as ``mpi`` on track ``mpi:<name>``.

    The result lives in one of two reused buffers, alternating: it stays valid through the
    next call (where it is typically the residual) and is overwritten by the one after.
    """

    def __init__(self, group=None, timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "tp"):
        self.comm = as_mpi_comm(group)
        self.tp = 1 if self.comm is None else self.comm.Get_size()
        self.timeout_s = float(timeout_s)
        self.name = name
        self._scratch = Scratch()
        self._flip = 0

    def __call__(self, x_local, w_shard, bias, residual, ln_weight, ln_bias, eps, *, name: str = "row_parallel"):
        T, H = x_local.shape[0], w_shard.shape[0]
        if residual.shape != (T, H):
            raise ValueError(f"residual has shape {residual.shape}; expected ({T}, {H}) (the full hidden state)")
        self._flip ^= 1
        partial = self._scratch.take(f"out{self._flip}", (T, H))
        if np.may_share_memory(partial, residual) or np.may_share_memory(partial, x_local):
            partial = np.empty((T, H), dtype=np.float32)  # a caller kept an older result: do not clobber it
        np.matmul(x_local, w_shard.T, out=partial)  # [T, H]: this rank's share of the K sum
        if self.tp > 1:
            with trace.span(f"allreduce {name}", "mpi", f"mpi:{self.name}", nbytes=partial.nbytes):
                _allreduce(self.comm, partial, timeout_s=self.timeout_s, what=f"all-reduce of a {partial.shape} partial sum")
        # The sum is complete (and identical) on every rank: add bias + residual and normalise in
        # place -- the same fused kernel TPSP runs on its rows.  (z, the un-normalised sum, is
        # not needed after a post-LayerNorm, but the kernel writes it: it re-reads z for the norm.)
        z = self._scratch.take("z", (T, H))
        fused_add_layer_norm(partial, residual, ln_weight, ln_bias, eps, bias=bias, out=partial, new_residual=z)
        return partial


class TPSPReduceNorm:
    """Adapts the fused TPSP op to the ``reduce_norm`` signature.

    ``ops`` is one op for every projection, or a mapping from projection name to op (as
    TPSP keeps a handle per projection).  An op is called as
    ``op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=ln_bias) -> (gathered, new_residual)``
    -- TPSP with LayerNorm, ``gathered`` ``[>= T, H]`` the normalised rows of every rank in
    token order.  ``rank`` and ``tp`` say which token rows this rank owns.

    ``device=True`` (targets ``cuda`` and ``cudasim``, whose TPSP backend takes device arrays):
    the model's host arrays are staged -- activations and the residual shard copied to the
    device on every call, weights once (cached for the model's lifetime), and ``gathered``
    copied back.  The dense math of the model stays on the host either way.
    """

    def __init__(self, ops, rank: int, tp: int, *, device: bool = False):
        if isinstance(ops, Mapping):
            bad = [k for k, op in ops.items() if not callable(op)]
            if not ops or bad:
                raise TypeError(f"ops must map projection names to callable TPSP ops; not callable: {bad or 'empty mapping'}")
        elif not callable(ops):
            raise TypeError(f"ops={ops!r} must be the callable TPSP op (or a mapping name -> op)")
        if not (isinstance(tp, int) and tp >= 1 and isinstance(rank, int) and 0 <= rank < tp):
            raise ValueError(f"rank={rank!r}, tp={tp!r}: expected integers with 0 <= rank < tp")
        self.ops, self.rank, self.tp = ops, rank, tp
        self.device = bool(device)
        self._scratch = Scratch()
        self._flip = 0
        self._on_device: dict[int, tuple[np.ndarray, object]] = {}  # id(host weight) -> (host, device copy)

    def _weight(self, arr):
        if arr is None:
            return None
        hit = self._on_device.get(id(arr))
        if hit is None or hit[0] is not arr:
            from numba import cuda

            # Keeping the host array in the entry keeps its id from being reused by another array.
            hit = (arr, cuda.to_device(np.ascontiguousarray(arr)))
            self._on_device[id(arr)] = hit
        return hit[1]

    def _call_op(self, name, x_local, w_shard, bias, residual_shard, ln_weight, ln_bias, eps):
        op = self.op_for(name)
        if not self.device:
            return op(x_local, w_shard, bias, residual_shard, ln_weight, eps, norm_bias=ln_bias)[0]
        from numba import cuda

        gathered = op(cuda.to_device(np.ascontiguousarray(x_local)), self._weight(w_shard), self._weight(bias),
                      cuda.to_device(residual_shard), self._weight(ln_weight), eps, norm_bias=self._weight(ln_bias))[0]
        return gathered.copy_to_host() if hasattr(gathered, "copy_to_host") else gathered

    def op_for(self, name: str) -> Callable:
        if not isinstance(self.ops, Mapping):
            return self.ops
        try:
            return self.ops[name]
        except KeyError:
            raise ValueError(f"no TPSP op for projection {name!r}; the mapping has {sorted(self.ops)}") from None

    def __call__(self, x_local, w_shard, bias, residual, ln_weight, ln_bias, eps, *, name: str = "row_parallel"):
        T, H = residual.shape
        # The op's second result, the un-normalised residual shard, is not needed after a post-LayerNorm.
        from vtnumba.tpsp.sharding import shard_residual  # the token-row ownership rule lives in tpsp

        gathered = self._call_op(name, x_local, w_shard, bias, shard_residual(residual, self.tp, self.rank),
                                 ln_weight, ln_bias, eps)
        gathered = np.asarray(gathered)
        if gathered.ndim != 2 or gathered.shape[0] < T or gathered.shape[1] != H:
            raise RuntimeError(f"the TPSP op for {name!r} returned gathered of shape {gathered.shape}; expected at least ({T}, {H})")
        # Post-LayerNorm: the normalised rows are the next hidden state (and the next residual).
        # Copied out, because the op may hand back its own workspace, which its next call reuses.
        self._flip ^= 1
        out = self._scratch.take(f"out{self._flip}", (T, H))
        if np.may_share_memory(out, residual):
            out = np.empty((T, H), dtype=np.float32)
        out[...] = gathered[:T]
        return out
