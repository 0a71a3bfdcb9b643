"""Peer reduce fused with the norm, and the gather copy: device kernels, host reference, bad input.

The device kernels run on the device target -- numba's CUDA simulator, or the GPU under
``VTNUMBA_TARGET=cuda`` (see tests/conftest.py): inputs and NaN/sentinel-poisoned outputs
go in with ``device_backend.asarray``, results come back with ``device_backend.to_host``.
"""

import numpy as np
import pytest

from vtnumba.backend.cpu import CPUBackend
from vtnumba.kernels import gather_rows, peer_reduce_norm
from vtnumba.kernels.peer_cuda import MAX_DESTS, MAX_SOURCES

EPS = 1e-5
SENTINEL = np.float32(-3.5)


@pytest.fixture(params=["host", "device"])
def where(request):
    """``(wrap, unwrap)`` for one kind of array: numpy as it is, or the device target's arrays."""
    if request.param == "host":
        return (lambda a: a), (lambda a: a)
    return request.getfixturevalue("dev"), request.getfixturevalue("host")


def full(shape, value=np.nan):
    return np.full(shape, value, np.float32)


def rel_err(out, ref):
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(np.asarray(out, dtype=np.float64) - ref) / np.linalg.norm(ref)


def make(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference(sources, bias, residual, weight, norm_bias, eps, layer):
    z = sum(s.astype(np.float64) for s in sources)
    if bias is not None:
        z = z + bias
    if residual is not None:
        z = z + residual
    if layer:
        mu = z.mean(-1, keepdims=True)
        out = (z - mu) / np.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + eps) * weight
        return (out + norm_bias if norm_bias is not None else out), z
    return z / np.sqrt((z * z).mean(-1, keepdims=True) + eps) * weight, z


def problem(rng, tp, R, H, layer, *, bias=True, residual=True):
    return dict(sources=[make(rng, (R, H)) for _ in range(tp)], bias=make(rng, H) if bias else None,
                residual=make(rng, (R, H)) if residual else None, weight=make(rng, H),
                norm_bias=make(rng, H) if layer else None)


def run(p, layer, out, new_res, wrap=lambda a: a, rows=None, **kw):
    """peer_reduce_norm on ``wrap``ped inputs; ``out``/``new_res`` are already of the right kind."""
    return peer_reduce_norm([wrap(s) for s in p["sources"]], wrap(p["bias"]), wrap(p["residual"]), wrap(p["weight"]),
                            wrap(p["norm_bias"]), EPS, out, new_res, norm="layer" if layer else "rms",
                            rows=rows, **kw)


# (tp, R, H): one, two and three sources; odd shapes 1, 7, 33, 65, 129 (element-by-element
# quads); H = 64 and 8200 take the 128-bit path, and 8200 is longer than a block keeps in
# registers (the end of the row streams through memory).
DEVICE_CASES = [(1, 7, 33), (2, 33, 7), (3, 1, 65), (2, 65, 1), (3, 2, 129), (2, 3, 64), (2, 1, 8200)]


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("tp,R,H", DEVICE_CASES)
def test_kernel_matches_float64_on_the_device(dev, host, rng, tp, R, H, layer):
    p = problem(rng, tp, R, H, layer)
    d_out, d_new_res = dev(full((R, H))), dev(full((R, H)))
    run(p, layer, d_out, d_new_res, dev)
    out, new_res = host(d_out), host(d_new_res)
    assert np.isfinite(out).all() and np.isfinite(new_res).all()
    ref, z = reference(p["sources"], p["bias"], p["residual"], p["weight"], p["norm_bias"], EPS, layer)
    assert rel_err(out, ref) <= 1e-5 and rel_err(new_res, z) <= 1e-6


def test_row_range_leaves_other_rows_untouched(rng, where):
    wrap, unwrap = where
    R, H = 7, 33
    p = problem(rng, 2, R, H, True)
    d_out, d_new_res = wrap(full((R, H), SENTINEL)), wrap(full((R, H), SENTINEL))
    run(p, True, d_out, d_new_res, wrap, rows=(2, 5))
    out, new_res = unwrap(d_out), unwrap(d_new_res)
    ref, z = reference(p["sources"], p["bias"], p["residual"], p["weight"], p["norm_bias"], EPS, True)
    assert rel_err(out[2:5], ref[2:5]) <= 1e-5 and rel_err(new_res[2:5], z[2:5]) <= 1e-6
    for a in (out, new_res):
        assert (a[:2] == SENTINEL).all() and (a[5:] == SENTINEL).all()
    # An empty range touches nothing.
    run(p, True, d_out, d_new_res, wrap, rows=(4, 4))
    assert (unwrap(d_out)[:2] == SENTINEL).all()


@pytest.mark.parametrize("max_blocks", [1, 2, 3])
def test_fewer_blocks_than_rows_walk_every_row(rng, where, max_blocks):
    # TPSP's SM budget: a few blocks stride over the rows (and the gather over its quads);
    # the host reference ignores the bound.  Rows outside the range stay untouched.
    wrap, unwrap = where
    R, H = 7, 36
    p = problem(rng, 3, R, H, True)
    ref, z = reference(p["sources"], p["bias"], p["residual"], p["weight"], p["norm_bias"], EPS, True)
    d_out, d_new_res = wrap(full((R, H), SENTINEL)), wrap(full((R, H), SENTINEL))
    run(p, True, d_out, d_new_res, wrap, rows=(1, 7), max_blocks=max_blocks)
    out, new_res = unwrap(d_out), unwrap(d_new_res)
    assert rel_err(out[1:], ref[1:]) <= 1e-5 and rel_err(new_res[1:], z[1:]) <= 1e-6
    assert (out[0] == SENTINEL).all() and (new_res[0] == SENTINEL).all()
    src, dst = make(rng, (R, H)), wrap(full((R + 2, H), SENTINEL))
    gather_rows(wrap(src), [dst], 2, max_blocks=max_blocks)
    got = unwrap(dst)
    assert np.array_equal(got[2:], src) and (got[:2] == SENTINEL).all()


def test_max_blocks_must_be_a_positive_int(rng):
    p = problem(rng, 2, 3, 8, False)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_blocks"):
            run(p, False, full((3, 8)), full((3, 8)), max_blocks=bad)


@pytest.mark.parametrize("H", [5, 8])  # the fold's copy kernel element by element, and 128 bits wide
def test_more_sources_than_one_launch_takes(rng, where, H):
    # tp > MAX_SOURCES: the surplus is folded into new_residual first, which may be residual itself.
    wrap, unwrap = where
    tp, R = MAX_SOURCES + 3, 3
    p = problem(rng, tp, R, H, False)
    ref, z = reference(p["sources"], p["bias"], p["residual"], p["weight"], None, EPS, False)
    d_out, d_res = wrap(full((R, H))), wrap(p["residual"])
    peer_reduce_norm([wrap(s) for s in p["sources"]], wrap(p["bias"]), d_res, wrap(p["weight"]), None, EPS,
                     d_out, d_res, norm="rms", rows=(1, 3))
    out, res = unwrap(d_out), unwrap(d_res)
    assert rel_err(out[1:], ref[1:]) <= 1e-5 and rel_err(res[1:], z[1:]) <= 1e-6
    assert np.isnan(out[0]).all()


@pytest.mark.parametrize("nsrc,residual,H", [(1, "none", 7), (3, "given", 5), (MAX_SOURCES, "acc", 8),
                                             (5, "none", 12)])
def test_sum_sources_kernel_matches_its_host_reference(dev, host, rng, nsrc, residual, H):
    # The fold of tp > MAX_SOURCES (launch_sum_sources) against its host twin, bit for bit:
    # both add the sources in order, then the residual.  "acc": the residual *is* the output,
    # as in the fold's second round.  Rows outside [1, 4) keep their poison.
    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK
    from vtnumba.kernels.peer import sum_sources_rows_host
    from vtnumba.kernels.peer_cuda import launch_sum_sources

    R = 6
    sources = [make(rng, (R, H)) for _ in range(nsrc)]
    res = make(rng, (R, H))
    want = full((R, H)) if residual != "acc" else res.copy()
    d_acc = dev(want.copy())
    d_sources = [dev(s) for s in sources]
    d_res = d_acc if residual == "acc" else dev(res) if residual == "given" else None
    sum_sources_rows_host(sources, want if residual == "acc" else res if residual == "given" else None, want, 1, 4)
    with SIM_LAUNCH_LOCK:  # a raw launch: the simulator runs one at a time per process
        launch_sum_sources(d_sources, d_res, d_acc, 1, 4, 0)
    got = host(d_acc)
    np.testing.assert_array_equal(got, want)
    expected = np.sum(np.stack(sources)[:, 1:4].astype(np.float64), axis=0) + (res[1:4] if residual != "none" else 0)
    assert rel_err(got[1:4], expected) <= 1e-6
    if residual == "none":
        assert np.isnan(got[[0, 4, 5]]).all()
    with pytest.raises(ValueError, match=f"sources: {MAX_SOURCES + 1} arrays; one launch sums 1..{MAX_SOURCES}"):
        launch_sum_sources(d_sources[:1] * (MAX_SOURCES + 1), None, d_acc, 0, R, 0)


def test_two_folds_without_a_residual(rng, where):
    # tp > 2 * MAX_SOURCES and no residual: the first fold starts new_residual from the sources
    # alone, the second adds to it, and the norm runs over the rest.
    wrap, unwrap = where
    tp, R, H = 2 * MAX_SOURCES + 1, 3, 6
    p = problem(rng, tp, R, H, True, residual=False)
    ref, z = reference(p["sources"], p["bias"], None, p["weight"], p["norm_bias"], EPS, True)
    d_out, d_res = wrap(full((R, H))), wrap(full((R, H)))
    peer_reduce_norm([wrap(s) for s in p["sources"]], wrap(p["bias"]), None, wrap(p["weight"]), wrap(p["norm_bias"]),
                     EPS, d_out, d_res, norm="layer", rows=(1, 3))
    out, res = unwrap(d_out), unwrap(d_res)
    assert rel_err(out[1:], ref[1:]) <= 1e-5 and rel_err(res[1:], z[1:]) <= 1e-6
    assert np.isnan(out[0]).all() and np.isnan(res[0]).all()


def test_no_residual_no_bias_device_matches_host(dev, host, rng):
    p = problem(rng, 3, 5, 20, True, bias=False, residual=False)
    on_host = [full((5, 20)) for _ in range(2)]
    on_device = [dev(full((5, 20))) for _ in range(2)]
    run(p, True, *on_host)
    run(p, True, *on_device, dev)
    got = [host(d) for d in on_device]
    assert rel_err(got[0], on_host[0]) <= 1e-5 and rel_err(got[1], on_host[1]) <= 1e-6
    ref, _ = reference(p["sources"], None, None, p["weight"], p["norm_bias"], EPS, True)
    assert rel_err(on_host[0], ref) <= 1e-5


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_host_reference_realistic(rng, layer):
    tp, R, H = 4, 1024, 1024
    p = problem(rng, tp, R, H, layer)
    out, new_res = np.full((R, H), np.nan, np.float32), np.full((R, H), np.nan, np.float32)
    run(p, layer, out, new_res)
    ref, z = reference(p["sources"], p["bias"], p["residual"], p["weight"], p["norm_bias"], EPS, layer)
    assert rel_err(out, ref) <= 1e-5 and rel_err(new_res, z) <= 1e-6


# ---------------------------------------------------------------------------- gather
@pytest.mark.parametrize("ndest", [1, 3, MAX_DESTS + 2])
def test_gather_on_host_and_device(rng, where, ndest):
    wrap, unwrap = where
    n, H, T, off = 3, 7, 9, 4
    src = make(rng, (n, H))
    dests = [wrap(full((T, H), SENTINEL)) for _ in range(ndest)]
    gather_rows(wrap(src), dests, off)
    for d in map(unwrap, dests):
        assert (d[off:off + n] == src).all()
        assert (d[:off] == SENTINEL).all() and (d[off + n:] == SENTINEL).all()


@pytest.mark.parametrize("H,misaligned", [(64, False), (64, True), (30, False)])
def test_gather_wide_rows_and_views(dev, host, rng, H, misaligned):
    # 128-bit copies where source and destinations allow it (H % 4 == 0, aligned starts); a
    # destination view one float past an aligned address, or H = 30, copies element by element.
    from vtnumba.kernels._wide_cuda import wide_ok

    n, T, off = 5, 12, 3
    src = make(rng, (n, H))
    flat = dev(full(1 + T * H, SENTINEL))
    view = flat[1:].reshape(T, H) if misaligned else flat[:T * H].reshape(T, H)
    other = dev(full((T, H), SENTINEL))
    d_src = dev(src)
    assert wide_ok(d_src, view, other) == (H % 4 == 0 and not misaligned)
    gather_rows(d_src, [view, other], off)
    got = host(flat)[1:] if misaligned else host(flat)[:T * H]
    for d in (got.reshape(T, H), host(other)):
        assert (d[off:off + n] == src).all()
        assert (d[:off] == SENTINEL).all() and (d[off + n:] == SENTINEL).all()


def test_gather_on_queues(device_backend, dev, host, rng):
    src = make(rng, (65, 33))
    backend = CPUBackend(threaded=True)
    q = backend.create_queue("gather")
    dests = [np.full((130, 33), SENTINEL) for _ in range(2)]
    gather_rows(src, dests, 65, queue=q)
    backend.synchronize(q)
    assert all((d[65:] == src).all() and (d[:65] == SENTINEL).all() for d in dests)
    backend.destroy_queue(q)
    backend.close()
    cuda_backend = device_backend
    cq = cuda_backend.create_queue("gather")
    dests = [dev(full((65, 33), SENTINEL)) for _ in range(2)]
    gather_rows(dev(src), dests, 0, queue=cq)
    cuda_backend.synchronize(cq)
    assert all((host(d) == src).all() for d in dests)
    cuda_backend.destroy_queue(cq)


# ---------------------------------------------------------------------------- queued as checked once
def test_the_unchecked_queue_twins_do_the_checked_calls_work(rng, where, request):
    # What the TPSP pipeline queues per chunk: the same reduce + norm and gather, on a queue,
    # with the arguments taken as checked.  Row range, untouched rows and the gather's offset
    # must come out exactly as the checked calls' do.
    from vtnumba.backend.arrays import array_kind
    from vtnumba.kernels.peer import queue_gather_rows, queue_peer_reduce_norm

    wrap, unwrap = where
    kind = array_kind("x", wrap(np.zeros(1, np.float32)))  # "host" or "device"
    # (The device backend only for device arrays: the host case must run where no GPU is usable.)
    backend = CPUBackend() if kind == "host" else request.getfixturevalue("device_backend")
    q = backend.create_queue("twins")
    try:
        R, H = 7, 33
        p = problem(rng, 3, R, H, True)
        args = [wrap(s) for s in p["sources"]], wrap(p["bias"]), wrap(p["residual"]), wrap(p["weight"]), \
            wrap(p["norm_bias"])
        d_out, d_new_res = wrap(full((R, H), SENTINEL)), wrap(full((R, H), SENTINEL))
        queue_peer_reduce_norm(kind, *args, EPS, True, d_out, d_new_res, 1, 6, q)
        dests = [wrap(full((12, H), SENTINEL)) for _ in range(2)]
        queue_gather_rows(kind, d_out[1:6], dests, 4, q)
        backend.synchronize(q)
        out, new_res = unwrap(d_out), unwrap(d_new_res)
        ref, z = reference(p["sources"], p["bias"], p["residual"], p["weight"], p["norm_bias"], EPS, True)
        assert rel_err(out[1:6], ref[1:6]) <= 1e-5 and rel_err(new_res[1:6], z[1:6]) <= 1e-6
        for a in (out, new_res):
            assert (a[:1] == SENTINEL).all() and (a[6:] == SENTINEL).all()
        for d in map(unwrap, dests):
            assert (d[4:9] == out[1:6]).all() and (d[:4] == SENTINEL).all() and (d[9:] == SENTINEL).all()
    finally:
        backend.destroy_queue(q)
        if kind == "host":
            backend.close()


# ---------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument(dev, rng):
    R, H = 4, 8
    s = [make(rng, (R, H)) for _ in range(2)]
    w, out, nr = make(rng, H), np.empty((R, H), np.float32), np.empty((R, H), np.float32)
    with pytest.raises(ValueError, match=r"sources\[1\] has shape \(4, 7\); expected \(4, 8\)"):
        peer_reduce_norm([s[0], make(rng, (R, 7))], None, None, w, None, EPS, out, nr)
    with pytest.raises(TypeError, match=r"sources must be a non-empty list of arrays, got list \(empty\)"):
        peer_reduce_norm([], None, None, w, None, EPS, out, nr)
    with pytest.raises(ValueError, match=r"norm='l2' is not supported"):
        peer_reduce_norm(s, None, None, w, None, EPS, out, nr, norm="l2")
    with pytest.raises(ValueError, match=r"norm_bias is only used by norm='layer'"):
        peer_reduce_norm(s, None, None, w, w, EPS, out, nr, norm="rms")
    with pytest.raises(ValueError, match=r"rows=\(3, 9\) is not a valid row range; expected 0 <= start <= stop <= 4"):
        peer_reduce_norm(s, None, None, w, None, EPS, out, nr, rows=(3, 9))
    with pytest.raises(TypeError, match=r"rows=5 must be None or a \(start, stop\) pair"):
        peer_reduce_norm(s, None, None, w, None, EPS, out, nr, rows=5)
    with pytest.raises(ValueError, match=r"out and new_residual are required"):
        peer_reduce_norm(s, None, None, w, None, EPS, None, nr)
    with pytest.raises(ValueError, match=r"new_residual and sources\[1\] share memory"):
        peer_reduce_norm(s, None, None, w, None, EPS, out, s[1])
    # Views over the same bytes, not the same objects: refused too (rows cascaded into each other).
    buf = np.random.default_rng(1).standard_normal((5, H)).astype(np.float32)
    with pytest.raises(ValueError, match=r"out and sources\[0\] share memory"):
        peer_reduce_norm([buf[0:4]], None, None, w, None, EPS, buf[1:5], nr)
    with pytest.raises(ValueError, match=r"new_residual and residual share overlapping memory"):
        peer_reduce_norm(s, None, buf[0:4], w, None, EPS, out, buf[1:5])
    with pytest.raises(ValueError, match=r"dests\[0\] and src share memory"):
        gather_rows(buf[0:3], [buf], 1)
    with pytest.raises(TypeError, match=r"numpy for .* and device arrays for sources\[1\]"):
        peer_reduce_norm([s[0], dev(s[1])], None, None, w, None, EPS, out, nr)
    with pytest.raises(ValueError, match=r"dests\[0\] has 5 rows; rows \[3, 7\) do not fit"):
        gather_rows(s[0], [np.empty((5, H), np.float32)], 3)
    with pytest.raises(ValueError, match=r"dests\[0\] has shape \(9, 7\)"):
        gather_rows(s[0], [np.empty((9, 7), np.float32)], 0)
    with pytest.raises(ValueError, match=r"row_offset=-1 must be a non-negative int"):
        gather_rows(s[0], [np.empty((9, H), np.float32)], -1)
    with pytest.raises(TypeError, match=r"dests must be a non-empty list"):
        gather_rows(s[0], np.empty((9, H), np.float32), 0)
