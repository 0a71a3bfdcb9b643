"""Bad input a learner plausibly passes, named as the learner named it.

Each case here once failed deep inside the library -- an AttributeError, numpy's "could not
convert string to float", a ZeroDivisionError, a kernel's own argument name (``y`` for the
``x`` passed to a norm), a mismatch blamed on the module's weight -- or was silently
accepted (``create="no"`` made a region; ``bias=np.True_`` was taken for an array).  Now
each raises a TypeError or ValueError naming the caller's argument and what was expected,
before anything is done.  (The multi-rank cases -- one rank's bad ``x`` heard by the
others at once -- are in ``tests/mpi/test_tpsp_fused.py``.)
"""

import os
import re

import numpy as np
import pytest

from vtnumba import dist, kernels, memory, nn, tpsp
from vtnumba.backend import CPUBackend, Device, DeviceType, as_device, default_backend
from vtnumba.dist.shm import ShmSegment
from vtnumba.ec import create_ec_shared_region
from vtnumba.kernels.activation import fast_erf
from vtnumba.tpsp.select import get_tpsp_backend


@pytest.fixture
def x(rng):
    return rng.standard_normal((3, 5)).astype(np.float32)


# ---------------------------------------------------------------------------- nn modules
@pytest.mark.parametrize("make", [lambda: nn.RMSNorm(8), lambda: nn.LayerNorm(8)], ids=["rms", "layer"])
def test_a_norm_module_names_its_input_not_its_weight(make, x):
    norm = make()
    with pytest.raises(ValueError, match=r"x has shape \(3, 5\); (RMS|Layer)Norm\(8, .*\) takes \[tokens, "
                                         r"hidden_size\] = \[\?, 8\]"):
        norm(x)
    with pytest.raises(ValueError, match=r"x has shape \(8,\)"):
        norm(np.ones(8, np.float32))
    with pytest.raises(TypeError, match="x has dtype float64; expected float32"):
        norm(np.ones((3, 8)))
    with pytest.raises(TypeError, match="x must be a numpy array .* got builtins.list"):
        norm([[1.0] * 8])
    out = norm(np.ones((2, 8), np.float32))  # and the right input still works
    assert out.shape == (2, 8) and np.isfinite(out).all()


def test_linear_modules_name_their_input(x):
    col = nn.ColumnParallelLinear(8, 4, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match=r"x has shape \(3, 5\); ColumnParallelLinear\(8 -> 4, .*\) takes "
                                         r"\[tokens, in_features\] = \[\?, 8\]"):
        col(x)
    row = nn.RowParallelLinear(8, 4, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match=r"x_local has shape \(3, 5\); RowParallelLinear.* takes \[tokens, "
                                         r"input_size_per_partition\] = \[\?, 4\]"):
        row.partial(x)


@pytest.mark.parametrize("group", [None, "tp"])
def test_a_row_parallel_layer_names_a_wrong_group(group, rng):
    layer = nn.RowParallelLinear(8, 4, tp_size=1, tp_rank=0)
    x8 = rng.standard_normal((3, 8)).astype(np.float32)
    if group is None:  # (None means the tensor-parallel group, which must be initialised)
        with dist.distributed(tp_size=1):
            assert layer(x8, None).shape == (3, 4)
        return
    with pytest.raises(TypeError, match="group must be a vtnumba ProcessGroup .* got str"):
        layer(x8, group)


@pytest.mark.parametrize("weight, bias, exc, match", [
    ("w", True, TypeError, "weight='w' must be an array of numbers"),
    ([["a"] * 8] * 4, True, TypeError, "weight must be an array of real numbers, got dtype <U1"),
    # None became NaN, a complex number lost its imaginary part: parameters of NaNs, no error
    ([[None] * 8] * 4, True, TypeError, "weight must be an array of real numbers, got dtype object"),
    (np.ones((4, 8), complex), True, TypeError, "weight must be an array of real numbers, got dtype complex128"),
    (None, "yes", TypeError, "bias='yes' must be True, False, None or an array"),
    (None, 2.5, TypeError, "bias=2.5 must be True, False, None or an array"),
    (None, [["x"]], TypeError, "bias must be an array of real numbers"),
])
def test_linear_weights_that_hold_no_numbers_are_named(weight, bias, exc, match):
    with pytest.raises(exc, match=match):
        nn.ColumnParallelLinear(8, 4, weight=weight, bias=bias, tp_size=1, tp_rank=0)


def test_norm_weights_that_hold_no_numbers_and_float32_overflow_are_named():
    # RMSNorm(weight="abc") said only "could not convert string to float"; a 1e300 weight
    # became inf with numpy's RuntimeWarning.
    with pytest.raises(TypeError, match="weight='abc' must be an array of numbers"):
        nn.RMSNorm(3, weight="abc")
    with pytest.raises(TypeError, match="bias must be an array of real numbers"):
        nn.LayerNorm(2, bias=["a", "b"])
    with pytest.raises(TypeError, match="weight must be an array of real numbers, got dtype object"):
        nn.RMSNorm(2, weight=[None, None])
    # The norms' seeds are checked as the linear layers' are (-1, 1.5 failed inside numpy; True passed)
    for bad in (-1, 1.5, True, "3"):
        for norm in (nn.RMSNorm, nn.LayerNorm):
            with pytest.raises(ValueError, match=rf"seed={bad!r} must be a non-negative int \(or None\)"):
                norm(4, seed=bad)
    with pytest.raises(ValueError, match="weight holds values too large for float32"):
        nn.ColumnParallelLinear(1, 1, weight=[[1e300]], tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="weight holds values too large for float32"):
        nn.RMSNorm(2, weight=np.array([1.0, 1e39]))
    # (an inf or NaN given as such is the caller's to keep: the NaN tests pass them on purpose)
    assert np.isinf(nn.ColumnParallelLinear(1, 1, weight=[[np.inf]], tp_size=1, tp_rank=0).weight).all()


def test_a_numpy_bool_bias_is_a_flag_not_an_array():
    assert nn.ColumnParallelLinear(8, 4, bias=np.True_, tp_size=1, tp_rank=0).bias.shape == (4,)
    assert nn.RowParallelLinear(8, 4, bias=np.False_, tp_size=1, tp_rank=0).bias is None


# ---------------------------------------------------------------------------- dist
def test_collectives_on_a_freed_group_say_so():
    g = dist.init_distributed()
    dist.destroy_distributed()
    a = np.ones((1, 2), np.float32)
    for call in (lambda: dist.mpi_all_gather(a, a.copy(), g), lambda: dist.mpi_reduce_scatter(a, a.copy(), g),
                 lambda: tpsp.regular_matmul_rs_norm_ag(g, a, a, None, a, a[0], 1e-5)):
        with pytest.raises(RuntimeError, match=r"group 'tp' was freed \(destroy_distributed\(\) ran\)"):
            call()
    with pytest.raises(TypeError, match="group must be a vtnumba ProcessGroup .* got NoneType"):
        tpsp.regular_matmul_rs_norm_ag(None, a, a, None, a, a[0], 1e-5)


def test_init_distributed_takes_a_numpy_integer():
    try:
        assert dist.init_distributed(np.int64(1)).size == 1
    finally:
        dist.destroy_distributed()
    with pytest.raises(TypeError, match="tp_size=1.5 must be an int"):
        dist.init_distributed(1.5)
    assert not dist.is_initialized()


def test_a_segment_tag_and_size_are_checked():
    with pytest.raises(ValueError, match="tag='my seg' must be a name of 1 to 64 letters, digits"):
        ShmSegment.create(8, tag="my seg")
    seg = ShmSegment.create(64, tag="probe")
    try:
        with pytest.raises(TypeError, match="nbytes='64' must be an int"):
            ShmSegment.attach(seg.handle, "64")
        with pytest.raises(ValueError, match="has 64 bytes, expected 32"):
            ShmSegment.attach(seg.handle, 32)
    finally:
        seg.close()


def test_published_meta_must_be_ints():
    with dist.distributed(tp_size=1) as g:
        signals = dist.PeerSignals(g)
        try:
            for bad in ("abc", [1, "2"], [1.5]):
                with pytest.raises(TypeError, match="values=.* must be a sequence of at most 8 ints"):
                    signals.set_meta(bad)
            signals.set_meta([np.int32(3), 4])
            assert signals.meta(0)[:2] == (3, 4)
        finally:
            signals.close()


def test_queue_flags_without_a_backend_use_the_default_one():
    with dist.distributed(tp_size=1) as g:
        flags = dist.QueueFlags(g, ["a"], None)
        try:
            assert flags.backend is default_backend() and "QueueFlags ['a']" in repr(flags)
        finally:
            flags.close()


# ---------------------------------------------------------------------------- backend and memory
def test_device_strings_are_read_as_pytorch_writes_them():
    assert as_device("cuda:1") == Device(DeviceType.CUDA, 1)
    assert as_device("CPU") == Device(DeviceType.CPU, 0) and as_device(DeviceType.CUDA) == Device("cuda", 0)
    assert default_backend("cpu:0") is default_backend("cpu")
    with pytest.raises(ValueError, match="device='cuda:x' is not a device; expected 'cpu', 'cuda' or 'cuda:N'"):
        default_backend("cuda:x")
    with pytest.raises(ValueError, match="device='gpu' is not a device"):
        get_tpsp_backend("tp", "gpu")
    with pytest.raises(TypeError, match="device=0 must be a Device, a DeviceType, or a string"):
        default_backend(0)
    for odd in ("cuda:1_0", "cuda: 1", "cuda:+1", "cuda:"):  # int() took these ("cuda:1_0" was cuda:10)
        with pytest.raises(ValueError, match=re.escape(f"device='{odd}' is not a device")):
            as_device(odd)


def test_the_simulator_refuses_a_cuda_device_it_does_not_have(device_backend_factory):
    # The simulator has one device; "cuda:7" was accepted (and registered) there, while the
    # same program fails on a one-GPU machine.
    from vtnumba.backend.cuda import CUDABackend

    device_backend_factory().close()  # (skips where the device target is not the simulator's)
    from vtnumba.backend.arrays import simulator_active

    if not simulator_active():
        pytest.skip("the simulator's rule: a GPU refuses a missing device in numba's select_device")
    with pytest.raises(ValueError, match="device=cuda:7: numba's CUDA simulator has one device, cuda:0"):
        CUDABackend("cuda:7")


@pytest.mark.parametrize("dtype, match", [("foo", "dtype='foo' is not a numpy dtype"),
                                          (object, "dtype=object cannot view raw memory"),
                                          ("U4", "dtype=<U4 cannot view raw memory")])
def test_raw_memory_takes_number_types_only(dtype, match):
    be = CPUBackend()
    buf = be.alloc(64)
    arena = memory.StepArena(be, 256)
    try:
        for call in (lambda: buf.view(dtype), lambda: arena.alloc(8, dtype), lambda: be.empty((2,), dtype)):
            with pytest.raises(TypeError, match=match):
                call()
    finally:
        arena.close()
        be.free(buf)


def test_round_size_checks_its_arguments():
    assert memory.round_size(5) == memory.round_size(np.int64(5)) == 512
    with pytest.raises(ValueError, match="min_block=0 is out of range"):
        memory.round_size(5, 0)
    with pytest.raises(TypeError, match="nbytes='5' must be an int number of bytes"):
        memory.round_size("5")


def test_a_kernel_refuses_a_backend_that_does_not_serve_its_arrays(x, device_backend):
    with pytest.raises(TypeError, match="does not serve these arrays: numpy arrays run on a cpu backend"):
        kernels.matmul(x, x.T.copy(), backend=device_backend)
    assert kernels.matmul(x, x.T.copy(), backend=CPUBackend()).shape == (3, 3)


# ---------------------------------------------------------------------------- kernels, tpsp, ec
def test_erf_of_nan_is_nan():
    assert np.isnan(fast_erf(float("nan")))
    assert fast_erf(float("inf")) == 1.0 and fast_erf(-float("inf")) == -1.0


def test_attention_sizes_are_ints(rng):
    with pytest.raises(TypeError, match="num_sentences='2' must be an int"):
        kernels.AttentionWorkspace.allocate("2", 3, 1, 2)
    with pytest.raises(ValueError, match="max_len=-1 is out of range"):
        kernels.AttentionWorkspace.shapes(2, -1, 1, 2)
    qkv = rng.standard_normal((4, 6)).astype(np.float32)
    offsets = np.array([0, 2, 4])
    for bad, exc in ((3.5, TypeError), ("3", TypeError), (0, ValueError)):
        with pytest.raises(exc, match=f"max_len={bad!r} "):
            kernels.attention(qkv, offsets, 1, 2, max_len=bad)
    assert kernels.attention(qkv, offsets, 1, 2, max_len=2).shape == (4, 2)


def test_shard_residual_names_a_residual_without_tokens():
    # (It said "num_tokens=0 must be an int >= 1": an argument the caller never passed.)
    with pytest.raises(ValueError, match=r"residual has shape \(0, 4\); expected at least one token row"):
        tpsp.shard_residual(np.zeros((0, 4), np.float32), 2, 0)


def test_unshard_residual_names_a_shard_that_is_no_matrix():
    with pytest.raises(ValueError, match=r"shards\[0\] has shape \(\); expected a 2-D \[R, H\] shard"):
        tpsp.unshard_residual([np.float32(1)], 1)


@pytest.mark.parametrize("flag", ["create", "anonymous"])
def test_region_flags_must_be_bools(flag):
    kwargs = dict(engine_id="bad-flag", hidden_size=4, region_bytes=1024, create=True)
    kwargs[flag] = "no"  # a true string: it used to create a region (a /dev/shm file for create="no")
    with pytest.raises(TypeError, match=f"{flag}='no' must be True or False"):
        create_ec_shared_region(**kwargs)
    assert not [f for f in os.listdir("/dev/shm") if "bad-flag" in f]


def test_a_read_only_output_is_named_not_a_numba_typing_error(rng):
    # numba's compiled host kernels refused it with a long "setitem(readonly array ...)" typing
    # error that named no argument; linear's numpy path said "output array is read-only".
    def ro(a):
        a = a.copy()
        a.flags.writeable = False
        return a

    x = rng.standard_normal((3, 4)).astype(np.float32)
    w = rng.standard_normal(4).astype(np.float32)
    mm = rng.standard_normal((5, 4)).astype(np.float32)
    calls = {
        "out": [lambda: kernels.fused_add_rms_norm(x, x, w, 1e-5, out=ro(x)),
                lambda: kernels.activation(x, "gelu", out=ro(x)),
                lambda: kernels.linear(x, mm, out=ro(np.zeros((3, 5), np.float32))),
                lambda: kernels.attention(np.zeros((2, 3), np.float32), np.array([0, 2]), 1, 1,
                                          out=ro(np.zeros((2, 1), np.float32))),
                lambda: kernels.peer_reduce_norm([x, x], None, x, w, None, 1e-5, ro(x), x.copy())],
        "new_residual": [lambda: kernels.fused_add_rms_norm(x, x, w, 1e-5, new_residual=ro(x))],
        "x": [lambda: kernels.add_bias(ro(x), w)],
        r"dests\[0\]": [lambda: kernels.gather_rows(x, [ro(x)])],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=rf"^{name} is a read-only array \(numpy's writeable flag is off\)"):
                fn()
    assert kernels.activation(ro(x), "relu").flags.writeable  # a read-only *input* is fine
