"""Reference collectives on one rank, and the row-sum kernels they use (vtnumba.kernels.reduce).

Kernels: host references vs float64 numpy; the @cuda.jit kernels on the device target (numba's
simulator, or the GPU under ``VTNUMBA_TARGET=cuda``) vs the host references (fresh random
inputs, NaN-poisoned outputs, odd shapes).  Their PTX for cc 8.0 and 9.0 is checked with
every other kernel's, in tests/test_kernels_ptx.py.
Multi-rank correctness of the collectives is in tests/mpi/test_dist_peer_mpi.py.
"""


import numpy as np
import pytest

from vtnumba import dist
from vtnumba.backend.cpu import CPUBackend
from vtnumba.kernels import reduce as kr

SHAPES = [(1, 1), (1, 7), (3, 33), (2, 65), (7, 5)]


def poisoned(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype=dtype)


# ---------------------------------------------------------------------------- host references
@pytest.mark.parametrize("R,H", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_references_match_float64_numpy(R, H, dtype, rng):
    T = 2 * R + 1
    a, b, c = (rng.standard_normal((T, H)).astype(dtype) for _ in range(3))
    for row0, nrows in [(0, R), (R, R), (2 * R, 1), (T - 1, 1 if R >= 1 else 0), (0, 0)]:
        nrows = min(nrows, R)
        out = poisoned((R, H), dtype)
        kr.copy_rows_host(out, a, row0, nrows)
        want = np.zeros((R, H))
        want[:nrows] = a[row0:row0 + nrows]
        np.testing.assert_array_equal(out, want.astype(dtype))
        out = poisoned((R, H), dtype)
        kr.add_rows_host(out, a, b, row0, nrows)
        want[:nrows] = a[row0:row0 + nrows].astype(np.float64) + b[row0:row0 + nrows]
        np.testing.assert_allclose(out, want, rtol=1e-6)
        kr.accumulate_rows_host(out, c, row0, nrows)
        want[:nrows] += c[row0:row0 + nrows]
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        assert not np.isnan(out).any()


def test_accumulate_leaves_padding_rows_alone(rng):
    out = rng.standard_normal((4, 3)).astype(np.float32)
    keep = out[2:].copy()
    kr.accumulate_rows_host(out, rng.standard_normal((5, 3)).astype(np.float32), 1, 2)
    np.testing.assert_array_equal(out[2:], keep)


# ---------------------------------------------------------------------------- device kernels
@pytest.mark.parametrize("R,H", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cuda_kernels_match_host_references_on_the_device(device_backend, R, H, dtype, rng):
    # (float16 too: on a GPU numba links its half-precision "+" in at launch, from CUDA C++ --
    # the PTX alone cannot show that it works.)
    from numba import cuda

    from vtnumba.kernels import reduce_cuda

    T = R + 2
    a, b, c = (rng.standard_normal((T, H)).astype(dtype) for _ in range(3))
    row0 = 1
    nrows = R - 1 if R > 1 else 1  # R > 1: the last row is padding (zeros / untouched)
    rtol = 1e-6 if dtype == np.float32 else 1e-3  # float16: each sum is rounded once, on both sides

    for name, args in [("copy_rows", (a,)), ("add_rows", (a, b)), ("accumulate_rows", (c,))]:
        want = poisoned((R, H), dtype) if name != "accumulate_rows" else \
            rng.standard_normal((R, H)).astype(dtype)
        got = device_backend.asarray(want)
        kr.HOST_REFERENCES[name](want, *args, row0, nrows)
        reduce_cuda.launch(name, cuda.default_stream(), got, *[device_backend.asarray(x) for x in args], row0, nrows)
        np.testing.assert_allclose(device_backend.to_host(got), want, rtol=rtol, err_msg=name)


@pytest.mark.parametrize("kind", ["cpu", "device"])
def test_sum_rows_on_cpu_and_device_backends(request, kind, rng):
    be = CPUBackend() if kind == "cpu" else request.getfixturevalue("device_backend")
    srcs = [rng.standard_normal((6, 7)).astype(np.float32) for _ in range(3)]
    q = be.create_queue()
    out, args = be.asarray(poisoned((3, 7))), [be.asarray(s) for s in srcs]
    for k in (1, 2, 3):
        kr.sum_rows(out, args[:k], 4, 2, backend=be, queue=q)
        be.synchronize(q)
        w = np.zeros((3, 7), np.float32)
        w[:2] = sum(s[4:6] for s in srcs[:k])
        np.testing.assert_allclose(be.to_host(out), w, rtol=1e-6)
    be.destroy_queue(q)


def test_sum_rows_validation():
    be = CPUBackend()
    q = be.create_queue()
    out = np.zeros((2, 3), np.float32)
    a = np.zeros((4, 3), np.float32)
    for args, exc, match in [
        ((np.zeros(3, np.float32), [a], 0, 1), ValueError, "out must be a 2-D array"),
        ((out, [], 0, 1), ValueError, "sources is empty"),
        ((out, [a], -1, 1), ValueError, "row0=-1 must be a non-negative int"),
        ((out, [a], 0, 3), ValueError, r"nrows=3 must be an int in 0..2"),
        ((out, [np.zeros((4, 2), np.float32)], 0, 1), ValueError, r"sources\[0\] has shape \(4, 2\); expected"),
        ((out, [a.astype(np.float64)], 0, 1), TypeError, "sources\\[0\\] has dtype float64; expected out's float32"),
        ((out, [a], 3, 2), ValueError, r"rows \[3, 5\) run past sources\[0\]'s 4 rows"),
        # out inside a source: the later steps would read what the first one wrote
        ((a[:2], [a[2:], a[1:3], a[:2]], 0, 2), ValueError, r"out and sources\[1\] share memory"),
    ]:
        with pytest.raises(exc, match=match):
            kr.sum_rows(*args, backend=be, queue=q)


# ---------------------------------------------------------------------------- collectives, one rank
@pytest.fixture(params=["cpu", "device"])
def setup(request, group):
    be = CPUBackend() if request.param == "cpu" else request.getfixturevalue("device_backend")

    def put(dst, host):
        """Write ``host`` into ``dst`` (a view of the peer buffer) in place, as a producer kernel would."""
        q = be.create_queue("put")
        be.copy(q, dst, np.ascontiguousarray(host, dtype=np.float32), dst.nbytes)
        be.synchronize(q)
        be.destroy_queue(q)

    with dist.PeerBuffers(4096, group, be) as pb, dist.PeerSignals(group, backend=be, timeout_s=10) as sig:
        yield pb, sig, be.asarray, be.to_host, put


@pytest.mark.parametrize("T,H", [(1, 1), (3, 7), (5, 33)])
def test_one_rank_collectives_are_copies(setup, T, H, rng):
    pb, sig, wrap, unwrap, put = setup
    x = rng.standard_normal((T, H)).astype(np.float32)
    out = wrap(poisoned((T, H)))
    dist.reduce_scatter(pb, wrap(x), out, sig)
    np.testing.assert_array_equal(unwrap(out), x)
    g = wrap(poisoned((T, H)))
    dist.all_gather(pb, out, g, sig)
    np.testing.assert_array_equal(unwrap(g), x)
    # zero-copy input: x produced directly in the local peer buffer, at an offset
    (xin,) = pb.views(np.float32, (T, H), offset=64)
    put(xin, x + 1)
    out2 = wrap(poisoned((T, H)))
    dist.reduce_scatter(pb, xin, out2, sig, offset=64)
    np.testing.assert_array_equal(unwrap(out2), x + 1)
    assert sig.epoch == 3
    # in-place all-gather: out is the peer buffer, the shard already sits in its own rows
    (gin,) = pb.views(np.float32, (T, H), offset=128)
    put(gin, x)
    dist.all_gather(pb, gin[0:T], gin, sig, offset=128)
    np.testing.assert_array_equal(unwrap(gin), x)
    # in place with the shard elsewhere: it is staged into out's rows
    (gin2,) = pb.views(np.float32, (T, H), offset=1024)
    put(gin2, poisoned((T, H)))
    dist.all_gather(pb, wrap(x - 1), gin2, sig, offset=1024)
    np.testing.assert_array_equal(unwrap(gin2), x - 1)


def test_mpi_baselines_one_rank(group, rng):
    x = rng.standard_normal((5, 3)).astype(np.float32)
    out = poisoned((5, 3))
    dist.mpi_reduce_scatter(x, out, group)
    np.testing.assert_array_equal(out, x)
    g = poisoned((5, 3))
    dist.mpi_all_gather(out, g, group, timeout_s=None)
    np.testing.assert_array_equal(g, x)
    with pytest.raises(TypeError, match="supports float32/float64/int32/int64"):
        dist.mpi_reduce_scatter(x.astype(np.float16), out.astype(np.float16), group)
    with pytest.raises(ValueError, match=r"out has shape \(4, 3\); expected \(R, H\) = \(5, 3\)"):
        dist.mpi_reduce_scatter(x, poisoned((4, 3)), group)
    with pytest.raises(ValueError, match=r"expected \(T, 3\) with 1 <= T <= tp\*R = 5"):
        dist.mpi_all_gather(x, poisoned((6, 3)), group)


def test_collective_argument_errors_keep_the_channel_usable(group, rng):
    be = CPUBackend()
    with dist.PeerBuffers(256, group, be) as pb, dist.PeerSignals(group, backend=be, timeout_s=5) as sig:
        x = rng.standard_normal((4, 4)).astype(np.float32)
        for args, kw, exc, match in [
            ((x, poisoned((3, 4))), {}, ValueError, r"out has shape \(3, 4\); expected \(R, H\) = \(4, 4\)"),
            ((x, poisoned((4, 4), np.float64)), {}, TypeError, "out has dtype float64; expected x's float32"),
            ((x[:, :2], poisoned((4, 2))), {}, ValueError, "x .* must be C-contiguous"),
            ((x, poisoned((4, 4))), {"offset": 2}, ValueError, "offset=2 must be a non-negative multiple of 4"),
            ((x, poisoned((4, 4))), {"offset": 256}, ValueError, r"needs 320 bytes of peer buffer; pb has nbytes=256"),
            ((np.zeros((0, 4), np.float32), poisoned((0, 4))), {}, ValueError, "at least one row"),
        ]:
            with pytest.raises(exc, match=match):
                dist.reduce_scatter(pb, *args, sig, **kw)
        with pytest.raises(ValueError, match=r"expected \(T, 4\) with 1 <= T <= tp\*R = 4"):
            dist.all_gather(pb, x, poisoned((5, 4)), sig)
        with pytest.raises(TypeError, match="signals must be a PeerSignals"):
            dist.reduce_scatter(pb, x, poisoned((4, 4)), None)
        with pytest.raises(TypeError, match="pb must be a PeerBuffers"):
            dist.all_gather(None, x, poisoned((4, 4)), sig)
        # An out over the bytes where x is staged: the peers would read rows already overwritten
        # (wrong sums on their side, no error anywhere).  Past the staged bytes it is fine.
        (over,) = pb.views(np.float32, (4, 4), offset=32)
        with pytest.raises(ValueError, match=r"out shares memory with bytes 0\.\.64 of this rank's peer buffer, "
                                             r"where x is staged"):
            dist.reduce_scatter(pb, x, over, sig)
        with pytest.raises(ValueError, match=r"bytes 0\.\.64 .* where x_shard is staged .* the in-place layout"):
            dist.all_gather(pb, x, over, sig)
        # Nor x itself: this rank's rows are summed from x while out is written.  (Refused only
        # inside the step, it named an internal sources[0] and left QueuedSignals unusable.)
        with pytest.raises(ValueError, match=r"out and x share memory"):
            dist.reduce_scatter(pb, x, x, sig)
        (past,) = pb.views(np.float32, (4, 4), offset=64)
        dist.reduce_scatter(pb, x, past, sig)
        np.testing.assert_array_equal(past, x)
        dist.all_gather(pb, x + 1, past, sig)
        np.testing.assert_array_equal(past, x + 1)
        # every failed call used up its epoch consistently; the next real call works
        out = poisoned((4, 4))
        dist.reduce_scatter(pb, x, out, sig)
        np.testing.assert_array_equal(out, x)
    with dist.PeerSignals(group, names=("consumed",)) as few, dist.PeerBuffers(64, group, be) as pb2:
        with pytest.raises(ValueError, match="signals needs a flag named 'inbox_ready'"):
            dist.reduce_scatter(pb2, x, poisoned((4, 4)), few)


def test_peer_traffic_factors_count_what_each_collective_moves():
    # In units of S, all ranks together: reduce-scatter reads each rank's block from n buffers and
    # writes it; all-gather reads n shards and writes them (in place: only the peers' n-1).
    from vtnumba.bench.peer import traffic_factor

    assert [traffic_factor("reduce_scatter", impl, 2) for impl in ("peer-in-buffer", "peer-staged")] == [3, 5]
    assert [traffic_factor("all_gather", impl, 2) for impl in ("peer-in-buffer", "peer-staged", "peer-in-place")] \
        == [4, 6, 2]
    assert traffic_factor("reduce_scatter", "peer-in-buffer", 4) == 5
    assert traffic_factor("all_gather", "peer-in-place", 4) == 6
    # The queued calls move the same bytes as the host-flag ones.
    assert traffic_factor("reduce_scatter", "peer-in-buffer-queued", 2) == 3
    assert traffic_factor("all_gather", "peer-in-place-queued", 3) == traffic_factor("all_gather", "peer-in-place", 3)
    with pytest.raises(ValueError, match="case='broadcast'"):
        traffic_factor("broadcast", "peer-in-buffer", 2)


def test_bench_peer_runs_on_one_rank_and_follows_the_schema():
    import argparse

    from vtnumba.bench import peer, schema

    args = argparse.Namespace(quick=True, sizes=[0.25], repeat=2)
    d = peer.run(args)
    schema.validate_suite(d)
    assert d["suite"] == "peer" and d["ranks"] == 1
    impls = {(r["case"], r["impl"]) for r in d["results"]}
    expected = {(c, i) for c in ("reduce_scatter", "all_gather") for i in ("peer-in-buffer", "peer-staged", "mpi4py")}
    expected |= {("all_gather", "peer-in-place"), ("reduce_scatter", "peer-in-buffer-queued"),
                 ("all_gather", "peer-in-place-queued")}
    if d["target"] != "cuda":  # MPI_IN_PLACE needs host memory: the pip mpich is not CUDA-aware
        expected.add(("all_gather", "mpi4py-in-place"))
    assert impls == expected
    assert all(r["value"] > 0 for r in d["results"])
    assert "reduce_scatter peer-in-buffer/mpi4py geomean" in d["ratios"]
    assert any("1 rank" in n for n in d["notes"])


def test_bench_peer_names_the_size_it_measured():
    # 0.01 MiB is less than a row (16 KiB): S is rounded up to one row per rank, and busbw
    # used it, but the row said 0.01 MiB -- busbw x time then came to twice the bytes named.
    import argparse

    from vtnumba.bench import peer, schema

    d = peer.run(argparse.Namespace(quick=True, sizes=[0.01], repeat=2))
    assert {r["size"] for r in d["results"]} == {16 * 1024 / 2**20}
    # ... and the ratios name it as the rows print it (at 3 ranks the rows of 1 MiB are 1008 KiB:
    # "@0.984375MiB" missed gpu_check's patterns).
    assert any(k.endswith("@16KiB") for k in d["ratios"]) and not any("@0.01" in k for k in d["ratios"])
    assert schema.format_bytes(1008 * 1024).replace(" ", "") == "1008KiB"


def test_allreduce_max_keeps_nan(group):
    # MPI's MAX drops a NaN (every comparison with it is false): ranks then disagreed, and
    # mpi/tpsp_model.py printed OK on one rank and failed on another.
    from vtnumba.dist import allreduce_max

    assert allreduce_max(2.5, group, "x") == 2.5
    assert allreduce_max(float("nan"), group, "x") != allreduce_max(float("nan"), group, "x")  # NaN
    assert allreduce_max(float("-inf"), group, "x") == float("-inf")


def test_a_row_parallel_layer_refuses_a_group_it_was_not_built_for(group):
    from vtnumba.nn import ParallelMLPBlock, RowParallelLinear

    row = RowParallelLinear(4, 3, tp_size=2, tp_rank=0)  # the half of rank 0 of 2, on a group of 1
    x = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match=r"built for rank 0 of tp_size=2 but is run on rank 0 of group .* with 1 "
                                         r"ranks"):
        row(x, group)
    block = ParallelMLPBlock(4, 8, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match=r"RowParallelLinear was built for rank 1 of tp_size=2"):
        block.forward_regular(np.ones((2, 4), np.float32), np.ones((2, 4), np.float32), group)
    assert RowParallelLinear(4, 3, tp_size=1, tp_rank=0)(np.ones((2, 4), np.float32), group).shape == (2, 3)
