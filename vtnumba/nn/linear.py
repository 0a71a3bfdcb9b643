"""Tensor-parallel linear layers: column-parallel (split outputs) and row-parallel (split inputs).

A transformer MLP is ``down(act(up(x)))`` with ``up: H -> F`` and ``down: F -> H``.  Megatron-style
tensor parallelism splits it so that only *one* exchange is needed per MLP:

* :class:`ColumnParallelLinear` (``up``) -- rank ``r`` holds rows ``F_r`` of ``W_up [F, H]``
  (a slice of the *output* features): ``y_r = x @ W_up[F_r].T + b_up[F_r]`` needs the full
  input ``x`` and no communication; its output is feature-sharded.
* :class:`RowParallelLinear` (``down``) -- rank ``r`` holds columns ``F_r`` of ``W_down [H, F]``
  (a slice of the *input* features) and multiplies the feature-sharded activations it
  already has: ``P_r = y_r @ W_down[:, F_r].T`` is a *partial* sum; ``sum_r P_r + b_down`` is
  the layer's output.  That sum is the exchange -- an all-reduce in the regular forward,
  TPSP's reduce-scatter + norm + all-gather when the next norm is fused in.

Splits are as even as possible (:func:`split_range`: the first ``total % parts`` ranks get
one more), so any size works, not only multiples of ``tp``.  Weights use the ``nn.Linear``
layout ``[out_features, in_features]`` and float32.  A module is built from the *full*
weight (``weight=``, identical on every rank) or, without one, from a seeded random
initialisation that is identical on every rank -- then each rank keeps its slice.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import check_int, is_int
from vtnumba.dist.comm import check_group
from vtnumba.kernels import add_bias, linear
from vtnumba.nn._params import Params, check_input, float32_array


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items are split into ``parts`` near-equal parts."""
    for name, v in (("total", total), ("parts", parts), ("index", index)):
        if not is_int(v):
            raise TypeError(f"{name}={v!r} must be an int")
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split total={total} into parts={parts} non-empty parts")
    if not 0 <= index < parts:
        raise ValueError(f"index={index} must be in 0..{parts - 1}")
    base, extra = divmod(int(total), int(parts))
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _tp(tp_size, tp_rank) -> tuple[int, int]:
    if tp_size is None or tp_rank is None:
        from vtnumba.dist import get_tp_group

        g = get_tp_group()
        tp_size = g.size if tp_size is None else tp_size
        tp_rank = g.rank if tp_rank is None else tp_rank
    tp_size = check_int("tp_size", tp_size, min_value=1)
    return tp_size, check_int("tp_rank", tp_rank, min_value=0, max_value=tp_size - 1)


def _full_weight(weight, out_features: int, in_features: int, seed: int) -> np.ndarray:
    if weight is None:
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((out_features, in_features), dtype=np.float32)
                / np.float32(np.sqrt(in_features)))
    w = float32_array("weight", weight)
    if w.shape != (out_features, in_features):
        raise ValueError(f"weight has shape {w.shape}; expected (out_features, in_features) = "
                         f"({out_features}, {in_features})")
    return w


def _full_bias(bias, out_features: int, seed: int) -> np.ndarray | None:
    if bias is None or isinstance(bias, (bool, np.bool_)):
        if not bias:
            return None
        return np.random.default_rng(seed + 1).standard_normal(out_features, dtype=np.float32) * np.float32(0.1)
    if isinstance(bias, (int, float, np.number, str, bytes)):
        raise TypeError(f"bias={bias!r} must be True, False, None or an array of out_features={out_features} values")
    b = float32_array("bias", bias)
    if b.shape != (out_features,):
        raise ValueError(f"bias has shape {b.shape}; expected (out_features,) = ({out_features},)")
    return b


def _features(in_features, out_features, seed) -> tuple[int, int]:
    """The two sizes as positive ints (2.5 is refused, not truncated), and a usable seed."""
    if isinstance(seed, bool) or not is_int(seed) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    return (check_int("in_features", in_features, min_value=1), check_int("out_features", out_features, min_value=1))


def check_layer_group(layer, group) -> None:
    """ValueError unless ``group`` is the tensor-parallel group ``layer`` was built for: a layer
    holding the shard of rank r of tp, summed over a group of another size (or at another
    rank), gives a wrong answer without any error -- e.g. tp_size=1 (the full weight) on 3
    ranks triples it.  (TypeError when ``group`` is not a ProcessGroup at all.)"""
    check_group(group)
    if group.size != layer.tp_size or group.rank != layer.tp_rank:
        raise ValueError(f"{type(layer).__name__} was built for rank {layer.tp_rank} of tp_size={layer.tp_size} "
                         f"but is run on rank {group.rank} of group {group.name!r} with {group.size} ranks; build "
                         "it with this group's tp_size and tp_rank (the default)")


class ColumnParallelLinear(Params):
    """``y_local = x @ W[out slice].T + b[out slice]``; ``x`` is the full input, replicated.

    A contiguous split of the output features is what a plain MLP needs.  A layer whose
    outputs come in groups that must stay together on one rank (attention: whole heads of
    Q, K and V) arranges the *full* weight so that each rank's contiguous slice is one
    whole group -- see :func:`vtnumba.models.minilm.shard_layer`.
    """

    def __init__(self, in_features: int, out_features: int, *, bias=True, weight=None, tp_size=None, tp_rank=None,
                 seed: int = 0):
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.in_features, self.out_features = _features(in_features, out_features, seed)
        lo, hi = split_range(self.out_features, self.tp_size, self.tp_rank)
        self.out_range = (lo, hi)
        full = _full_weight(weight, self.out_features, self.in_features, seed)
        self.weight = np.ascontiguousarray(full[lo:hi])
        fb = _full_bias(bias, self.out_features, seed)
        self.bias = None if fb is None else np.ascontiguousarray(fb[lo:hi])

    @property
    def output_size_per_partition(self) -> int:
        """How many of the output features this rank holds (Megatron's name)."""
        return self.out_range[1] - self.out_range[0]

    def __call__(self, x, out=None, *, add_bias: bool = True):
        """``x [T, in_features] -> [T, output_size_per_partition]`` (into ``out`` when given).

        ``add_bias=False`` leaves the bias out, for a caller that fuses it into the next
        elementwise pass (BERT: bias + GELU, or the QKV bias inside attention); the bias
        in the input's memory is ``self.param("bias", x)``.
        """
        check_input(self, "x", x, self.in_features, "in_features")
        return linear(x, self.param("weight", x), self.param("bias", x) if add_bias else None, out=out)

    def __repr__(self) -> str:
        return (f"ColumnParallelLinear({self.in_features} -> {self.out_features}, rank {self.tp_rank}/{self.tp_size} "
                f"holds outputs {self.out_range[0]}..{self.out_range[1] - 1})")


class RowParallelLinear(Params):
    """``partial = x_local @ W[:, in slice].T``; the sum over ranks plus ``bias`` is the output.

    ``bias`` is the full ``[out_features]`` vector: it must be added *once*, after the sum,
    so :meth:`partial` leaves it out and whoever completes the sum (the all-reduce path, or
    TPSP's reduce + norm) adds it.
    """

    def __init__(self, in_features: int, out_features: int, *, bias=True, weight=None, tp_size=None, tp_rank=None,
                 seed: int = 0):
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.in_features, self.out_features = _features(in_features, out_features, seed)
        lo, hi = split_range(self.in_features, self.tp_size, self.tp_rank)
        self.in_range = (lo, hi)
        full = _full_weight(weight, self.out_features, self.in_features, seed)
        self.weight = np.ascontiguousarray(full[:, lo:hi])
        self.bias = _full_bias(bias, self.out_features, seed)

    @property
    def input_size_per_partition(self) -> int:
        """How many of the input features this rank holds (Megatron's name)."""
        return self.in_range[1] - self.in_range[0]

    def partial(self, x_local, out=None):
        """This rank's partial sum ``x_local @ W_local.T`` (no bias, no communication)."""
        check_input(self, "x_local", x_local, self.input_size_per_partition, "input_size_per_partition")
        return linear(x_local, self.param("weight", x_local), None, out=out)

    def __call__(self, x_local, group=None):
        """The complete output ``sum_r partial_r + bias``, via an MPI all-reduce over ``group``."""
        from vtnumba.dist.comm import agree_on_call
        from vtnumba.tpsp.regular import mpi_all_reduce_

        if group is None:
            from vtnumba.dist import get_tp_group

            group = get_tp_group()
        check_layer_group(self, group)
        if group.size == 1:
            out = self.partial(x_local)
        else:
            # The ranks agree on the token count first: an all-reduce of different lengths
            # returns garbage rows without an error, and a rank refusing its input would leave
            # the others waiting in the all-reduce.
            out = agree_on_call(group, "RowParallelLinear", lambda: self._partial_and_rows(x_local), ("T",))
            mpi_all_reduce_(out, group)
        if self.bias is not None:
            add_bias(out, self.param("bias", out))
        return out

    def _partial_and_rows(self, x_local):
        out = self.partial(x_local)
        return out, (int(out.shape[0]),)

    def __repr__(self) -> str:
        return (f"RowParallelLinear({self.in_features} -> {self.out_features}, rank {self.tp_rank}/{self.tp_size} "
                f"holds inputs {self.in_range[0]}..{self.in_range[1] - 1})")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "check_layer_group", "split_range"]
