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
