"""Matmul: the CUDA ladder on the device target, the host reference at realistic sizes, and bad input.

The device target is numba's CUDA simulator, or the GPU under ``VTNUMBA_TARGET=cuda`` (see
tests/conftest.py); inputs go in with ``device_backend.asarray`` and results come back with
``device_backend.to_host``, so the same test runs on both.  Every run uses fresh random
inputs, poisons the output with NaN first (so an element the kernel forgets to write shows
up), and compares with float64 numpy.
"""

import numpy as np
import pytest

from vtnumba.backend.cpu import CPUBackend
from vtnumba.kernels import VARIANTS, linear, linear_rows_to, matmul, matmul_rows_host
from vtnumba.kernels.matmul import LADDER

TOL = {np.float32: 1e-5, np.float16: 1e-2}


def rel_err(out, ref):
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(np.asarray(out, dtype=np.float64) - ref) / np.linalg.norm(ref)


def make(rng, shape, dtype=np.float32):
    # Standard normal values: never zero, both signs, so cancellation errors show.
    return rng.standard_normal(shape).astype(dtype)


def nan_out(shape):
    return np.full(shape, np.nan, dtype=np.float32)


# Shapes cover 1, 7, 33 and 65 along each of M, K, N, both B layouts, both dtypes, with and
# without bias; kept small because the simulator runs ~7000 threads/s.
DEVICE_CASES = [
    (1, 65, 33, False, np.float32, True),
    (65, 7, 1, True, np.float32, False),
    (33, 33, 7, True, np.float16, True),
    (7, 1, 65, False, np.float16, False),
]


WIDE_RUNGS = ("wide", "warptile", "dbuf", "async")  # rungs 4-7: 128-bit accesses where the arrays allow


@pytest.fixture(autouse=True)
def _skip_async_without_cp_async(request):
    """The async rung needs cp.async (compute capability 8.0): on an older GPU its tests skip."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("variant") == "async":
        request.getfixturevalue("device_backend")  # first: without a usable GPU that skips, saying why
        from vtnumba.kernels._async_copy_cuda import async_copies_supported

        ok, why = async_copies_supported()
        if not ok:
            pytest.skip(why)


def _ladder_cases():
    # Rungs 4-7 have their own float32 tests below (both access paths, several k-steps); here
    # they take the float16 cases (scalar path; test_wide_rungs_row_range_and_padding runs
    # their 64-bit float16 loads).
    return [pytest.param(variant, *case, id=f"{variant}-{case[0]}x{case[1]}x{case[2]}-{case[4].__name__}")
            for variant in VARIANTS for case in DEVICE_CASES
            if not (variant in WIDE_RUNGS and case[4] is np.float32)]


@pytest.mark.parametrize("variant,M,K,N,trans,dtype,with_bias", _ladder_cases())
def test_ladder_matches_float64_on_the_device(dev, host, rng, variant, M, K, N, trans, dtype, with_bias):
    a = make(rng, (M, K), dtype)
    b = make(rng, (N, K) if trans else (K, N), dtype)
    bias = make(rng, N) if with_bias else None
    fn = linear if trans else matmul
    d_out = dev(nan_out((M, N)))
    ret = fn(dev(a), dev(b), dev(bias), d_out, variant=variant)
    assert ret is d_out
    out = host(d_out)
    assert np.isfinite(out).all(), "some output element was never written"
    b64 = (b.T if trans else b).astype(np.float64)
    ref = a.astype(np.float64) @ b64 + (0 if bias is None else bias)
    assert rel_err(out, ref) <= TOL[dtype]
    # float32 accumulation: exact-ish against the (rounded) float16 inputs too.
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("M,K,N,trans", [(130, 3, 2, False), (2, 9, 131, True)])
def test_regtile_with_several_blocks(dev, host, rng, M, K, N, trans):
    # regtile's 128 x 128 tiles: the shapes above exercise block rows/columns past the first.
    a, b, bias = make(rng, (M, K)), make(rng, (N, K) if trans else (K, N)), make(rng, N)
    d_out = dev(nan_out((M, N)))
    (linear if trans else matmul)(dev(a), dev(b), dev(bias), d_out, variant="regtile")
    out = host(d_out)
    ref = a.astype(np.float64) @ (b.T if trans else b).astype(np.float64) + bias
    assert np.isfinite(out).all() and rel_err(out, ref) <= 1e-5


# ---------------------------------------------------------------------------- rungs 4-7 (wide accesses)

def test_ladder_order_and_descriptions():
    # Tutorial 04 and the benchmark list the rungs from LADDER; every rung has a kernel.
    from vtnumba.kernels.matmul_cuda import KERNELS, WIDE_VARIANTS

    assert VARIANTS == ("naive", "smem", "regtile", "wide", "warptile", "dbuf", "async")
    assert set(KERNELS) == set(VARIANTS) and set(WIDE_VARIANTS) == set(WIDE_RUNGS)
    assert all(isinstance(LADDER[v], str) and LADDER[v] for v in VARIANTS)


def launch_rows(variant, a, b, bias, c, m0, m_valid, trans):
    """One raw ladder launch (the contract TPSP's epilogue uses), serialised as the simulator needs."""
    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK
    from vtnumba.kernels.matmul_cuda import launch_matmul_rows

    with SIM_LAUNCH_LOCK:
        launch_matmul_rows(variant, a, b, bias, c, m0, m_valid, trans, 0)


# (M, K, N, trans, bias, wide): 37 x 29 x 53 has no dimension divisible by 4 (the scalar path);
# the others have all of them (the 128-bit path), both B layouts, and N = 132 two block
# columns; K = 29 and 32 are several k-steps, so the double buffer swaps more than once (and
# the async rung's three stages all fill, and wrap around, for K = 32).
WIDE_CASES = [(37, 29, 53, False, True, False), (36, 32, 52, True, True, True), (36, 32, 132, False, False, True)]


@pytest.mark.parametrize("variant", WIDE_RUNGS)
@pytest.mark.parametrize("M,K,N,trans,with_bias,wide", WIDE_CASES)
def test_wide_rungs_match_the_host_reference(dev, host, rng, variant, M, K, N, trans, with_bias, wide):
    from vtnumba.kernels.matmul_cuda import wide_flags

    a, b = make(rng, (M, K)), make(rng, (N, K) if trans else (K, N))
    bias = make(rng, N) if with_bias else None
    d_a, d_b, d_c = dev(a), dev(b), dev(nan_out((M, N)))
    # The case really takes the path it is meant to test.
    assert wide_flags(d_a, d_b, d_c) == ((1, 1, 1) if wide else (0, 0, 0))
    (linear if trans else matmul)(d_a, d_b, dev(bias), d_c, variant=variant)
    ref = nan_out((M, N))
    matmul_rows_host(a, b, bias, ref, 0, M, trans)
    out = host(d_c)
    assert np.isfinite(out).all(), "some output element was never written"
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.simulator_only
@pytest.mark.parametrize("M,K,N,trans,with_bias,wide", WIDE_CASES[1:])
def test_async_rung_when_copies_land_at_once(dev, host, rng, monkeypatch, M, K, N, trans, with_bias, wide):
    # The simulator lands cp.async copies at the thread's wait (the latest moment) in the test
    # above; here at issue (the earliest), which shows a copy issued into a stage that other
    # threads are still reading.  A correct kernel is right with both.
    from vtnumba.kernels import _async_copy_cuda

    monkeypatch.setattr(_async_copy_cuda, "SIMULATED_LANDING", "issue")
    a, b = make(rng, (M, K)), make(rng, (N, K) if trans else (K, N))
    bias = make(rng, N) if with_bias else None
    d_c = dev(nan_out((M, N)))
    (linear if trans else matmul)(dev(a), dev(b), dev(bias), d_c, variant="async")
    ref = nan_out((M, N))
    matmul_rows_host(a, b, bias, ref, 0, M, trans)
    out = host(d_c)
    assert np.isfinite(out).all() and rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("variant", WIDE_RUNGS)
def test_wide_rungs_row_range_and_padding(dev, host, rng, variant):
    # The TPSP contract: c[i] = a[m0 + i] @ B + bias for i < m_valid, zeros after -- on the
    # 128-bit path (K, N multiples of 4), float16 inputs (64-bit loads), and a 2-block-row c.
    M, K, N, m0, m_valid, rows = 150, 12, 20, 9, 131, 140
    a, w, bias = make(rng, (M, K), np.float16), make(rng, (N, K), np.float16), make(rng, N)
    d_c = dev(nan_out((rows, N)))
    launch_rows(variant, dev(a), dev(w), dev(bias), d_c, m0, m_valid, True)
    ref = nan_out((rows, N))
    matmul_rows_host(a, w, bias, ref, m0, m_valid, True)
    out = host(d_c)
    assert (out[m_valid:] == 0).all() and np.isfinite(out).all()
    assert rel_err(out[:m_valid], ref[:m_valid]) <= 1e-5


@pytest.mark.parametrize("variant", WIDE_RUNGS)
def test_wide_rungs_float16_with_b_as_k_by_n(dev, host, rng, variant):
    # float16 inputs on the 64-bit path with b as [K, N] (the row-range test above takes b.T):
    # the async rung's copy widens these quads through registers instead of cp.async.
    from vtnumba.kernels.matmul_cuda import wide_flags

    M, K, N = 36, 40, 20
    a, b = make(rng, (M, K), np.float16), make(rng, (K, N), np.float16)
    d_a, d_b, d_c = dev(a), dev(b), dev(nan_out((M, N)))
    assert wide_flags(d_a, d_b, d_c) == (1, 1, 1)
    matmul(d_a, d_b, out=d_c, variant=variant)
    ref = nan_out((M, N))
    matmul_rows_host(a, b, None, ref, 0, M, False)
    out = host(d_c)
    assert np.isfinite(out).all() and rel_err(out, ref) <= 1e-5


def test_wide_rungs_fall_back_on_misaligned_views(dev, host, rng):
    # Views that start one float past an aligned address: the launcher must see it and take
    # the scalar path (a 128-bit access there would stop a GPU with "misaligned address").
    from vtnumba.kernels.matmul_cuda import wide_flags

    M, K, N = 8, 16, 12
    a, b = make(rng, (M, K)), make(rng, (K, N))
    flat_a = dev(np.concatenate([[0.0], a.ravel()]).astype(np.float32))
    flat_c = dev(nan_out(1 + M * N))
    d_a, d_c = flat_a[1:].reshape(M, K), flat_c[1:].reshape(M, N)
    d_b = dev(b)
    assert wide_flags(d_a, d_b, d_c) == (0, 1, 0)
    matmul(d_a, d_b, out=d_c, variant="dbuf")  # the flags are computed once for all four rungs
    out = host(flat_c)[1:].reshape(M, N)
    assert rel_err(out, a.astype(np.float64) @ b) <= 1e-5


def test_async_rung_is_refused_by_name_on_a_gpu_without_cp_async(dev, rng, monkeypatch):
    # Before Ampere there is no cp.async: the launch says so, instead of a ptxas error from deep
    # inside numba (stood in for here: the device reports compute capability 7.5).
    from vtnumba.kernels import matmul_cuda

    monkeypatch.setattr(matmul_cuda, "async_copies_supported",
                        lambda: (False, "cp.async needs compute capability 8.0 or newer; this GPU is 7.5"))
    a, b = dev(make(rng, (4, 8))), dev(make(rng, (8, 4)))
    with pytest.raises(RuntimeError, match=r"variant='async' cannot run here: .*7\.5; use another rung"):
        matmul(a, b, out=dev(nan_out((4, 4))), variant="async")


@pytest.mark.parametrize("rung, tile", [("naive", 16), ("smem", 16), ("regtile", 128), ("async", 128)])
def test_launch_config_refuses_more_row_tiles_than_the_grid_holds(rung, tile):
    # ("rung", not "variant": the autouse fixture above would want a device for the async one.)
    # CUDA's gridDim.y stops at 65535: one more row tile would fail to launch on a GPU (the
    # simulator takes any grid), so the launch configuration says so, naming the rows.
    from vtnumba.kernels.matmul_cuda import MAX_GRID_Y, launch_config

    grid, _ = launch_config(rung, MAX_GRID_Y * tile, 8)
    assert grid[1] == MAX_GRID_Y
    with pytest.raises(ValueError, match=rf"rows={MAX_GRID_Y * tile + 1} is too many for variant='{rung}'.*"
                                         rf"at most {MAX_GRID_Y * tile} rows"):
        launch_config(rung, MAX_GRID_Y * tile + 1, 8)


@pytest.mark.simulator_only
def test_simulated_wide_access_checks_alignment(device_backend, dev, rng):
    # The simulator's load4 checks what the hardware would: forcing the wide path on a
    # misaligned view fails loudly (on a GPU this launch would kill the CUDA context).
    from numba import cuda

    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK
    from vtnumba.kernels.matmul_cuda import matmul_wide_kernel

    flat = dev(np.zeros(1 + 4 * 8, np.float32))
    a, b, c = flat[1:].reshape(4, 8), dev(make(rng, (8, 4))), dev(nan_out((4, 4)))
    with SIM_LAUNCH_LOCK, pytest.raises(ValueError, match="not 16-byte aligned"):
        matmul_wide_kernel[(1, 1), (16, 16), cuda.default_stream()](a, b, c[0], c, 0, 4, 0, 0, 1, 1, 1)


def test_float16_against_unrounded_data(dev, host, rng):
    # The float16 error budget (1e-2) holds against the float32 data before rounding.
    a32, b32 = make(rng, (33, 65)), make(rng, (65, 7))
    d_out = dev(nan_out((33, 7)))
    matmul(dev(a32.astype(np.float16)), dev(b32.astype(np.float16)), out=d_out, variant="naive")
    assert rel_err(host(d_out), a32.astype(np.float64) @ b32) <= 1e-2


# Every rung: any of them may run under TPSP's epilogue ($VTNUMBA_MATMUL_VARIANT), and this
# is its contract -- real rows into each destination, zeros past M.
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_to_destinations_on_the_device(dev, host, rng, variant):
    # M=7 rows over 4 destinations of R=3: dest 2 gets one real row + 2 zero rows, dest 3 only zeros.
    M, K, N, R = 7, 5, 9, 3
    x, w, bias = make(rng, (M, K)), make(rng, (N, K)), make(rng, N)
    dests = [dev(nan_out((R, N))) for _ in range(4)]
    linear_rows_to(dev(x), dev(w), dev(bias), dests, R, variant=variant)
    full = np.concatenate([host(d) for d in dests])
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    assert np.isfinite(full).all()
    assert rel_err(full[:M], ref) <= 1e-5
    assert (full[M:] == 0).all()


def test_rows_to_host_reference_matches_the_device(dev, host, rng):
    M, K, N, R = 10, 33, 7, 4
    x, w, bias = make(rng, (M, K)), make(rng, (N, K)), make(rng, N)
    on_host = [nan_out((R, N)) for _ in range(3)]
    on_device = [dev(nan_out((R, N))) for _ in range(3)]
    linear_rows_to(x, w, bias, on_host, R)
    linear_rows_to(dev(x), dev(w), dev(bias), on_device, R, variant="regtile")
    assert rel_err(np.concatenate([host(d) for d in on_device]), np.concatenate(on_host)) <= 1e-5
    assert (np.concatenate(on_host)[M:] == 0).all()


@pytest.mark.parametrize("where", ["host", "device"])
def test_the_unchecked_queue_twin_does_the_checked_calls_work(request, rng, where):
    # What the TPSP strategies queue per chunk: the same matmul into row blocks, the
    # arguments taken as checked, on a queue.  Padding rows past M come out zero.
    from vtnumba.backend.cpu import CPUBackend
    from vtnumba.kernels.matmul import queue_linear_rows_to

    on_device = where == "device"
    put = request.getfixturevalue("dev") if on_device else (lambda a: a)
    get = request.getfixturevalue("host") if on_device else (lambda a: a)
    backend = request.getfixturevalue("device_backend") if on_device else CPUBackend()
    q = backend.create_queue("twin")
    try:
        M, K, N, R = 7, 5, 9, 3
        x, w, bias = make(rng, (M, K)), make(rng, (N, K)), make(rng, N)
        dests = [put(nan_out((R, N))) for _ in range(3)]
        queue_linear_rows_to(where, put(x), put(w), put(bias), dests, R, q)
        backend.synchronize(q)
        full = np.concatenate([get(d) for d in dests])
        assert rel_err(full[:M], x.astype(np.float64) @ w.T.astype(np.float64) + bias) <= 1e-5
        assert (full[M:] == 0).all()
    finally:
        backend.destroy_queue(q)
        if not on_device:
            backend.close()


# ---------------------------------------------------------------------------- host reference
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_host_matmul_realistic(rng, dtype):
    a, b, bias = make(rng, (512, 1024), dtype), make(rng, (1024, 768), dtype), make(rng, 768)
    out = nan_out((512, 768))
    assert matmul(a, b, bias, out=out) is out
    ref = a.astype(np.float64) @ b.astype(np.float64) + bias
    assert rel_err(out, ref) <= TOL[dtype]


def test_host_linear_and_rows_to_realistic(rng):
    T, K, H, tp = 1000, 384, 512, 3
    R = -(-T // tp)
    x, w, bias = make(rng, (T, K)), make(rng, (H, K)), make(rng, H)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    out = linear(x, w, bias)
    assert out.dtype == np.float32 and out.shape == (T, H)
    assert rel_err(out, ref) <= 1e-5
    dests = [nan_out((R, H)) for _ in range(tp)]
    linear_rows_to(x, w, bias, dests, R)
    full = np.concatenate(dests)
    assert rel_err(full[:T], ref) <= 1e-5 and (full[T:] == 0).all()


def test_host_rows_to_float16(rng):
    x, w = make(rng, (33, 65), np.float16), make(rng, (7, 65), np.float16)
    dests = [nan_out((16, 7)) for _ in range(3)]
    linear_rows_to(x, w, None, dests, 16)
    full = np.concatenate(dests)
    assert rel_err(full[:33], x.astype(np.float64) @ w.T.astype(np.float64)) <= 1e-5
    assert (full[33:] == 0).all()


def test_kernel_contract_host_reference(rng):
    # matmul_rows_host is the kernels' contract: rows m0.. of a, zero padding after m_valid.
    a, b = make(rng, (9, 4)), make(rng, (4, 5))
    c = nan_out((6, 5))
    matmul_rows_host(a, b, None, c, 5, 4, False)
    np.testing.assert_allclose(c[:4], a[5:9] @ b, rtol=1e-5)
    assert (c[4:] == 0).all()


# ---------------------------------------------------------------------------- queues
def test_cpu_queues_run_in_order(rng):
    a, b = make(rng, (64, 32)), make(rng, (32, 48))
    ref = a.astype(np.float64) @ b
    for backend in (CPUBackend(), CPUBackend(threaded=True)):
        q = backend.create_queue("mm")
        out = nan_out((64, 48))
        matmul(a, b, out=out, queue=q)
        backend.synchronize(q)
        assert rel_err(out, ref) <= 1e-5
        backend.destroy_queue(q)
        backend.close()


def test_cuda_queue_with_buffers(device_backend, rng):
    backend = device_backend
    q = backend.create_queue("mm")
    M, K, N = 7, 33, 5
    bufs = [backend.alloc(n * 4) for n in (M * K, K * N, M * N)]
    a, b, c = bufs[0].view(np.float32, (M, K)), bufs[1].view(np.float32, (K, N)), bufs[2].view(np.float32, (M, N))
    ha, hb = make(rng, (M, K)), make(rng, (K, N))
    backend.copy(q, a, ha, ha.nbytes)
    backend.copy(q, b, hb, hb.nbytes)
    matmul(a, b, out=c, queue=q, variant="naive")
    host = np.empty((M, N), np.float32)
    backend.copy(q, host, c, host.nbytes)
    backend.synchronize(q)
    assert rel_err(host, ha.astype(np.float64) @ hb) <= 1e-5
    backend.destroy_queue(q)
    for buf in bufs:
        backend.free(buf)


def test_queue_of_the_wrong_kind_is_refused(device_backend, dev, rng):
    a, b = make(rng, (3, 4)), make(rng, (4, 5))
    cuda_backend, cpu_backend = device_backend, CPUBackend()
    qc, qh = cuda_backend.create_queue(), cpu_backend.create_queue()
    with pytest.raises(TypeError, match="numpy arrays need a cpu backend queue"):
        matmul(a, b, queue=qc)
    with pytest.raises(TypeError, match="device arrays need a cuda backend queue"):
        matmul(dev(a), dev(b), out=dev(nan_out((3, 5))), queue=qh)
    with pytest.raises(ValueError, match="belongs to"):
        matmul(a, b, queue=qh, backend=CPUBackend())
    with pytest.raises(TypeError, match="queue must be a vtnumba Queue"):
        matmul(a, b, queue="stream0")


# ---------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument(dev, rng):
    a, b = make(rng, (4, 6)), make(rng, (6, 5))
    with pytest.raises(ValueError, match=r"a must be a 2-D array"):
        matmul(a[0], b)
    with pytest.raises(TypeError, match=r"b has dtype float64; expected float32 or float16"):
        matmul(a, b.astype(np.float64))
    with pytest.raises(TypeError, match=r"must have the same dtype"):
        matmul(a, b.astype(np.float16))
    with pytest.raises(ValueError, match=r"b has shape \(5, 5\) but a has K=6"):
        matmul(a, make(rng, (5, 5)))
    with pytest.raises(ValueError, match=r"w has shape \(6, 5\) but x has K=6"):
        linear(a, b)
    with pytest.raises(ValueError, match=r"C-contiguous"):
        matmul(make(rng, (4, 12))[:, ::2], b)
    with pytest.raises(ValueError, match=r"bias has shape \(4,\); expected \(5,\)"):
        matmul(a, b, bias=make(rng, 4))
    with pytest.raises(TypeError, match=r"out has dtype float16; expected float32"):
        matmul(a, b, out=np.empty((4, 5), np.float16))
    with pytest.raises(ValueError, match=r"out has shape \(5, 5\)"):
        matmul(a, b, out=np.empty((5, 5), np.float32))
    with pytest.raises(ValueError, match=r"variant='fast' is not a matmul variant"):
        matmul(a, b, variant="fast")
    with pytest.raises(TypeError, match=r"numpy for a, out and device arrays for b"):
        matmul(a, dev(b), out=np.empty((4, 5), np.float32))
    with pytest.raises(TypeError, match=r"a must be a numpy array .* got builtins.list"):
        matmul([[1.0]], b)


def test_rows_to_bad_inputs(rng):
    x, w = make(rng, (7, 4)), make(rng, (5, 4))
    with pytest.raises(ValueError, match=r"rows_per_dest=0 must be a positive int"):
        linear_rows_to(x, w, None, [nan_out((3, 5))], 0)
    with pytest.raises(ValueError, match=r"dests hold len\(dests\) \* rows_per_dest = 2 \* 3 = 6 rows"):
        linear_rows_to(x, w, None, [nan_out((3, 5)), nan_out((3, 5))], 3)
    with pytest.raises(ValueError, match=r"dests\[1\] has shape \(2, 5\)"):
        linear_rows_to(x, w, None, [nan_out((3, 5)), nan_out((2, 5)), nan_out((3, 5))], 3)
    with pytest.raises(TypeError, match=r"dests must be a non-empty list"):
        linear_rows_to(x, w, None, [], 3)


@pytest.mark.parametrize("where", ["host", "device"])
def test_outputs_sharing_memory_are_refused(request, rng, where):
    # A matmul cannot run in place: on a GPU a block reads x rows another block's output tile
    # has already overwritten (np.matmul would quietly copy, so the host reference hid it), and
    # two destinations of one call overwrite each other's rows.  Nothing is written then.
    on_device = where == "device"
    put = request.getfixturevalue("dev") if on_device else (lambda a: a)
    x, w = put(make(rng, (6, 6))), put(make(rng, (6, 6)))
    with pytest.raises(ValueError, match=r"out and a share memory \(a is an input the kernel reads"):
        matmul(x, w, out=x)
    with pytest.raises(ValueError, match=r"out and w share memory"):
        linear(x, w, out=w[0:6])  # a view of w: not the same object, the same bytes
    d0 = put(nan_out((3, 6)))
    with pytest.raises(ValueError, match=r"dests\[0\] and dests\[1\] share memory \(dests\[1\] is another output"):
        linear_rows_to(x, w, None, [d0, d0], 3)
    both = put(nan_out((4, 6)))
    with pytest.raises(ValueError, match=r"dests\[0\] and dests\[1\] share memory"):
        linear_rows_to(x, w, None, [both[0:3], both[1:4]], 3)  # two overlapping windows of one buffer
    with pytest.raises(ValueError, match=r"dests\[1\] and x share memory"):
        linear_rows_to(x, w, None, [d0, x[0:3]], 3)
    halves = put(nan_out((6, 6)))  # side by side in one buffer, not overlapping: fine
    linear_rows_to(x, w, None, [halves[0:3], halves[3:6]], 3)
    got = np.asarray(halves.copy_to_host() if on_device else halves, np.float64)
    ref = np.asarray(x.copy_to_host() if on_device else x, np.float64) @ \
        np.asarray(w.copy_to_host() if on_device else w, np.float64).T
    assert np.allclose(got, ref, atol=1e-4)


def test_the_default_rung_is_named_by_the_environment(dev, host, rng, monkeypatch):
    """``$VTNUMBA_MATMUL_VARIANT`` picks the rung every matmul without a ``variant`` runs -- the
    model's, TPSP's (through queue_linear_rows_to) and the benchmarks' matmul alone at once;
    a named variant still wins, and a bad value is refused naming the variable."""
    from vtnumba.kernels import matmul_cuda
    from vtnumba.kernels.matmul import DEFAULT_VARIANT, VARIANT_ENV, default_variant, queue_linear_rows_to

    seen = []
    real = matmul_cuda.launch_matmul_rows

    def spy(variant, *args):
        seen.append(variant)
        return real(variant, *args)

    monkeypatch.setattr(matmul_cuda, "launch_matmul_rows", spy)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    w = rng.standard_normal((6, 7)).astype(np.float32)
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    assert default_variant() in ("naive", DEFAULT_VARIANT)  # (naive in the simulator)
    for rung in ("smem", "wide"):
        monkeypatch.setenv(VARIANT_ENV, rung)
        assert default_variant() == rung
        np.testing.assert_allclose(host(linear(dev(a), dev(w))), a @ w.T, rtol=1e-5, atol=1e-5)
        assert seen[-1] == rung
        dests = [dev(np.full((3, 6), np.nan, np.float32)) for _ in range(2)]  # TPSP's epilogue, two ranks' rows
        queue_linear_rows_to("device", dev(a), dev(w), None, dests, 3)
        got = np.concatenate([host(d) for d in dests])
        np.testing.assert_allclose(got[:5], a @ w.T, rtol=1e-5, atol=1e-5)
        assert (got[5:] == 0).all() and seen[-2:] == [rung, rung]
    linear(dev(a), dev(w), variant="naive")
    assert seen[-1] == "naive"
    monkeypatch.setenv(VARIANT_ENV, "fastest")
    with pytest.raises(ValueError, match=f"{VARIANT_ENV}='fastest' is not a matmul variant; expected one of naive"):
        linear(dev(a), dev(w))
