"""TPSP lifecycle and misuse: each mistake gets a clear error on the ranks that make it, and nothing hangs.

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_tpsp_lifecycle.py -q

Runs with any group size >= 2.  A failed fused call poisons its handle on every rank (the
ranks' chunk counters may disagree), so each misuse case opens a fresh handle; every
test also checks that the handles it opened are closed and no /dev/shm segment is left.
"""

import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from vtnumba.dist import list_segments
from vtnumba.tpsp import CudaTPSPBackend, HostTPSPBackend, TPSPConfig, TPSPOp, shard_residual
from vtnumba.tpsp.regular import regular_matmul_rs_norm_ag

from mpi_helpers import collectively, group  # noqa: E402,F401 (group is a fixture)

COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120)]


@pytest.fixture
def backend(group):
    before = set(list_segments())
    be = HostTPSPBackend("tp", timeout_s=30)
    yield be
    be.close()
    COMM.Barrier()
    assert not set(list_segments()) - before, "a test left /dev/shm segments behind"


def _inputs(group, T=9, K=5, H=None, seed=0):
    H = H or 4 * group.size
    rng = np.random.default_rng(seed + group.rank)
    R = -(-T // group.size)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return dict(x=f(T, K), w=f(H, K), bias=f(H), residual=f(R, H), norm_weight=f(H), eps=1e-5)


def _open(be, group, **kw):
    args = dict(tp_size=group.size, hidden_size=4 * group.size, max_batched_tokens=64, name="h")
    args.update(kw)
    return be.open(**args)


def _call(be, h, a, **kw):
    return be.tpsp_matmul_rs_norm_ag(h, a["x"], a["w"], a["bias"], a["residual"], a["norm_weight"], a["eps"], **kw)


def test_open_call_close_and_use_after_close(backend, group):
    def body():
        h = _open(backend, group)
        assert h is not None and not h.closed
        # The exchange runs beside the matmul only if a GPU gives its kernels SMs first.
        assert (h.compute_queue.priority, h.exchange_queue.priority) == ("normal", "high")
        out, res = _call(backend, h, _inputs(group))
        assert out.shape == (9, 4 * group.size) and h.calls == 1
        backend.close(h)
        backend.close(h)  # closing twice is harmless
        with pytest.raises(RuntimeError, match="closed"):
            _call(backend, h, _inputs(group))
        with pytest.raises(RuntimeError, match="closed"):
            backend.set_config(h, 8)
        backend.close()
        with pytest.raises(RuntimeError, match="closed"):
            _open(backend, group)
        with pytest.raises(RuntimeError, match="closed"):
            _call(backend, h, _inputs(group))

    collectively(body)


def test_open_twice_with_the_same_name(backend, group):
    def body():
        h = _open(backend, group, name="o_proj")
        with pytest.raises(RuntimeError, match="already open.*open twice"):
            _open(backend, group, name="o_proj")
        h2 = _open(backend, group, name="down_proj")  # another ops group is fine
        _call(backend, h, _inputs(group))  # the first handle is still usable
        backend.close(h2)
        backend.close(h)
        backend.close(_open(backend, group, name="o_proj"))  # the name is free again

    collectively(body)


def test_use_before_open_and_handles_of_another_backend(backend, group):
    def body():
        with pytest.raises(ValueError, match="call open"):
            _call(backend, None, _inputs(group))
        other = HostTPSPBackend("tp")
        h = _open(other, group)
        with pytest.raises(ValueError, match="another backend"):
            _call(backend, h, _inputs(group))
        with pytest.raises(ValueError, match="another backend"):
            backend.set_config(h, 4)
        with pytest.raises(ValueError, match="another backend"):
            backend.close(h)
        with pytest.raises(ValueError, match="another backend"):
            _call(backend, object(), _inputs(group))
        other.close()  # closes h too
        assert h.closed

    collectively(body)


def test_open_argument_errors_are_the_same_on_every_rank(backend, group):
    def body():
        with pytest.raises(ValueError, match="not divisible by tp_size"):
            _open(backend, group, hidden_size=4 * group.size + 1)
        with pytest.raises(ValueError, match="tp_size"):
            _open(backend, group, tp_size=group.size + 1)
        with pytest.raises(ValueError, match="max_batched_tokens"):
            _open(backend, group, max_batched_tokens=0)
        with pytest.raises(ValueError, match="name"):
            _open(backend, group, name="")
        with pytest.raises(ValueError, match="group_name"):
            _open(backend, group, group_name="dp")
        with pytest.raises(ValueError, match="no process group named"):
            HostTPSPBackend("no-such-group").open(tp_size=group.size, hidden_size=8, max_batched_tokens=4)

    collectively(body)


def test_one_rank_with_bad_open_arguments_fails_everywhere(backend, group):
    """A mistake on one rank only must not leave the others waiting in the collective setup."""
    def body():
        hidden = 4 * group.size + (1 if group.rank == 1 else 0)
        with pytest.raises(ValueError, match="rank 1: hidden_size"):
            _open(backend, group, hidden_size=hidden)

    collectively(body)


def test_ranks_with_different_tpsp_backends_are_told_which(group):
    # A push rank and a pull rank (or a cpu rank and a simulator rank) size their peer buffers
    # differently: they were told only "PeerBuffers(nbytes=...) must be the same on every rank".
    def body():
        be = HostTPSPBackend("tp", timeout_s=30, exchange="push" if group.rank else "pull")
        try:
            with pytest.raises(ValueError, match=r"opened different TPSP backends -- rank 0: HostTPSPBackend "
                                                 r"\(exchange='pull'.*rank 1: HostTPSPBackend \(exchange='push'"):
                _open(be, group)
        finally:
            be.close()

    collectively(body)


@pytest.mark.parametrize("arg, mine, others", [("hidden_size", 4, 8), ("max_batched_tokens", 8, 7)])
def test_ranks_opening_different_handles_are_told_which_argument(backend, group, arg, mine, others):
    # Other sizes were refused as "PeerBuffers(nbytes=...) must be the same", naming no argument;
    # max_batched_tokens 8 vs 7 was accepted, and the first call of 8 tokens failed on one rank.
    def body():
        nonlocal mine, others
        if arg == "hidden_size":  # (multiples of the rank count: each rank normalises H / tp columns)
            mine, others = mine * group.size, others * group.size
        value = mine if group.rank == 0 else others
        with pytest.raises(ValueError, match=rf"passed different arguments -- rank 0: .*{arg}={mine}.*rank 1: "
                                             rf".*{arg}={others}.*every rank must open the same handle"):
            _open(backend, group, **{arg: value})
        assert not backend._handles

    collectively(body)


def test_declines_are_agreed(backend, group):
    def body():
        assert _open(backend, group, dtype=np.float16) is None
        # float16 on one rank only: every rank declines, none hangs
        dtype = np.float16 if group.rank == group.size - 1 else np.float32
        assert _open(backend, group, dtype=dtype) is None

    collectively(body)


def test_a_rank_that_cannot_map_peer_buffers_makes_every_rank_fall_back(backend, group, caplog):
    def body():
        os.environ["VTNUMBA_FAIL_PEER_OPEN"] = "1"  # group rank 1 fails to open its peers' memory
        try:
            with caplog.at_level("WARNING", logger="vtnumba"):
                h = _open(backend, group)
        finally:
            del os.environ["VTNUMBA_FAIL_PEER_OPEN"]
        assert h is None  # on every rank
        if group.rank == 0:  # (which says why: the warning carried no reason before)
            said = [r.getMessage() for r in caplog.records if "could not be mapped" in r.getMessage()]
            assert said and "rank 1:" in said[0] and "using the regular forward" in said[0], said
        op = TPSPOp(None, "h", group=group)  # what a model does then: the regular forward
        a = _inputs(group)
        out, res = op(a["x"], a["w"], a["bias"], a["residual"], a["norm_weight"], a["eps"])
        assert out.shape == (9, 4 * group.size) and op.regular_calls == 1 and op.fused_calls == 0
        h = _open(backend, group)  # and nothing is stuck: the next open works
        assert h is not None
        backend.close(h)

    collectively(body)


@pytest.mark.parametrize("case", [
    "unsupported_norm", "norm_bias_with_rms", "residual_wrong_shape", "too_many_tokens", "hidden_mismatch",
    "float64_input", "eps_zero", "out_wrong_shape", "sm_count_on_host",
])
def test_bad_call_arguments_raise_clear_errors(backend, group, case):
    def body():
        h = _open(backend, group)
        a = _inputs(group)
        kw = {}
        exc, words = ValueError, None
        if case == "unsupported_norm":
            kw["norm"], words = "batchnorm", "not a TPSP norm"
        elif case == "norm_bias_with_rms":
            kw["norm_bias"], words = np.ones(4 * group.size, np.float32), "only LayerNorm has a bias"
        elif case == "residual_wrong_shape":
            a["residual"], words = np.zeros((9, 4 * group.size), np.float32), "R = ceil"
        elif case == "too_many_tokens":
            a = _inputs(group, T=65)
            words = "max_batched_tokens=64"
        elif case == "hidden_mismatch":
            a = _inputs(group, H=8 * group.size)
            words = "hidden_size"
        elif case == "float64_input":
            a["x"], exc, words = a["x"].astype(np.float64), TypeError, "float32"
        elif case == "eps_zero":
            a["eps"], words = 0.0, "eps"
        elif case == "out_wrong_shape":
            kw["out"], words = np.empty((8, 4 * group.size), np.float32), "out has shape"
        elif case == "sm_count_on_host":
            kw["config"], words = TPSPConfig(4, sm_count_target=8), "GPUs only"
        with pytest.raises(exc, match=words) as info:
            _call(backend, h, a, **kw)
        # ... and the error says what it did to the handle, where the caller first looks.
        assert any("unusable on every rank" in note for note in getattr(info.value, "__notes__", [])), info.value
        # The failed call poisoned the handle on every rank: a clear error, then close works.
        with pytest.raises(RuntimeError, match="unusable after a failed call"):
            _call(backend, h, _inputs(group))
        backend.close(h)

    collectively(body)


def test_a_chunk_beyond_the_workspace_slot_takes_the_slot(backend, group):
    # set_config and profile accepted such a chunk; the first call whose shard passed the slot
    # then failed ("exceeds the P2P workspace capacity") and left the handle unusable.
    def body():
        backend.tpsp_max_microchunk_tokens = 2 * group.size  # a tiny workspace: 2 rows per rank
        try:
            h = _open(backend, group)
        finally:
            backend.tpsp_max_microchunk_tokens = 16_384
        assert h.max_chunk_rows == 2
        backend.set_config(h, 100)
        for T in (3, 9, 2 * group.size * 4 + 1):  # shards of 1 .. 5 rows: one step, then several
            a = _inputs(group, T=T)
            got, new_res = _call(backend, h, a)
            ref, ref_res = regular_matmul_rs_norm_ag(group, a["x"], a["w"], a["bias"], a["residual"],
                                                     a["norm_weight"], a["eps"])
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(new_res, ref_res, rtol=1e-5, atol=1e-5)
        backend.close(h)

    collectively(body)


def test_a_handle_whose_flag_epochs_are_spent_says_so_on_every_rank(backend, group):
    # Each microchunk takes a 32-bit flag epoch; past the last one the flags refused the value
    # mid-call ("flag value ... reopen the flags"), which named no handle.
    from vtnumba.dist.queue_flags import RELEASED

    def body():
        h = _open(backend, group)
        backend.set_config(h, 1)
        h.workspace.chunks_done = RELEASED - 2  # (a server that ran for weeks; nothing was queued for them)
        with pytest.raises(RuntimeError, match=r"this TPSP handle has run 1073741822 microchunks; .* close the "
                                               r"handle and open a new one"):
            _call(backend, h, _inputs(group, T=4 * group.size))
        backend.close(h)
        h = _open(backend, group)  # a new handle counts afresh
        got, _ = _call(backend, h, _inputs(group, T=4 * group.size))
        assert np.isfinite(got).all()
        backend.close(h)

    collectively(body)


def test_invalid_configs_are_refused(backend, group):
    def body():
        h = _open(backend, group)
        for bad, exc in ((0, ValueError), (-3, ValueError), (2.5, TypeError), ("8", TypeError), (True, TypeError)):
            with pytest.raises(exc):
                backend.set_config(h, bad)
        with pytest.raises(ValueError, match="GPUs only"):
            backend.set_config(h, TPSPConfig(8, sm_count_target=4))
        backend.set_config(h, TPSPConfig(3))
        assert h.config.chunk_tokens_per_rank == 3
        _call(backend, h, _inputs(group))  # the handle survived the refused configs
        backend.close(h)

    collectively(body)


def test_bad_arguments_on_one_rank_fail_fast_everywhere(backend, group):
    """One rank passes a wrong residual: it raises ValueError, its peers RuntimeError -- at once, no hang."""
    def body():
        h = _open(backend, group)
        a = _inputs(group)
        if group.rank == 0:
            a["residual"] = np.zeros((1, 4 * group.size), np.float32)
        t0 = time.perf_counter()
        with pytest.raises(ValueError if group.rank == 0 else RuntimeError, match="R = ceil|aborted"):
            _call(backend, h, a)
        assert time.perf_counter() - t0 < 10, "peers waited instead of failing fast"
        backend.close(h)

    collectively(body)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failing_matmul_on_one_rank_fails_fast_everywhere(group, monkeypatch, threaded):
    """An error inside the compute step (here injected on rank 0) must not leave peers waiting."""
    import vtnumba.tpsp.host as pipeline  # the host chunk strategy's matmul

    real = pipeline.queue_linear_rows_to

    def broken(*args, **kwargs):
        if group.rank == 0:
            raise FloatingPointError("injected matmul failure")
        return real(*args, **kwargs)

    def body():
        be = HostTPSPBackend("tp", threaded=threaded)
        h = _open(be, group)
        monkeypatch.setattr(pipeline, "queue_linear_rows_to", broken)
        t0 = time.perf_counter()
        try:
            with pytest.raises((FloatingPointError, RuntimeError),
                               match="injected matmul failure" if group.rank == 0 else "aborted"):
                _call(be, h, _inputs(group))
        finally:
            monkeypatch.setattr(pipeline, "queue_linear_rows_to", real)
        assert time.perf_counter() - t0 < 10, "the failure was not reported fast"
        be.close()

    collectively(body)


def test_ranks_with_different_token_counts_all_raise(backend, group):
    def body():
        h = _open(backend, group)
        T = 9 if group.rank == 0 else 10
        with pytest.raises((ValueError, RuntimeError), match="different shapes|aborted"):
            _call(backend, h, _inputs(group, T=T))
        backend.close(h)

    collectively(body)


def test_an_op_called_past_max_batched_tokens_takes_the_regular_forward(backend, group):
    # The op asked profile.is_active(T), which raises above max_batched_tokens: a batch of long
    # documents crashed the model (and, sent to the fused call, broke the handle for good).  Such
    # a batch takes the regular forward, as the encoder's docs say, and the handle stays usable.
    from vtnumba.tpsp import TPSPContext, TPSPProfile

    def body():
        h = _open(backend, group, max_batched_tokens=8)
        op = TPSPOp(TPSPContext(TPSPProfile(True, 1, 8), backend, {"h": h}), "h")
        for T in (12, 8):  # past the workspace: regular; within it: fused
            a = _inputs(group, T=T)
            got, new_res = op(a["x"], a["w"], a["bias"], a["residual"], a["norm_weight"], a["eps"])
            ref, ref_res = regular_matmul_rs_norm_ag(group, a["x"], a["w"], a["bias"], a["residual"],
                                                     a["norm_weight"], a["eps"])
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(new_res, ref_res, rtol=1e-5, atol=1e-5)
        assert (op.regular_calls, op.fused_calls) == (1, 1) and h.broken is None
        with pytest.raises(ValueError, match="num_tokens=0 is outside the profiled range"):
            op.uses_tpsp(0)
        backend.close(h)

    collectively(body)


def test_profile_is_active_range_and_regular_fallback(backend, group):
    from vtnumba.nn import RMSNorm, RowParallelLinear
    from vtnumba.tpsp import TPSPOpsGroup

    def body():
        H = 4 * group.size
        proj = RowParallelLinear(3 * group.size, H, seed=1)
        norm = RMSNorm(H, seed=2)
        ctx = backend.profile([TPSPOpsGroup("down", proj, norm)], max_batched_tokens=32, threshold_tokens=8)
        assert ctx is not None and ctx.profile.threshold_tokens == 8 and ctx.report.parity_max_err < 1e-4
        op = TPSPOp(ctx, "down", norm=norm)
        # A batch past the workspace runs the regular forward, and uses_tpsp says so (it raised).
        assert not op.uses_tpsp(33) and op.uses_tpsp(32) and not op.uses_tpsp(7)
        with pytest.raises(TypeError, match="num_tokens=8.0 must be an int"):
            op.uses_tpsp(8.0)
        for T in (3, 8, 32):  # below the threshold: regular; from it on: fused
            rng = np.random.default_rng(T)
            x = rng.standard_normal((T, proj.input_size_per_partition), dtype=np.float32)
            full = np.random.default_rng(99).standard_normal((T, H), dtype=np.float32)
            got, _ = op(x, proj.weight, proj.bias, shard_residual(full, group.size, group.rank), norm.weight, norm.eps)
            assert got.shape == (T, H)
        assert (op.regular_calls, op.fused_calls) == (1, 2)
        ctx.close()
        assert not backend._handles

    collectively(body)


def test_cuda_backend_checks_on_the_device(group, device_backend):
    """The GPU backend's own checks, without running kernels (instant even in the simulator)."""
    def body():
        be = CudaTPSPBackend("tp", backend=device_backend)
        h = be.open(tp_size=group.size, hidden_size=4 * group.size, max_batched_tokens=8, name="c")
        assert h.workspace.exchange == "push"
        # 3 SMs: within every GPU's count (the simulator has none to compare with).
        be.set_config(h, TPSPConfig(2, sm_count_target=3))
        assert h.config.sm_count_target == 3
        with pytest.raises(TypeError, match="device arrays"):
            _call(be, h, _inputs(group, T=4))
        be.close()
        assert h.closed

    collectively(body)


def test_a_handle_serves_one_thread_at_a_time(backend, group):
    """Threads sharing a handle stepped its flags' epochs out of order ('flags are epoch
    counters and must not decrease') and broke it on every rank.  A second thread is now
    refused before it touches anything, and the handle is not broken by it."""
    import threading

    def body():
        h = _open(backend, group, name="threads")
        a = _inputs(group)
        errors = []

        def second_thread():
            try:
                _call(backend, h, a)
            except RuntimeError as exc:
                errors.append(str(exc))

        def closer():  # closing under a call pulled its queues and flags away ("QueueFlags ... are closed")
            try:
                backend.close(h)
            except RuntimeError as exc:
                errors.append(str(exc))

        with h.caller:  # as if another thread of this rank were inside a call
            for target in (second_thread, closer):
                t = threading.Thread(target=target)
                t.start()
                t.join(30)
        assert len(errors) == 2 and all("TPSP handle 'threads' is already running a call on another thread" in e
                                        for e in errors), errors
        assert not h.closed
        assert h.broken is None
        out, _ = _call(backend, h, a)  # every rank's next call pairs up as before
        assert np.isfinite(out).all()
        backend.close(h)

    collectively(body)

