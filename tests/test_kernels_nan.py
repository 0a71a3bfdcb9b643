"""A NaN in a row comes out as NaN -- on the host as on a GPU -- and a norm over zero elements is refused.

The host references are compiled with fast-math reassociation (so their float32 sums
vectorise) but not with "no NaNs": one poisoned row must stay one poisoned row, not raise
ZeroDivisionError from inside a queued kernel (inside TPSP that aborted every rank), and the
other rows must be untouched.
"""

import numpy as np
import pytest

from vtnumba.kernels import fused_add_layer_norm, fused_add_rms_norm, peer_reduce_norm

# The simulator runs the kernels as numpy scalar code, which warns about the NaN arithmetic
# it is asked to do; that arithmetic is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(params=["cpu", "device"])
def arrays(request, device_backend_factory):
    if request.param == "cpu":
        return lambda a: a, lambda a: a
    be = device_backend_factory()
    return be.asarray, be.to_host


@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_poisoned_row_propagates_and_the_others_are_exact(rng, arrays, poison, norm):
    to, back = arrays
    rows, h = 5, 33
    y = rng.standard_normal((rows, h)).astype(np.float32)
    res = rng.standard_normal((rows, h)).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    clean_out, _ = (fused_add_rms_norm(y, res, w, 1e-5) if norm == "rms" else
                    fused_add_layer_norm(y, res, w, b, 1e-5))
    y[2, 7] = poison
    args = [to(a) for a in (y, res, w)]
    out, new_res = (fused_add_rms_norm(*args, 1e-5) if norm == "rms" else
                    fused_add_layer_norm(args[0], args[1], args[2], to(b), 1e-5))
    out, new_res = back(out), back(new_res)
    if np.isnan(poison):
        assert np.isnan(out[2]).all(), "a NaN makes the whole row's statistics NaN"
    else:  # inf: the row's rsqrt is 0, so inf * 0 = NaN where the inf was (as IEEE says, on a GPU too)
        assert not np.isfinite(out[2]).all()
    keep = [0, 1, 3, 4]
    np.testing.assert_allclose(out[keep], clean_out[keep], rtol=2e-5, atol=2e-6)
    assert np.isfinite(new_res[keep]).all()


def test_peer_reduce_propagates_a_nan_from_one_source(rng, arrays):
    to, back = arrays
    R, h = 4, 17
    srcs = [rng.standard_normal((R, h)).astype(np.float32) for _ in range(3)]
    srcs[1][3, 0] = np.nan
    w = rng.standard_normal(h).astype(np.float32)
    out, new_res = to(np.full((R, h), 7.0, np.float32)), to(np.full((R, h), 7.0, np.float32))
    peer_reduce_norm([to(s) for s in srcs], None, None, to(w), None, 1e-6, out, new_res)
    out = back(out)
    assert np.isnan(out[3]).all() and np.isfinite(out[:3]).all()


def test_a_norm_over_zero_elements_is_refused_with_the_shape():
    y = np.zeros((3, 0), np.float32)
    with pytest.raises(ValueError, match=r"y has shape \(3, 0\).*H >= 1"):
        fused_add_rms_norm(y, None, np.zeros(0, np.float32), 1e-5)
    with pytest.raises(ValueError, match=r"sources\[0\] has shape \(3, 0\)"):
        peer_reduce_norm([y], None, None, np.zeros(0, np.float32), None, 1e-5, y.copy(), y.copy())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the simulator's numpy scalars)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_row_whose_sum_of_squares_overflows_matches_the_gpu(arrays, norm):
    # rsqrt(inf) is 0 on a GPU; the host's fast-math division gave NaN for the whole row, even
    # for a row of finite values whose squares overflow float32.
    to, back = arrays
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    for row, want in (([3e19, 3e19, 3e19, 3e19], [0, 0, 0, 0]), ([np.inf, 1, 2, 3], [np.nan, 0, 0, 0])):
        y = np.array([row], np.float32)
        if norm == "layer" and np.isinf(row[0]):
            continue  # (the mean itself is inf: every element is NaN, on a GPU too)
        out, _ = (fused_add_rms_norm(to(y), None, to(w), 1e-5) if norm == "rms" else
                  fused_add_layer_norm(to(y * np.float32([1, -1, 1, -1])), None, to(w), to(b), 1e-5))
        np.testing.assert_array_equal(back(out)[0], np.float32(want))


@pytest.mark.parametrize("eps", [1e-46, 1e39, 10 ** 400], ids=["1e-46", "1e39", "10**400"])
def test_an_eps_float32_cannot_hold_is_refused(eps):
    # 1e-46 is 0 in float32 and 1e39 is inf: a constant row came out NaN; 10**400 raised an
    # OverflowError that named nothing.
    with pytest.raises(ValueError, match=r"eps=.* must be a positive finite float that float32 can hold"):
        fused_add_rms_norm(np.ones((1, 3), np.float32), None, np.ones(3, np.float32), eps)
