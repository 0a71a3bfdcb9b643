"""The Backend seam's newer parts: capabilities, arrays, flags in queue order, host functions, the CUDA stack check.

``write_value32``/``wait_value32`` are what TPSP orders its chunks with (a GPU's stream memory
operations); here they run on every host-side backend: synchronous and threaded cpu queues
and numba's simulator.  The GPU implementation itself needs a GPU (``cuda`` marker).
"""

import contextlib
import threading
import time

import numpy as np
import pytest

from vtnumba.backend import FLAG_MAX, Capabilities, CPUBackend
from vtnumba.backend.cpu import flag_reached
from vtnumba.backend.cuda_stack import check_cuda_stack, describe_cuda_stack
from vtnumba.backend.polling import WaitTimeout


@pytest.fixture(params=["cpu", "cpu-threaded", "device"])
def backend(request, device_backend_factory):
    if request.param == "device":
        b = device_backend_factory()
    else:
        b = CPUBackend(threaded=request.param == "cpu-threaded")
    yield b
    b.close()


def _flags(backend, n=4):
    return backend.asarray(np.zeros(n, np.uint32))


def test_capabilities_are_declared_as_data(backend):
    caps = backend.capabilities
    assert isinstance(caps, Capabilities)
    assert caps.kernel_arrays in ("numpy", "device")
    assert backend.supports_aux_stream() == caps.aux_stream
    assert backend.supports_graph_capture() == caps.graph_capture
    assert backend.unified_memory() == caps.unified_memory
    if isinstance(backend, CPUBackend):
        assert caps.host_addressable and not caps.simulator and caps.async_queues == backend.threaded


def test_asarray_empty_to_host_round_trip(backend, rng):
    host = rng.standard_normal((3, 5)).astype(np.float32)
    dev = backend.asarray(host)
    host[0, 0] = 99.0  # asarray copied: the original may change
    got = backend.to_host(dev)
    assert got.shape == (3, 5) and got[0, 0] != 99.0
    e = backend.empty((2, 7), np.int32)
    assert tuple(e.shape) == (2, 7) and np.dtype(e.dtype) == np.int32
    with pytest.raises(TypeError, match="host must be a numpy array"):
        backend.asarray([1, 2, 3])
    with pytest.raises(ValueError, match="negative extent"):
        backend.empty((2, -1))


def test_write_then_wait_in_queue_order(backend):
    flags = _flags(backend)
    q = backend.create_queue("flags")
    backend.write_value32(q, flags, 2, 7)
    backend.wait_value32(q, flags, 2, 7, timeout_s=5)  # already there: passes
    backend.wait_value32(q, flags, 2, 5, timeout_s=5)  # "at least": passes
    backend.synchronize(q)
    assert backend.to_host(flags).tolist() == [0, 0, 7, 0]
    backend.destroy_queue(q)


def test_a_wait_holds_back_later_work_until_the_flag_arrives(backend):
    if not backend.capabilities.async_queues:
        pytest.skip("only asynchronous queues can hold work back; synchronous ones wait inline")
    flags = _flags(backend)
    out = backend.asarray(np.zeros(1, np.uint32))
    q = backend.create_queue("waiter")
    backend.wait_value32(q, flags, 0, 1, timeout_s=10)
    backend.write_value32(q, out, 0, 42)  # must not happen before flags[0] >= 1
    time.sleep(0.2)
    assert backend.to_host(out)[0] == 0, "work after the wait ran before the flag arrived"
    side = backend.create_queue("signaller")
    backend.write_value32(side, flags, 0, 1)
    backend.synchronize(q)
    assert backend.to_host(out)[0] == 42
    backend.destroy_queue(side)
    backend.destroy_queue(q)


def test_a_wait_on_a_flag_that_never_comes_times_out_naming_the_word(backend):
    flags = _flags(backend)
    q = backend.create_queue("stuck")
    t0 = time.perf_counter()
    if backend.capabilities.async_queues:
        backend.wait_value32(q, flags, 3, 9, timeout_s=0.2)
        with pytest.raises(RuntimeError, match="flag word 3 to reach 9; it is 0"):
            backend.synchronize(q)
    else:
        with pytest.raises(WaitTimeout, match="flag word 3 to reach 9; it is 0"):
            backend.wait_value32(q, flags, 3, 9, timeout_s=0.2)
    assert time.perf_counter() - t0 < 5
    backend.destroy_queue(q)


def test_release_flag_word_frees_a_queue_that_waits_for_a_flag_that_never_comes(backend, caplog):
    # What a failing TPSP call and a GPU wait past its deadline both do: store the awaited value
    # from the backend's own queue, so the waiting queue drains.
    flags = _flags(backend)
    if backend.capabilities.async_queues:
        out = backend.asarray(np.zeros(1, np.uint32))
        q = backend.create_queue("waiter")
        backend.wait_value32(q, flags, 1, 5, timeout_s=60)
        backend.write_value32(q, out, 0, 42)
        held = backend.create_event(timing=False)
        backend.record_event(held, q)
        time.sleep(0.1)
        assert backend.to_host(out)[0] == 0, "work after the wait ran before the flag arrived"
        # Polling an event that has not fired says so quietly: deadline loops poll thousands of
        # times (numba's Event.query would log an ERROR record each time on a GPU).
        with caplog.at_level("DEBUG"):
            assert not any(backend.query_event(held) for _ in range(100))
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        t0 = time.perf_counter()
        backend.release_flag_word(flags, 1, 5, timeout_s=5)
        backend.synchronize(q)  # the wait passed (the word reached 5): no error, no 60 s wait
        assert time.perf_counter() - t0 < 5
        assert backend.to_host(out)[0] == 42
        assert backend.query_event(held)
        backend.destroy_event(held)
        backend.destroy_queue(q)
    else:
        backend.release_flag_word(flags, 1, 5)  # a synchronous queue's wait would block the caller itself
    assert backend.to_host(flags).tolist() == [0, 5, 0, 0]
    with pytest.raises(ValueError, match=r"index=4 is out of range"):
        backend.release_flag_word(flags, 4, 1)
    with pytest.raises(TypeError, match="1-D uint32"):
        backend.release_flag_word(backend.asarray(np.zeros(4, np.int64)), 0, 1)
    with pytest.raises(ValueError, match=r"timeout_s=-1(\.0)? must be a positive"):
        backend.release_flag_word(flags, 0, 1, timeout_s=-1)
    assert backend.to_host(flags).tolist() == [0, 5, 0, 0], "a refused call stored something"


def test_release_flag_word_gives_up_when_its_own_queue_is_held_up():
    # The release is waited for with a deadline, never in a blocking call: on a GPU its stream may
    # share a hardware queue with the stuck one.  Here the backend's side queue is held up by hand.
    backend = CPUBackend(threaded=True)
    gate = threading.Event()
    try:
        flags = _flags(backend)
        backend.submit(backend._flag_side_queue(), lambda _stream: gate.wait(10), "held up")
        t0 = time.perf_counter()
        with pytest.raises(WaitTimeout, match=r"storing 3 into flag word 2 did not finish within 0\.\d+ s"):
            backend.release_flag_word(flags, 2, 3, timeout_s=0.2)
        assert time.perf_counter() - t0 < 3
        gate.set()
        backend.synchronize()
        assert flags.tolist() == [0, 0, 3, 0]  # it was queued, so it lands once the queue moves
    finally:
        gate.set()
        backend.close()


def test_read_flag_word_reads_a_word_now(backend):
    flags = _flags(backend)
    backend.release_flag_word(flags, 2, 123, timeout_s=5)
    assert [backend.read_flag_word(flags, k) for k in range(4)] == [0, 0, 123, 0]
    with pytest.raises(ValueError, match=r"index=4 is out of range"):
        backend.read_flag_word(flags, 4)
    with pytest.raises(TypeError, match="1-D uint32"):
        backend.read_flag_word(backend.asarray(np.zeros(4, np.int64)), 0)
    with pytest.raises(ValueError, match=r"timeout_s=0(\.0)? must be a positive"):
        backend.read_flag_word(flags, 0, timeout_s=0)


def test_threads_reading_flag_words_at_once_each_get_their_own(backend):
    # A GPU reads a word through one pinned word of the backend's: two readers at once each got
    # the other's copy, and a wait taken for arrived was never released.
    import threading

    flags = _flags(backend)
    for k in range(4):
        backend.release_flag_word(flags, k, 100 + k, timeout_s=5)
    wrong: list = []

    def reader(k):
        for _ in range(50):
            got = backend.read_flag_word(flags, k)
            if got != 100 + k:
                wrong.append((k, got))

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:5]


def test_queue_flags_report_a_release_that_timed_out_as_their_own_error():
    # QueueFlags releases device words through the backend (the path only a GPU takes) and
    # names the rank when that release cannot finish.
    from types import SimpleNamespace

    from vtnumba.dist.queue_flags import QueueFlags, QueueFlagsError

    class HeldUp:
        def release_flag_word(self, flags, index, value, *, timeout_s):
            raise WaitTimeout(f"storing {value} into flag word {index} did not finish within {timeout_s} s")

    qf = object.__new__(QueueFlags)  # only what _release_device_word reads
    qf.backend, qf.timeout_s, qf.group = HeldUp(), 0.5, SimpleNamespace(rank=1)
    with pytest.raises(QueueFlagsError, match=r"rank 1: releasing flag word 6: storing \d+ into flag word 6 did not "
                                              r"finish within 0.5 s"):
        qf._release_device_word(None, 6, 0.5)


def test_queue_flags_drain_releases_device_words_again_with_a_short_deadline():
    # A failing rank's drain stores RELEASED into its own (device) area again while its queue
    # has not finished -- a peer may have stored an epoch over the first release -- each store
    # with a short deadline of its own, so a side queue that does not answer cannot eat the drain.
    from types import SimpleNamespace

    from vtnumba.dist.queue_flags import RELEASED, RERELEASE_S, QueueFlags

    class Device:
        def __init__(self):
            self.releases = []

        def release_flag_word(self, flags, index, value, *, timeout_s):
            self.releases.append((flags, index, value, timeout_s))

        def create_event(self, timing=True):
            return object()

        def record_event(self, event, queue):
            pass

        def query_event(self, event):  # the queue finishes once its word was released twice
            return len(self.releases) >= 2 * words

        def synchronize(self, queue):
            pass

    names, size, words = ("ready", "done"), 2, 4
    area = object()  # device memory: no host view
    qf = object.__new__(QueueFlags)  # only what _drain reads
    qf.backend, qf.timeout_s, qf.names, qf._events = Device(), 30.0, names, {}
    qf.group, qf._areas = SimpleNamespace(rank=1, size=size, name="g"), [object(), area]
    t0 = time.perf_counter()
    qf._drain([SimpleNamespace(id=7)])
    assert time.perf_counter() - t0 < 5
    assert qf.backend.releases == [(area, k, RELEASED, RERELEASE_S * 10) for k in range(words)] * 2


def test_queue_flags_fail_stops_storing_device_words_once_the_side_queue_timed_out():
    # The side queue held up behind a stuck stream: the first device store times out, and every
    # later one would wait out its own deadline (minutes, for 3 x tp words) -- fail() stores no
    # more device words, says which ranks it skipped, and raises nothing.
    import warnings
    from types import SimpleNamespace

    from vtnumba.dist.queue_flags import QueueFlags

    class StuckSide:
        def __init__(self):
            self.stores = 0

        def release_flag_word(self, flags, index, value, *, timeout_s):
            self.stores += 1
            raise WaitTimeout(f"storing {value} into flag word {index} did not finish within {timeout_s} s")

        def defer_frees(self):
            return contextlib.nullcontext()

        def create_event(self, timing=True):
            return object()

        def record_event(self, event, queue):
            pass

        def query_event(self, event):
            return True

        def synchronize(self, queue):
            pass

    class Stamps:
        def __init__(self):
            self.aborted = []

        def abort_stamp(self, rank):
            return 0

        def abort(self, epoch):
            self.aborted.append(epoch)

    qf = object.__new__(QueueFlags)  # only what fail() reads
    qf.backend, qf.timeout_s, qf.names, qf._events, qf.call_epoch = StuckSide(), 60.0, ("ready", "done"), {}, 7
    qf.group, qf._areas = SimpleNamespace(rank=0, size=3, name="g"), [object(), object(), object()]
    qf._pb, qf.host = SimpleNamespace(closed=False), Stamps()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qf.fail([SimpleNamespace(id=1)])
    assert time.perf_counter() - t0 < 5
    assert qf.host.aborted == [7] and qf.backend.stores == 1
    said = [str(w.message) for w in caught]
    assert any("could not release its own flag words" in m for m in said), said
    assert any("did not release its flag words in the areas of ranks [1, 2]" in m for m in said), said


class _FakeStuckGPU:
    """Stands in for CUDABackend's device side in the deadline logic: flag words in a dict; a
    "release" stores the awaited value, as the real one does from a queue of its own."""

    def __init__(self, words):
        self.words, self.released, self.reads = words, [], 0
        self.deferring, self.undeferred = 0, []  # calls made while frees were not held back

    @contextlib.contextmanager
    def defer_frees(self):
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1

    def _read_flag_word(self, flags, index):
        self.reads += 1
        if not self.deferring:
            self.undeferred.append(("read", index))
        return self.words[index]

    def release_flag_word(self, flags, index, value):
        self.released.append((index, value))
        if not self.deferring:
            self.undeferred.append(("release", index))
        self.words[index] = value


def test_only_a_real_gpu_array_is_gpu_memory(device_backend):
    # What CUDABackend accepts as a flag word on a GPU: host and simulated arrays have no
    # device address to hand the driver.
    from vtnumba.backend.arrays import is_device_array, is_gpu_array

    word = device_backend.asarray(np.zeros(1, np.uint32))
    assert is_device_array(word)
    assert is_gpu_array(word) == (not device_backend.capabilities.simulator)
    assert not is_gpu_array(np.zeros(1, np.uint32))


def test_gpu_stream_waits_get_their_deadline_from_the_host():
    # A GPU stream's wait (cuStreamWaitValue32) cannot time out, so CUDABackend.synchronize polls
    # the stream and keeps each wait's deadline itself: a wait past its deadline with its word
    # short is released (the only way to free the stream) and reported by word and value; a
    # wait whose word did arrive is left alone.  The logic, without a GPU:
    from vtnumba.backend.cuda import CUDABackend

    gpu = _FakeStuckGPU({3: 0, 5: 7})
    now = time.monotonic()
    waits = [(None, 3, 9, now + 0.2), (None, 5, 7, now - 1)]  # word 5 reached 7 already

    def stream_idle():  # the stream drains once every wait on it has passed
        return flag_reached(gpu.words[3], 9) and flag_reached(gpu.words[5], 7)

    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"queue q: timed out waiting for flag word 3 to reach 9; it is 0 "):
        CUDABackend._wait_out_flag_waits(gpu, stream_idle, waits, "queue q")
    assert 0.15 < time.perf_counter() - t0 < 2
    assert gpu.released == [(3, 9)]
    # ... with frees held back meanwhile: a cuMemFree would wait for the stuck stream for good.
    assert gpu.undeferred == [] and gpu.deferring == 0
    # Waits that pass before their deadline cost no reads and no errors.
    gpu = _FakeStuckGPU({3: 0})
    polls = iter([False, False, True])
    CUDABackend._wait_out_flag_waits(gpu, lambda: next(polls), [(None, 3, 9, time.monotonic() + 60)], "queue q")
    assert gpu.released == [] and gpu.reads == 0


def test_flag_arguments_are_checked(backend):
    flags = _flags(backend)
    q = backend.create_queue("bad")
    with pytest.raises(TypeError, match="1-D uint32"):
        backend.write_value32(q, backend.asarray(np.zeros(4, np.int64)), 0, 1)
    with pytest.raises(ValueError, match="index=4 is out of range"):
        backend.write_value32(q, flags, 4, 1)
    with pytest.raises(TypeError, match="index=True must be an int"):
        backend.wait_value32(q, flags, True, 1)
    with pytest.raises(ValueError, match="value=-1 is out of range"):
        backend.write_value32(q, flags, 0, -1)
    with pytest.raises(ValueError, match=f"value={FLAG_MAX + 1} is out of range"):
        backend.write_value32(q, flags, 0, FLAG_MAX + 1)
    with pytest.raises(ValueError, match="timeout_s=0.0 must be a positive"):
        backend.wait_value32(q, flags, 0, 1, timeout_s=0)
    if backend.device_type.value == "cuda":
        # Host memory is no flag word for a GPU's driver or kernels -- in the simulator too,
        # where it used to work (and the same program then failed on a GPU).
        host = np.zeros(4, np.uint32)
        for call in (lambda: backend.write_value32(q, host, 0, 1), lambda: backend.wait_value32(q, host, 0, 1),
                     lambda: backend.read_flag_word(host, 0)):
            with pytest.raises(TypeError, match="flags must be GPU memory"):
                call()
    backend.destroy_queue(q)


@pytest.mark.parametrize("threaded", [False, True], ids=["sync", "threaded"])
def test_flag_stores_refuse_read_only_and_misaligned_words_at_the_call(threaded):
    # A read-only view of an immutable bytes object was written through its address; a
    # misaligned word passed on threaded queues and failed later, as the queue's sticky error.
    b = CPUBackend(threaded=threaded)
    q = b.create_queue()
    data = bytes(16)
    frozen = np.frombuffer(data, np.uint32)
    with pytest.raises(ValueError, match="flags is a read-only array"):
        b.write_value32(q, frozen, 0, 7)
    with pytest.raises(ValueError, match="flags is a read-only array"):
        b.release_flag_word(frozen, 1, 9)
    assert data == bytes(16)
    assert b.read_flag_word(frozen, 0) == 0  # reading a read-only word is fine
    b.wait_value32(q, frozen, 0, 0, timeout_s=5)  # and so is waiting on one
    raw = np.zeros(5 * 4, np.uint8)
    crooked = raw[1:17].view(np.uint32)
    for call in (lambda: b.write_value32(q, crooked, 0, 1), lambda: b.wait_value32(q, crooked, 0, 0),
                 lambda: b.release_flag_word(crooked, 0, 1)):
        with pytest.raises(ValueError, match="must be 4-byte aligned for atomic access"):
            call()
    b.synchronize(q)  # no sticky error: nothing bad was queued
    b.close()


def test_cyclic_comparison_is_cudas_geq():
    assert flag_reached(5, 5) and flag_reached(6, 5) and not flag_reached(4, 5)
    assert flag_reached(1 << 30, 12345)          # a released word passes every epoch wait
    assert not flag_reached(0xFFFFFFFF, 5)       # cyclic: -1 is "before" 5
    assert flag_reached(3, 0xFFFFFFFE)           # ... and 3 is "after" -2


def test_host_functions_run_in_queue_order_and_their_errors_are_sticky(backend):
    # Queues that run on their own (threaded cpu, a real GPU's streams through cuLaunchHostFunc):
    # a host function runs when the queue gets there, and its exception is kept for the queue's
    # next synchronize, once.
    if not backend.capabilities.async_queues:
        pytest.skip("synchronous queues run host functions inline: their errors reach the caller at once")
    flags = _flags(backend)
    q, side = backend.create_queue("hf"), backend.create_queue("side")
    ran = []
    backend.wait_value32(q, flags, 0, 1, timeout_s=30)  # hold the queue
    backend.launch_host_func(q, lambda: ran.append("first"))
    backend.launch_host_func(q, lambda: 1 / 0)
    time.sleep(0.2)
    assert ran == [], "a host function ran before the queue got to it"
    backend.write_value32(side, flags, 0, 1)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        backend.synchronize(q)
    assert ran[0] == "first"
    backend.synchronize(q)  # reported once
    backend.destroy_queue(side)
    backend.destroy_queue(q)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_copy_with_pageable_memory_behind_a_flag_wait_keeps_the_deadline(backend, direction):
    # A real GPU's driver may return from a copy with pageable host memory only once the copy
    # has run: queued behind a wait that never passes, it would block for good.  The deadline
    # must still end it.  (Real GPUs only; elsewhere host memory is not staged by a driver.)
    if not backend.capabilities.async_queues or backend.capabilities.host_addressable:
        pytest.skip("only a real GPU's driver stages copies with pageable memory")
    flags = _flags(backend)
    q = backend.create_queue("stuck-copy")
    buf, pageable = backend.alloc(64), np.zeros(64, np.uint8)
    backend.wait_value32(q, flags, 3, 9, timeout_s=0.5)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="flag word 3 to reach 9; it is 0"):
        if direction == "d2h":
            backend.copy(q, pageable, buf, 64)
        else:
            backend.copy(q, buf, pageable, 64)
    assert time.perf_counter() - t0 < 10
    backend.synchronize(q)
    backend.destroy_queue(q)
    backend.free(buf)


def test_a_host_function_may_drop_the_last_reference_to_device_arrays(backend):
    # Dropping device arrays can make numba flush its pending frees (cuMemFree) right there --
    # on a real GPU, inside the host function, where CUDA calls are not allowed.  The frees
    # must wait until it has returned.  (Real GPUs only: elsewhere nothing is freed by CUDA.)
    if not backend.capabilities.async_queues or backend.capabilities.host_addressable:
        pytest.skip("only a real GPU runs host functions on a driver thread")
    from numba import cuda

    doomed = [cuda.device_array(256, np.float32) for _ in range(64)]  # past numba's pending-free limit
    q = backend.create_queue("hf-frees")
    backend.launch_host_func(q, doomed.clear)
    backend.synchronize(q)  # no "operation not permitted" kept from inside the host function
    assert doomed == []
    backend.destroy_queue(q)


def test_host_functions_and_flags_are_refused_while_capturing(backend):
    # Captured, a host function would become a graph node that every replay calls again; a
    # flag write or wait would be replayed unseen by the host.
    if not backend.supports_graph_capture():
        pytest.skip(f"{backend.name} has no graph capture")
    flags = _flags(backend)
    q = backend.create_queue("capturing")
    backend.begin_capture(q)
    try:
        with pytest.raises(RuntimeError, match="while it is capturing a graph"):
            backend.launch_host_func(q, lambda: None)
        with pytest.raises(RuntimeError, match="write_value32 .* while it is capturing a graph"):
            backend.write_value32(q, flags, 0, 1)
        with pytest.raises(RuntimeError, match="wait_value32 .* while it is capturing a graph"):
            backend.wait_value32(q, flags, 0, 1, timeout_s=1)
    finally:
        try:
            backend.end_capture_graph(q)
        except RuntimeError:
            pass  # an empty capture may be refused; the point was the launch above
    backend.destroy_queue(q)


@pytest.mark.cuda
def test_copies_a_graph_cannot_hold_are_refused_while_capturing(device_backend):
    # A host-to-host copy runs on the host (keeping queue order would synchronize the capturing
    # stream, which invalidates the capture); pageable host memory is staged by the driver on
    # this thread.  Both are refused at the call, and the capture goes on.
    be = device_backend
    src = np.arange(64, dtype=np.float32)
    dev_buf, pinned = be.alloc(src.nbytes), be.alloc_pinned(src.nbytes)
    q = be.create_queue("capturing")
    be.copy(q, dev_buf, src, src.nbytes)
    be.synchronize(q)
    be.begin_capture(q)
    try:
        with pytest.raises(RuntimeError, match="both sides are host memory"):
            be.copy(q, np.empty_like(src), src, src.nbytes)
        with pytest.raises(RuntimeError, match="pageable memory"):
            be.copy(q, np.empty_like(src), dev_buf, src.nbytes)
        be.copy(q, pinned, dev_buf, src.nbytes)  # pinned: captured like any device copy
        graph = be.end_capture_graph(q)
    except BaseException:
        with contextlib.suppress(RuntimeError):
            be.end_capture_graph(q)
        raise
    be.replay_graph(q, graph)
    be.synchronize(q)
    np.testing.assert_array_equal(be.to_host(pinned.view(np.float32, (64,))), src)
    be.destroy_graph(graph)
    be.destroy_queue(q)
    be.free(dev_buf)
    be.free(pinned)


@pytest.mark.simulator_only
def test_copies_a_graph_cannot_hold_are_refused_before_the_driver_is_asked(device_backend, monkeypatch):
    # The rule above without a GPU: the CUDA backend's copy path, with a capture entered by hand
    # (the simulator has no graphs) and the driver's answers stood in for.
    from vtnumba.backend import cuda as cuda_backend

    be = device_backend
    q = be.create_queue("capturing")
    src = np.arange(64, dtype=np.float32)
    dev_arr = be.asarray(src)
    monkeypatch.setattr(be, "simulator", False)
    monkeypatch.setattr(cuda_backend, "_gpu", lambda: pytest.fail("the driver was reached"))
    monkeypatch.setattr(be, "_synchronize", lambda q: pytest.fail("a capturing queue was synchronized"))
    be._capturing[q.id] = (q, None)
    try:
        with pytest.raises(RuntimeError, match="both sides are host memory"):
            be._copy(q, np.empty_like(src), src, src.nbytes, 0, 0)
        monkeypatch.setattr(cuda_backend, "_page_locked", lambda host: False)
        with pytest.raises(RuntimeError, match="pageable memory"):
            be._copy(q, np.empty_like(src), dev_arr, src.nbytes, 0, 0)
        with pytest.raises(RuntimeError, match="pageable memory"):
            be._copy(q, dev_arr, src, src.nbytes, 0, 0)
        monkeypatch.setattr(cuda_backend, "_page_locked", lambda host: True)
        with pytest.raises(pytest.fail.Exception, match="the driver was reached"):  # pinned: on to the driver
            be._copy(q, dev_arr, src, src.nbytes, 0, 0)
    finally:
        be._capturing.clear()
    monkeypatch.undo()
    be.destroy_queue(q)


def test_a_capturing_queue_is_never_idle_and_the_driver_is_not_asked(monkeypatch):
    # cuStreamQuery on a capturing stream is an error that also invalidates the capture (the
    # hazard checker asks at every free).  Capture needs a GPU; the bookkeeping is the base
    # class's, so a cpu backend with a capture entered by hand shows the rule.
    b = CPUBackend()
    q = b.create_queue()
    assert b.query_queue(q)
    monkeypatch.setattr(b, "_query_queue", lambda q: pytest.fail("the driver was asked about a capturing queue"))
    b._capturing[q.id] = (q, None)
    try:
        assert b.query_queue(q) is False
    finally:
        b._capturing.clear()
    b.close()


def test_host_function_errors_are_sticky_on_threaded_queues():
    b = CPUBackend(threaded=True)
    q = b.create_queue("hf")
    ran = threading.Event()
    b.launch_host_func(q, ran.set)
    b.launch_host_func(q, lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        b.synchronize(q)
    assert ran.is_set()
    b.synchronize(q)  # the error was reported once
    with pytest.raises(TypeError, match="fn must be callable"):
        b.launch_host_func(q, 42)
    b.destroy_queue(q)
    b.close()


def test_a_failed_queue_still_fires_its_events_and_reports_the_error():
    b = CPUBackend(threaded=True)
    q = b.create_queue("poisoned")
    b.submit(q, lambda _s: 1 / 0, "boom")
    ev = b.create_event()
    b.record_event(ev, q)  # after the failure: still fires (nobody may wait forever on it)
    b.synchronize_event(ev)
    assert isinstance(b.queue_error(q), ZeroDivisionError)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        b.synchronize(q)
    assert b.queue_error(q) is None
    b.destroy_queue(q)
    b.close()


def test_cuda_stack_description_names_the_implementation():
    info = describe_cuda_stack()
    assert info["implementation"] == "numba-cuda", info
    assert info["ok"] and info["cuda_bindings"] and "numba_cuda" in info["numba_cuda_file"]
    assert check_cuda_stack(info) is info


def test_the_deprecated_numba_cuda_is_refused_with_how_to_fix_it():
    wrong = dict(describe_cuda_stack(), implementation="numba (deprecated built-in)", ok=False,
                 numba_cuda_file="/env/site-packages/numba/cuda/__init__.py")
    wrong["problem"] = ("numba.cuda is numba's deprecated built-in CUDA target (/env/site-packages/numba/cuda/"
                        "__init__.py), not numba-cuda's; install numba-cuda ...")
    with pytest.raises(RuntimeError, match="needs numba-cuda: numba.cuda is numba's deprecated built-in"):
        check_cuda_stack(wrong)


def test_the_check_reports_the_real_problem_for_a_module_outside_numba_cuda(monkeypatch):
    import importlib.util

    import vtnumba.backend.cuda_stack as stack

    class FakeSpec:
        origin = "/somewhere/site-packages/numba/cuda/__init__.py"

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: FakeSpec())
    info = stack.describe_cuda_stack()
    assert info["implementation"] == "numba (deprecated built-in)" and not info["ok"]
    assert "site.addsitedir" in info["problem"] and "/somewhere/site-packages/numba/cuda" in info["problem"]
    with pytest.raises(RuntimeError, match="pip install 'numba-cuda"):
        stack.check_cuda_stack()


def test_defer_frees_is_a_context_manager_on_every_backend(device_backend):
    # Host memory has nothing to defer; the device target's is numba's defer_cleanup on a GPU.
    for backend in (CPUBackend(), device_backend):
        with backend.defer_frees():
            buf = backend.alloc(64)
            backend.free(buf)  # freeing inside is allowed: only the return to the device waits


def test_the_flag_kernels_load_before_any_stream_waits(device_backend, monkeypatch):
    # The fallback for drivers without stream memory operations compiles and loads both kernels
    # up front (a first load while a stream waits could wait for the whole GPU): the driver's
    # first NOT_SUPPORTED switches the backend to the kernels and loads them, once, before the
    # caller launches its wait kernel; any other answer is a memory operation queued, or an error.
    from types import SimpleNamespace

    from cuda.bindings import driver as cu

    from vtnumba.backend import cuda_flags
    from vtnumba.backend.cuda import CUDABackend

    cuda_flags.load_flag_kernels()  # they compile and run (here: on the device target)
    loads = []
    monkeypatch.setattr(cuda_flags, "load_flag_kernels", lambda: loads.append("loaded"))
    gpu = SimpleNamespace(_memops_ok=True)
    assert CUDABackend._memop_done(gpu, cu.CUresult.CUDA_SUCCESS, "cuStreamWaitValue32")
    assert gpu._memops_ok and loads == []
    assert not CUDABackend._memop_done(gpu, cu.CUresult.CUDA_ERROR_NOT_SUPPORTED, "cuStreamWaitValue32")
    assert not gpu._memops_ok and loads == ["loaded"]
    with pytest.raises(RuntimeError, match="cuStreamWriteValue32"):
        CUDABackend._memop_done(gpu, cu.CUresult.CUDA_ERROR_INVALID_VALUE, "cuStreamWriteValue32")


@pytest.mark.simulator_only
@pytest.mark.parametrize("seen,value", [(5, 5), (6, 5), (4, 5), (0xFFFFFFFF, 5), (3, 0xFFFFFFFE),
                                        (0x80000004, 5), (0x80000005, 5), (0, 0xFFFFFFFF)])
def test_the_wait_kernel_compares_like_its_host_twin(device_backend, seen, value):
    # wait_flag_kernel's cyclic >= against flag_reached (the host twin's test), across the
    # 32-bit wrap-around: a flag that has passed the wanted value -- even by wrapping -- lets the
    # stream go on; one that has not keeps the kernel polling until the word is written.
    # (Simulator only: there a spinning kernel is a thread, and a host write releases it.)
    from numba import cuda

    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK
    from vtnumba.backend.cuda_flags import launch_wait_flag, launch_write_flag

    def launch(kernel, *args):
        with SIM_LAUNCH_LOCK:  # a raw launch: the simulator runs one at a time per process
            kernel(*args)

    word = cuda.to_device(np.zeros(1, np.uint32))
    launch(launch_write_flag, word, 0, seen, 0)
    assert int(word.copy_to_host()[0]) == seen
    waiter = threading.Thread(target=launch, args=(launch_wait_flag, word, 0, value, 0), daemon=True)
    waiter.start()
    waiter.join(10 if flag_reached(seen, value) else 0.3)  # (a reached flag may take its time on a busy machine)
    returned = not waiter.is_alive()
    if not returned:
        word[0] = value  # release it, so that no kernel is left spinning
        waiter.join(10)
        assert not waiter.is_alive(), "the wait kernel did not see the flag written after it started"
    assert returned == flag_reached(seen, value), (hex(seen), hex(value))


def test_a_queue_that_waits_for_an_event_inherits_its_flag_waits():
    # On a GPU, queue_wait_event makes q wait for the event -- and so for the flag waits the
    # event fires after: q's synchronize must keep those deadlines too (not block in the driver).
    from types import SimpleNamespace

    from vtnumba.backend.cuda import CUDABackend

    w1, w2, w3 = (object(), 1, 1, 0.0), (object(), 2, 1, 0.0), (object(), 3, 1, 0.0)
    gpu = SimpleNamespace(simulator=False)
    q = SimpleNamespace(stream="s", flag_waits=[w1])
    e = SimpleNamespace(native=SimpleNamespace(wait=lambda stream: None), flag_waits=([w1, w2, w3], 2))
    CUDABackend._queue_wait_event(gpu, q, e)
    assert q.flag_waits == [w1, w2]  # w1 once; w3 was queued after the event was recorded


class _FakeEvent:
    """A stand-in CUDA event: fired or not, at a device time (ms) of our choosing."""

    def __init__(self):
        self.fired, self.ms, self.destroyed = False, None, False


def _fake_gpu(capturing=(), origin=None):
    """A stand-in CUDABackend for its tracing methods (no GPU needed)."""
    from types import SimpleNamespace

    from vtnumba.backend.cuda import CUDABackend

    gpu = SimpleNamespace(simulator=False, _capturing=set(capturing), _trace_origin=lambda: origin)
    gpu._traced = lambda *args: CUDABackend._traced(gpu, *args)
    return gpu


@pytest.fixture
def fake_gpu_events(monkeypatch):
    """The driver-event helpers of vtnumba.backend.cuda, on _FakeEvents; ``log`` lists the records."""
    from types import SimpleNamespace

    from vtnumba.backend import cuda as cuda_mod

    log, events = [], []

    def timing_event():
        events.append(_FakeEvent())
        return events[-1]

    def destroy(event):
        assert not event.destroyed, "an event destroyed twice"
        event.destroyed = True

    monkeypatch.setattr(cuda_mod, "_timing_event", timing_event)
    monkeypatch.setattr(cuda_mod, "_record_on", lambda event, stream: log.append(("record", stream)))
    monkeypatch.setattr(cuda_mod, "_event_done", lambda event, what: event.fired)
    monkeypatch.setattr(cuda_mod, "_elapsed_ms", lambda first, second: second.ms - first.ms)
    monkeypatch.setattr(cuda_mod, "_destroy_timing_event", destroy)
    return SimpleNamespace(log=log, events=events)


def test_tracing_never_waits_for_a_launch_on_a_held_queue(fake_gpu_events):
    # With tracing on, a GPU launch is timed by CUDA events around it.  Waiting for the end
    # event at the launch would block for good on a queue held by a flag wait, or by an event
    # behind a host function this thread releases after the launch (the runtime tour's gate),
    # and would serialise every traced call.  So the span waits, unsettled, until the events
    # have fired -- and takes its times from them, on the host's clock.
    from types import SimpleNamespace

    from vtnumba import trace
    from vtnumba.backend.cuda import CUDABackend

    origin = _FakeEvent()
    origin.ms = 100.0
    gpu = _fake_gpu(origin=(origin, 5_000_000))
    q = SimpleNamespace(id=1, name="held", stream="s", handle="h", flag_waits=[(None, 0, 1, 0.0)])
    launched = []
    with trace.recording(rank=0) as rec:
        CUDABackend._submit(gpu, q, lambda stream: launched.append(stream), "k", {"bytes": 4})
        assert launched == ["s"] and fake_gpu_events.log == [("record", "h"), ("record", "h")]
        start, end = fake_gpu_events.events
        rec.settle()  # not fired yet: nothing to draw
        assert rec.events == [] and not start.destroyed
        start.fired, end.fired, start.ms, end.ms = True, True, 100.25, 100.75
        rec.settle()
        (ev,) = rec.events
        assert ev["name"] == "k" and ev["track"] == "cuda:held" and ev["args"] == {"bytes": 4}
        assert ev["ts"] == (5_000_000 + 250_000) / 1000 and ev["dur"] == 500.0  # microseconds
        assert start.destroyed and end.destroyed and not origin.destroyed  # (settled: its events go)
        rec.settle()
        assert len(rec.events) == 1  # settled once


def test_a_traced_launch_unfinished_when_the_trace_is_written_shows_its_launch(fake_gpu_events):
    from types import SimpleNamespace

    from vtnumba import trace
    from vtnumba.backend.cuda import CUDABackend

    origin = _FakeEvent()
    origin.ms = 0.0
    gpu = _fake_gpu(origin=(origin, 0))
    q = SimpleNamespace(id=1, name="held", stream="s", handle="h", flag_waits=[])
    with trace.recording(rank=0) as rec:
        CUDABackend._submit(gpu, q, lambda stream: None, "k", {"bytes": 4})
    (ev,) = [e for e in rec.to_json()["traceEvents"] if e.get("ph") == "X"]
    assert ev["args"]["timing"].startswith("host launch (not finished") and ev["args"]["bytes"] == 4
    assert all(e.destroyed for e in fake_gpu_events.events)


def test_a_settle_that_raises_loses_only_its_own_span():
    # The whole pending batch was dropped, and the error escaped to_json: no trace file at all.
    from vtnumba import trace

    rec = trace.Recorder("unused", rank=0)

    def broken(final):
        raise RuntimeError("the event's context is gone")

    def fine(final):
        rec.add("ok", "queue", "cuda:q", 0, 1)
        return True

    rec.defer(broken)
    rec.defer(fine)
    names = [e["name"] for e in rec.to_json()["traceEvents"] if e["ph"] == "X"]
    assert names == ["ok"] and not rec._deferred


def test_a_launch_captured_into_a_graph_is_traced_as_its_host_launch():
    # Captured, the launch does not run: there is no device time to read.
    from types import SimpleNamespace

    from vtnumba import trace
    from vtnumba.backend.cuda import CUDABackend

    gpu = _fake_gpu(capturing={1})
    q = SimpleNamespace(id=1, name="cap", stream="s", handle="h", flag_waits=[])
    launched = []
    with trace.recording(rank=0) as rec:
        CUDABackend._submit(gpu, q, lambda stream: launched.append(stream), "k", {"bytes": 4})
    assert launched == ["s"]
    (ev,) = [e for e in rec.to_json()["traceEvents"] if e.get("ph") == "X"]
    assert ev["args"]["timing"] == "host launch (capturing a graph)" and ev["args"]["bytes"] == 4
