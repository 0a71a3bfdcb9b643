"""The fused TPSP op against float64 numpy of the whole layer (run under mpiexec -n 2 and -n 3).

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_tpsp_fused.py -q

Every rank builds the *whole* layer's inputs from one seed (so it can compute the float64
reference ``norm(X @ W.T + bias + residual)`` of all T rows itself), keeps its K slice and
its residual shard, and checks the fused op's ``gathered`` (all rows) and ``new_residual``
(its shard).  Checks are made collective, so a failure on one rank fails every rank.
"""


import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import collectively, group  # noqa: F401 (group is a fixture)

from vtnumba.dist import list_segments
from vtnumba.tpsp import (
    CudaTPSPBackend,
    HostTPSPBackend,
    TPSPConfig,
    TPSPOp,
    regular_matmul_ar_norm,
    regular_matmul_rs_norm_ag,
    shard_residual,
    token_range,
)

COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(180)]
REL_TOL = 1e-5


class Layer:
    """The whole layer's inputs (same on every rank) and this rank's slices of them."""

    def __init__(self, group, T, H, k_base, norm, with_bias, seed):
        tp, me = group.size, group.rank
        rng = np.random.default_rng(seed)
        self.ks = [k_base + r for r in range(tp)]  # an uneven K split, no multiple of a tile
        K = sum(self.ks)
        f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
        self.X, self.W = f(T, K), f(H, K) / np.float32(np.sqrt(K))
        self.bias = f(H) if with_bias else None
        self.res_full = f(T, H)
        self.nw = (1 + 0.1 * f(H)).astype(np.float32)
        self.nb = f(H) if (norm == "layer" and with_bias) else None
        off = sum(self.ks[:me])
        self.x = np.ascontiguousarray(self.X[:, off:off + self.ks[me]])
        self.w = np.ascontiguousarray(self.W[:, off:off + self.ks[me]])
        self.res = shard_residual(self.res_full, tp, me)
        self.T, self.H, self.norm, self.eps, self.tp, self.me = T, H, norm, 1e-5, tp, me

    def reference(self):
        z = self.X.astype(np.float64) @ self.W.T.astype(np.float64) + self.res_full
        if self.bias is not None:
            z += self.bias
        if self.norm == "rms":
            out = z / np.sqrt((z * z).mean(-1, keepdims=True) + self.eps) * self.nw
        else:
            mu = z.mean(-1, keepdims=True)
            out = (z - mu) / np.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + self.eps) * self.nw
            if self.nb is not None:
                out += self.nb
        return out, z

    def check(self, gathered, new_residual, tol=REL_TOL):
        ref, z = self.reference()
        assert gathered.shape == (self.T, self.H)
        err = np.max(np.abs(gathered - ref)) / np.max(np.abs(ref))
        assert err <= tol, f"gathered: relative error {err:.3g} > {tol}"
        lo, hi = token_range(self.T, self.tp, self.me)
        if hi > lo:
            err = np.max(np.abs(new_residual[: hi - lo] - z[lo:hi])) / np.max(np.abs(z))
            assert err <= tol, f"new_residual: relative error {err:.3g} > {tol}"
        pad = new_residual[hi - lo:]  # padding rows: z = bias + residual padding (0)
        expect = np.zeros_like(pad) if self.bias is None else np.broadcast_to(self.bias, pad.shape)
        np.testing.assert_allclose(pad, expect, atol=1e-6)


@pytest.fixture(scope="module", params=["pull", "push"])
def host_backend(request, group):
    before = set(list_segments())
    be = HostTPSPBackend("tp", exchange=request.param)
    handle = be.open(tp_size=group.size, hidden_size=8 * group.size, max_batched_tokens=1000, name="fused")
    yield be, handle
    be.close(handle)
    be.close()
    leftover = set(list_segments()) - before
    assert not leftover, f"/dev/shm segments left behind: {leftover}"


def _token_counts(tp):
    return sorted({1, max(1, tp - 1), tp, 129, 1000})


@pytest.mark.parametrize("norm, with_bias", [("rms", True), ("rms", False), ("layer", True), ("layer", False)])
def test_fused_matches_float64_for_all_token_counts_and_chunks(host_backend, group, norm, with_bias):
    be, handle = host_backend
    H = 8 * group.size

    def body():
        for T in _token_counts(group.size):
            R = -(-T // group.size)
            for chunk in sorted({1, 7, 64, handle.max_chunk_rows}):
                if chunk == 1 and R > 200:
                    continue  # 500 one-row steps would only test the same code slower
                layer = Layer(group, T, H, 37, norm, with_bias, seed=T * 31 + chunk)
                out = np.full((T, H), np.nan, np.float32)  # NaN-poisoned: every row must be written
                new_res = np.full((R, H), np.nan, np.float32)
                got, got_res = be.tpsp_matmul_rs_norm_ag(handle, layer.x, layer.w, layer.bias, layer.res, layer.nw,
                                                         layer.eps, layer.nb, norm=norm, config=chunk, out=out,
                                                         new_residual=new_res)
                assert got is out and got_res is new_res
                layer.check(got, got_res)

    collectively(body)


def test_fused_allocates_outputs_and_updates_the_residual_in_place(host_backend, group):
    be, handle = host_backend

    def body():
        layer = Layer(group, 33, 8 * group.size, 5, "rms", True, seed=3)
        out, new_res = be.tpsp_matmul_rs_norm_ag(handle, layer.x, layer.w, layer.bias, layer.res, layer.nw,
                                                 layer.eps)
        layer.check(out, new_res)
        res = layer.res.copy()
        out2, new_res2 = be.tpsp_matmul_rs_norm_ag(handle, layer.x, layer.w, layer.bias, res, layer.nw, layer.eps,
                                                   new_residual=res)
        assert new_res2 is res
        layer.check(out2, new_res2)

    collectively(body)


def test_many_calls_in_a_row_keep_the_ranks_in_step(host_backend, group):
    """Slots are reused across calls (epochs never reset): alternate shapes and chunk sizes."""
    be, handle = host_backend

    def body():
        for i in range(12):
            T = (5, 64, 17, 300)[i % 4]
            layer = Layer(group, T, 8 * group.size, 9, ("rms", "layer")[i % 2], True, seed=100 + i)
            chunk = (3, 64, handle.max_chunk_rows, 16)[i % 4]
            got, res = be.tpsp_matmul_rs_norm_ag(handle, layer.x, layer.w, layer.bias, layer.res, layer.nw, layer.eps,
                                                 layer.nb, norm=layer.norm, config=chunk)
            layer.check(got, res)

    collectively(body)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_regular_forward_matches_float64(group, norm):
    def body():
        for T in (1, group.size + 1, 129):
            layer = Layer(group, T, 8 * group.size, 6, norm, True, seed=T)
            got, res = regular_matmul_rs_norm_ag(group, layer.x, layer.w, layer.bias, layer.res, layer.nw, layer.eps,
                                                 layer.nb, norm=norm)
            layer.check(got, res)
            full, full_res = regular_matmul_ar_norm(group, layer.x, layer.w, layer.bias, layer.res_full, layer.nw,
                                                    layer.eps, layer.nb, norm=norm)
            ref, z = layer.reference()
            assert np.max(np.abs(full - ref)) / np.max(np.abs(ref)) <= REL_TOL
            assert np.max(np.abs(full_res - z)) / np.max(np.abs(z)) <= REL_TOL

    collectively(body)


def test_the_regular_forwards_refuse_calls_the_ranks_disagree_on(group):
    """MPI cannot see that two ranks passed different shapes to one collective: the regular
    forwards returned wrong rows (different T), or -- one rank refusing its arguments before
    the collective -- matched the others' collective with its next call.  Now every rank says
    what is wrong, and the next call works."""
    me, n = group.rank, group.size
    rng = np.random.default_rng(me)

    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w, b, nw, H = f(8, 4), f(8), np.ones(8, np.float32), 8
    T = 2 * n
    with pytest.raises(ValueError, match=r"called it with different arguments \(rank 0: T=%d, H=8, norm=rms, "
                                         r"eps=1e-05, bias=given, norm_bias=None; rank 1: T=%d" % (T, T + 1)):
        regular_matmul_rs_norm_ag(group, f(T + (me > 0) * me, 4), w, b, f(-(-(T + me) // n), H), nw, 1e-5)
    if me == 1:
        with pytest.raises(ValueError, match=r"w has shape \(8, 4\)"):
            regular_matmul_rs_norm_ag(group, f(T, 5), w, b, f(2, H), nw, 1e-5)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of group .* refused their arguments"):
            regular_matmul_rs_norm_ag(group, f(T, 4), w, b, f(2, H), nw, 1e-5)
    with pytest.raises(ValueError, match="called it with different arguments"):
        regular_matmul_ar_norm(group, f(4 + me, 4), w, b, f(4 + me, H), nw, 1e-5, norm="rms" if me else "layer")
    # An eps, or a bias, on one rank only: each rank normalised its rows its own way, and the
    # outputs came back wrong (or, replicated, different on every rank) with no error.
    with pytest.raises(ValueError, match=r"eps=1e-05, bias=given.*eps=1, bias=given.*the same T, H, norm, eps, bias, "
                                         r"norm_bias"):
        regular_matmul_rs_norm_ag(group, f(T, 4), w, b, f(2, H), nw, 1.0 if me else 1e-5)
    with pytest.raises(ValueError, match=r"rank 0: .*bias=given.*rank 1: .*bias=None"):
        regular_matmul_rs_norm_ag(group, f(T, 4), w, None if me else b, f(2, H), nw, 1e-5)
    with pytest.raises(ValueError, match=r"eps=1e-05.*eps=0.5"):
        regular_matmul_ar_norm(group, f(4, 4), w, b, f(4, H), nw, 0.5 if me else 1e-5)
    # Not an array at all (x=None on rank 1, through the op a model calls): a TypeError there,
    # and the others hear of it at once (left waiting, they would raise WaitTimeout instead).
    op = TPSPOp(None, "bad-input", group=group, timeout_s=20)
    x = None if me == 1 else f(T, 4)
    if me == 1:
        with pytest.raises(TypeError, match="x must be an array, got NoneType"):
            op(x, w, b, f(2, H), nw, 1e-5)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of group .* refused their arguments"):
            op(x, w, b, f(2, H), nw, 1e-5)

    def ok():
        got, _ = regular_matmul_rs_norm_ag(group, f(T, 4), w, b, f(2, H), nw, 1e-5)
        assert got.shape == (T, H) and np.isfinite(got).all()

    collectively(ok)


def test_row_parallel_linear_refuses_token_counts_the_ranks_disagree_on(group):
    # The all-reduce of different lengths returned garbage rows with no error; a rank refusing
    # its input left the others in the all-reduce for the whole timeout.
    from vtnumba.nn import RowParallelLinear

    me, n = group.rank, group.size
    proj = RowParallelLinear(3 * n, 4, seed=1)
    lo, hi = proj.in_range
    x = np.ones((4 + me, hi - lo), np.float32)
    with pytest.raises(ValueError, match=r"RowParallelLinear: .* different arguments \(rank 0: T=4; rank 1: T=5"):
        proj(x, group)
    if me == 1:
        with pytest.raises(ValueError, match=r"x_local has shape \(4, 7\)"):
            proj(np.ones((4, 7), np.float32), group)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of group .* refused their arguments"):
            proj(np.ones((4, hi - lo), np.float32), group)

    def ok():
        full = proj(np.ones((4, hi - lo), np.float32), group)
        assert full.shape == (4, 4) and np.isfinite(full).all()

    collectively(ok)


def test_threaded_host_queue_gives_the_same_result(group):
    """Matmuls on a worker thread (overlapping the exchange) must not change the result."""
    def body():
        be = HostTPSPBackend("tp", threaded=True)
        h = be.open(tp_size=group.size, hidden_size=8 * group.size, max_batched_tokens=300, name="threaded")
        try:
            for T, chunk in ((300, 16), (7, 1), (64, 100)):
                layer = Layer(group, T, 8 * group.size, 11, "layer", True, seed=T)
                got, res = be.tpsp_matmul_rs_norm_ag(h, layer.x, layer.w, layer.bias, layer.res, layer.nw, layer.eps,
                                                     layer.nb, norm="layer", config=chunk)
                layer.check(got, res)
        finally:
            be.close(h)
            be.close()

    collectively(body)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange, T, chunk, norm", [("push", 5, 1, "layer"), ("pull", 3, 8, "rms"),
                                                      ("push", 8, 4, "rms")])
def test_cuda_backend_on_the_device(group, device_backend, exchange, T, chunk, norm):
    """CudaTPSPBackend with the @cuda.jit kernels on the device target (numba's simulator, or the
    GPU under VTNUMBA_TARGET=cuda): tiny shapes, for the simulator's ~7000 threads/s."""

    def body():
        H = 8 * group.size
        be = CudaTPSPBackend("tp", exchange=exchange, backend=device_backend)
        h = be.open(tp_size=group.size, hidden_size=H, max_batched_tokens=8, name="device")
        try:
            layer = Layer(group, T, H, 8, norm, True, seed=T + chunk)
            d = device_backend.asarray
            R = -(-T // group.size)
            out = d(np.full((T, H), np.nan, np.float32))
            new_res = d(np.full((R, H), np.nan, np.float32))
            # The third case bounds the exchange to one thread block (TPSP's SM budget on a GPU):
            # each of its kernels walks all of a chunk's rows with that one block.
            config = TPSPConfig(chunk, sm_count_target=1) if T == 8 else chunk
            be.tpsp_matmul_rs_norm_ag(h, d(layer.x), d(layer.w), d(layer.bias), d(layer.res), d(layer.nw), layer.eps,
                                      None if layer.nb is None else d(layer.nb), norm=norm, config=config, out=out,
                                      new_residual=new_res)
            layer.check(device_backend.to_host(out), device_backend.to_host(new_res), tol=1e-5)
            with pytest.raises(TypeError, match="device arrays"):
                be.tpsp_matmul_rs_norm_ag(h, layer.x, layer.w, None, layer.res, layer.nw, layer.eps)
        finally:
            be.close(h)
            be.close()

    collectively(body)
