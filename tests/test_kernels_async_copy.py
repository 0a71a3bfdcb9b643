"""Asynchronous global -> shared copies (vtnumba.kernels._async_copy_cuda), on their own.

The matmul rung built on them is tested with the ladder (test_kernels_matmul); here is the
protocol itself -- copy, commit, wait, barrier -- on the device target, and the simulator's
part of the bargain: a copy lands only when its thread waits, so reading too early shows.
"""

import numpy as np
import pytest
from numba import cuda, float32

from vtnumba.backend.cuda import SIM_LAUNCH_LOCK
from vtnumba.kernels._async_copy_cuda import (
    async_copies_supported,
    commit_copies,
    copy_quad_to_shared,
    wait_all_copies,
    wait_copies,
)
from vtnumba.kernels._wide_cuda import SMEM_ALIGN

ROWS, COLS = 8, 16  # 32 quads: one per thread of a one-warp block
# Shared arrays that cp.async writes must be 16-byte aligned (SMEM_ALIGN; None in the
# simulator, which refuses the argument and checks offsets instead).


@pytest.fixture(autouse=True)
def _cp_async_or_skip(device_backend):
    """cp.async needs compute capability 8.0: on an older GPU these tests skip, saying so."""
    ok, why = async_copies_supported()
    if not ok:
        pytest.skip(why)


def _launch(kernel, *args):
    with SIM_LAUNCH_LOCK:  # (launches in the simulator are serialised, as the backends do)
        kernel[1, ROWS * COLS // 4](*args)
        cuda.synchronize()


@cuda.jit
def _copy_and_read_a_neighbours_quad(src, out):
    """Each thread copies its quad into shared memory, then writes out the quad of the *next*
    thread: visible only after every thread's wait and the barrier."""
    sh = cuda.shared.array((ROWS, COLS), float32, alignment=SMEM_ALIGN)
    t = cuda.threadIdx.x
    copy_quad_to_shared(sh, t // 4, 4 * (t % 4), src, t // 4, 4 * (t % 4))
    commit_copies()
    wait_copies(0)
    cuda.syncthreads()
    n = (t + 1) % (ROWS * COLS // 4)
    for q in range(4):
        out[n // 4, 4 * (n % 4) + q] = sh[n // 4, 4 * (n % 4) + q]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_copies_reach_every_thread_after_wait_and_barrier(dev, host, rng, dtype):
    # float32 moves by cp.async; float16 is widened through registers (cp.async cannot convert).
    src = rng.standard_normal((ROWS, COLS)).astype(dtype)
    out = dev(np.full((ROWS, COLS), np.nan, np.float32))
    _launch(_copy_and_read_a_neighbours_quad, dev(src), out)
    np.testing.assert_array_equal(host(out), src.astype(np.float32))


@cuda.jit
def _read_before_and_after_waits(src, early, middle, late):
    """Two groups (the thread's quad of src, then 1 + it); reads before any wait, after
    ``wait_copies(1)`` (the older group in), and after ``wait_all_copies``."""
    sh = cuda.shared.array((2, ROWS, COLS), float32, alignment=SMEM_ALIGN)
    t = cuda.threadIdx.x
    r, c = t // 4, 4 * (t % 4)
    for q in range(4):
        sh[0, r, c + q] = -1.0
        sh[1, r, c + q] = -1.0
    copy_quad_to_shared(sh[0], r, c, src, r, c)
    commit_copies()
    copy_quad_to_shared(sh[1], r, c, src, r, c)
    commit_copies()
    for q in range(4):
        early[r, c + q] = sh[0, r, c + q] + sh[1, r, c + q]
    wait_copies(1)
    for q in range(4):
        middle[r, c + q] = sh[0, r, c + q] + sh[1, r, c + q]
    wait_all_copies()
    for q in range(4):
        late[r, c + q] = sh[0, r, c + q] + sh[1, r, c + q]


@pytest.mark.simulator_only  # on a GPU the early reads race with the copies: any value may show
def test_the_simulator_lands_a_copy_only_when_its_thread_waits(dev, host, rng):
    src = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    outs = [dev(np.full((ROWS, COLS), np.nan, np.float32)) for _ in range(3)]
    _launch(_read_before_and_after_waits, dev(src), *outs)
    early, middle, late = (host(o) for o in outs)
    np.testing.assert_array_equal(early, np.full_like(src, -2.0))  # nothing landed yet
    np.testing.assert_array_equal(middle, src - 1.0)  # the older group only
    np.testing.assert_array_equal(late, 2 * src)


@pytest.mark.simulator_only
def test_the_simulator_can_land_copies_at_once(dev, host, rng, monkeypatch):
    # The other extreme a GPU allows: every copy in shared memory as soon as it is issued.
    from vtnumba.kernels import _async_copy_cuda

    monkeypatch.setattr(_async_copy_cuda, "SIMULATED_LANDING", "issue")
    src = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    outs = [dev(np.full((ROWS, COLS), np.nan, np.float32)) for _ in range(3)]
    _launch(_read_before_and_after_waits, dev(src), *outs)
    for out in outs:
        np.testing.assert_array_equal(host(out), 2 * src)


@cuda.jit
def _copy_from(src, col, out):
    sh = cuda.shared.array((ROWS, COLS), float32, alignment=SMEM_ALIGN)
    copy_quad_to_shared(sh, 0, 0, src, 0, col)
    commit_copies()
    wait_all_copies()
    out[0] = sh[0, 0]


@pytest.mark.simulator_only  # on a GPU this launch would stop with "misaligned address"
def test_a_misaligned_source_is_refused_in_the_simulator(dev):
    src = dev(np.zeros((ROWS, COLS + 4), np.float32))
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        _launch(_copy_from, src, 1, dev(np.zeros(1, np.float32)))


@cuda.jit
def _issue_and_leave(src, sh_out):
    # A GPU thread that ends with its copy still in flight (no wait): into a global array
    # standing in for shared memory, so the test can see when it lands.
    copy_quad_to_shared(sh_out, 0, 0, src, 0, 0)
    commit_copies()


@cuda.jit
def _wait_for_nothing(flag):
    wait_all_copies()
    flag[0] = 1.0


@pytest.mark.simulator_only
def test_copies_left_in_flight_land_when_their_thread_ends(dev, host, rng):
    # The simulator keeps a thread's copies in flight per Python thread, and reuses Python
    # threads for the next GPU threads: a copy a GPU thread never waited for landed only when
    # a *later* kernel on the same Python thread waited.  On a GPU it completes anyway; now
    # it lands when its GPU thread ends, and nothing carries into the next launch.
    src = rng.standard_normal((1, 4)).astype(np.float32)
    target = dev(np.zeros((1, 4), np.float32))
    with SIM_LAUNCH_LOCK:
        _issue_and_leave[1, 1](dev(src), target)
    np.testing.assert_array_equal(host(target), src)
    host(target)[:] = 0  # (the simulator's device array is this numpy array)
    with SIM_LAUNCH_LOCK:
        _wait_for_nothing[1, 1](dev(np.zeros(1, np.float32)))
    np.testing.assert_array_equal(host(target), np.zeros((1, 4), np.float32))
