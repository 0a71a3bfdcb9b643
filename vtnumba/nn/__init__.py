"""Small tensor-parallel building blocks on top of :mod:`vtnumba.kernels` and :mod:`vtnumba.tpsp`.

* :mod:`~vtnumba.nn.linear`     -- ColumnParallelLinear, RowParallelLinear (Megatron-style splits);
* :mod:`~vtnumba.nn.norm`       -- RMSNorm, LayerNorm (fused residual add + norm);
* :mod:`~vtnumba.nn.activation` -- ReLU / GELU (tanh, erf) / SiLU and the bias add (the kernels:
  :mod:`vtnumba.kernels.activation`);
* :mod:`~vtnumba.nn.block`      -- ParallelMLPBlock (down-projection paired with the next norm,
  as TPSP fuses them) and ParallelMLPStack.

Weights are numpy arrays; a forward on device arrays uploads them once (:mod:`~vtnumba.nn._params`).
"""

from vtnumba.nn.activation import ACTIVATIONS, activation, add_bias
from vtnumba.nn.block import ParallelMLPBlock, ParallelMLPStack
from vtnumba.nn.linear import ColumnParallelLinear, RowParallelLinear, split_range
from vtnumba.nn.norm import LayerNorm, RMSNorm, make_norm

__all__ = [
    "ACTIVATIONS", "activation", "add_bias", "ParallelMLPBlock", "ParallelMLPStack", "ColumnParallelLinear",
    "RowParallelLinear", "split_range", "LayerNorm", "RMSNorm", "make_norm",
]
