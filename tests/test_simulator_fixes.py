"""vtnumba.backend.simulator_fixes: numba's simulator with one shared array per block and call
site whatever the thread timing, a barrier that counts arrivals instead of polling, and
device-function calls without per-call locks -- kernels must see exactly what they saw before."""

import sys
import threading
import time

import numpy as np
import pytest
from numba import cuda, float32

from vtnumba.kernels.norm_cuda import block_sum  # a device function of another module

pytestmark = pytest.mark.simulator_only


@pytest.fixture
def tiny_switch_interval():
    """Switch threads as often as the interpreter can: what makes a race window show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _arrays_seen_by(threads: int, shared, call) -> list:
    """What ``call(shared)`` returns on each of ``threads`` threads released together."""
    got = [None] * threads
    start = threading.Barrier(threads)

    def run(i):
        start.wait()
        got[i] = call(shared)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return got


def test_every_thread_of_a_block_gets_the_same_array(device_backend, tiny_switch_interval):
    # (device_backend: a CUDABackend in the simulator, which applies the fix.)
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    from vtnumba.backend.simulator_fixes import make_shared_arrays_thread_safe

    assert make_shared_arrays_thread_safe()  # idempotent: already applied by the backend
    for _ in range(150):  # numba's own version gave two arrays in 9 of 200 trials here
        got = _arrays_seen_by(32, FakeCUDAShared(0), lambda s: s.array(128, np.float32))
        assert len({id(a) for a in got}) == 1


def test_call_sites_dynamic_memory_and_types_behave_as_in_numba(device_backend):
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    shared = FakeCUDAShared(64)
    a = shared.array(8, np.float32)
    b = shared.array(8, np.float32)  # another line: another array
    again = [shared.array(8, np.int32) for _ in range(2)]  # one line: one array, however often
    assert a is not b and again[0] is again[1] and again[0].dtype == np.int32
    typed = shared.array((2, 3), float32)  # a numba type is taken as its numpy dtype
    assert typed.shape == (2, 3) and typed.dtype == np.float32
    dyn1, dyn2 = shared.array(0, float32), shared.array(0, np.dtype(np.int8))  # dynamic: one buffer for all
    assert dyn1.size == 16 and dyn2.size == 64 and np.shares_memory(dyn1, dyn2)
    with pytest.raises(RuntimeError, match="alignment"):
        shared.array(8, np.float32, alignment=16)


@cuda.jit
def _block_total(x, out):
    buf = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    buf[t] = x[t]
    cuda.syncthreads()
    if t == 0:
        s = float32(0.0)
        for i in range(32):
            s += buf[i]
        out[0] = s


def test_a_block_reduction_sees_every_thread(device_backend, tiny_switch_interval):
    # The failure the fix is for, in a kernel: a thread writing its value into an array of its
    # own, so the total misses it.  (The simulator starts a block's threads one by one, so here
    # the race is rarer than in the test above; this checks the fixed method in a kernel's
    # frames.  The suite's kernels with several shared arrays -- the matmul tiles -- check that
    # different lines still get different arrays.)
    x = device_backend.asarray(np.arange(1, 33, dtype=np.float32))
    out = device_backend.asarray(np.full(1, np.nan, np.float32))
    for _ in range(20):
        _block_total[1, 32](x, out)
        assert device_backend.to_host(out)[0] == 528.0  # 1 + 2 + ... + 32


# --- the barrier --------------------------------------------------------------------------


@cuda.jit
def _block_sums(x, out):
    # Three tree reductions in a row (norm_cuda.block_sum: a barrier after every halving
    # step): a barrier that let a thread through early would mix steps and calls.
    t = cuda.threadIdx.x
    for k in range(3):
        out[k, t] = block_sum(x[t] * float32(k + 1))


def test_tree_reductions_see_finished_steps(device_backend):
    rng = np.random.default_rng(7)
    for threads in (64, 128):
        x = rng.integers(-50, 50, threads).astype(np.float32)  # integers: every sum is exact
        out = device_backend.asarray(np.full((3, threads), np.nan, np.float32))
        for _ in range(3):
            _block_sums[1, threads](device_backend.asarray(x), out)
            want = np.outer([1, 2, 3], np.full(threads, x.sum())).astype(np.float32)
            np.testing.assert_array_equal(device_backend.to_host(out), want)


@cuda.jit
def _sum_of_the_first(x, out, active):
    # Threads past `active` finish before the barrier: as in numba (and on a GPU, where an
    # exited thread no longer takes part), the barrier then waits only for the others.
    buf = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    if t >= active:
        return
    buf[t] = x[t]
    cuda.syncthreads()
    if t == 0:
        s = float32(0.0)
        for i in range(active):
            s += buf[i]
        out[0] = s


@pytest.mark.parametrize("active", [1, 17, 64])
def test_threads_that_finish_early_do_not_hold_the_barrier(device_backend, active):
    x = np.arange(1, 65, dtype=np.float32)
    out = device_backend.asarray(np.full(1, np.nan, np.float32))
    _sum_of_the_first[1, 64](device_backend.asarray(x), out, active)
    assert device_backend.to_host(out)[0] == x[:active].sum()


@cuda.jit
def _votes(x, out):
    t = cuda.threadIdx.x
    count = cuda.syncthreads_count(x[t] > 0)
    every = cuda.syncthreads_and(x[t] > 0)
    some = cuda.syncthreads_or(x[t] > 0)
    if t == 0:
        out[0], out[1], out[2] = count, every, some


def test_block_votes_count_every_thread(device_backend):
    out = device_backend.asarray(np.full(3, -1, np.int32))
    for x, want in ((np.arange(-10, 22), [21, 0, 1]), (np.ones(32), [32, 1, 1]), (np.zeros(32), [0, 0, 0])):
        _votes[1, 32](device_backend.asarray(x.astype(np.float32)), out)
        assert device_backend.to_host(out).tolist() == want


@cuda.jit
def _fails_in_one_thread(out, bad):
    t = cuda.threadIdx.x
    if t == bad:
        raise ValueError("failed on purpose")
    cuda.syncthreads()  # where the other threads wait when `bad` fails
    out[t] = block_sum(float32(1.0))


def _all_simulator_threads_idle(limit_s=20.0) -> bool:
    """Whether, within ``limit_s``, every simulator thread alive waits in the pool for work."""
    from numba.cuda.simulator.kernel import BlockThread

    from vtnumba.backend import simulator_fixes

    deadline = time.monotonic() + limit_s
    while True:
        busy = [t for t in threading.enumerate()
                if isinstance(t, BlockThread) and not any(t is idle for idle in simulator_fixes._pool._idle)]
        if not busy or time.monotonic() > deadline:
            return not busy
        time.sleep(0.01)


def _launch_in_a_thread(launch, limit_s=60.0):
    """Run ``launch()`` on a thread of its own; its exception, or a failure if it hangs."""
    caught = []

    def run():
        try:
            launch()
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            caught.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit_s)
    assert not worker.is_alive(), "the launch hangs"
    return caught[0] if caught else None


def test_a_failing_thread_fails_the_launch_and_frees_the_others(device_backend):
    import vtnumba.kernels.norm_cuda as norm_cuda

    out = device_backend.asarray(np.zeros(32, np.float32))
    err = _launch_in_a_thread(lambda: _fails_in_one_thread[1, 32](out, 5))
    assert isinstance(err, ValueError) and "tid=[5, 0, 0]" in str(err) and "failed on purpose" in str(err), err
    # The launch raises at once, as numba's does; the block's other threads finish soon after
    # (told to abort at the barrier), none left waiting for a barrier that will never open:
    # every simulator thread still alive is an idle one, back in the pool.
    assert _all_simulator_threads_idle()
    # The launch is over: modules have the real cuda back, and the next launch runs whole.
    assert norm_cuda.cuda is cuda
    assert _launch_in_a_thread(lambda: _fails_in_one_thread[1, 32](out, -1)) is None
    assert (device_backend.to_host(out) == 32).all()


@cuda.jit
def _one_slow_thread(out):
    t = cuda.threadIdx.x
    if t == 0:
        time.sleep(0.5)  # plain Python in the simulator: the GIL is free meanwhile
    cuda.syncthreads()
    out[t] = t


def test_the_launching_thread_sleeps_while_the_block_waits(device_backend):
    # numba's BlockManager polls the block's threads in a loop that never sleeps: about 0.5 s
    # of CPU here, while 31 threads wait at the barrier for the sleeping one.
    out = device_backend.asarray(np.full(32, -1, np.int32))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    _one_slow_thread[1, 32](out)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert wall >= 0.5 and cpu < 0.2, (cpu, wall)
    assert device_backend.to_host(out).tolist() == list(range(32))


# --- reused threads -----------------------------------------------------------------------

_threads_seen = []


@cuda.jit
def _record_threads(out):
    # Plain Python in the simulator: which simulator thread ran this GPU thread.
    _threads_seen.append((cuda.blockIdx.x, cuda.threadIdx.x, threading.current_thread()))
    cuda.syncthreads()
    out[cuda.grid(1)] = cuda.blockIdx.x * 100 + cuda.threadIdx.x


def test_later_blocks_run_on_the_threads_of_earlier_ones(device_backend):
    # numba starts a new Python thread for every GPU thread of every block (430 us each on
    # a 2-core machine); the pool hands each block the threads the last one finished with.
    _threads_seen.clear()
    out = device_backend.asarray(np.full(96, -1, np.int64))
    _record_threads[3, 32](out)
    assert device_backend.to_host(out).tolist() == [b * 100 + t for b in range(3) for t in range(32)]
    seen = {(b, t) for b, t, _ in _threads_seen}
    assert len(_threads_seen) == 96 and seen == {(b, t) for b in range(3) for t in range(32)}
    # Each GPU thread saw its own indices on the thread that ran it, and 32 threads ran them all.
    assert len({id(thread) for _, _, thread in _threads_seen}) == 32
    _threads_seen.clear()


def _launch_in_a_forked_child(q):
    from vtnumba.backend.cuda import CUDABackend

    backend = CUDABackend()
    out = backend.asarray(np.zeros((3, 64), np.float32))
    _block_sums[1, 64](backend.asarray(np.ones(64, np.float32)), out)
    q.put("ok" if (backend.to_host(out)[:, 0] == [64, 128, 192]).all() else "wrong sums")


def test_a_forked_child_starts_its_own_threads(device_backend):
    # After fork the child has none of the parent's idle threads, only their objects: a pool
    # that handed those out would hang the child's first launch.
    import multiprocessing

    _block_sums[1, 64](device_backend.asarray(np.ones(64, np.float32)),
                       device_backend.asarray(np.zeros((3, 64), np.float32)))  # the pool has threads now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_launch_in_a_forked_child, args=(q,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the child's launch hangs")
    assert child.exitcode == 0 and q.get(timeout=5) == "ok"


# --- device-function calls ----------------------------------------------------------------


def test_device_functions_swap_their_module_once_per_launch(device_backend, monkeypatch):
    # numba swaps a device function's module globals on every call, under two locks: here
    # 1 swap for the launch + 64 threads x 3 calls.  With the fix, the launch's swap is the
    # only one that goes through numba's swapped_cuda_module.
    from numba.cuda.simulator import kernel

    import vtnumba.kernels.norm_cuda as norm_cuda

    swaps = []
    original = kernel.swapped_cuda_module

    def counted(fn, fake_cuda_module):
        swaps.append(fn.__name__)
        return original(fn, fake_cuda_module)

    monkeypatch.setattr(kernel, "swapped_cuda_module", counted)
    x = np.ones(64, np.float32)
    out = device_backend.asarray(np.zeros((3, 64), np.float32))
    _block_sums[1, 64](device_backend.asarray(x), out)
    assert swaps == ["_block_sums"]
    np.testing.assert_array_equal(device_backend.to_host(out), np.outer([64, 128, 192], np.ones(64)))
    assert norm_cuda.cuda is cuda  # restored when the launch ended


def test_a_simulator_it_does_not_know_is_left_alone():
    from vtnumba.backend.simulator_fixes import _apply_once

    def install():
        raise AssertionError("installed into a simulator it does not recognise")

    assert _apply_once("a fix for another simulator", lambda: False, install) is False
