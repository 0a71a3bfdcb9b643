"""CUDA kernels of :mod:`vtnumba.kernels.activation` (imports ``numba.cuda``; loaded on the first device array).

One thread per element of a ``[rows, cols]`` array on a 1-D grid: consecutive threads touch
consecutive columns of a row, so loads and stores coalesce.  Elementwise kernels are bound by
memory bandwidth, not arithmetic, which is why the bias is added in the same pass as the
activation (one read of ``x``, one write of ``out``) instead of in a separate kernel.

Host twins with the same contract: :func:`vtnumba.kernels.activation.activation_rows_host`
and :func:`vtnumba.kernels.activation.add_bias_host`.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from vtnumba.backend.arrays import cdiv

THREADS = 256  # threads per block: a multiple of the warp size, enough to hide memory latency
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # same constants as the host twin
RSQRT_2 = 1.0 / math.sqrt(2.0)


@cuda.jit(device=True)
def act_value(v, code):
    """The activation of one float32 value; ``code`` as :data:`vtnumba.kernels.activation.CODES`."""
    if code == 0:
        return float32(0.0) if v <= float32(0.0) else v  # (NaN stays NaN, as on the host)
    if code == 1:
        inner = float32(SQRT_2_OVER_PI) * (v + float32(0.044715) * v * v * v)
        return float32(0.5) * v * (float32(1.0) + math.tanh(inner))
    if code == 2:
        # Past v = -88.72 float32's exp(-v) is inf, and the quotient -0 -- NaN at v = -inf, as
        # on the host and in torch.  v * 0 is both, and keeps such arguments away from the
        # simulator's math.exp (Python's), which raises OverflowError instead of returning inf.
        if v < float32(-88.72283):
            return v * float32(0.0)
        return v / (float32(1.0) + math.exp(-v))
    # erf-GELU: math.erf on a float32 is libdevice's erff (2 ulp), no host-style polynomial needed.
    return float32(0.5) * v * (float32(1.0) + math.erf(v * float32(RSQRT_2)))


@cuda.jit
def activation_kernel(x, bias, has_bias, code, out):
    """``out[r, c] = act(x[r, c] (+ bias[c]))``, one thread per element."""
    i = cuda.grid(1)
    cols = x.shape[1]
    if i < x.shape[0] * cols:
        r = i // cols
        c = i - r * cols
        v = x[r, c]
        if has_bias:
            v += bias[c]
        out[r, c] = act_value(v, code)


@cuda.jit
def add_bias_kernel(x, bias):
    """``x[r, c] += bias[c]``, one thread per element."""
    i = cuda.grid(1)
    cols = x.shape[1]
    if i < x.shape[0] * cols:
        r = i // cols
        c = i - r * cols
        x[r, c] += bias[c]


def launch_activation(x, bias, code, out, stream) -> None:
    """Launch :func:`activation_kernel` over all of ``x`` (host twin:
    :func:`vtnumba.kernels.activation.activation_rows_host`)."""
    n = int(x.shape[0]) * int(x.shape[1])
    if n == 0:
        return
    # Kernels take no None: an absent bias is replaced by a row of ``out`` (same type), which
    # the has_bias flag guarantees is never read.
    activation_kernel[cdiv(n, THREADS), THREADS, stream](x, out[0] if bias is None else bias, int(bias is not None),
                                                         int(code), out)


def launch_add_bias(x, bias, stream) -> None:
    """Launch :func:`add_bias_kernel` (host twin: :func:`vtnumba.kernels.activation.add_bias_host`)."""
    n = int(x.shape[0]) * int(x.shape[1])
    if n == 0:
        return
    add_bias_kernel[cdiv(n, THREADS), THREADS, stream](x, bias)


_V = "float32[::1]"
_M = "float32[:, ::1]"
PTX_SIGNATURES = [
    ("activation", activation_kernel, f"void({_M}, {_V}, int64, int64, {_M})"),
    ("add_bias", add_bias_kernel, f"void({_M}, {_V})"),
]
