"""Elementwise pieces of an MLP block: the activation (ReLU, GELU, SiLU) and a row-broadcast bias add.

Between the column-parallel up-projection and the row-parallel down-projection sits one
elementwise activation on the feature-sharded ``[T, F_local]`` activations -- no
communication, so each rank applies it to its own slice.  Like every kernel in vtnumba it
exists twice with one contract:

* host: ``@numba.njit`` loops (``fastmath`` so they vectorise, ``nogil`` so a threaded
  queue can run them beside other work);
* device: ``@cuda.jit`` kernels, one thread per element, in
  :mod:`vtnumba.nn.activation_cuda` -- imported on the first device array, so the ``cpu``
  target never imports ``numba.cuda``.

``gelu`` is the tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (what
GPT-2 and many BERT exports use); ``silu`` is ``x * sigmoid(x)``.  The functions pick the
implementation from the array type: numpy -> host, numba device array -> kernel.
"""

from __future__ import annotations

import math

import numba
import numpy as np

ACTIVATIONS = ("relu", "gelu", "silu")
_CODES = {"relu": 0, "gelu": 1, "silu": 2}
_THREADS = 256
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
PTX_SIGNATURES = {"activation": "void(float32[:, ::1], int64, float32[:, ::1])",
                  "add_bias": "void(float32[:, ::1], float32[::1])"}


# ---------------------------------------------------------------------------- host references
@numba.njit(nogil=True, fastmath=True, cache=True)
def _act_value(v, code):
    if code == 0:
        return v if v > 0 else np.float32(0.0)
    if code == 1:
        c = np.float32(SQRT_2_OVER_PI)
        return np.float32(0.5) * v * (np.float32(1.0) + np.tanh(c * (v + np.float32(0.044715) * v * v * v)))
    return v / (np.float32(1.0) + np.exp(-v))


@numba.njit(nogil=True, fastmath=True, cache=True)
def activation_host(x, code, out):
    """``out = act(x)`` elementwise over ``[rows, cols]`` (host reference of ``activation_kernel``)."""
    rows, cols = x.shape
    for r in range(rows):
        for c in range(cols):
            out[r, c] = _act_value(x[r, c], code)


@numba.njit(nogil=True, fastmath=True, cache=True)
def add_bias_host(x, bias):
    """``x[r, :] += bias`` for every row (host reference of ``add_bias_kernel``)."""
    rows, cols = x.shape
    for r in range(rows):
        for c in range(cols):
            x[r, c] += bias[c]


# ---------------------------------------------------------------------------- CUDA kernels
def kernel_sources() -> dict:
    """The kernels as plain Python functions (what ``cuda.jit`` compiles; the PTX test uses them)."""
    from vtnumba.nn import activation_cuda

    return {"activation": activation_cuda.activation_kernel.py_func,
            "add_bias": activation_cuda.add_bias_kernel.py_func}


def _kernels() -> dict:
    from vtnumba.nn import activation_cuda

    return {"activation": activation_cuda.activation_kernel, "add_bias": activation_cuda.add_bias_kernel}


def _launch(name: str, n: int, *args) -> None:
    if n == 0:
        return
    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK, simulator_active

    blocks = -(-n // _THREADS)
    if simulator_active():
        with SIM_LAUNCH_LOCK:  # the simulator runs one kernel per process at a time
            _kernels()[name][blocks, _THREADS](*args)
        return
    from numba import cuda

    stream = cuda.default_stream()
    _kernels()[name][blocks, _THREADS, stream](*args)
    stream.synchronize()


# ---------------------------------------------------------------------------- public API
def _check(name: str, arr, ndim: int) -> None:
    if getattr(arr, "ndim", None) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {getattr(arr, 'shape', None)}")
    if np.dtype(arr.dtype) != np.float32:
        raise TypeError(f"{name} has dtype {np.dtype(arr.dtype).name}; expected float32")


def activation(x, kind: str = "gelu", out=None):
    """``act(x)`` for a float32 ``[rows, cols]`` array; ``out`` may be ``x`` (in place).  Returns ``out``."""
    if kind not in _CODES:
        raise ValueError(f"activation kind={kind!r} is not supported; expected one of {ACTIVATIONS}")
    _check("x", x, 2)
    host = isinstance(x, np.ndarray)
    if out is None:
        if host:
            out = np.empty(x.shape, dtype=np.float32)
        else:
            from numba import cuda

            out = cuda.device_array(x.shape, dtype=np.float32)
    _check("out", out, 2)
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected x's {tuple(x.shape)}")
    if isinstance(out, np.ndarray) != host:
        raise TypeError("x and out must both be numpy arrays or both device arrays")
    if host:
        activation_host(x, _CODES[kind], out)
    else:
        _launch("activation", int(x.shape[0]) * int(x.shape[1]), x, _CODES[kind], out)
    return out


def add_bias(x, bias):
    """``x[r, :] += bias`` in place for a float32 ``[rows, cols]`` array; returns ``x``."""
    _check("x", x, 2)
    _check("bias", bias, 1)
    if int(bias.shape[0]) != int(x.shape[1]):
        raise ValueError(f"bias has {bias.shape[0]} entries; x has {x.shape[1]} columns")
    if isinstance(x, np.ndarray) != isinstance(bias, np.ndarray):
        raise TypeError("x and bias must both be numpy arrays or both device arrays")
    if isinstance(x, np.ndarray):
        add_bias_host(x, bias)
    else:
        _launch("add_bias", int(x.shape[0]) * int(x.shape[1]), x, bias)
    return x


__all__ = ["ACTIVATIONS", "activation", "add_bias", "activation_host", "add_bias_host", "kernel_sources",
           "PTX_SIGNATURES", "SQRT_2_OVER_PI"]
