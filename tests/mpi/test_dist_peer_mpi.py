"""Peer buffers, signals and the reference collectives across ranks (mpiexec -n 2 and -n 3).

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_dist_peer_mpi.py -q

Checks are collective (allgathered before asserting) so a failure on one rank fails the
test everywhere instead of leaving a peer blocked; every wait has a short timeout.
"""

import os
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

from conftest import ON_GPU
from mpi_helpers import COMM, collectively
from vtnumba import dist
from vtnumba.backend.arrays import to_host
from vtnumba.backend.cpu import CPUBackend
from vtnumba.dist import shm
from vtnumba.dist.peer_buffers import PeerAccessError

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(180)]
TIMEOUT = 20.0


def errors_everywhere(fn) -> list[str]:
    """Run ``fn`` on every rank and return every rank's ``"Type: message"`` (or "no exception")."""
    try:
        fn()
        got = "no exception"
    except BaseException as exc:  # noqa: BLE001
        got = f"{type(exc).__name__}: {exc}"
    return COMM.allgather(got)


def same_error_everywhere(exc_type, fn) -> str:
    everyone = errors_everywhere(fn)
    prefix = f"{exc_type.__name__}: "
    assert all(g.startswith(prefix) for g in everyone), everyone
    assert len(set(everyone)) == 1, everyone
    return everyone[0][len(prefix):]


def our_segments() -> list[str]:
    """vtnumba segments in /dev/shm made by any rank of this job (names carry the creator's pid)."""
    pids = COMM.allgather(os.getpid())
    return [s for s in shm.list_segments() if any(f"-{p}-" in s for p in pids)]


@pytest.fixture(scope="module")
def tp():
    dist.destroy_distributed()
    g = dist.init_distributed()
    yield g
    dist.destroy_distributed()


@pytest.fixture
def shm_unchanged():
    """/dev/shm holds the same entries of this job before and after the test, on every rank.

    Only names made by this job's ranks count: other jobs on the machine may create and
    remove vtnumba segments at the same time."""
    COMM.Barrier()
    before = our_segments()
    yield
    COMM.Barrier()
    after = our_segments()
    diffs = COMM.allgather((sorted(set(after) - set(before)), sorted(set(before) - set(after))))
    assert all(d == ([], []) for d in diffs), f"/dev/shm changed: (added, removed) per rank: {diffs}"


@pytest.fixture(params=["cpu", "device"])
def backend(request):
    """cpu, or the device target: numba's simulator, or the GPU under VTNUMBA_TARGET=cuda."""
    if request.param == "device":
        return request.getfixturevalue("device_backend")
    return CPUBackend()


def host_write(arr, values: np.ndarray) -> None:
    """Store ``values`` into ``arr`` in place: numpy directly, a device array (local or a
    peer's) with a host-to-device copy."""
    if isinstance(arr, np.ndarray):
        arr[...] = values
    else:
        from numba import cuda

        arr.copy_to_device(values)
        # From pageable memory that copy may return before the bytes land on the GPU, and the
        # peer's read after the barrier is not ordered after it: wait for it here.
        cuda.default_stream().synchronize()


def pattern(rank: int, n: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng(1000 * salt + rank).standard_normal(n).astype(np.float32)


# ---------------------------------------------------------------------------- peer memory
def test_every_rank_reads_every_peers_pattern(tp, backend, shm_unchanged):
    n, me = tp.size, tp.rank
    count = 257  # odd, so buffers are not a round number of anything

    def body():
        with dist.PeerBuffers(count * 4 * 2, tp, backend, timeout_s=TIMEOUT) as pb:
            assert not our_segments(), "names must be unlinked as soon as every rank has mapped them"
            views = pb.views(np.float32, (2, count))
            host_write(views[me][0], pattern(me, count))
            dist.barrier(tp)
            for j in range(n):
                np.testing.assert_array_equal(to_host(views[j][0]), pattern(j, count), err_msg=f"peer {j}")
                np.testing.assert_array_equal(to_host(pb.peer(j))[:count * 4],
                                              pattern(j, count).view(np.uint8))
            # remote writes: each rank writes into the next rank's second row
            nxt = (me + 1) % n
            host_write(views[nxt][1], pattern(me, count, salt=7))
            dist.barrier(tp)
            np.testing.assert_array_equal(to_host(views[me][1]), pattern((me - 1) % n, count, salt=7))
            if pb.kind != "shm":
                _kernel_reads_a_peer(pb, backend, views, me, n, count)
            dist.barrier(tp)

    collectively(body)


def _kernel_reads_a_peer(pb, backend, views, me, n, count):
    """A kernel (simulated, or real on a GPU) copies a peer's row into local memory."""
    from vtnumba.kernels.reduce_cuda import launch

    src = (me + 1) % n
    q = pb.queue
    dst = backend.alloc(count * 4)
    dst_view = dst.view(np.float32, (1, count))
    backend.submit(q, lambda stream: launch("copy_rows", stream, dst_view, views[src], 0, 1), name="peer_read")
    backend.synchronize(q)
    np.testing.assert_array_equal(to_host(dst_view)[0], pattern(src, count))
    backend.free(dst)


def test_a_rank_raising_mid_test_leaves_dev_shm_unchanged(tp, shm_unchanged):
    me = tp.rank
    errs = errors_everywhere(lambda: _raise_inside(tp, me))
    assert errs[1].startswith("ZeroDivisionError") and all(e == "no exception" for r, e in enumerate(errs) if r != 1)


def _raise_inside(tp, me):
    with dist.PeerBuffers(4096, tp, CPUBackend(), timeout_s=TIMEOUT) as pb:
        pb.views(np.uint8, 8)[me][:] = me
        if me == 1:
            raise ZeroDivisionError("rank 1 fails mid-test")  # __exit__ still closes collectively


@pytest.mark.parametrize("stage", ["export", "open"])
def test_one_rank_refusing_fails_every_rank_the_same_way(tp, stage, shm_unchanged):
    n = tp.size
    msg = same_error_everywhere(
        PeerAccessError, lambda: dist.PeerBuffers(4096, tp, CPUBackend(), timeout_s=TIMEOUT, _fail_on_rank=n - 1,
                                                  _fail_stage=stage))
    assert f"PeerBuffers {stage}: failed on 1 of {n} ranks" in msg and f"rank {n - 1}: forced" in msg
    got = COMM.allgather(dist.PeerBuffers.try_create(4096, tp, CPUBackend(), _fail_on_rank=0, _fail_stage=stage))
    assert got == [None] * n


def test_refusal_from_the_environment(tp, monkeypatch, shm_unchanged):
    monkeypatch.setenv("VTNUMBA_FAIL_PEER_OPEN", "1")
    t0 = time.perf_counter()
    assert COMM.allgather(dist.PeerBuffers.try_create(4096, tp, CPUBackend())) == [None] * tp.size
    assert time.perf_counter() - t0 < TIMEOUT / 2  # agreed, not timed out


def test_sizes_that_differ_across_ranks(tp, shm_unchanged):
    me = tp.rank
    msg = same_error_everywhere(ValueError, lambda: dist.PeerBuffers(1024 * (me + 1), tp, CPUBackend()))
    assert msg.startswith("PeerBuffers(nbytes=...) must be the same on every rank of group 'tp'; got rank 0: 1024, "
                          "rank 1: 2048")
    msg = same_error_everywhere(ValueError, lambda: dist.PeerBuffers(0 if me == 1 else 64, tp, CPUBackend()))
    assert "rank 1: nbytes=0 is not a valid size" in msg


def test_ranks_on_different_targets_are_refused_everywhere(tp, device_backend, shm_unchanged):
    # A rank whose 'auto' fell back to cpu beside ranks on a GPU could not open their memory:
    # every rank refuses at once, naming each rank's target, instead of failing later.
    me = tp.rank
    msg = same_error_everywhere(ValueError, lambda: dist.PeerBuffers(1024, tp, device_backend if me == 1
                                                                     else CPUBackend()))
    device = "cuda (CUDA IPC)" if ON_GPU else "cudasim (shared memory seen as device arrays)"
    assert msg.startswith("PeerBuffers: the ranks of group 'tp' run on different targets, whose memory cannot be "
                          f"shared (rank 0: cpu (shared memory), rank 1: {device}"), msg


# ---------------------------------------------------------------------------- signals
def test_flags_order_data_across_ranks(tp, shm_unchanged):
    """Ping-pong: producer writes data then raises a flag; the consumer must see the data."""
    n, me = tp.size, tp.rank
    steps = 200

    def body():
        with dist.PeerBuffers(4096, tp, CPUBackend(), timeout_s=TIMEOUT) as pb, \
                dist.PeerSignals(tp, timeout_s=TIMEOUT) as sig:
            inbox = pb.views(np.int64, (n, 8))  # inbox[r][j]: slot written by rank j
            nxt, prv = (me + 1) % n, (me - 1) % n
            for e in range(1, steps + 1):
                sig.wait("consumed", e - 1, source=nxt)     # nxt finished reading my previous write
                inbox[nxt][me][:] = e * 10 + me               # data first ...
                sig.set("inbox_ready", nxt, e)              # ... then the flag (release)
                sig.wait("inbox_ready", e, source=prv)      # acquire
                assert (inbox[me][prv] == e * 10 + prv).all(), (e, inbox[me][prv])
                sig.set("consumed", prv, e)
            dist.barrier(tp)

    collectively(body)


def test_a_wait_whose_peer_never_signals_times_out(tp, shm_unchanged):
    me = tp.rank

    def body():
        with dist.PeerSignals(tp, timeout_s=TIMEOUT) as sig:
            if me == 0:
                t0 = time.perf_counter()
                try:
                    sig.wait("gather_ready", 1, source=1, timeout_s=0.3)
                    raise AssertionError("no timeout")
                except RuntimeError as exc:
                    assert str(exc) == ("rank 0 of group 'tp': timed out after 0.3 s waiting for flag 'gather_ready' "
                                        "from rank 1 to reach 1; it is 0"), str(exc)
                assert time.perf_counter() - t0 < 5
            dist.barrier(tp)

    collectively(body)


def test_a_rank_leaving_its_signals_with_an_exception_releases_waiting_peers(tp, shm_unchanged):
    me = tp.rank
    t0 = time.perf_counter()

    def run():
        with dist.PeerSignals(tp, timeout_s=TIMEOUT) as sig:
            if me == 1:
                raise KeyError("boom")  # leaves mid-protocol: __exit__ aborts, then closes collectively
            sig.wait("inbox_ready", 1, source=1)  # would wait TIMEOUT s without the abort

    errs = errors_everywhere(run)
    assert time.perf_counter() - t0 < TIMEOUT / 2, errs
    assert errs[1] == "KeyError: 'boom'", errs
    # (PeerAborted: rank 0 did not fail itself -- a program's report says it stopped because of rank 1)
    assert errs[0].startswith("PeerAborted: rank 0 of group 'tp': waiting for flag 'inbox_ready' >= 1 from rank 1, "
                              "but rank 1 aborted"), errs


# ---------------------------------------------------------------------------- collectives
def _ts(n):
    return sorted({t for t in (1, n - 1, n, 129) if t >= 1})


@pytest.mark.parametrize("dtype,threaded", [(np.float32, False), (np.float64, False), (np.float32, True)])
def test_reduce_scatter_and_all_gather_match_numpy_on_cpu(tp, dtype, threaded, shm_unchanged):
    n, me = tp.size, tp.rank
    H = 33

    def body():
        be = CPUBackend(threaded=threaded)  # threaded: the work runs on the queue's thread
        with dist.PeerBuffers((129 + n) * H * 8 + 64, tp, be, timeout_s=TIMEOUT) as pb, \
                dist.PeerSignals(tp, backend=be, timeout_s=TIMEOUT) as sig:
            for T in _ts(n):
                R = -(-T // n)
                xs = [np.random.default_rng(100 * T + r).standard_normal((T, H)).astype(dtype) for r in range(n)]
                total = np.zeros((n * R, H), np.float64)
                total[:T] = np.sum([x.astype(np.float64) for x in xs], axis=0)
                want = total[me * R:(me + 1) * R]
                out = np.full((R, H), np.nan, dtype)
                dist.reduce_scatter(pb, xs[me], out, sig)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"reduce_scatter T={T}")
                ref = np.full((R, H), np.nan, dtype)
                dist.mpi_reduce_scatter(xs[me], ref, tp)
                np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
                # zero-copy input: produced straight into the peer buffer
                xin = pb.views(dtype, (T, H), offset=64)[me]
                sig.wait_consumed()  # peers may still read my buffer from the last step
                xin[...] = xs[me]
                out2 = np.full((R, H), np.nan, dtype)
                dist.reduce_scatter(pb, xin, out2, sig, offset=64)
                np.testing.assert_array_equal(out2, out)
                # all-gather of the reduced shards reproduces the sum's first T rows
                gathered = np.full((T, H), np.nan, dtype)
                dist.all_gather(pb, out, gathered, sig)
                np.testing.assert_allclose(gathered, total[:T], rtol=1e-5, atol=1e-5, err_msg=f"all_gather T={T}")
                ref_g = np.full((T, H), np.nan, dtype)
                dist.mpi_all_gather(out, ref_g, tp)
                np.testing.assert_array_equal(gathered, ref_g)
                full = np.full((n * R, H), np.nan, dtype)  # out may also hold every padded row
                dist.all_gather(pb, out, full, sig)
                np.testing.assert_array_equal(full[:T], gathered)
                # in place: out lives in the peer buffer and the shard already sits in its rows
                gin = pb.views(dtype, (n * R, H), offset=64)[me]
                sig.wait_consumed()
                gin[...] = np.nan
                gin[me * R:(me + 1) * R] = out
                dist.all_gather(pb, gin[me * R:(me + 1) * R], gin[:T], sig, offset=64)
                np.testing.assert_array_equal(gin[:T], gathered)

    collectively(body)


def test_reduce_scatter_and_all_gather_on_the_device(tp, device_backend, shm_unchanged):
    """Both collectives with the device's kernels on its peer buffers: shared memory seen as
    device memory in the simulator, raw-handle CUDA IPC buffers (kernels reading peers) on a GPU."""
    n, me = tp.size, tp.rank
    be = device_backend
    if be.capabilities.simulator:  # ~7000 threads/s: tiny rows
        kind, nbytes, H, Ts, atol = "shm-sim", 1024, 3, sorted({1, max(n - 1, 1), n, 7}), 1e-6
    else:  # wider rows, up to 129 tokens; float32 sums in another order than numpy's
        kind, nbytes, H, Ts, atol = "cuda_ipc", 1 << 20, 65, _ts(n), 1e-5

    def body():
        with dist.PeerBuffers(nbytes, tp, be, timeout_s=TIMEOUT) as pb, \
                dist.PeerSignals(tp, backend=be, timeout_s=TIMEOUT) as sig:
            assert pb.kind == kind
            for T in Ts:
                R = -(-T // n)
                xs = [np.random.default_rng(7 * T + r).standard_normal((T, H)).astype(np.float32) for r in range(n)]
                total = np.zeros((n * R, H), np.float32)
                total[:T] = np.sum(xs, axis=0)
                out = be.asarray(np.full((R, H), np.nan, np.float32))
                dist.reduce_scatter(pb, be.asarray(xs[me]), out, sig)
                np.testing.assert_allclose(be.to_host(out), total[me * R:(me + 1) * R], rtol=1e-5, atol=atol)
                gathered = be.asarray(np.full((T, H), np.nan, np.float32))
                dist.all_gather(pb, out, gathered, sig)
                np.testing.assert_allclose(be.to_host(gathered), total[:T], rtol=1e-5, atol=atol)

    collectively(body)


def test_shapes_that_differ_across_ranks_fail_everywhere_and_the_channel_recovers(tp, shm_unchanged):
    n, me = tp.size, tp.rank
    be = CPUBackend()
    with dist.PeerBuffers(4096, tp, be, timeout_s=TIMEOUT) as pb, \
            dist.PeerSignals(tp, backend=be, timeout_s=TIMEOUT) as sig:
        T = 4 * n + me  # a different token count on every rank: each call is locally consistent
        R = -(-T // n)
        msg = same_error_everywhere(ValueError, lambda: dist.reduce_scatter(
            pb, np.ones((T, 4), np.float32), np.zeros((R, 4), np.float32), sig))
        assert "reduce_scatter: ranks of group 'tp' called it with different arguments" in msg
        # a bad argument on one rank only: it raises ValueError, the others fail fast (not after the timeout)
        t0 = time.perf_counter()
        errs = errors_everywhere(lambda: dist.all_gather(
            pb, np.ones((2, 4), np.float32), np.zeros((2 * n + (me == 1), 4), np.float32), sig))
        assert time.perf_counter() - t0 < TIMEOUT / 2
        assert errs[1].startswith("ValueError: out has shape"), errs
        assert all(e.startswith("PeerAborted: ") and "but rank 1 aborted" in e for r, e in enumerate(errs) if r != 1)
        # and the next correct call works on every rank
        out = np.full((2, 4), np.nan, np.float32)

        def ok():
            dist.reduce_scatter(pb, np.full((2 * n, 4), me + 1, np.float32), out, sig)
            np.testing.assert_array_equal(out, np.full((2, 4), n * (n + 1) / 2, np.float32))

        collectively(ok)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_bad_timeout_is_refused_everywhere_and_the_channel_recovers(tp, shm_unchanged, bad):
    # A NaN timeout never compares: its wait never ended (the job hung); 0 and -1 timed out at
    # once, spuriously.  Refused by the argument checks, on every rank alike, before any wait.
    n, me = tp.size, tp.rank
    be = CPUBackend()
    with dist.PeerBuffers(4096, tp, be, timeout_s=TIMEOUT) as pb, \
            dist.PeerSignals(tp, backend=be, timeout_s=TIMEOUT) as sig:
        out = np.full((2, 4), np.nan, np.float32)
        x = np.full((2 * n, 4), me + 1, np.float32)
        for call in (lambda: dist.reduce_scatter(pb, x, out, sig, timeout_s=bad),
                     lambda: dist.all_gather(pb, out, np.zeros((2 * n, 4), np.float32), sig, timeout_s=bad)):
            msg = same_error_everywhere(ValueError, call)
            assert f"timeout_s={float(bad)!r} must be a positive, finite number of seconds" in msg
        with pytest.raises(ValueError, match="timeout_s="):
            sig.wait("consumed", 0, timeout_s=bad)

        def ok():
            dist.reduce_scatter(pb, x, out, sig)
            np.testing.assert_array_equal(out, np.full((2, 4), n * (n + 1) / 2, np.float32))

        collectively(ok)


def test_the_mpi_baselines_take_aliased_buffers_and_name_bad_ones(tp):
    # MPI forbids a receive buffer inside the send buffer (MPICH raised 'Buffers must not be
    # aliased'); the baselines stage through a copy instead.  Bad arguments are named.
    n, me = tp.size, tp.rank
    x = np.full((2 * n, 4), me + 1, np.float32)
    dist.mpi_reduce_scatter(x, x[:2], tp)
    np.testing.assert_array_equal(x[:2], np.full((2, 4), n * (n + 1) / 2, np.float32))
    buf = np.zeros((2 * n, 4), np.float32)
    buf[2 * me:2 * me + 2] = me + 1
    dist.mpi_all_gather(buf[2 * me:2 * me + 2], buf, tp)  # in place: the shard is inside out
    np.testing.assert_array_equal(buf[:, 0], np.repeat(np.arange(1, n + 1, dtype=np.float32), 2))
    with pytest.raises(ValueError, match=r"out \(shape \(2, 4\)\) must be C-contiguous"):
        dist.mpi_reduce_scatter(x, np.empty((2, 8), np.float32)[:, ::2], tp)
    with pytest.raises(TypeError, match="out must be a 2-D array, got list"):
        dist.mpi_reduce_scatter(x, [[0.0] * 4] * 2, tp)
    with pytest.raises(TypeError, match="group must be a vtnumba ProcessGroup"):
        dist.mpi_all_gather(np.ones((2, 4), np.float32), np.empty((2 * n, 4), np.float32), None)
    # Shapes that differ between ranks: MPI returned some rows to each, without an error (a
    # zero row in the gather); and a rank refusing its arguments left the others in the call.
    T = 2 * n + (me == 1) * 2
    with pytest.raises(ValueError, match=r"mpi_reduce_scatter: .* different arguments \(rank 0: T=%d, H=4, "
                                         r"dtype=float32; rank 1: T=%d" % (2 * n, 2 * n + 2)):
        dist.mpi_reduce_scatter(np.ones((T, 4), np.float32), np.empty((-(-T // n), 4), np.float32), tp)
    R = 2 + (me == 1)
    with pytest.raises(ValueError, match=r"mpi_all_gather: .* different arguments \(rank 0: R=2, H=4, T=%d" % (2 * n)):
        dist.mpi_all_gather(np.ones((R, 4), np.float32), np.empty((2 * n, 4), np.float32), tp)
    t0 = time.monotonic()
    if me == 1:
        with pytest.raises(ValueError, match=r"out has shape \(3, 4\)"):
            dist.mpi_reduce_scatter(x, np.empty((3, 4), np.float32), tp)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of group .* refused their arguments"):
            dist.mpi_reduce_scatter(x, np.empty((2, 4), np.float32), tp)
    assert time.monotonic() - t0 < 10
    dist.mpi_reduce_scatter(x, x[:2], tp)  # the group still works


# ---------------------------------------------------------------------------- queued signals
def _queued_round(pb, sig, xs, T, H, dtype, me, n, offset=64):
    """One reduce-scatter and all-gather of every kind with ``sig``; checks each against numpy."""
    R = -(-T // n)
    total = np.zeros((n * R, H), np.float64)
    total[:T] = np.sum([x.astype(np.float64) for x in xs], axis=0)
    to, back = pb.backend.asarray, pb.backend.to_host
    out = to(np.full((R, H), np.nan, dtype))
    dist.reduce_scatter(pb, to(xs[me]), out, sig)  # staged
    np.testing.assert_allclose(back(out), total[me * R:(me + 1) * R], rtol=1e-5, atol=1e-5, err_msg=f"staged T={T}")
    xin = pb.views(dtype, (T, H), offset=offset)[me]  # produced in the buffer, in queue order
    sig.wait_consumed(pb.queue)
    pb.backend.copy(pb.queue, xin, to(xs[me]), xs[me].nbytes)
    out2 = to(np.full((R, H), np.nan, dtype))
    dist.reduce_scatter(pb, xin, out2, sig, offset=offset)
    np.testing.assert_array_equal(back(out2), back(out))
    gathered = to(np.full((T, H), np.nan, dtype))
    dist.all_gather(pb, out, gathered, sig)
    np.testing.assert_allclose(back(gathered), total[:T], rtol=1e-5, atol=1e-5, err_msg=f"all_gather T={T}")
    gin = pb.views(dtype, (n * R, H), offset=offset)[me]  # in place: the shard already in its rows
    sig.wait_consumed(pb.queue)
    pb.backend.copy(pb.queue, gin[me * R:(me + 1) * R], out, R * H * np.dtype(dtype).itemsize)
    dist.all_gather(pb, gin[me * R:(me + 1) * R], gin[:T], sig, offset=offset)
    np.testing.assert_array_equal(back(gin[:T]), back(gathered))


@pytest.mark.parametrize("threaded", [False, True])
def test_queued_signals_give_the_reference_results_on_cpu(tp, threaded, shm_unchanged):
    # The flags raised and awaited in queue order: on synchronous queues every step runs as it
    # is queued; on threaded ones the waits hold the queue's thread, as a stream waits on a GPU.
    n, me = tp.size, tp.rank
    H = 33

    def body():
        be = CPUBackend(threaded=threaded)
        with dist.PeerBuffers((129 + n) * H * 8 + 64, tp, be, timeout_s=TIMEOUT) as pb, \
                dist.QueuedSignals(tp, be, timeout_s=TIMEOUT) as sig:
            for T in _ts(n):
                xs = [np.random.default_rng(100 * T + r).standard_normal((T, H)).astype(np.float32) for r in range(n)]
                _queued_round(pb, sig, xs, T, H, np.float32, me, n)
            assert sig.epoch == 4 * len(_ts(n)) and sig.broken is None

    collectively(body)


def test_queued_signals_on_the_device(tp, device_backend, shm_unchanged):
    """The queued flags with the device's kernels: the simulator's flag kernels, or stream memory
    operations on a GPU."""
    n, me = tp.size, tp.rank
    be = device_backend
    H, Ts, nbytes = (3, sorted({1, n, 5}), 1024) if be.capabilities.simulator else (65, _ts(n), 1 << 20)

    def body():
        with dist.PeerBuffers(nbytes, tp, be, timeout_s=TIMEOUT) as pb, \
                dist.QueuedSignals(tp, be, timeout_s=TIMEOUT) as sig:
            for T in Ts:
                xs = [np.random.default_rng(7 * T + r).standard_normal((T, H)).astype(np.float32) for r in range(n)]
                _queued_round(pb, sig, xs, T, H, np.float32, me, n)

    collectively(body)


def test_queued_signals_refusals_and_mismatches_fail_everywhere_and_the_channel_goes_on(tp, shm_unchanged):
    n, me = tp.size, tp.rank
    be = CPUBackend()
    with dist.PeerBuffers(4096, tp, be, timeout_s=TIMEOUT) as pb, \
            dist.QueuedSignals(tp, be, timeout_s=TIMEOUT) as sig:
        # a bad argument on rank 1 only: it raises its ValueError, the others refuse at once
        t0 = time.perf_counter()
        errs = errors_everywhere(lambda: dist.all_gather(
            pb, np.ones((2, 4), np.float32), np.zeros((2 * n + (me == 1), 4), np.float32), sig))
        assert time.perf_counter() - t0 < TIMEOUT / 2
        assert errs[1].startswith("ValueError: out has shape"), errs
        assert all(e == "RuntimeError: all_gather: rank 1 of group 'tp' refused its arguments (see its error); "
                        "nothing was exchanged" for r, e in enumerate(errs) if r != 1), errs
        # shapes that differ across ranks: the same ValueError everywhere, before anything is queued
        T = 4 * n + me
        msg = same_error_everywhere(ValueError, lambda: dist.reduce_scatter(
            pb, np.ones((T, 4), np.float32), np.zeros((-(-T // n), 4), np.float32), sig))
        assert "reduce_scatter: ranks of group 'tp' called it with different arguments" in msg
        # a refusal by the pairing checks goes through the handshake too
        errs = errors_everywhere(lambda: dist.reduce_scatter(
            "not peer buffers" if me == 1 else pb, np.ones((2 * n, 4), np.float32), np.zeros((2, 4), np.float32), sig))
        assert errs[1] == "TypeError: pb must be a PeerBuffers, got str", errs
        assert all("rank 1 of group 'tp' refused its arguments" in e for r, e in enumerate(errs) if r != 1), errs
        assert sig.epoch == 0 and sig.broken is None  # nothing was queued: the channel goes on
        out = np.full((2, 4), np.nan, np.float32)

        def ok():
            dist.reduce_scatter(pb, np.full((2 * n, 4), me + 1, np.float32), out, sig)
            np.testing.assert_array_equal(out, np.full((2, 4), n * (n + 1) / 2, np.float32))

        collectively(ok)
        with pytest.raises(TypeError, match="signals must be a PeerSignals or a QueuedSignals"):
            dist.reduce_scatter(pb, np.ones((2 * n, 4), np.float32), out, "signals")
        with dist.QueuedSignals(tp, CPUBackend(), timeout_s=TIMEOUT) as other:
            with pytest.raises(ValueError, match="must use the same backend"):
                dist.reduce_scatter(pb, np.ones((2 * n, 4), np.float32), out, other)


def test_a_queued_call_refuses_an_out_its_kernel_cannot_write_and_the_channel_goes_on(tp, device_backend,
                                                                                     shm_unchanged):
    # A numpy out beside device peer buffers used to fail inside the queued step, after the
    # handshake, leaving the channel unusable on every rank: it is now an argument check.
    n = tp.size
    be = device_backend
    with dist.PeerBuffers(4096, tp, be, timeout_s=TIMEOUT) as pb, \
            dist.QueuedSignals(tp, be, timeout_s=TIMEOUT) as sig:
        x = be.asarray(np.full((2 * n, 4), tp.rank + 1, np.float32))
        msg = same_error_everywhere(TypeError, lambda: dist.reduce_scatter(pb, x, np.zeros((2, 4), np.float32), sig))
        assert msg.startswith("out is a numpy array, but the row-sum kernel that writes it runs on backend"), msg
        assert sig.broken is None and sig.epoch == 0
        out = be.asarray(np.full((2, 4), np.nan, np.float32))

        def ok():
            dist.reduce_scatter(pb, x, out, sig)
            np.testing.assert_array_equal(to_host(out), np.full((2, 4), n * (n + 1) / 2, np.float32))

        collectively(ok)


@pytest.mark.parametrize("rank0_refuses", [False, True])
def test_a_queued_calls_timeout_bounds_its_handshake(tp, rank0_refuses, shm_unchanged):
    # Rank 0 calls with timeout_s=1; the others arrive 4 s later.  Rank 0 must give up after
    # its own second, not the channel's 20 s -- also when it refuses its arguments (a wrong
    # out), whose refusal still joins the handshake -- and its peers then fail at once.
    be = CPUBackend()
    late = 4.0
    with dist.PeerBuffers(4096, tp, be, timeout_s=TIMEOUT) as pb, \
            dist.QueuedSignals(tp, be, timeout_s=TIMEOUT) as sig:
        x = np.ones((2 * tp.size, 4), np.float32)
        out = np.zeros((3, 4) if rank0_refuses and tp.rank == 0 else (2, 4), np.float32)
        COMM.Barrier()
        t0 = time.perf_counter()
        ended = []

        def call():
            try:
                if tp.rank:
                    time.sleep(late)
                dist.reduce_scatter(pb, x, out, sig, timeout_s=1.0 if tp.rank == 0 else None)
            finally:
                ended.append(time.perf_counter() - t0)

        errs = errors_everywhere(call)
        took = COMM.allgather(ended[0])
        if rank0_refuses:
            assert errs[0].startswith("ValueError: out has shape (3, 4)"), errs  # its own error, not the wait's
        else:
            assert errs[0].startswith("WaitTimeout: ") and "timed out after 1 s waiting for flag 'call'" in errs[0]
        assert took[0] < late, f"rank 0 gave up after {took[0]:.1f} s; its timeout_s was 1 s"
        assert all("rank 0" in e for e in errs[1:]), errs  # its refusal, or its abort
        assert max(took[1:]) < late + TIMEOUT / 2, took  # the peers saw rank 0's abort, not their deadline
        # Rank 0's channel is unusable (its handshake gave up); a peer that found its refusal
        # learns at its next call, which every rank then refuses at once.
        assert COMM.allgather(sig.broken is not None)[0]
        t0 = time.perf_counter()
        errs = errors_everywhere(lambda: dist.reduce_scatter(pb, x, np.zeros((2, 4), np.float32), sig))
        assert all(e.startswith("RuntimeError: ") and "unusable after a failed call" in e for e in errs), errs
        assert time.perf_counter() - t0 < TIMEOUT / 2


@pytest.mark.parametrize("threaded", [False, True])
def test_a_rank_failing_inside_a_queued_call_fails_every_rank_and_poisons_the_channel(tp, threaded, monkeypatch,
                                                                                     shm_unchanged):
    n, me = tp.size, tp.rank
    from vtnumba.dist import collectives

    def broken_sum(*args, **kwargs):
        raise RuntimeError("injected: the row sum failed")

    be = CPUBackend(threaded=threaded)
    with dist.PeerBuffers(4096, tp, be, timeout_s=TIMEOUT) as pb, \
            dist.QueuedSignals(tp, be, timeout_s=TIMEOUT) as sig:
        if me == 0:
            monkeypatch.setattr(collectives, "sum_rows", broken_sum)
        x, out = np.full((2 * n, 4), me + 1, np.float32), np.zeros((2, 4), np.float32)
        t0 = time.perf_counter()
        errs = errors_everywhere(lambda: dist.reduce_scatter(pb, x, out, sig))
        took = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        assert errs[0] == "RuntimeError: injected: the row sum failed", errs
        # A peer still in the call fails at once, naming rank 0.  (A peer whose reads and
        # signals were all done before rank 0 failed has its correct result: it learns at its
        # next call.)
        named = [e.startswith(("QueuePeerAborted: ", "PeerAborted: ")) and re.search(r"rank 0(, \d+)* aborted", e)
                 for e in errs[1:]]
        assert all(ok or e == "no exception" for ok, e in zip(named, errs[1:])), errs
        if errs[me] == "no exception":  # (its part was done: its result is the right one)
            np.testing.assert_array_equal(out, np.full((2, 4), n * (n + 1) / 2, np.float32))
        assert took < TIMEOUT / 2, f"the failure was noticed after {took:.1f} s: by a deadline, not the abort"
        monkeypatch.undo()
        # The released waits would pass at once: every rank refuses the next call, none waits.
        t0 = time.perf_counter()
        errs = errors_everywhere(lambda: dist.reduce_scatter(pb, x, out, sig))
        assert time.perf_counter() - t0 < TIMEOUT / 2
        assert all(e.startswith("RuntimeError: ") and "unusable after a failed call" in e for e in errs), errs
        assert all(COMM.allgather(sig.broken is not None))


def test_bench_peer_runs_under_mpi_and_follows_the_schema(tp):
    import argparse

    from vtnumba.bench import peer, schema

    def body():
        d = peer.run(argparse.Namespace(quick=True, sizes=[0.25], repeat=2))
        schema.validate_suite(d)
        assert d["ranks"] == tp.size and d["target"] == ("cuda" if ON_GPU else "cpu")
        assert all(r["value"] > 0 and r["samples"] == 2 for r in d["results"])
        # The size measured: 0.25 MiB rounded to whole 16 KiB rows, a multiple of the rank count
        # (16 rows on 2 ranks; 15 = 240 KiB on 3) -- the rows and the ratio keys name it, the
        # keys as the table prints it.
        rows = 16 // tp.size * tp.size
        at = {16: "@256KiB", 15: "@240KiB"}[rows]
        assert {r["size"] for r in d["results"]} == {rows * 16 / 1024}
        for key in (f"reduce_scatter peer-in-buffer/mpi4py {at}", "all_gather peer-in-place/mpi4py geomean",
                    f"reduce_scatter peer-in-buffer-queued/peer-in-buffer {at}",
                    "all_gather peer-in-place-queued/peer-in-place geomean"):
            assert d["ratios"][key] > 0, key
        # The fraction of the memory limit: the bytes each call moves (all ranks) per second against
        # the copy ceiling -- busbw scaled by traffic_factor * n / (n - 1).
        n = tp.size
        for case, impl in (("reduce_scatter", "peer-in-buffer"), ("all_gather", "peer-in-place"),
                           ("reduce_scatter", "peer-in-buffer-queued"), ("all_gather", "peer-in-place-queued")):
            busbw = d["ratios"][f"{case} {impl} busbw / copy traffic {at}"]
            traffic = d["ratios"][f"{case} {impl} memory traffic / copy traffic {at}"]
            assert traffic == pytest.approx(busbw * peer.traffic_factor(case, impl, n) * n / (n - 1))

    collectively(body)
    assert dist.is_initialized()  # run() leaves a distributed setup it did not create alone
