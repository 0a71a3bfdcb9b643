"""TPSP value types, norm types, sharding, argument checks and backend selection (serial, no MPI).

    python -m pytest tests/test_tpsp_config.py -q
"""

import numpy as np
import pytest

from vtnumba.backend import CPU, Device, DeviceType
from vtnumba.nn import LayerNorm, RMSNorm
from vtnumba.tpsp import (
    CudaTPSPBackend,
    HostTPSPBackend,
    TPSPConfig,
    TPSPContext,
    TPSPOpsGroup,
    TPSPProfile,
    get_tpsp_backend,
    get_tpsp_norm_type,
    shard_residual,
    shard_rows,
    token_range,
    unshard_residual,
)
from vtnumba.tpsp.config import check_ops_groups
from vtnumba.tpsp.pipeline import check_call
from vtnumba.tpsp.profiling import chunk_candidates, threshold_sizes


# ---------------------------------------------------------------------------- TPSPConfig
def test_config_accepts_positive_ints():
    c = TPSPConfig(64)
    assert c.chunk_tokens_per_rank == 64 and c.sm_count_target is None
    c = TPSPConfig(np.int64(3), sm_count_target=np.int32(8))
    assert (c.chunk_tokens_per_rank, c.sm_count_target) == (3, 8)
    assert type(c.chunk_tokens_per_rank) is int


@pytest.mark.parametrize("bad, exc, words", [
    (0, ValueError, ">= 1"), (-5, ValueError, ">= 1"), (1.5, TypeError, "must be an int"),
    (True, TypeError, "must be an int"), ("64", TypeError, "must be an int"), (None, TypeError, "must be an int"),
])
def test_config_rejects_bad_chunks(bad, exc, words):
    with pytest.raises(exc, match="chunk_tokens_per_rank") as info:
        TPSPConfig(bad)
    assert words in str(info.value)


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (False, TypeError)])
def test_config_rejects_bad_sm_count(bad, exc):
    with pytest.raises(exc, match="sm_count_target"):
        TPSPConfig(64, sm_count_target=bad)


# ---------------------------------------------------------------------------- TPSPProfile
def test_profile_is_active_uses_the_threshold():
    p = TPSPProfile(True, 128, 1024)
    assert not p.is_active(1) and not p.is_active(127)
    assert p.is_active(128) and p.is_active(1024)
    off = TPSPProfile.disabled(1024, "no benefit")
    assert not off.is_active(512) and off.reason == "no benefit"


@pytest.mark.parametrize("tokens", [0, 1025, -3])
def test_profile_rejects_token_counts_outside_the_range(tokens):
    with pytest.raises(ValueError, match="max_batched_tokens=1024"):
        TPSPProfile(True, 16, 1024).is_active(tokens)


def test_profile_validates_fields():
    with pytest.raises(ValueError, match="threshold_tokens"):
        TPSPProfile(True, None, 100)
    with pytest.raises(ValueError, match="threshold_tokens"):
        TPSPProfile(True, 101, 100)
    with pytest.raises(ValueError, match="max_batched_tokens"):
        TPSPProfile(False, None, 0)
    with pytest.raises(TypeError, match="is_active|num_tokens"):
        TPSPProfile(True, 1, 10).is_active(2.0)


# ---------------------------------------------------------------------------- ops groups
class _Proj:
    def __init__(self, h=8, k=4):
        self.weight = np.zeros((h, k), np.float32)
        self.bias = None


def test_ops_group_names_must_be_non_empty_and_unique():
    with pytest.raises(ValueError, match="non-empty"):
        TPSPOpsGroup("", _Proj(), RMSNorm(8))
    with pytest.raises(ValueError, match="non-empty"):
        TPSPOpsGroup(None, _Proj(), RMSNorm(8))
    a, b = TPSPOpsGroup("o_proj", _Proj(), RMSNorm(8)), TPSPOpsGroup("o_proj", _Proj(), RMSNorm(8))
    with pytest.raises(ValueError, match="unique.*o_proj"):
        check_ops_groups([a, b])
    with pytest.raises(ValueError, match="empty"):
        check_ops_groups([])
    with pytest.raises(ValueError, match="hidden size"):
        check_ops_groups([a, TPSPOpsGroup("down", _Proj(), RMSNorm(16))])
    with pytest.raises(TypeError, match="has no .weight"):
        TPSPOpsGroup("x", object(), RMSNorm(8))


def test_context_handle_lookup_names_the_known_handles():
    ctx = TPSPContext(TPSPProfile(True, 1, 8), backend=None, handles={"a": 1})
    assert ctx.handle("a") == 1
    with pytest.raises(KeyError, match="'a'"):
        ctx.handle("b")


# ---------------------------------------------------------------------------- norm types
@pytest.mark.parametrize("name, expected", [
    ("rms", "rms"), ("RMSNorm", "rms"), ("rms_norm", "rms"), ("layer", "layer"), ("LayerNorm", "layer"),
    ("layer_norm", "layer"), (" Layernorm ", "layer"),
])
def test_norm_type_from_names(name, expected):
    assert get_tpsp_norm_type(name) == expected


def test_norm_types_lists_every_answer():
    # NORM_TYPES is what get_tpsp_norm_type can answer: each one names itself, and every
    # accepted spelling maps into it.
    from vtnumba.tpsp.norm_type import _ALIASES, NORM_TYPES

    assert NORM_TYPES == ("rms", "layer")
    assert [get_tpsp_norm_type(t) for t in NORM_TYPES] == list(NORM_TYPES)
    assert set(_ALIASES.values()) == set(NORM_TYPES)


def test_norm_type_from_modules():
    assert get_tpsp_norm_type(RMSNorm(4)) == "rms"
    assert get_tpsp_norm_type(LayerNorm(4)) == "layer"

    class LlamaRMSNorm:  # a module of another framework, recognised by its class name
        pass

    assert get_tpsp_norm_type(LlamaRMSNorm()) == "rms"


@pytest.mark.parametrize("bad", ["batchnorm", "group", "", 3, None, object()])
def test_unsupported_norm_is_refused(bad):
    with pytest.raises(ValueError, match="RMSNorm or LayerNorm|not a TPSP norm"):
        get_tpsp_norm_type(bad)


# ---------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("T, tp", [(1, 2), (1, 3), (2, 3), (7, 2), (9, 3), (129, 2), (1000, 3)])
def test_shard_and_unshard_round_trip(T, tp, rng):
    full = rng.standard_normal((T, 5), dtype=np.float32)
    R = shard_rows(T, tp)
    shards = [shard_residual(full, tp, r) for r in range(tp)]
    for r, s in enumerate(shards):
        assert s.shape == (R, 5)
        lo, hi = token_range(T, tp, r)
        np.testing.assert_array_equal(s[: hi - lo], full[lo:hi])
        assert not s[hi - lo:].any()  # padding rows are zero
    np.testing.assert_array_equal(unshard_residual(shards, T), full)


def test_token_range_of_numpy_ints_does_not_wrap():
    # start + R in int64 wrapped to a negative stop for T near 2**63.
    T = np.int64(2**63 - 1)
    assert token_range(T, 2, np.int64(1)) == (2**62, 2**63 - 1)
    assert all(type(v) is int for v in token_range(np.int64(10), np.int32(3), np.int8(2)))


def test_shard_argument_errors():
    with pytest.raises(ValueError, match="2-D"):
        shard_residual(np.zeros(4, np.float32), 2, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_residual(np.zeros((4, 2), np.float32), 2, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        shard_rows(0, 2)
    with pytest.raises(ValueError, match=r"shards\[0\] has shape \(1, 2\); expected \[R, H\] = \[3, 2\]"):
        unshard_residual([np.zeros((1, 2))], 3)
    # (-1 dropped a row silently, 2.5 raised a slice TypeError, shards of 2 and 1 rows were
    # concatenated into the wrong token positions)
    for bad in (-1, 0, 2.5):
        with pytest.raises(ValueError, match=rf"num_tokens={bad!r} must be an int >= 1"):
            unshard_residual([np.zeros((2, 2))] * 2, bad)
    with pytest.raises(ValueError, match=r"shards\[1\] has shape \(1, 2\)"):
        unshard_residual([np.zeros((2, 2)), np.zeros((1, 2))], 3)
    with pytest.raises(ValueError, match="shards is empty"):
        unshard_residual([], 3)


# ---------------------------------------------------------------------------- argument checks
def _args(rng, T=5, K=3, H=8, tp=2):
    R = -(-T // tp)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return dict(x=f(T, K), w=f(H, K), bias=f(H), residual=f(R, H), norm_weight=f(H), eps=1e-5, norm_bias=None,
                norm="rms", tp=tp)


def test_check_call_accepts_good_arguments(rng):
    shape, eps = check_call(**_args(rng))
    assert (shape.T, shape.K, shape.H, shape.R, shape.norm, eps) == (5, 3, 8, 3, "rms", 1e-5)


@pytest.mark.parametrize("change, exc, words", [
    (dict(residual=np.zeros((2, 8), np.float32)), ValueError, "R = ceil"),
    (dict(w=np.zeros((8, 4), np.float32)), ValueError, "w has shape"),
    (dict(norm_bias=np.zeros(8, np.float32)), ValueError, "only LayerNorm"),
    (dict(norm="batch"), ValueError, "not a TPSP norm"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=-1e-5), ValueError, "eps"),
    (dict(bias=np.zeros(8, np.float64)), TypeError, "float32"),
    (dict(x=np.zeros((0, 3), np.float32)), ValueError, "at least one token"),
    (dict(norm_weight=np.zeros(7, np.float32)), ValueError, "norm_weight"),
])
def test_check_call_rejects_bad_arguments(rng, change, exc, words):
    args = _args(rng)
    args.update(change)
    with pytest.raises(exc, match=words):
        check_call(**args)


def test_check_call_limits(rng):
    with pytest.raises(ValueError, match="max_batched_tokens=4"):
        check_call(**_args(rng), max_tokens=4)
    with pytest.raises(ValueError, match="hidden_size=16"):
        check_call(**_args(rng), hidden_size=16)
    a = _args(rng)
    a["x"] = np.asfortranarray(a["x"])
    with pytest.raises(ValueError, match="C-contiguous"):
        check_call(**a)


# ---------------------------------------------------------------------------- backend selection
def test_get_tpsp_backend_picks_by_device(device_backend):
    # device_backend: "cuda:0" must be usable -- the simulator, or the GPU under VTNUMBA_TARGET=cuda.
    assert isinstance(get_tpsp_backend("tp", CPU), HostTPSPBackend)
    assert isinstance(get_tpsp_backend("tp", "cpu"), HostTPSPBackend)
    be = get_tpsp_backend("tp", "cuda:0")  # makes its own CUDABackend on the device target
    assert isinstance(be, CudaTPSPBackend) and be.device == Device(DeviceType.CUDA, 0)
    assert be.exchange == "push" and HostTPSPBackend().exchange == "pull"
    assert HostTPSPBackend(exchange="push").exchange == "push"
    with pytest.raises(ValueError, match="not a device"):
        get_tpsp_backend("tp", "tpu")
    with pytest.raises(ValueError, match="group_name"):
        HostTPSPBackend("")
    with pytest.raises(ValueError, match="exchange"):
        HostTPSPBackend("tp", exchange="broadcast")
    with pytest.raises(ValueError, match="CUDA Device"):
        CudaTPSPBackend("tp", CPU)


def test_a_cuda_tpsp_backend_closes_the_backend_it_made_and_only_that(device_backend):
    own = CudaTPSPBackend("tp")  # makes its own CUDABackend: its streams go when it closes
    own.data_backend.create_queue("a stream of its own")
    own.close()
    assert own.data_backend.closed
    lent = CudaTPSPBackend("tp", backend=device_backend)  # the caller's: still theirs after close
    lent.close()
    assert not device_backend.closed
    device_backend.destroy_queue(device_backend.create_queue("still usable"))


def test_closing_a_backend_destroys_its_flag_side_queue(device_backend):
    side = device_backend._flag_side_queue()  # (made by a first flag release or read)
    device_backend.close()
    assert side.destroyed


def test_profile_search_grids():
    assert chunk_candidates(64, 1024) == [64, 128, 256, 512, 1024]
    assert chunk_candidates(64, 300) == [64, 128, 256, 300]
    assert chunk_candidates(64, 10) == [10]
    assert threshold_sizes(1000, 16) == [1000, 500, 250, 125, 62, 31, 16]
    assert threshold_sizes(5, 16) == [5]


def test_check_call_refuses_outputs_over_the_same_memory(rng):
    # out=buf and new_residual=buf[:R] passed the identity test and gave a wrong residual
    # (fused and regular alike); the outputs are written while later chunks still read.
    a = _args(rng)  # T=5, H=8, R=3
    buf = np.empty((5, 8), np.float32)
    with pytest.raises(ValueError, match=r"out and new_residual share memory"):
        check_call(**a, out=buf, new_residual=buf[:3])
    with pytest.raises(ValueError, match=r"out and residual share memory"):
        check_call(**dict(a, residual=buf[:3]), out=buf)
    with pytest.raises(ValueError, match=r"new_residual and x share memory"):
        big = np.empty(5 * 3 + 3 * 8, np.float32)  # x's last row and new_residual's first bytes overlap
        check_call(**dict(a, x=big[:15].reshape(5, 3)), new_residual=big[12:36].reshape(3, 8))
    with pytest.raises(ValueError, match=r"new_residual and residual share overlapping memory"):
        both = np.empty((4, 8), np.float32)
        check_call(**dict(a, residual=both[:3]), new_residual=both[1:4])
    check_call(**a, new_residual=a["residual"])  # in place: fine
    check_call(**a, out=buf[:5], new_residual=np.empty((3, 8), np.float32))


def test_a_tpsp_op_that_times_out_says_which_path_its_rank_took():
    # Ranks called with different T stand on two sides of the threshold: each timed out
    # blaming a peer that "never joined", with nothing about T.
    from types import SimpleNamespace

    from vtnumba.backend.polling import WaitTimeout
    from vtnumba.tpsp import TPSPOp

    def stuck(*args, **kwargs):
        raise WaitTimeout("timed out after 1 s waiting for flag 'call' from rank 1")

    profile = SimpleNamespace(threshold_tokens=4, max_batched_tokens=64, is_active=lambda t: t >= 4)
    ctx = SimpleNamespace(profile=profile, handle=lambda name: SimpleNamespace(group=None),
                          backend=SimpleNamespace(tpsp_matmul_rs_norm_ag=stuck))
    op = TPSPOp(ctx, "down")
    with pytest.raises(WaitTimeout, match=r"from rank 1 \[TPSPOp 'down': this rank was called with T=8 tokens and "
                                          r"took the fused path \(fused from 4 tokens\); every rank"):
        op(np.zeros((8, 2), np.float32), None, None, None, None, 1e-5)


def test_host_backend_threaded_must_be_a_bool():
    from vtnumba.tpsp import HostTPSPBackend

    with pytest.raises(TypeError, match="threaded='no' must be True or False"):  # ('no' is a true value)
        HostTPSPBackend("tp", threaded="no")
