"""vtnumba.backend.simulator_fixes: one shared array per block and call site in numba's simulator,
whatever the thread timing."""

import sys
import threading

import numpy as np
import pytest
from numba import cuda, float32

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
