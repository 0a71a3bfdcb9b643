"""The activation between a column-parallel and a row-parallel projection, as the nn layers use it.

Between the column-parallel up-projection and the row-parallel down-projection sits one
elementwise activation on the feature-sharded ``[T, F_local]`` activations -- no
communication, so each rank applies it to its own slice (:class:`~vtnumba.nn.block.ParallelMLPBlock`).

The kernels themselves -- host references and ``@cuda.jit`` twins, ReLU / GELU (tanh and
erf) / SiLU with an optional fused bias, and the bias add -- live with the other kernels in
:mod:`vtnumba.kernels.activation`; this module gives the layers their names for them.  They
pick the implementation from the array type: numpy -> host, numba device array -> kernel.
"""

from __future__ import annotations

from vtnumba.kernels.activation import (
    ACTIVATIONS,
    SQRT_2_OVER_PI,
    activation,
    activation_host,
    add_bias,
    add_bias_host,
)

__all__ = ["ACTIVATIONS", "activation", "add_bias", "activation_host", "add_bias_host", "SQRT_2_OVER_PI"]
