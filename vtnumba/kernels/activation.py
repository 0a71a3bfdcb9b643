"""Elementwise activations with an optional bias: ReLU, GELU (tanh and erf forms), SiLU, and a bias add.

Between a column-parallel up-projection and the row-parallel down-projection of an MLP sits
one elementwise function on the feature-sharded ``[T, F_local]`` activations -- no
communication, so each rank applies it to its own slice.  Two operations cover what the
layers need::

    activation(x, kind, out, bias=None):   out[r, c] = act(x[r, c] + bias[c])
    add_bias(x, bias):                     x[r, c] += bias[c]

The kinds (:data:`ACTIVATIONS`):

* ``relu``     -- ``max(v, 0)``;
* ``gelu``     -- the tanh approximation ``0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))``
  (GPT-2 and many exports);
* ``silu``     -- ``v * sigmoid(v)``;
* ``gelu_erf`` -- BERT's exact GELU ``0.5 v (1 + erf(v / sqrt 2))`` (all-MiniLM-L6-v2 uses it).

The optional ``bias`` is folded in because a projection's bias is followed by the activation
in every MLP: adding it in the same pass saves one read and one write of the whole array
(:func:`bias_gelu_` is BERT's "bias + erf-GELU" in place).

**erf on the host.**  ``math.erf`` per element costs ~18 ns in a numba loop -- 3 M calls per
layer for a batch of 64 sentences would dominate the whole encoder -- so :func:`fast_erf`
evaluates erf with the rational approximation Eigen and XLA use for float32 (odd degree-13
numerator over an even degree-8 denominator on ``[-4, 4]``, +-1 outside), in float64.  Its
error against ``math.erf`` is below 1e-7 everywhere -- about 1.5 float32 ulp of 1, as exact
as a float32 result can be -- and it vectorises (no branches, no ``exp``): ~15x faster than
``math.erf``.  The CUDA kernel calls the GPU's own ``erff`` (libdevice), which is already
fast and accurate to 2 ulp; both agree with float64 to ~1e-7.

**Where it runs** (the one launch pattern, :func:`vtnumba.kernels._common.run`): numpy
arrays run the host reference :func:`activation_rows_host` (one ``@numba.njit`` pass), device
arrays run :func:`vtnumba.kernels.activation_cuda.activation_kernel` (one thread per element).
Both take the same arguments.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from vtnumba.kernels._common import (HOST_JIT, check_array, check_not_partly_overlapping, check_outputs_apart,
                                     common_kind, empty, run)

#: The activation kinds, in the order of their kernel codes (0, 1, 2, 3).
ACTIVATIONS = ("relu", "gelu", "silu", "gelu_erf")
CODES = {name: code for code, name in enumerate(ACTIVATIONS)}
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # the tanh-GELU constant
RSQRT_2 = 1.0 / math.sqrt(2.0)  # erf-GELU: erf(v / sqrt 2)
_F32 = (np.float32,)

# Eigen's / XLA's float32 erf: erf(x) ~= x * P(x^2) / Q(x^2) for |x| <= 4, highest power first.
_A13, _A11, _A9, _A7, _A5, _A3, _A1 = (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
    -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_B8, _B6, _B4, _B2, _B0 = (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
    -1.42647390514189e-02)


# ---------------------------------------------------------------------------- host reference
@numba.njit(**HOST_JIT, inline="always")  # (no "nnan" fast-math flag, numpy's error model: erf(NaN) is NaN)
def fast_erf(x):
    """erf by Eigen's float32 rational approximation, evaluated in float64 (see the module docstring).

    The absolute error is below 1e-7 against ``math.erf``.  Evaluating the same polynomial
    in float32 would be ~1.5x faster but 4x less accurate (3.8e-7).
    """
    z = min(max(np.float64(x), -4.0), 4.0)  # erf is +-1 to float32 precision beyond |x| = 4
    z2 = z * z
    p = z2 * _A13 + _A11
    p = z2 * p + _A9
    p = z2 * p + _A7
    p = z2 * p + _A5
    p = z2 * p + _A3
    p = z2 * p + _A1
    q = z2 * _B8 + _B6
    q = z2 * q + _B4
    q = z2 * q + _B2
    q = z2 * q + _B0
    # The fit overshoots 1 in its last digits at |z| = 4 (-1.00000005): clamped, 1 + erf never
    # goes negative, which made gelu_erf of a large negative x large and positive.
    return min(max(z * p / q, -1.0), 1.0)


@numba.njit(**HOST_JIT, inline="always")
def _act(v, code):
    if code == 0:
        return np.float32(0.0) if v <= 0 else v  # (so NaN stays NaN, as torch.relu keeps it)
    if code == 1:
        c = np.float32(SQRT_2_OVER_PI)
        return np.float32(0.5) * v * (np.float32(1.0) + np.tanh(c * (v + np.float32(0.044715) * v * v * v)))
    if code == 2:
        return v / (np.float32(1.0) + np.exp(-v))
    w = np.float64(v)  # erf-GELU in float64, rounded once: as exact as float32 can hold
    return np.float32(0.5 * w * (1.0 + fast_erf(w * RSQRT_2)))


@numba.njit(**HOST_JIT)
def _activation_rows(x, bias, has_bias, code, out):
    rows, cols = x.shape
    # ``code`` and ``has_bias`` are loop-invariant: LLVM unswitches the loop into one
    # branch-free (and vectorised) copy per case.
    for r in range(rows):
        for c in range(cols):
            v = x[r, c]
            if has_bias:
                v += bias[c]  # rounded to float32 first, as the GPU (and torch's addmm) does
            out[r, c] = _act(v, code)


@numba.njit(**HOST_JIT)
def _activation_rows_in_place(x, bias, has_bias, code):
    # The same loop as _activation_rows with x as its own output.  numba cannot prove that two
    # array arguments do not overlap, so the two-array loop is vectorised behind a run-time
    # overlap check -- which an in-place call (out is x) fails, falling back to the scalar loop,
    # about 4x slower.  One array read and written element by element needs no such check.
    rows, cols = x.shape
    for r in range(rows):
        for c in range(cols):
            v = x[r, c]
            if has_bias:
                v += bias[c]
            x[r, c] = _act(v, code)


@numba.njit(**HOST_JIT)
def add_bias_host(x, bias):
    """``x[r, :] += bias`` for every row (host reference of ``add_bias_kernel``)."""
    rows, cols = x.shape
    for r in range(rows):
        for c in range(cols):
            x[r, c] += bias[c]


_NO_BIAS = np.zeros(0, np.float32)  # numba functions take no None: a placeholder the flag never reads


def activation_rows_host(x, bias, code: int, out) -> None:
    """Host reference of :func:`vtnumba.kernels.activation_cuda.launch_activation` (same arguments,
    minus the stream): ``out = act(x + bias)``, ``bias`` may be None."""
    b = _NO_BIAS if bias is None else bias
    if out is x:
        _activation_rows_in_place(x, b, bias is not None, int(code))
    else:
        _activation_rows(x, b, bias is not None, int(code), out)


def activation_host(x, code: int, out, bias=None) -> None:
    """``out = act(x (+ bias))`` on numpy arrays, ``code`` from :data:`CODES` (host reference)."""
    activation_rows_host(x, bias, code, out)


# ---------------------------------------------------------------------------- public API
def _launch(x, bias, code, out, stream):
    from vtnumba.kernels.activation_cuda import launch_activation  # imports numba.cuda: device arrays only

    launch_activation(x, bias, code, out, stream)


def _launch_add_bias(x, bias, stream):
    from vtnumba.kernels.activation_cuda import launch_add_bias

    launch_add_bias(x, bias, stream)


def activation(x, kind: str = "gelu", out=None, *, bias=None, queue=None, backend=None):
    """``out = act(x + bias)`` for a float32 ``[rows, cols]`` array; returns ``out``.

    ``kind`` is one of :data:`ACTIVATIONS`; ``bias`` (float32 ``[cols]``) may be None;
    ``out`` may be ``x`` (in place: every element is read before it is written, by the same
    thread) and is allocated when None.  numpy arrays run the host reference, device arrays
    the CUDA kernel; with a ``queue`` the work runs in queue order.
    """
    if not isinstance(kind, str) or kind not in CODES:
        raise ValueError(f"activation kind={kind!r} is not supported; expected one of {ACTIVATIONS}")
    kind_of = common_kind({"x": x, "bias": bias, "out": out})
    check_array("x", x, ndim=2, dtypes=_F32)
    rows, cols = (int(s) for s in x.shape)
    if bias is not None:
        check_array("bias", bias, ndim=1, dtypes=_F32, shape=(cols,))
    if out is None:
        out = empty(kind_of, (rows, cols), np.float32)
    check_array("out", out, ndim=2, dtypes=_F32, shape=(rows, cols), writable=True)
    # In place means *the same* bytes (each element read before it is written by one thread);
    # a shifted view would read rows another thread has already overwritten.
    check_not_partly_overlapping("out", out, "x", x)
    check_outputs_apart({"out": out}, {"bias": bias})
    code = CODES[kind]
    run(kind_of, f"activation[{kind}]", queue, backend,
        host_fn=lambda: activation_rows_host(x, bias, code, out),
        launch_fn=lambda stream: _launch(x, bias, code, out, stream),
        bytes=(2 * rows * cols + (cols if bias is not None else 0)) * 4)
    return out


def bias_gelu_(x, bias, *, queue=None, backend=None):
    """In place: ``x = gelu_erf(x + bias)`` -- BERT's FFN activation after the intermediate projection."""
    return activation(x, "gelu_erf", out=x, bias=bias, queue=queue, backend=backend)


def add_bias(x, bias, *, queue=None, backend=None):
    """``x[r, :] += bias`` in place for a float32 ``[rows, cols]`` array; returns ``x``."""
    kind = common_kind({"x": x, "bias": bias})
    check_array("x", x, ndim=2, dtypes=_F32, writable=True)
    cols = int(x.shape[1])
    if getattr(bias, "ndim", None) == 1 and int(bias.shape[0]) != cols:
        raise ValueError(f"bias has {bias.shape[0]} entries; x has {cols} columns")
    check_array("bias", bias, ndim=1, dtypes=_F32, shape=(cols,))
    check_outputs_apart({"x": x}, {"bias": bias})  # (a bias inside x would be added to itself first)
    run(kind, "add_bias", queue, backend,
        host_fn=lambda: add_bias_host(x, bias),
        launch_fn=lambda stream: _launch_add_bias(x, bias, stream),
        bytes=2 * int(x.shape[0]) * cols * 4)
    return x


__all__ = ["ACTIVATIONS", "CODES", "SQRT_2_OVER_PI", "activation", "add_bias", "bias_gelu_", "fast_erf",
           "activation_host", "activation_rows_host", "add_bias_host"]
