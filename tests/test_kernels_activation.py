"""vtnumba.kernels.activation: the host reference vs float64 numpy, the CUDA kernel vs the host reference.

The CUDA kernel runs on the device target (numba's simulator here, the GPU under
``VTNUMBA_TARGET=cuda``: the ``device_backend`` fixture of tests/conftest.py).  Every check
uses fresh random inputs and outputs filled with NaN first, so an element a kernel forgets
to write cannot pass for a right answer.
"""

import math

import numpy as np
import pytest

from vtnumba.backend import CPUBackend
from vtnumba.kernels import ACTIVATIONS, activation, add_bias, bias_gelu_
from vtnumba.kernels.activation import CODES, activation_rows_host, add_bias_host

SHAPES = [(1, 1), (1, 7), (7, 33), (33, 65), (65, 7)]
# The simulator runs ~7,000 GPU threads per second; (3, 101) is 303 elements, more than one
# block of activation_cuda.THREADS = 256 (the grid-stride's second block).
DEVICE_SHAPES = [(1, 1), (7, 33), (3, 65), (3, 101)]
_ERF = np.vectorize(math.erf)


def _act64(v, kind):
    if kind == "relu":
        return np.maximum(v, 0)
    if kind == "gelu":
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
    if kind == "silu":
        return v / (1 + np.exp(-v))
    return 0.5 * v * (1 + _ERF(v / np.sqrt(2.0)))


def _inputs(rng, rows, cols, with_bias):
    x = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    bias = rng.standard_normal(cols).astype(np.float32) if with_bias else None
    return x, bias


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_host_reference_matches_float64(rng, rows, cols, kind, with_bias):
    x, bias = _inputs(rng, rows, cols, with_bias)
    out = np.full_like(x, np.nan)
    assert activation(x, kind, out=out, bias=bias) is out
    # The bias is added in float32 first (as on the GPU and in torch's addmm), then the
    # activation: the reference does the same rounding, the rest in float64.
    v = (x + bias if with_bias else x).astype(np.float64)
    want = _act64(v, kind)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6 * max(1.0, float(np.abs(want).max())))


def test_bias_gelu_is_bert_gelu_in_place(rng):
    x, bias = _inputs(rng, 7, 33, True)
    want = _act64((x + bias).astype(np.float64), "gelu_erf")
    got = x.copy()
    assert bias_gelu_(got, bias) is got
    assert np.abs(got - want).max() <= 2e-6 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("rows, cols", DEVICE_SHAPES)
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_host_reference(device_backend, rng, rows, cols, kind, with_bias):
    x, bias = _inputs(rng, rows, cols, with_bias)
    d_out = device_backend.asarray(np.full_like(x, np.nan))
    got = activation(device_backend.asarray(x), kind, out=d_out,
                     bias=None if bias is None else device_backend.asarray(bias))
    assert got is d_out
    host = np.full_like(x, np.nan)
    activation_rows_host(x, bias, CODES[kind], host)
    # The GPU's tanh / exp / erff and the host's (erf: a float64 polynomial) differ by an ulp or two.
    np.testing.assert_allclose(device_backend.to_host(d_out), host, rtol=1e-5, atol=1e-6)


def test_kernel_in_place_and_allocating(device_backend, rng):
    x, bias = _inputs(rng, 5, 17, True)
    want = np.full_like(x, np.nan)
    activation_rows_host(x, bias, CODES["gelu_erf"], want)
    d = device_backend.asarray(x)
    bias_gelu_(d, device_backend.asarray(bias))  # out is x: each element read before written
    np.testing.assert_allclose(device_backend.to_host(d), want, rtol=1e-5, atol=1e-6)
    fresh = activation(device_backend.asarray(x), "silu")
    assert tuple(fresh.shape) == x.shape
    np.testing.assert_allclose(device_backend.to_host(fresh), _act64(x.astype(np.float64), "silu"),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 33), (3, 101)])
def test_add_bias_host_and_kernel(device_backend, rng, rows, cols):
    x, bias = _inputs(rng, rows, cols, True)
    host = x.copy()
    add_bias_host(host, bias)
    np.testing.assert_allclose(host, x.astype(np.float64) + bias, rtol=1e-6, atol=1e-6)
    d = device_backend.asarray(x)
    assert add_bias(d, device_backend.asarray(bias)) is d
    np.testing.assert_array_equal(device_backend.to_host(d), host)  # one float32 add: exact on both


def test_queue_order_on_the_host(rng):
    backend = CPUBackend()
    q = backend.create_queue("act")
    try:
        x, bias = _inputs(rng, 4, 9, True)
        out = np.full_like(x, np.nan)
        activation(x, "relu", out=out, bias=bias, queue=q)
        backend.synchronize(q)
        np.testing.assert_array_equal(out, np.maximum(x + bias, 0))
    finally:
        backend.destroy_queue(q)
        backend.close()


def test_errors_name_the_argument(device_backend, rng):
    x, _ = _inputs(rng, 2, 3, False)
    with pytest.raises(ValueError, match="kind='tanh' is not supported"):
        activation(x, "tanh")
    with pytest.raises(TypeError, match="x has dtype float64"):
        activation(x.astype(np.float64))
    with pytest.raises(ValueError, match="out has shape"):
        activation(x, out=np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="bias has shape"):
        activation(x, bias=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="bias has 4 entries; x has 3 columns"):
        add_bias(x, np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="must all be numpy arrays or all device arrays"):
        activation(x, out=device_backend.empty((2, 3)))


def test_a_kind_or_an_array_of_the_wrong_type_is_named(rng):
    x = rng.standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"activation kind=\['relu'\] is not supported"):
        activation(x, ["relu"])
    with pytest.raises(TypeError, match=r"x must be a numpy array \(cpu\) or a numba device array .*got None"):
        activation(None, "relu")


def test_a_backend_that_is_not_one_is_named(rng):
    x = rng.standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(TypeError, match="backend must be a vtnumba Backend or None, got int"):
        activation(x, "relu", backend=3)


def test_extreme_inputs_match_between_host_and_device(device_backend):
    # gelu_erf of a large negative x was large and positive on the host (the erf fit overshot
    # -1); relu turned NaN into 0 on both; silu of x < -709 raised in the simulator.
    from vtnumba.kernels import fast_erf

    assert -1.0 <= fast_erf(-4.0) <= 1.0 and fast_erf(-1e30) == -1.0 and fast_erf(1e30) == 1.0
    x = np.array([[-5.0, -10.0, -1e6, -1e30, np.nan, 0.5, -710.0, 3.0]], np.float32)
    ref64 = {"relu": lambda v: np.where(np.isnan(v), np.nan, np.maximum(v, 0)),
             "silu": lambda v: v / (1 + np.exp(np.minimum(-v, 700))),
             "gelu_erf": lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))}
    for kind, ref in ref64.items():
        want = ref(x.astype(np.float64))
        host = activation(x, kind)
        dev = device_backend.to_host(activation(device_backend.asarray(x), kind))
        for got in (host, dev):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=kind)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the simulator's -inf * 0
def test_infinite_inputs_give_what_the_host_and_torch_give(device_backend):
    # silu(-inf) = -inf / (1 + inf) is NaN (so in torch); the device clamped exp's argument for
    # the simulator and gave -inf, and -6e-36 for x = -1000 where the host gives -0.
    x = np.array([[-np.inf, -1000.0, -88.8, -88.7, -20.0, np.inf, np.nan]], np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = {"relu": np.where(np.isnan(x), np.nan, np.maximum(x, 0)), "silu": x / (1 + np.exp(-x))}
    assert np.isnan(want["silu"][0, 0]) and want["silu"][0, 1] == 0 and want["silu"][0, 5] == np.inf
    for kind, w in want.items():
        host = activation(x, kind)
        dev = device_backend.to_host(activation(device_backend.asarray(x), kind))
        for got in (host, dev):
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=0, equal_nan=True, err_msg=kind)
