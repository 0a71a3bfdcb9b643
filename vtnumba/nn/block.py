"""A tensor-parallel MLP block whose down-projection is fused with the next norm -- with or without TPSP.

One block (attention-free, pre-norm style)::

    h          = act(up(x))                       # ColumnParallelLinear: [T, F_local], no exchange
    partial    = h @ W_down_local.T               # RowParallelLinear: partial sum over F
    z          = sum_r partial + b_down + residual  # the exchange completes the sum
    x', res'   = norm(z), z                       # the NEXT norm (the following block's input norm)

The seed pairs ``o_proj``/``down_proj`` with the layernorm that follows them in exactly this
way (:class:`~vtnumba.tpsp.TPSPOpsGroup`): the last three lines are one TPSP call.  Two
forwards, same weights, same result:

* :meth:`ParallelMLPBlock.forward_regular` -- residual *replicated* ``[T, H]`` on every rank;
  MPI all-reduce of the ``[T, H]`` partial; every rank normalises all ``T`` rows;
* :meth:`ParallelMLPBlock.forward_tpsp` -- residual *sharded* by token rows ``[R, H]``;
  one :class:`~vtnumba.tpsp.TPSPOp` call (fused when the profile says so, regular
  reduce-scatter/all-gather otherwise).

:class:`ParallelMLPStack` chains ``L`` blocks after an input norm; ``mpi/tpsp_model.py``
runs it both ways and compares.
"""

from __future__ import annotations

from vtnumba.backend.arrays import is_int
from vtnumba.kernels import ACTIVATIONS
from vtnumba.nn.activation import activation
from vtnumba.nn.linear import ColumnParallelLinear, RowParallelLinear, check_layer_group
from vtnumba.nn.norm import make_norm
from vtnumba.tpsp.config import TPSPOpsGroup
from vtnumba.tpsp.regular import regular_matmul_ar_norm


class ParallelMLPBlock:
    """``up (column-parallel) -> act -> down (row-parallel) + residual -> next norm``."""

    def __init__(self, hidden_size: int, ffn_size: int, *, norm: str = "rms", act: str = "gelu", bias: bool = True,
                 tp_size=None, tp_rank=None, seed: int = 0):
        if not isinstance(act, str) or act not in ACTIVATIONS:  # now, not at the first forward
            raise ValueError(f"act={act!r} is not an activation; expected one of {ACTIVATIONS}")
        if isinstance(seed, bool) or not is_int(seed) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative int")
        if not isinstance(bias, bool):  # (the layers also take a bias array; a block makes its own)
            raise TypeError(f"bias={bias!r} must be True or False (whether the block's projections have biases)")
        self.up = ColumnParallelLinear(hidden_size, ffn_size, bias=bias, tp_size=tp_size, tp_rank=tp_rank,
                                       seed=seed * 10 + 1)
        self.down = RowParallelLinear(ffn_size, hidden_size, bias=bias, tp_size=tp_size, tp_rank=tp_rank,
                                      seed=seed * 10 + 2)
        self.norm = make_norm(norm, hidden_size, seed=seed * 10 + 3)
        self.act = act
        self.hidden_size, self.ffn_size = hidden_size, ffn_size

    def ops_group(self, name: str) -> TPSPOpsGroup:
        """The (projection, norm) pair TPSP fuses: the down-projection and the next norm."""
        return TPSPOpsGroup(name, self.down, self.norm)

    def _hidden(self, x):
        h = self.up(x)
        return activation(h, self.act, out=h)

    def forward_regular(self, x, residual, group):
        """``x [T, H]`` and ``residual [T, H]`` replicated; returns ``(x', residual')``, both ``[T, H]``."""
        check_layer_group(self.down, group)
        h = self._hidden(x)
        d = self.down
        return regular_matmul_ar_norm(group, h, d.param("weight", h), d.param("bias", h), residual,
                                      self.norm.param("weight", h), self.norm.eps, self.norm.param("bias", h),
                                      norm=self.norm.norm_type)

    def forward_tpsp(self, x, residual_shard, op):
        """``x [T, H]`` replicated, ``residual_shard [R, H]``; returns ``(x' [T, H], residual_shard')``."""
        h = self._hidden(x)
        d = self.down
        return op(h, d.param("weight", h), d.param("bias", h), residual_shard, self.norm.param("weight", h),
                  self.norm.eps, self.norm.param("bias", h))


class ParallelMLPStack:
    """An input norm followed by ``layers`` :class:`ParallelMLPBlock` s (random weights, same on every rank)."""

    def __init__(self, layers: int, hidden_size: int, ffn_size: int, *, norm: str = "rms", act: str = "gelu",
                 bias: bool = True, tp_size=None, tp_rank=None, seed: int = 0):
        if not is_int(layers) or layers < 1:
            raise ValueError(f"layers={layers!r} must be a positive int")
        if isinstance(seed, bool) or not is_int(seed) or seed < 0:  # (the blocks get seed * 1000 + ...)
            raise ValueError(f"seed={seed!r} must be a non-negative int")
        self.input_norm = make_norm(norm, hidden_size, seed=seed * 1000 + 7)
        self.blocks = [ParallelMLPBlock(hidden_size, ffn_size, norm=norm, act=act, bias=bias, tp_size=tp_size,
                                        tp_rank=tp_rank, seed=seed * 1000 + 10 + i) for i in range(layers)]

    def ops_groups(self) -> list[TPSPOpsGroup]:
        """One :class:`~vtnumba.tpsp.TPSPOpsGroup` per block (``block{i}.down``): what TPSP opens handles for."""
        return [b.ops_group(f"block{i}.down") for i, b in enumerate(self.blocks)]

    def forward_regular(self, embeddings, group):
        """Returns ``(hidden [T, H], residual [T, H])`` after the last block."""
        x = self.input_norm(embeddings)
        residual = embeddings
        for block in self.blocks:
            x, residual = block.forward_regular(x, residual, group)
        return x, residual

    def forward_tpsp(self, embeddings, residual_shard, ops):
        """``ops``: one :class:`~vtnumba.tpsp.TPSPOp` per block.  Returns ``(hidden [T, H], residual_shard)``."""
        if len(ops) != len(self.blocks):
            raise ValueError(f"got {len(ops)} TPSP ops for {len(self.blocks)} blocks")
        x = self.input_norm(embeddings)
        for block, op in zip(self.blocks, ops, strict=True):
            x, residual_shard = block.forward_tpsp(x, residual_shard, op)
        return x, residual_shard


__all__ = ["ParallelMLPBlock", "ParallelMLPStack"]
