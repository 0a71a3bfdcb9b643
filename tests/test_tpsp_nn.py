"""vtnumba.nn: parallel linears, norms, activations (host vs float64, CUDA kernels on the device target vs host).

(The kernels' PTX compile check is tests/test_kernels_ptx.py; their own tests are
tests/test_kernels_activation.py.)

The device target is numba's CUDA simulator, or the GPU under ``VTNUMBA_TARGET=cuda`` (the
``device_backend`` fixture of tests/conftest.py).

    python -m pytest tests/test_tpsp_nn.py -q
"""

import numpy as np
import pytest

from vtnumba.nn import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    activation,
    add_bias,
    make_norm,
    split_range,
)
from vtnumba.nn.activation import activation_host, add_bias_host

SHAPES = [(1, 1), (1, 7), (7, 33), (33, 65), (65, 7)]


def _act64(x, kind):
    x = x.astype(np.float64)
    if kind == "relu":
        return np.maximum(x, 0)
    if kind == "gelu":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return x / (1 + np.exp(-x))


# ---------------------------------------------------------------------------- splits and linears
@pytest.mark.parametrize("total, parts", [(7, 2), (9, 3), (10, 3), (4, 4), (65, 3)])
def test_split_range_covers_everything_once(total, parts):
    ranges = [split_range(total, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_split_range_errors():
    with pytest.raises(ValueError, match="cannot split"):
        split_range(2, 3, 0)
    with pytest.raises(ValueError, match="index"):
        split_range(6, 3, 3)
    with pytest.raises(TypeError, match="int"):
        split_range(6.0, 3, 0)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_parallel_linears_rebuild_the_full_layer(tp, rng):
    T, K, N = 5, 13, 11
    x = rng.standard_normal((T, K), dtype=np.float32)
    w_full = rng.standard_normal((N, K), dtype=np.float32)
    b_full = rng.standard_normal(N, dtype=np.float32)
    ref = x.astype(np.float64) @ w_full.T.astype(np.float64) + b_full
    cols = [ColumnParallelLinear(K, N, weight=w_full, bias=b_full, tp_size=tp, tp_rank=r) for r in range(tp)]
    np.testing.assert_allclose(np.concatenate([c(x) for c in cols], axis=1), ref, rtol=1e-5, atol=1e-5)
    rows = [RowParallelLinear(K, N, weight=w_full, bias=b_full, tp_size=tp, tp_rank=r) for r in range(tp)]
    partials = [r.partial(np.ascontiguousarray(x[:, r.in_range[0]:r.in_range[1]])) for r in rows]
    np.testing.assert_allclose(sum(p.astype(np.float64) for p in partials) + rows[0].bias, ref, rtol=1e-5, atol=1e-5)
    assert sum(r.input_size_per_partition for r in rows) == K
    assert sum(c.output_size_per_partition for c in cols) == N


def test_random_init_is_identical_across_ranks():
    a = ColumnParallelLinear(8, 6, tp_size=2, tp_rank=0, seed=5)
    b = ColumnParallelLinear(8, 6, tp_size=2, tp_rank=1, seed=5)
    full = ColumnParallelLinear(8, 6, tp_size=1, tp_rank=0, seed=5)
    np.testing.assert_array_equal(np.concatenate([a.weight, b.weight]), full.weight)
    with pytest.raises(ValueError, match="weight has shape"):
        RowParallelLinear(8, 6, weight=np.zeros((8, 6)), tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank"):
        RowParallelLinear(8, 6, tp_size=2, tp_rank=2)


# ---------------------------------------------------------------------------- norms
@pytest.mark.parametrize("rows, h", SHAPES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_modules_match_float64(rows, h, kind, rng):
    norm = make_norm(kind, h, seed=3)
    x = rng.standard_normal((rows, h), dtype=np.float32)
    res = rng.standard_normal((rows, h), dtype=np.float32)
    z = x.astype(np.float64) + res
    if kind == "rms":
        ref = z / np.sqrt((z * z).mean(-1, keepdims=True) + norm.eps) * norm.weight
    else:
        mu = z.mean(-1, keepdims=True)
        ref = (z - mu) / np.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + norm.eps) * norm.weight + norm.bias
    out = np.full((rows, h), np.nan, np.float32)
    new_res = np.full((rows, h), np.nan, np.float32)
    got, got_res = norm(x, res, out=out, new_residual=new_res)
    assert got is out and got_res is new_res
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_res, z, rtol=1e-6, atol=1e-6)


def test_norm_module_errors():
    with pytest.raises(ValueError, match="hidden_size"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        LayerNorm(4, eps=0.0)
    with pytest.raises(ValueError, match="weight has shape"):
        RMSNorm(4, weight=np.ones(5))
    assert RMSNorm(4).norm_type == "rms" and LayerNorm(4).norm_type == "layer" and RMSNorm(4).bias is None


# ---------------------------------------------------------------------------- activations
@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("kind", ["relu", "gelu", "silu"])
def test_activation_host_matches_float64(rows, cols, kind, rng):
    x = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    out = np.full_like(x, np.nan)
    assert activation(x, kind, out=out) is out
    np.testing.assert_allclose(out, _act64(x, kind), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_add_bias_host(rows, cols, rng):
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    b = rng.standard_normal(cols, dtype=np.float32)
    ref = x.astype(np.float64) + b
    add_bias(x, b)
    np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 33), (3, 65)])
@pytest.mark.parametrize("kind", ["relu", "gelu", "silu"])
def test_activation_kernel_matches_host_reference(device_backend, rows, cols, kind, rng):
    x = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    d_out = device_backend.asarray(np.full_like(x, np.nan))
    activation(device_backend.asarray(x), kind, out=d_out)
    host = np.full_like(x, np.nan)
    activation_host(x, {"relu": 0, "gelu": 1, "silu": 2}[kind], host)
    np.testing.assert_allclose(device_backend.to_host(d_out), host, rtol=1e-5, atol=1e-6)


def test_add_bias_kernel_matches_host_reference(device_backend, rng):
    x = rng.standard_normal((7, 33), dtype=np.float32)
    b = rng.standard_normal(33, dtype=np.float32)
    d = device_backend.asarray(x)
    add_bias(d, device_backend.asarray(b))
    host = x.copy()
    add_bias_host(host, b)
    np.testing.assert_allclose(device_backend.to_host(d), host, rtol=1e-6, atol=1e-6)


def test_activation_errors(rng):
    x = rng.standard_normal((2, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="not supported"):
        activation(x, "tanh")
    with pytest.raises(TypeError, match="float32"):
        activation(x.astype(np.float64))
    with pytest.raises(ValueError, match="shape"):
        activation(x, out=np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="columns"):
        add_bias(x, np.zeros(4, np.float32))


def test_device_params_follow_the_input(device_backend, rng):
    lin = ColumnParallelLinear(6, 4, tp_size=1, tp_rank=0, seed=1)
    x = rng.standard_normal((3, 6), dtype=np.float32)
    on_device = lambda: device_backend.to_host(lin(device_backend.asarray(x)))  # noqa: E731
    np.testing.assert_allclose(on_device(), lin(x), rtol=1e-5, atol=1e-5)
    lin.weight = lin.weight * 2  # a new host array drops the stale device copy
    np.testing.assert_allclose(on_device(), lin(x), rtol=1e-5, atol=1e-5)


def test_layers_refuse_sizes_seeds_and_activations_they_cannot_use():
    # (2.5 was truncated to 2, 0 gave a (4, 0) weight, seed=-1 numpy's SeedSequence error, and a
    # bad act= was found only at the first forward; a list input went looking for a GPU.)
    from vtnumba.nn import ColumnParallelLinear, ParallelMLPBlock

    with pytest.raises(TypeError, match="in_features=2.5 must be an int"):
        ColumnParallelLinear(2.5, 4, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="out_features=0"):
        ColumnParallelLinear(4, 0, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="seed=-1 must be a non-negative int"):
        ColumnParallelLinear(4, 6, tp_size=1, tp_rank=0, seed=-1)
    with pytest.raises(ValueError, match="act='nope' is not an activation"):
        ParallelMLPBlock(4, 8, act="nope", tp_size=1, tp_rank=0)
    with pytest.raises(TypeError, match="x must be a numpy array .* got builtins.list"):
        ColumnParallelLinear(4, 6, tp_size=1, tp_rank=0)([[1.0, 2.0, 3.0, 4.0]])
    # bias=1 was read as a bias array of shape () -- an error about shapes, not about the flag
    from vtnumba.nn import ParallelMLPStack

    for bad in (-1, 2.5, True):  # (numpy's SeedSequence errors; True was taken for 1)
        with pytest.raises(ValueError, match=rf"seed={bad!r} must be a non-negative int"):
            ParallelMLPStack(1, 4, 8, tp_size=1, tp_rank=0, seed=bad)
    with pytest.raises(TypeError, match="bias=1 must be True or False"):
        ParallelMLPBlock(4, 8, bias=1, tp_size=1, tp_rank=0)
    with pytest.raises(TypeError, match=r"bias=0\.5 must be True, False, None or an array of out_features=6"):
        ColumnParallelLinear(4, 6, tp_size=1, tp_rank=0, bias=0.5)
    assert ColumnParallelLinear(4, 6, tp_size=1, tp_rank=0, bias=np.arange(6.0)).bias.tolist() == list(range(6))
