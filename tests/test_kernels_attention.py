"""vtnumba.kernels.attention: packed attention, host reference vs float64 numpy, CUDA kernel vs host reference.

The contract under test: each token attends to the keys of its own sentence only, and no
padding ever reaches a real token's output.  The CUDA kernel runs on the device target
(numba's simulator here, the GPU under ``VTNUMBA_TARGET=cuda``: the ``device_backend``
fixture).  Inputs are fresh random numbers, outputs are filled with NaN first, and the
sentence lengths are odd on purpose (1, 7, 33, several sentences of different lengths).
"""

import time

import numpy as np
import pytest
from attention_reference import attention64

from vtnumba.backend import CPUBackend
from vtnumba.kernels import AttentionWorkspace, attention, attention_host
from vtnumba.memory import StepArena


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _case(rng, lengths, nh, d, with_bias=True):
    T, K = int(sum(lengths)), nh * d
    qkv = rng.standard_normal((T, 3 * K)).astype(np.float32)
    bias = rng.standard_normal(3 * K).astype(np.float32) if with_bias else None
    return qkv, bias, _offsets(lengths)


def _tolerance(qkv, bias, nh, d):
    # float32 rounds each score q.k to ~1 ulp of |q| |k|; softmax passes that on to the output,
    # scaled by |v|: so one float32 ulp of max|q| max|k| max|v| (a padded key leaking into a row
    # would be off by O(|v|), far above this).
    x = qkv.astype(np.float64) + (0.0 if bias is None else bias)
    K = nh * d
    q, k = (np.linalg.norm(x[:, p * K:(p + 1) * K].reshape(-1, nh, d), axis=2).max() for p in (0, 1))
    return 4 * np.finfo(np.float32).eps * max(q * k, 1.0) * np.abs(x[:, 2 * K:]).max()


@pytest.mark.parametrize("lengths", [(1,), (7,), (33,), (7, 1, 33), (1, 1, 1), (65, 7, 33, 1)])
@pytest.mark.parametrize("nh,d", [(1, 8), (3, 64), (2, 5)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_host_reference_matches_float64(rng, lengths, nh, d, with_bias):
    qkv, bias, offsets = _case(rng, lengths, nh, d, with_bias)
    out = np.full((qkv.shape[0], nh * d), np.nan, np.float32)
    assert attention(qkv, offsets, nh, d, bias=bias, out=out) is out
    want = attention64(qkv, lengths, nh, d, bias)
    assert np.abs(out - want).max() < _tolerance(qkv, bias, nh, d)


def test_workspace_from_a_step_arena_gives_the_same_result(rng):
    lengths, nh, d = (7, 1, 33), 2, 16
    qkv, bias, offsets = _case(rng, lengths, nh, d)
    want = attention(qkv, offsets, nh, d, bias=bias)
    backend = CPUBackend()
    shapes = AttentionWorkspace.shapes(len(lengths), max(lengths), nh, d)
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes.values())
    with StepArena(backend, nbytes + 64 * len(shapes)) as arena:
        ws = AttentionWorkspace.allocate(len(lengths), max(lengths), nh, d,
                                         alloc=lambda shape: arena.alloc(int(np.prod(shape)) * 4, np.float32, shape))
        for arr in ws:
            arr.fill(np.nan)  # stale contents must not matter (padding is zeroed, not assumed)
        got = attention(qkv, offsets, nh, d, bias=bias, workspace=ws)
    np.testing.assert_array_equal(got, want)


def test_padding_never_reaches_real_rows(rng):
    # The same sentence alone, and after a much longer one (so the host pads it): same rows.
    nh, d = 2, 16
    short, _, _ = _case(rng, (5,), nh, d)
    other, _, _ = _case(rng, (33,), nh, d)
    alone = attention(short, _offsets((5,)), nh, d)
    both = attention(np.concatenate([other, short]), _offsets((33, 5)), nh, d)
    # Padding must not *leak* (an O(1) error); it may change the order of float32 sums (a longer,
    # masked row vectorises differently): a few ulps of the values' scale.
    ulp = np.finfo(np.float32).eps * np.abs(alone).max()
    np.testing.assert_allclose(both[33:], alone, rtol=0, atol=8 * ulp)


# Few heads and short rows: the simulator starts a Python thread per GPU thread of every block.
@pytest.mark.parametrize("lengths,nh,d,with_bias", [((1,), 1, 8, False), ((7, 1, 33), 1, 5, True),
                                                    ((1, 7), 3, 16, True), ((3, 2), 2, 4, False)])
def test_kernel_matches_host_reference(device_backend, rng, lengths, nh, d, with_bias):
    qkv, bias, offsets = _case(rng, lengths, nh, d, with_bias)
    host = np.full((qkv.shape[0], nh * d), np.nan, np.float32)
    attention_host(qkv, bias, offsets, nh, d, max(lengths), host)
    dev = device_backend.asarray
    d_out = dev(np.full_like(host, np.nan))
    got = attention(dev(qkv), dev(offsets), nh, d, bias=None if bias is None else dev(bias), out=d_out,
                    max_len=max(lengths))
    assert got is d_out
    np.testing.assert_allclose(device_backend.to_host(d_out), host, rtol=0, atol=_tolerance(qkv, bias, nh, d))


def test_kernel_sentence_sees_only_its_own_keys(device_backend, rng):
    # Neighbours in the packed stream, and a longer batch (more threads per block), change nothing.
    nh, d = 1, 5
    short, bias, _ = _case(rng, (7,), nh, d)
    other, _, _ = _case(rng, (33,), nh, d)
    dev = device_backend.asarray
    alone = device_backend.to_host(attention(dev(short), dev(_offsets((7,))), nh, d, bias=dev(bias)))
    both = device_backend.to_host(attention(dev(np.concatenate([other, short, other[:1]])),
                                            dev(_offsets((33, 7, 1))), nh, d, bias=dev(bias)))
    ulp = np.finfo(np.float32).eps * np.abs(alone).max()
    np.testing.assert_allclose(both[33:40], alone, rtol=0, atol=8 * ulp)


@pytest.mark.parametrize("threads", [1, 3, 64])
def test_kernel_block_size_does_not_change_the_result(device_backend, rng, threads):
    # The launch picks the block size (smaller in the simulator); any size is correct.
    from vtnumba.kernels._common import DEVICE, run
    from vtnumba.kernels.attention_cuda import launch_attention

    lengths, nh, d = (3, 5), 1, 4
    qkv, bias, offsets = _case(rng, lengths, nh, d)
    host = np.full((qkv.shape[0], nh * d), np.nan, np.float32)
    attention_host(qkv, bias, offsets, nh, d, max(lengths), host)
    dev = device_backend.asarray
    d_qkv, d_bias, d_off = dev(qkv), dev(bias), dev(offsets)
    d_out = dev(np.full_like(host, np.nan))
    run(DEVICE, "attention", None, None, host_fn=None,
        launch_fn=lambda stream: launch_attention(d_qkv, d_bias, d_off, nh, d, max(lengths), d_out, stream,
                                                  threads=threads))
    np.testing.assert_allclose(device_backend.to_host(d_out), host, rtol=0, atol=_tolerance(qkv, bias, nh, d))


def test_offsets_written_by_queued_work_are_read_after_it(rng):
    """Without max_len, attention reads the offsets on the calling thread: with a queue, only
    once the work queued before it -- here, what writes the offsets -- has finished (a
    threaded cpu queue; on a GPU the same holds for the backend's streams)."""
    lengths = (4, 1, 6)
    qkv, bias, truth = _case(rng, lengths, 2, 3)
    offsets = np.zeros_like(truth)  # not offsets yet: the queued work writes them
    be = CPUBackend(threaded=True)
    try:
        q = be.create_queue("attention")

        def write_offsets(_stream):
            time.sleep(0.2)  # still running when attention() is called
            offsets[:] = truth

        be.submit(q, write_offsets, name="write offsets")
        out = attention(qkv, offsets, 2, 3, bias=bias, queue=q)  # (read too early: a ValueError)
        be.synchronize(q)
    finally:
        be.close()
    expected = np.full_like(out, np.nan)
    attention_host(qkv, bias, truth, 2, 3, max(lengths), expected)
    np.testing.assert_array_equal(out, expected)


def test_errors_name_the_argument(device_backend, rng):
    qkv, bias, offsets = _case(rng, (4, 3), 1, 4)
    with pytest.raises(ValueError, match=r"qkv has shape \(7, 12\); expected \(\?, 9\)"):
        attention(qkv, offsets, 1, 3)
    with pytest.raises(ValueError, match="bias has shape"):
        attention(qkv, offsets, 1, 4, bias=bias[:5])
    for bad in ([0, 4, 6], [1, 4, 7], [0, 4, 4, 7]):
        with pytest.raises(ValueError, match=r"offsets=\[.*\] must start at 0, end at T=7"):
            attention(qkv, np.asarray(bad, np.int64), 1, 4)
    with pytest.raises(TypeError, match="offsets has dtype int32"):
        attention(qkv, offsets.astype(np.int32), 1, 4)
    with pytest.raises(ValueError, match="max_len=3 but the longest sentence in offsets has 4"):
        attention(qkv, offsets, 1, 4, max_len=3)
    ws = AttentionWorkspace.allocate(2, 3, 1, 4)  # sized for max_len 3, not 4
    with pytest.raises(ValueError, match="workspace.q has shape"):
        attention(qkv, offsets, 1, 4, workspace=ws)
    with pytest.raises(TypeError, match="must all be numpy arrays or all device arrays"):
        attention(qkv, device_backend.asarray(offsets), 1, 4)
    dev = device_backend.asarray
    with pytest.raises(ValueError, match="workspace is for the host reference"):
        attention(dev(qkv), dev(offsets), 1, 4, workspace=AttentionWorkspace.allocate(2, 4, 1, 4))
    long = rng.standard_normal((513, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="513 tokens; the CUDA attention kernel takes at most 512"):
        attention(dev(long), dev(_offsets((513,))), 1, 1, max_len=513)


def test_an_out_sharing_memory_with_an_input_is_refused_on_host_and_device(device_backend, rng):
    # Blocks read their sentence's K and V rows while other blocks write out: an out inside qkv
    # gave wrong rows on the device (the host's workspace happened to hide it).
    qkv, bias, offsets = _case(rng, (4, 3), 1, 4)  # T = 7, K = 4: qkv (7, 12), bias (12,)
    dqkv = device_backend.asarray(qkv)
    for q, offs in ((qkv, offsets), (dqkv, device_backend.asarray(offsets))):
        inside = q.reshape(-1)[12:12 + 7 * 4].reshape(7, 4)  # C-contiguous, over qkv's rows 1 ..
        with pytest.raises(ValueError, match="out and qkv share memory"):
            attention(q, offs, 1, 4, out=inside)
    mem = rng.standard_normal(40).astype(np.float32)
    with pytest.raises(ValueError, match="out and bias share memory"):
        attention(qkv, offsets, 1, 4, bias=mem[:12], out=mem[8:36].reshape(7, 4))
    attention(qkv, offsets, 1, 4, bias=mem[:12], out=mem[12:40].reshape(7, 4))  # beside it: fine


def test_the_host_path_never_imports_numba_cuda():
    # Importing numba.cuda would lock the process out of choosing the simulator later.
    import os
    import subprocess
    import sys

    script = ("import sys, numpy as np\n"
              "from vtnumba.kernels import activation, attention\n"
              "x = np.ones((3, 6), np.float32)\n"
              "activation(x, 'gelu_erf', bias=np.ones(6, np.float32))\n"
              "attention(np.ones((3, 6), np.float32), np.array([0, 2, 3]), 2, 1)\n"
              "print('numba.cuda' in sys.modules)\n")
    env = dict(os.environ, VTNUMBA_TARGET="cpu", NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"


def test_device_offsets_are_checked_when_readable_and_a_too_long_sentence_comes_out_nan(device_backend, rng):
    # With a caller's max_len the device path trusted everything: offsets that left token 1 in
    # no sentence, and a 514-token sentence whose keys past 512 were silently dropped.
    from vtnumba.backend.arrays import host_view
    from vtnumba.kernels._common import DEVICE, run
    from vtnumba.kernels.attention_cuda import MAX_KEYS, launch_attention

    dev = device_backend.asarray
    qkv = dev(rng.standard_normal((2, 3)).astype(np.float32))
    bad = dev(np.array([0, 1], np.int64))
    if host_view(bad) is not None:  # the simulator: reading the offsets is free, so they are checked
        with pytest.raises(ValueError, match=r"offsets=\[0, 1\] must start at 0, end at T=2"):
            attention(qkv, bad, 1, 1, max_len=1)
    # The kernel itself (what a GPU runs when it trusts max_len): a sentence it cannot hold is NaN.
    T = MAX_KEYS + 2
    d_qkv = dev(rng.standard_normal((T, 3)).astype(np.float32))
    d_out = dev(np.zeros((T, 1), np.float32))
    run(DEVICE, "attention", None, None, host_fn=None,
        launch_fn=lambda stream: launch_attention(d_qkv, d_qkv[0], dev(np.array([0, T], np.int64)), 1, 1, 8, d_out,
                                                  stream))
    assert np.isnan(device_backend.to_host(d_out)).all()
    # Offsets past T or before 0 (a sentence reaching outside qkv's rows): NaN rows, no
    # reads outside qkv -- the simulator would raise IndexError, a GPU read another allocation.
    T = 6
    d_qkv = dev(rng.standard_normal((T, 3)).astype(np.float32))
    for offsets, bad_rows in (([0, 2, 9], slice(2, T)), ([-2, 6], slice(0, T))):
        d_out = dev(np.full((T, 1), 7.0, np.float32))
        run(DEVICE, "attention", None, None, host_fn=None,
            launch_fn=lambda stream: launch_attention(d_qkv, d_qkv[0], dev(np.array(offsets, np.int64)), 1, 1, 8,
                                                      d_out, stream))
        got = device_backend.to_host(d_out)
        assert np.isnan(got[bad_rows]).all() and np.isfinite(np.delete(got, np.r_[bad_rows], axis=0)).all(), \
            (offsets, got.ravel())
