"""CUDA kernels of :mod:`vtnumba.nn.activation` (imports ``numba.cuda``; loaded on the first device array).

One thread per element of a ``[rows, cols]`` array on a 1-D grid: consecutive threads touch
consecutive columns, so loads and stores coalesce.  Host twins (same contract):
:func:`vtnumba.nn.activation.activation_host`, :func:`vtnumba.nn.activation.add_bias_host`.
"""

from __future__ import annotations

import math

from numba import cuda, float32

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # the tanh-GELU constant (same value as the host twin's)


@cuda.jit
def activation_kernel(x, code, out):
    """``out[r, c] = act(x[r, c])``: code 0 = ReLU, 1 = GELU (tanh form), 2 = SiLU."""
    i = cuda.grid(1)
    cols = x.shape[1]
    if i < x.shape[0] * cols:
        r = i // cols
        c = i - r * cols
        v = x[r, c]
        if code == 0:
            y = v if v > float32(0.0) else float32(0.0)
        elif code == 1:
            y = float32(0.5) * v * (float32(1.0) + math.tanh(float32(SQRT_2_OVER_PI)
                                                             * (v + float32(0.044715) * v * v * v)))
        else:
            y = v / (float32(1.0) + math.exp(-v))
        out[r, c] = y


@cuda.jit
def add_bias_kernel(x, bias):
    """``x[r, c] += bias[c]``."""
    i = cuda.grid(1)
    cols = x.shape[1]
    if i < x.shape[0] * cols:
        r = i // cols
        c = i - r * cols
        x[r, c] += bias[c]
