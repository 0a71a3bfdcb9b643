"""TPSP profiles (static and measured), the parity check, and the model built on them (mpiexec -n 2 / -n 3).

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_tpsp_profile.py -q
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

from vtnumba.dist import list_segments
from vtnumba.nn import LayerNorm, ParallelMLPStack, RMSNorm, RowParallelLinear
from vtnumba.tpsp import (
    HostTPSPBackend,
    TPSPConfig,
    TPSPDisabledWarning,
    TPSPOp,
    TPSPOpsGroup,
    shard_residual,
)

from mpi_helpers import collectively, group  # noqa: E402,F401 (group is a fixture)

COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(180)]


@pytest.fixture
def no_leaks():
    before = set(list_segments())
    yield
    COMM.Barrier()
    assert not set(list_segments()) - before, "a test left /dev/shm segments behind"


def _groups(group, n=2, H=None, K=None, layer=False):
    H = H or 16 * group.size
    K = K or 24 * group.size
    out = []
    for i in range(n):
        proj = RowParallelLinear(K, H, seed=10 + i)
        norm = LayerNorm(H, seed=20 + i) if layer else RMSNorm(H, seed=20 + i)
        out.append(TPSPOpsGroup(f"g{i}", proj, norm))
    return out


def test_static_profile_opens_one_handle_per_group(group, no_leaks):
    def body():
        be = HostTPSPBackend("tp")
        ctx = be.profile(_groups(group, layer=True), max_batched_tokens=40, config=TPSPConfig(3), threshold_tokens=5)
        assert ctx is not None and ctx.backend is be
        assert sorted(ctx.handles) == ["g0", "g1"]
        assert ctx.profile.enabled and ctx.profile.threshold_tokens == 5 and ctx.profile.max_batched_tokens == 40
        assert all(h.config.chunk_tokens_per_rank == 3 for h in ctx.handles.values())
        assert ctx.report.parity_max_err is not None and ctx.report.parity_max_err < 1e-4
        ctx.close()
        be.close()

    collectively(body)


def test_module_form_equals_the_array_form(group, no_leaks):
    """``fused_gemm_rs_norm_ag(handle, x, projection, residual, norm)`` (the seed's form) == the array form."""
    def body():
        be = HostTPSPBackend("tp")
        g = _groups(group, n=1, layer=True)[0]
        h = be.open(tp_size=group.size, hidden_size=g.norm.hidden_size, max_batched_tokens=16, name="m")
        rng = np.random.default_rng(group.rank)
        x = rng.standard_normal((11, g.projection.input_size_per_partition), dtype=np.float32)
        res = rng.standard_normal((-(-11 // group.size), g.norm.hidden_size), dtype=np.float32)
        a, ra = be.fused_gemm_rs_norm_ag(h, x, g.projection, res, g.norm)
        b, rb = be.tpsp_matmul_rs_norm_ag(h, x, g.projection.weight, g.projection.bias, res, g.norm.weight,
                                          g.norm.eps, g.norm.bias, norm="layer")
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ra, rb)
        assert be.prepare_weights(h, g.projection) is be.prepare_weights(h, g.projection)  # cached
        be.close()

    collectively(body)


def test_profile_argument_errors(group, no_leaks):
    def body():
        be = HostTPSPBackend("tp")
        g = _groups(group)
        with pytest.raises(ValueError, match="unique"):
            be.profile([g[0], TPSPOpsGroup("g0", g[1].projection, g[1].norm)], 16)
        with pytest.raises(ValueError, match="empty"):
            be.profile([], 16)
        with pytest.raises(ValueError, match="threshold_tokens"):
            be.profile(g, 16, threshold_tokens=17)
        with pytest.raises(ValueError, match="budget_s"):
            be.profile(g, 16, search=True, budget_s=0)
        with pytest.raises(ValueError, match="chunk_tokens_per_rank"):
            be.profile(g, 16, config=0)
        be.close()
        with pytest.raises(RuntimeError, match="closed"):
            be.profile(g, 16)

    collectively(body)


def test_profile_arguments_are_agreed_across_ranks(group, no_leaks):
    """A bad argument on one rank left the others waiting for it until the timeout; different
    thresholds on two ranks sent one call down the fused path and the other down the regular
    one (a hang).  Both are now errors on every rank, before any collective."""
    me = group.rank

    def body():
        be = HostTPSPBackend("tp", timeout_s=20)
        g = _groups(group)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"profile: failed on 1 of \d+ ranks .* rank 1: budget_s=-1 must be"):
            be.profile(g, 16, budget_s=-1 if me == 1 else 5)
        assert time.monotonic() - t0 < 10  # told at once, not after the timeout
        with pytest.raises(ValueError, match=r"profile: the ranks passed different arguments"):
            be.profile(g, 16, threshold_tokens=4 + me)
        # Other ops groups on one rank (fewer of them): they timed out, blaming the parity check.
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"profile: the ranks passed different arguments .*ops group's name"):
            be.profile(g[:1] if me == 1 else g, 16)
        assert time.monotonic() - t0 < 10
        # Another norm type or eps on one rank: it only showed up as a failed parity check (a
        # warning, and the regular forward), or not at all with parity_check=False.
        for other in (_groups(group, layer=me == 1), _groups(group)):
            if me == 1 and other[0].norm.__class__.__name__ == "RMSNorm":
                other[0].norm.eps = 0.5
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=r"profile: the ranks passed different arguments .*norm type, eps"):
                be.profile(other, 16, parity_check=False)
            assert time.monotonic() - t0 < 10
        with pytest.raises(TypeError, match=r"search='no' must be True or False"):
            be.profile(g, 16, search="no")
        ctx = be.profile(g, 16, budget_s=np.float32(5.0))  # the group still works (and numpy seconds count)
        assert ctx is not None
        be.close()

    collectively(body)


def test_measured_profile_picks_a_chunk_and_a_threshold_within_budget(group, no_leaks):
    def body():
        be = HostTPSPBackend("tp")
        be.tpsp_chunk_granularity = 8  # a small grid for a small problem
        t0 = time.monotonic()
        with _maybe_warns():
            ctx = be.profile(_groups(group, n=1, H=64 * group.size, K=64 * group.size), max_batched_tokens=256,
                             search=True, budget_s=8.0)
        elapsed = time.monotonic() - t0
        assert elapsed < 40, f"the search took {elapsed:.1f} s for an 8 s budget"
        if ctx is not None:  # on a quiet machine TPSP wins at 256 tokens; under load it may not
            rep = ctx.report
            assert rep.chunks["g0"], "no chunk was timed"
            chosen = ctx.handles["g0"].config.chunk_tokens_per_rank
            assert chosen in [c for c, _ in rep.chunks["g0"]]
            assert rep.threshold_scan and rep.threshold_scan[0][0] == 256
            assert 16 <= ctx.profile.threshold_tokens <= 256
            # the decision is the same on every rank
            assert len(set(COMM.allgather((chosen, ctx.profile.threshold_tokens)))) == 1
            ctx.close()
        assert len(set(COMM.allgather(ctx is None))) == 1
        be.close()

    collectively(body)


class _maybe_warns:
    """Accept a TPSPDisabledWarning (a loaded machine may show no benefit) without requiring one."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore", TPSPDisabledWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


class _CorruptOnLastRank(HostTPSPBackend):
    """A backend whose fused op is wrong on one rank: the parity check must catch it everywhere."""

    def tpsp_matmul_rs_norm_ag(self, *args, **kwargs):
        out, res = super().tpsp_matmul_rs_norm_ag(*args, **kwargs)
        if self._corrupt and COMM.Get_rank() == COMM.Get_size() - 1:
            out[0, 0] += 1.0
        return out, res


def test_parity_failure_disables_tpsp_on_every_rank(group, no_leaks):
    def body():
        be = _CorruptOnLastRank("tp")
        be._corrupt = True
        with pytest.warns(TPSPDisabledWarning, match="parity check"):
            ctx = be.profile(_groups(group), max_batched_tokens=16)
        assert ctx is None
        assert not be._handles, "a disabled profile must close the handles it opened"
        be._corrupt = False
        ctx = be.profile(_groups(group), max_batched_tokens=16)
        assert ctx is not None
        ctx.close()
        be.close()

    collectively(body)


def test_profile_falls_back_when_a_rank_cannot_map_peer_memory(group, no_leaks, monkeypatch):
    def body():
        monkeypatch.setenv("VTNUMBA_FAIL_PEER_OPEN", str(group.size - 1))
        be = HostTPSPBackend("tp")
        with pytest.warns(TPSPDisabledWarning, match="unavailable"):
            ctx = be.profile(_groups(group), max_batched_tokens=16)
        assert ctx is None
        be.close()

    collectively(body)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_mlp_stack_tpsp_equals_regular(group, norm, no_leaks):
    """The model of mpi/tpsp_model.py, small: TPSP (sharded residual) == regular (all-reduce)."""
    def body():
        T, H = 37, 16 * group.size
        stack = ParallelMLPStack(3, H, 40, norm=norm, act="gelu", seed=5)
        emb = np.random.default_rng(1).standard_normal((T, H), dtype=np.float32)
        x_reg, res_reg = stack.forward_regular(emb, group)
        be = HostTPSPBackend("tp")
        ctx = be.profile(stack.ops_groups(), max_batched_tokens=T, config=4, threshold_tokens=20)
        ops = [TPSPOp(ctx, g.name, norm=norm) for g in stack.ops_groups()]
        x_t, shard = stack.forward_tpsp(emb, shard_residual(emb, group.size, group.rank), ops)
        assert sum(op.fused_calls for op in ops) == 3
        full = np.concatenate(COMM.allgather(shard))[:T]
        np.testing.assert_allclose(x_t, x_reg, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(full, res_reg, rtol=1e-4, atol=1e-4)
        # below the threshold the same ops take the regular reduce-scatter path
        x_s, shard_s = stack.forward_tpsp(emb[:7], shard_residual(emb[:7], group.size, group.rank), ops)
        x_r, _ = stack.forward_regular(emb[:7], group)
        assert sum(op.regular_calls for op in ops) == 3
        np.testing.assert_allclose(x_s, x_r, rtol=1e-4, atol=1e-4)
        ctx.close()
        be.close()

    collectively(body)


def test_bench_quick_run_follows_the_schema(group, no_leaks):
    import argparse

    from vtnumba.bench import tpsp as bench
    from vtnumba.bench.schema import validate_suite

    def body():
        args = argparse.Namespace(quick=True, tokens=[16, 48], hidden=32 * group.size, k_total=32, repeat=2,
                                  chunk=None, exchange=None)
        res = bench.run(args)
        validate_suite(res)
        impls = {(r["case"], r["impl"]) for r in res["results"]}
        assert impls == {(f"tpsp T={T}", i) for T in (16, 48) for i in ("matmul-only", "mpi-baseline", "vtnumba-fused")}
        assert "fused / baseline T=48" in res["ratios"]
        assert not any("differs" in n for n in res["notes"]), res["notes"]

    collectively(body)
