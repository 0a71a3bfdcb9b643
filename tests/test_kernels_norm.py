"""Fused residual add + RMSNorm / LayerNorm: CUDA kernel on the device target, host reference, bad input.

The device target is numba's CUDA simulator, or the GPU under ``VTNUMBA_TARGET=cuda`` (see
tests/conftest.py): inputs go in with ``device_backend.asarray``, NaN-poisoned outputs too,
and results come back with ``device_backend.to_host``.
"""

import numpy as np
import pytest

from vtnumba.backend.cpu import CPUBackend
from vtnumba.kernels import add_norm_rows_host, fused_add_layer_norm, fused_add_rms_norm

EPS = 1e-5


def nans(shape):
    return np.full(shape, np.nan, np.float32)


def rel_err(out, ref):
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(np.asarray(out, dtype=np.float64) - ref) / np.linalg.norm(ref)


def make(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference(y, residual, weight, eps, bias=None, norm_bias=None, layer=False):
    """float64 numpy, the textbook formulas."""
    z = y.astype(np.float64)
    if bias is not None:
        z = z + bias
    if residual is not None:
        z = z + residual
    if layer:
        mu = z.mean(-1, keepdims=True)
        out = (z - mu) / np.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + eps) * weight
        if norm_bias is not None:
            out = out + norm_bias
    else:
        out = z / np.sqrt((z * z).mean(-1, keepdims=True) + eps) * weight
    return out, z


def inputs(rng, R, H, *, bias=True, residual=True, norm_bias=True):
    return dict(y=make(rng, (R, H)), residual=make(rng, (R, H)) if residual else None, weight=make(rng, H),
                bias=make(rng, H) if bias else None, norm_bias=make(rng, H) if norm_bias else None)


def call(layer, arrs, out, new_residual, wrap=lambda a: a, **kw):
    """The fused norm on ``wrap``ped inputs; ``out``/``new_residual`` are already of the right kind."""
    w = {k: wrap(v) for k, v in arrs.items()}
    if layer:
        return fused_add_layer_norm(w["y"], w["residual"], w["weight"], w["norm_bias"], EPS, bias=w["bias"],
                                    out=out, new_residual=new_residual, **kw)
    return fused_add_rms_norm(w["y"], w["residual"], w["weight"], EPS, bias=w["bias"], out=out,
                              new_residual=new_residual, **kw)


# (R, H): 1, 7, 33, 65 rows and columns, plus H=300 > block size (threads stride the row).
DEVICE_SHAPES = [(1, 65), (7, 33), (33, 7), (65, 1), (2, 300)]


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("R,H", DEVICE_SHAPES)
def test_kernel_matches_float64_on_the_device(dev, host, rng, R, H, layer):
    arrs = inputs(rng, R, H, norm_bias=layer)
    d_out, d_new_res = dev(nans((R, H))), dev(nans((R, H)))
    call(layer, arrs, d_out, d_new_res, dev)
    out, new_res = host(d_out), host(d_new_res)
    assert np.isfinite(out).all() and np.isfinite(new_res).all()
    ref, z = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"], arrs["norm_bias"], layer)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(new_res, z) <= 1e-6


# (R, H, wide, layer): H = 31, 129, 8195 are not multiples of 4 (quads element by element, a
# partial last quad); 64, 1000 and 8200 take the 128-bit path; 8195 and 8200 are longer than a
# block caches in registers (256 threads x CACHE_QUADS x 4 = 8192), so their ends stream
# through memory.
ROW_CASES = [(3, 31, False, True), (2, 129, False, False), (2, 1000, True, True), (3, 64, True, False),
             (1, 8195, False, False), (1, 8200, True, True)]


@pytest.mark.parametrize("R,H,wide,layer", ROW_CASES)
def test_kernel_odd_wide_and_long_rows(dev, host, rng, R, H, wide, layer):
    from vtnumba.kernels._wide_cuda import wide_ok

    arrs = inputs(rng, R, H, norm_bias=layer)
    d = {k: dev(v) for k, v in arrs.items()}
    d_out, d_new_res = dev(nans((R, H))), dev(nans((R, H)))
    assert wide_ok(*d.values(), d_out, d_new_res) == wide  # the case takes the path it is meant to
    call(layer, d, d_out, d_new_res)
    h_out, h_new_res = call(layer, arrs, nans((R, H)), nans((R, H)))  # the host reference, the spec
    out, new_res = host(d_out), host(d_new_res)
    assert np.isfinite(out).all() and np.isfinite(new_res).all()
    assert rel_err(out, h_out) <= 1e-5 and rel_err(new_res, h_new_res) <= 1e-6
    ref, _ = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"], arrs["norm_bias"], layer)
    assert rel_err(out, ref) <= 1e-5


def test_kernel_misaligned_views_and_in_place_on_the_wide_path(dev, host, rng):
    # y starting one float past an aligned address: the launcher must fall back to scalar
    # accesses; and the residual updated in place while every array allows 128-bit accesses.
    from vtnumba.kernels._wide_cuda import wide_ok

    R, H = 3, 64
    arrs = inputs(rng, R, H, norm_bias=False)
    ref, z = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"])
    flat = dev(np.concatenate([[0.0], arrs["y"].ravel()]).astype(np.float32))
    y_view = flat[1:].reshape(R, H)
    d_res, d_out = dev(arrs["residual"]), dev(nans((R, H)))
    assert not wide_ok(y_view) and wide_ok(d_res, d_out)
    fused_add_rms_norm(y_view, d_res, dev(arrs["weight"]), EPS, bias=dev(arrs["bias"]), out=d_out,
                       new_residual=dev(nans((R, H))))
    assert rel_err(host(d_out), ref) <= 1e-5
    d_out = dev(nans((R, H)))
    fused_add_rms_norm(dev(arrs["y"]), d_res, dev(arrs["weight"]), EPS, bias=dev(arrs["bias"]), out=d_out,
                       new_residual=d_res)
    assert rel_err(host(d_out), ref) <= 1e-5 and rel_err(host(d_res), z) <= 1e-6


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_kernel_optional_arguments_and_in_place(dev, host, rng, layer):
    # No bias, no norm_bias, no residual ...
    arrs = inputs(rng, 7, 33, bias=False, residual=False, norm_bias=False)
    d_out, d_new_res = dev(nans((7, 33))), dev(nans((7, 33)))
    call(layer, arrs, d_out, d_new_res, dev)
    ref, z = reference(arrs["y"], None, arrs["weight"], EPS, layer=layer)
    assert rel_err(host(d_out), ref) <= 1e-5 and rel_err(host(d_new_res), z) <= 1e-6
    # ... and the residual stream updated in place (new_residual is residual).
    arrs = inputs(rng, 7, 33, norm_bias=layer)
    ref, z = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"], arrs["norm_bias"], layer)
    d_res, d_out = dev(arrs["residual"]), dev(nans((7, 33)))
    w = {k: dev(v) for k, v in arrs.items() if k != "residual"}
    if layer:
        fused_add_layer_norm(w["y"], d_res, w["weight"], w["norm_bias"], EPS, bias=w["bias"], out=d_out,
                             new_residual=d_res)
    else:
        fused_add_rms_norm(w["y"], d_res, w["weight"], EPS, bias=w["bias"], out=d_out, new_residual=d_res)
    assert rel_err(host(d_out), ref) <= 1e-5 and rel_err(host(d_res), z) <= 1e-6


def test_kernel_allocates_outputs_and_matches_host(dev, host, rng):
    arrs = inputs(rng, 7, 65, norm_bias=True)
    d_out, d_res = fused_add_layer_norm(dev(arrs["y"]), dev(arrs["residual"]), dev(arrs["weight"]),
                                        dev(arrs["norm_bias"]), EPS, bias=dev(arrs["bias"]))
    h_out, h_res = fused_add_layer_norm(arrs["y"], arrs["residual"], arrs["weight"], arrs["norm_bias"], EPS,
                                        bias=arrs["bias"])
    assert isinstance(h_out, np.ndarray) and not isinstance(d_out, np.ndarray)
    assert rel_err(host(d_out), h_out) <= 1e-5
    assert rel_err(host(d_res), h_res) <= 1e-6


def test_row_range_contract_leaves_other_rows(dev, host, rng):
    # add_norm_rows_host / the kernel take a row range; rows outside it keep their contents.
    R, H = 9, 33
    arrs = inputs(rng, R, H)
    sentinel = np.float32(7.25)
    for kind in ("host", "cuda"):
        out, new_res = np.full((R, H), sentinel), np.full((R, H), sentinel)
        if kind == "host":
            add_norm_rows_host(arrs["y"], arrs["bias"], arrs["residual"], arrs["weight"], None, EPS, False, out,
                               new_res, 3, 6)
        else:
            from vtnumba.backend.cuda import SIM_LAUNCH_LOCK
            from vtnumba.kernels.norm_cuda import launch_add_norm_rows

            d_out, d_new_res = dev(out), dev(new_res)
            with SIM_LAUNCH_LOCK:  # a raw launch: the simulator runs one at a time per process
                launch_add_norm_rows(dev(arrs["y"]), dev(arrs["bias"]), dev(arrs["residual"]), dev(arrs["weight"]),
                                     None, EPS, False, d_out, d_new_res, 3, 6, 0)
            out, new_res = host(d_out), host(d_new_res)
        ref, z = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"])
        assert rel_err(out[3:6], ref[3:6]) <= 1e-5, kind
        assert rel_err(new_res[3:6], z[3:6]) <= 1e-6, kind
        assert (out[:3] == sentinel).all() and (out[6:] == sentinel).all(), kind
        assert (new_res[:3] == sentinel).all() and (new_res[6:] == sentinel).all(), kind


# ---------------------------------------------------------------------------- host reference
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("R,H", [(2048, 1024), (256, 4096), (33, 384)])
def test_host_reference_realistic(rng, R, H, layer):
    arrs = inputs(rng, R, H, norm_bias=layer)
    out, new_res = np.full((R, H), np.nan, np.float32), np.full((R, H), np.nan, np.float32)
    call(layer, arrs, out, new_res)
    ref, z = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"], arrs["norm_bias"], layer)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(new_res, z) <= 1e-6


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("h", [1, 7, 33, 1001])
def test_streaming_stores_match_plain_stores(rng, h, offset):
    # Large outputs are written with non-temporal stores (scalar head up to a 32-byte boundary,
    # 8-float vectors, scalar tail); check every alignment and tail against the plain path.
    from vtnumba.kernels.norm import _add_norm_rows

    R = 5
    y, res, w, nb = make(rng, (R, h)), make(rng, (R, h)), make(rng, h), make(rng, h)
    outs = []
    for stream in (False, True):
        flat = np.full(2 * R * h + offset + 16, np.nan, np.float32)
        out = flat[offset:offset + R * h].reshape(R, h)  # C-contiguous, deliberately misaligned
        new_res = flat[offset + R * h:offset + 2 * R * h].reshape(R, h)
        _add_norm_rows(y, nb, True, res, True, w, nb, True, EPS, True, out, new_res, 0, R, stream)
        assert np.isfinite(flat[offset:offset + 2 * R * h]).all()
        assert np.isnan(flat[:offset]).all() and np.isnan(flat[offset + 2 * R * h:]).all()
        outs.append((out.copy(), new_res.copy()))
    # new_residual is a plain sum: bit for bit the same.  out goes through the norm's
    # reductions, which fastmath lets the compiler round differently in the streaming and the
    # plain version of the loop (a few float32 ulps of the row's scale, in some processes);
    # a store in the wrong place, or a missed one, is off by O(1) or NaN.
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert rel_err(outs[1][0], outs[0][0]) <= 1e-6


def test_streaming_stores_fall_back_on_rows_not_4_byte_aligned(rng):
    # float32 rows at an odd byte address (np.frombuffer at an offset) can never reach a 32-byte
    # boundary in whole floats: the streaming path must use plain stores there -- a misaligned
    # non-temporal vector store is a crash (SIGSEGV/SIGBUS), not a slow store.
    from vtnumba.kernels.norm import _add_norm_rows

    R, h = 3, 41
    y, res, w, nb = make(rng, (R, h)), make(rng, (R, h)), make(rng, h), make(rng, h)
    outs = []
    for stream in (False, True):
        raw = np.zeros(2 * R * h * 4 + 1, np.uint8)
        out = np.frombuffer(raw.data, np.float32, R * h, offset=1).reshape(R, h)
        new_res = np.frombuffer(raw.data, np.float32, R * h, offset=1 + R * h * 4).reshape(R, h)
        assert not out.flags.aligned and out.flags.writeable
        _add_norm_rows(y, nb, True, res, True, w, nb, True, EPS, True, out, new_res, 0, R, stream)
        outs.append((out.copy(), new_res.copy()))
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert rel_err(outs[1][0], outs[0][0]) <= 1e-6
    np.testing.assert_allclose(outs[1][1], y + nb + res, rtol=1e-6)


@pytest.mark.parametrize("R,H", [(7, 33), (1024, 2048)])  # plain and streaming stores
def test_host_fully_in_place(rng, R, H):
    # out may be y and new_residual may be residual: row r is read completely before it is written.
    arrs = inputs(rng, R, H)
    ref, z = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"], arrs["norm_bias"], True)
    y, res = arrs["y"], arrs["residual"]
    fused_add_layer_norm(y, res, arrs["weight"], arrs["norm_bias"], EPS, bias=arrs["bias"], out=y, new_residual=res)
    assert rel_err(y, ref) <= 1e-5 and rel_err(res, z) <= 1e-6


def test_split_rows_covers_the_range_once_and_raises_errors(monkeypatch):
    from vtnumba.kernels import _common

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert _common.host_threads() == 3
    seen = []
    _common.split_rows(lambda a, b: seen.append((a, b)), 5, 12, nbytes=_common.PARALLEL_MIN_BYTES)
    assert sorted(seen) == [(5, 7), (7, 9), (9, 12)]  # contiguous, disjoint, all of [5, 12)
    seen.clear()
    _common.split_rows(lambda a, b: seen.append((a, b)), 5, 12, nbytes=_common.PARALLEL_MIN_BYTES - 1)
    assert seen == [(5, 12)]  # small calls stay on the calling thread

    import threading
    import time

    finished = []

    def fail_early_finish_late(a, b):
        if a == 7:
            raise RuntimeError(f"rows {a}..{b}")
        if a == 9:
            time.sleep(0.2)  # still writing when the range before it has failed
        finished.append((a, threading.get_ident()))

    # The first error in range order is raised, and only once every range has finished: no
    # thread may still be writing the caller's arrays after the call returned.
    with pytest.raises(RuntimeError, match=r"rows 7\.\.9"):
        _common.split_rows(fail_early_finish_late, 5, 12, nbytes=_common.PARALLEL_MIN_BYTES)
    assert sorted(a for a, _ in finished) == [5, 9]
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")  # (an explicit BLAS setting of any of the three wins)
    assert _common.host_threads() == 2


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_host_rows_split_over_threads_match_one_thread(rng, monkeypatch, layer):
    # Rows are independent: two threads give the one-thread result bit for bit.
    R, H = 512, 2048  # 8 MiB written: large enough to be split, and streamed
    arrs = inputs(rng, R, H, norm_bias=layer)
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", threads)
        results.append(call(layer, arrs, nans((R, H)), nans((R, H))))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_host_layer_norm_with_large_mean(rng):
    # var = mean((z - mean)^2), not E[z^2] - mean^2: the latter loses every digit here.
    y = (1000.0 + rng.standard_normal((16, 512))).astype(np.float32)
    weight = make(rng, 512)
    out, _ = fused_add_layer_norm(y, None, weight, None, EPS)
    ref, _ = reference(y, None, weight, EPS, layer=True)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("eps", [1e-45, 1e-40, 1.1e-38, 1e-30])
@pytest.mark.parametrize("scale", [0.0, 1e-20, 1e-10])
def test_tiny_rows_and_an_eps_below_float32s_normals(rng, scale, eps):
    # check_eps accepts eps down to float32's smallest subnormal.  mean(z^2) + eps below the
    # smallest normal (1.2e-38) went through the fast-math reciprocal square root, which takes
    # subnormals for 0: RMSNorm gave -inf, LayerNorm of a constant row NaN.
    from vtnumba.kernels import peer_reduce_norm

    y = (scale * (1.0 + rng.random((3, 8)))).astype(np.float32)
    y[2] = np.float32(scale)  # a constant row: LayerNorm's variance is exactly 0
    weight = (1.0 + rng.random(8)).astype(np.float32)
    for layer in (False, True):
        ref, _ = reference(y, None, weight, eps, layer=layer)
        norm = fused_add_layer_norm(y, None, weight, None, eps)[0] if layer else \
            fused_add_rms_norm(y, None, weight, eps)[0]
        out, new_res = nans(y.shape), nans(y.shape)
        peer_reduce_norm([y * 0.5, y * 0.5], None, None, weight, None, eps, out, new_res,
                         norm="layer" if layer else "rms")
        for got in (norm, out):
            assert np.isfinite(got).all(), (layer, got)
            # (z^2 of 1e-20 is itself subnormal in float32, with ~4 digits: float32's limit, on a GPU too)
            np.testing.assert_allclose(got, ref, rtol=2e-5 if scale != 1e-20 else 1e-3, atol=1e-6)


def test_threaded_queue_runs_host_reference(rng):
    backend = CPUBackend(threaded=True)
    q = backend.create_queue("norm")
    arrs = inputs(rng, 64, 256, norm_bias=False)
    out, new_res = np.full((64, 256), np.nan, np.float32), np.full((64, 256), np.nan, np.float32)
    call(False, arrs, out, new_res, queue=q)
    backend.synchronize(q)
    ref, _ = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"])
    assert rel_err(out, ref) <= 1e-5
    backend.destroy_queue(q)
    backend.close()


def test_cuda_queue_on_the_device(device_backend, dev, host, rng):
    backend = device_backend
    q = backend.create_queue("norm")
    arrs = inputs(rng, 3, 40, norm_bias=False)
    d_out, d_new_res = dev(nans((3, 40))), dev(nans((3, 40)))
    call(False, arrs, d_out, d_new_res, dev, queue=q)
    backend.synchronize(q)
    ref, _ = reference(arrs["y"], arrs["residual"], arrs["weight"], EPS, arrs["bias"])
    assert rel_err(host(d_out), ref) <= 1e-5
    backend.destroy_queue(q)


# ---------------------------------------------------------------------------- bad input
def test_outputs_that_overlap_without_being_in_place_are_refused(dev, rng):
    """Only the identity was tested: two views of one buffer (out=buf[:], new_residual=buf[:])
    or an output one row off its input passed and gave a wrong result."""
    y, res, w = make(rng, (4, 8)), make(rng, (4, 8)), make(rng, 8)
    for wrap in (lambda a: a, dev):
        buf = wrap(np.empty((5, 8), np.float32))
        yd, rd, wd = wrap(y), wrap(res), wrap(w)
        with pytest.raises(ValueError, match=r"out and new_residual share the same memory"):
            fused_add_rms_norm(yd, rd, wd, EPS, out=buf[:4], new_residual=buf[:4])
        with pytest.raises(ValueError, match=r"out and new_residual share overlapping memory \(96 bytes\)"):
            fused_add_rms_norm(yd, rd, wd, EPS, out=buf[:4], new_residual=buf[1:5])
        shifted = wrap(np.concatenate([res, res[:1]]))  # residual's rows, then one more
        with pytest.raises(ValueError, match=r"new_residual and residual share overlapping memory"):
            fused_add_rms_norm(yd, shifted[:4], wd, EPS, new_residual=shifted[1:5])
        with pytest.raises(ValueError, match=r"out and y share overlapping memory"):
            fused_add_layer_norm(shifted[1:5], rd, wd, None, EPS, out=shifted[:4])
        # ... while a view of the very same rows is in place, which is allowed
        inplace = wrap(res.copy())
        fused_add_rms_norm(yd, inplace[:], wd, EPS, new_residual=inplace)


def test_bad_inputs_name_the_argument(dev, rng):
    y, res, w = make(rng, (4, 8)), make(rng, (4, 8)), make(rng, 8)
    with pytest.raises(ValueError, match=r"residual has shape \(4, 7\); expected \(4, 8\)"):
        fused_add_rms_norm(y, make(rng, (4, 7)), w, EPS)
    with pytest.raises(ValueError, match=r"weight has shape \(9,\); expected \(8,\)"):
        fused_add_rms_norm(y, res, make(rng, 9), EPS)
    with pytest.raises(TypeError, match=r"y has dtype float64; expected float32"):
        fused_add_rms_norm(y.astype(np.float64), res, w, EPS)
    with pytest.raises(ValueError, match=r"y \(shape \(4, 4\)\) must be C-contiguous"):
        fused_add_rms_norm(y[:, ::2], None, make(rng, 4), EPS)
    with pytest.raises(ValueError, match=r"eps=0.0 must be a positive finite float"):
        fused_add_rms_norm(y, res, w, 0.0)
    with pytest.raises(TypeError, match=r"eps='1e-5' must be a float"):
        fused_add_rms_norm(y, res, w, "1e-5")
    with pytest.raises(ValueError, match=r"norm_bias has shape \(3,\)"):
        fused_add_layer_norm(y, res, w, make(rng, 3), EPS)
    with pytest.raises(ValueError, match=r"out and new_residual share the same memory; expected different memory"):
        same = np.empty((4, 8), np.float32)
        fused_add_rms_norm(y, res, w, EPS, out=same, new_residual=same)
    with pytest.raises(ValueError, match=r"new_residual has shape \(3, 8\)"):
        fused_add_rms_norm(y, res, w, EPS, new_residual=np.empty((3, 8), np.float32))
    with pytest.raises(TypeError, match=r"numpy for y, weight and device arrays for residual"):
        fused_add_rms_norm(y, dev(res), w, EPS)
