"""The Backend seam on every backend: cpu (sync), cpu (threaded), and the device target.

The device target is numba's CUDA simulator, or the GPU under ``VTNUMBA_TARGET=cuda`` (see
tests/conftest.py); the tests read device memory only through ``backend.copy``, so they
hold for both."""

import gc
import re
import threading
import time

import numpy as np
import pytest

import vtnumba
from vtnumba.backend import (CPU, MAX_DEVICES_PER_TYPE, CPUBackend, Device, DeviceResourceOps, DeviceType,
                             get_backend, register_backend, try_get_backend, unregister_backend)
from vtnumba.backend import registry


@pytest.fixture(params=["cpu", "cpu-threaded", "device"])
def backend(request, device_backend_factory):
    b = device_backend_factory() if request.param == "device" else CPUBackend(threaded=request.param == "cpu-threaded")
    yield b
    b.close()


def to_host(backend, buf, q):
    out = np.empty(buf.nbytes, np.uint8)
    backend.copy(q, out, buf, buf.nbytes)
    backend.synchronize(q)
    return out


def test_alignment_and_metadata(backend):
    for n in (1, 7, 64, 1000, 4097):
        b = backend.alloc(n)
        assert b.nbytes == n and b.device == backend.device
        assert b.ptr % 64 == 0, f"alloc({n}) returned address {b.ptr:#x}, not 64-byte aligned"
        backend.free(b)


def test_zero_byte_allocations(backend):
    b = backend.alloc(0)
    p = backend.alloc_pinned(0)
    assert b.nbytes == 0 and p.nbytes == 0 and p.pinned
    backend.free(b)
    backend.free_pinned(p)


def test_cpu_pinned_memory_is_resident_from_the_start():
    """Page-locked memory has no first-touch page faults (a GPU driver maps it whole): the cpu
    backend touches each page at alloc_pinned, so writing all of it later faults (almost) never
    -- counted with the kernel's minor-fault counter.  (Fresh memory faults less than once a
    page where the kernel maps huge pages or neighbours at a fault -- with transparent huge pages
    once per 2 MiB -- but still many times.)"""
    import resource

    def faults_writing(arr):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        arr.fill(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    backend = CPUBackend()
    n = 48 << 20  # above glibc's largest mmap threshold (32 MiB): always fresh pages, never reused heap
    pinned, plain = backend.alloc_pinned(n), backend.alloc(n)
    try:
        resident, lazy = faults_writing(pinned.array), faults_writing(plain.array)
        # The counter does count: lazily mapped memory faults at least once per 2 MiB (once per
        # page, or once per huge page where the kernel backs it with transparent huge pages).
        assert lazy >= n // (2 << 20), lazy
        assert resident <= max(1, lazy // 8), (resident, lazy)
    finally:
        backend.free_pinned(pinned)
        backend.free(plain)
        backend.close()


def test_memset_and_copy_every_direction(backend, rng):
    q = backend.create_queue()
    n = 1031
    src = rng.integers(0, 256, n, dtype=np.uint8)
    pinned = backend.alloc_pinned(n)
    pinned.view(np.uint8)[:] = src
    d1, d2 = backend.alloc(n), backend.alloc(n)
    backend.memset(q, d1, 0xAB)
    assert (to_host(backend, d1, q) == 0xAB).all()
    backend.copy(q, d1, pinned, n)  # H2D
    backend.copy(q, d2, d1, n)  # D2D
    out = np.full(n, 7, np.uint8)
    backend.copy(q, out, d2, n)  # D2H into a plain array
    backend.synchronize(q)
    np.testing.assert_array_equal(out, src)
    # Partial copies with offsets, and a partial memset.
    backend.memset(q, d2, 3, nbytes=10, offset=5)
    backend.copy(q, out, d2, 20, dst_offset=100, src_offset=0)
    backend.synchronize(q)
    expect = src[:20].copy()
    expect[5:15] = 3
    np.testing.assert_array_equal(out[100:120], expect)
    h2h = np.zeros(n, np.uint8)
    backend.copy(q, h2h, src, n)  # H2H
    backend.synchronize(q)
    np.testing.assert_array_equal(h2h, src)
    for b in (d1, d2):
        backend.free(b)
    backend.free_pinned(pinned)
    backend.destroy_queue(q)


def test_typed_views_alias_the_buffer(backend, rng):
    q = backend.create_queue()
    b = backend.alloc(64 * 4)
    vals = rng.standard_normal(64).astype(np.float32)
    backend.copy(q, b, vals, vals.nbytes)
    backend.synchronize(q)
    v = b.view(np.float32, (8, 8))
    assert v.shape == (8, 8)
    host = np.empty((8, 8), np.float32)
    backend.copy(q, host, v, host.nbytes)
    backend.synchronize(q)
    np.testing.assert_array_equal(host.ravel(), vals)
    with pytest.raises(ValueError, match="needs 1024 bytes"):
        b.view(np.float32, (16, 16))
    backend.free(b)
    backend.destroy_queue(q)


def test_two_queues_ordered_by_queue_wait_event(backend, rng):
    """The consumer queue waits for the producer's event, so it reads the new bytes."""
    producer, consumer = backend.create_queue("producer"), backend.create_queue("consumer")
    n = 4096
    data = rng.integers(1, 255, n, dtype=np.uint8)
    dev = backend.alloc(n)
    backend.memset(producer, dev, 0)
    backend.synchronize(producer)
    gate = threading.Event()
    threaded = isinstance(backend, CPUBackend) and backend.threaded
    if threaded:
        backend.launch_host_func(producer, gate.wait)  # hold the producer so ordering matters
    backend.copy(producer, dev, data, n)
    ev = backend.create_event()
    backend.record_event(ev, producer)
    backend.queue_wait_event(consumer, ev)
    out = np.zeros(n, np.uint8)
    backend.copy(consumer, out, dev, n)
    done = backend.create_event()
    backend.record_event(done, consumer)
    if threaded:
        assert not backend.query_event(done), "consumer ran before the producer's event fired"
        gate.set()
    backend.synchronize(consumer)
    np.testing.assert_array_equal(out, data)
    backend.free(dev)


def test_query_event_false_while_gated_then_true():
    b = CPUBackend(threaded=True)
    q = b.create_queue()
    gate = threading.Event()
    e = b.create_event()
    b.launch_host_func(q, gate.wait)
    b.record_event(e, q)
    assert b.query_event(e) is False
    assert b.query_event(e) is False  # still not blocking, still False
    gate.set()
    b.synchronize_event(e)
    assert b.query_event(e) is True
    b.close()


def test_elapsed_ms_non_negative_and_ordered(backend):
    q = backend.create_queue()
    evs = [backend.create_event() for _ in range(3)]
    buf = backend.alloc(1 << 16)
    backend.record_event(evs[0], q)
    backend.memset(q, buf, 1)
    backend.record_event(evs[1], q)
    backend.memset(q, buf, 2)
    backend.record_event(evs[2], q)
    backend.synchronize(q)
    a, b_ = backend.elapsed_ms(evs[0], evs[1]), backend.elapsed_ms(evs[0], evs[2])
    assert 0 <= a <= b_
    for e in evs:
        backend.destroy_event(e)
    backend.free(buf)


def test_an_event_without_timing_orders_work_but_cannot_be_timed(backend):
    q, other = backend.create_queue(), backend.create_queue()
    fast, timed = backend.create_event(timing=False), backend.create_event()
    assert fast.timing is False and timed.timing is True
    buf = backend.alloc(1 << 12)
    host = np.empty(1 << 12, np.uint8)
    backend.memset(q, buf, 7)
    backend.record_event(fast, q)
    backend.record_event(timed, q)
    backend.queue_wait_event(other, fast)  # it still orders: the copy sees the memset
    backend.copy(other, host, buf, host.nbytes)
    backend.synchronize(other)
    backend.synchronize_event(fast)
    assert backend.query_event(fast) and np.all(host == 7)
    for args in ((fast, timed), (timed, fast)):
        name = "start" if args[0] is fast else "end"
        with pytest.raises(RuntimeError, match=rf"elapsed_ms: event {name} \(#{fast.id}\) was created with "
                                               "timing=False"):
            backend.elapsed_ms(*args)
    assert backend.elapsed_ms(timed, timed) == 0.0
    for e in (fast, timed):
        backend.destroy_event(e)
    backend.free(buf)
    for x in (q, other):
        backend.destroy_queue(x)


def test_queue_errors_are_sticky_until_synchronize():
    b = CPUBackend(threaded=True)
    q = b.create_queue()

    def boom(_stream):
        raise ZeroDivisionError("inside a queued op")

    b.submit(q, boom, name="boom")
    with pytest.raises(RuntimeError, match="inside a queued op"):
        b.synchronize(q)
    b.synchronize(q)  # the error was reported once; the queue is usable again
    b.close()


def test_capability_flags(backend):
    assert isinstance(backend.unified_memory(), bool)
    cap = backend.device_capability()
    assert isinstance(cap, tuple) and len(cap) == 2
    if not backend.supports_graph_capture():
        q = backend.create_queue()
        with pytest.raises(RuntimeError, match="does not support graph capture"):
            backend.begin_capture(q)
        with pytest.raises(RuntimeError, match="nothing captured"):
            backend.replay(q)


def test_device_frees_wait_until_a_capture_ends(backend):
    # numba frees device memory in batches, from whichever call pushes its pending list over
    # a limit; a cuMemFree while the thread captures would invalidate the capture, and
    # end_capture would fail.  (Real GPUs only: nothing else captures.)
    if not backend.supports_graph_capture():
        pytest.skip(f"{backend.name} has no graph capture")
    from numba import cuda

    doomed = [cuda.device_array(256, np.float32) for _ in range(64)]  # more than numba's pending-free limit
    src, dst = backend.alloc(4096), backend.alloc(4096)
    q = backend.create_queue("capture-frees")
    backend.begin_capture(q)
    try:
        backend.copy(q, dst, src, 4096)  # something to capture
        del doomed[:]  # 64 frees requested inside the capture
        gc.collect()
    finally:
        graph = backend.end_capture_graph(q)  # not "capture invalidated"
    backend.replay_graph(q, graph)
    backend.synchronize(q)
    backend.destroy_graph(graph)
    backend.destroy_queue(q)
    backend.free(src)
    backend.free(dst)


def test_each_gpu_call_on_a_new_thread_makes_the_process_gpu_current_first(backend):
    # numba makes *device 0's* context current on a thread that has none, so on a rank that runs
    # on cuda:1 an event, an allocation or a defer_cleanup made first thing on a new thread landed
    # on the wrong GPU, and numba's own copies found no context.  Each call below runs first on a
    # thread of its own, and must have made this process's GPU current (vtnumba's current_context).
    if not hasattr(backend, "streams_created") or backend.capabilities.simulator:
        pytest.skip(f"{backend.name} has no CUDA contexts (real GPUs only)")
    import threading

    from vtnumba.backend import cuda as cuda_backend

    q = backend.create_queue("threads")
    buf, host = backend.alloc(64), np.arange(16, dtype=np.float32)
    dev_arr = backend.asarray(host)
    def deferred_nothing():
        with backend.defer_frees():
            pass

    calls = {
        "alloc": lambda: backend.free(backend.alloc(64)),
        "alloc_pinned": lambda: backend.free(backend.alloc_pinned(64)),
        "empty": lambda: backend.empty((4,), np.float32),
        "asarray": lambda: backend.asarray(host),
        "to_host": lambda: backend.to_host(dev_arr),
        "create_event": lambda: backend.create_event(),
        "defer_frees": deferred_nothing,
        "order_after_default_stream": lambda: backend.order_after_default_stream(q),
        "order_default_stream_after": lambda: backend.order_default_stream_after(q),
        "memset": lambda: (backend.memset(q, buf, 1, 64), backend.synchronize(q)),
        "copy": lambda: (backend.copy(q, buf, host, 64), backend.synchronize(q)),
    }
    for name, call in calls.items():
        seen = {}

        def first_call_on_a_new_thread(call=call, seen=seen):
            call()
            seen["ready"] = getattr(cuda_backend._thread_context, "ready", False)

        t = threading.Thread(target=first_call_on_a_new_thread)
        t.start()
        t.join()
        assert seen.get("ready"), f"{name} on a new thread did not go through current_context()"
    backend.free(buf)
    backend.destroy_queue(q)


def test_a_stream_that_cannot_be_destroyed_is_warned_of_not_raised(monkeypatch):
    # After a fatal GPU error every cuStreamDestroy fails: raised from close()'s cleanup it
    # left the other streams alive and hid the error that mattered.
    from cuda.bindings import driver as cu

    from vtnumba.backend.cuda import CUDABackend

    monkeypatch.setattr(cu, "cuStreamDestroy", lambda handle: (cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,))
    with pytest.warns(RuntimeWarning, match="cuStreamDestroy failed .CUDA_ERROR_ILLEGAL_ADDRESS."):
        CUDABackend._destroy_stream(object())


def test_queue_priority(backend):
    normal, high = backend.create_queue("normal"), backend.create_queue("comm", priority="high")
    assert (normal.priority, high.priority) == ("normal", "high")
    for bad in ("urgent", 1, None):
        with pytest.raises(ValueError, match=r"priority=.*expected one of 'normal', 'high'"):
            backend.create_queue(priority=bad)
    if hasattr(backend, "streams_created") and not backend.capabilities.simulator:
        # A real GPU: the stream itself has the device's greatest priority (the lowest number).
        from cuda.bindings import driver as cu

        err, least, greatest = cu.cuCtxGetStreamPriorityRange()
        (e1, p_normal), (e2, p_high) = cu.cuStreamGetPriority(normal.handle), cu.cuStreamGetPriority(high.handle)
        assert err == e1 == e2 == cu.CUresult.CUDA_SUCCESS
        assert p_high == greatest and (p_normal == 0 or greatest == least), (p_normal, p_high, least, greatest)
        # A recycled stream keeps its priority, so it only serves queues of that priority.
        backend.destroy_queue(high)
        again, plain = backend.create_queue(priority="high"), backend.create_queue()
        assert cu.cuStreamGetPriority(again.handle)[1] == greatest
        assert cu.cuStreamGetPriority(plain.handle)[1] == p_normal
        backend.destroy_queue(again)
        backend.destroy_queue(plain)
    else:
        backend.destroy_queue(high)
    backend.destroy_queue(normal)


def test_queues_come_and_go_on_recycled_streams(backend):
    # A GPU ties each new stream to one of a few hardware queues in turn, so a process that
    # kept creating streams would end up with two sharing one -- and a stream held by a flag
    # wait would hold up the other.  A destroyed queue's idle stream serves the next queue.
    if not hasattr(backend, "streams_created") or backend.capabilities.simulator:
        pytest.skip(f"{backend.name} makes no streams of its own (real GPUs only)")
    keep = backend.create_queue("kept")
    src, dst = backend.alloc(64), backend.alloc(64)
    before = backend.streams_created
    for i in range(40):
        q = backend.create_queue(f"short-lived-{i}")
        backend.copy(q, dst, src, 64)  # some work, finished by destroy_queue
        backend.destroy_queue(q)
    assert backend.streams_created - before <= 1
    backend.free(src)
    backend.free(dst)
    busy = [backend.create_queue(f"at-once-{i}") for i in range(3)]  # three at once: three streams
    assert len({int(q.handle) for q in busy + [keep]}) == 4
    for q in busy + [keep]:
        backend.destroy_queue(q)


# ---------------------------------------------------------------- bad input
def test_bad_sizes_name_the_argument(backend):
    for bad, exc in ((-1, ValueError), (1.5, TypeError), ("8", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="nbytes"):
            backend.alloc(bad)
    with pytest.raises(ValueError, match="nbytes=-4"):
        backend.alloc_pinned(-4)
    for alloc in (backend.alloc, backend.alloc_pinned):  # (numpy said "Maximum allowed dimension exceeded")
        with pytest.raises(ValueError, match=r"nbytes=9223372036854775808 is more memory than any device has"):
            alloc(2 ** 63)


def test_copy_beyond_end_and_bad_memset(backend):
    q = backend.create_queue()
    b = backend.alloc(100)
    host = np.zeros(200, np.uint8)
    with pytest.raises(ValueError, match="past the end of dst"):
        backend.copy(q, b, host, 101)
    with pytest.raises(ValueError, match="past the end of src"):
        backend.copy(q, host, b, 60, src_offset=50)
    with pytest.raises(ValueError, match="value=300"):
        backend.memset(q, b, 300)
    with pytest.raises(ValueError, match="past the end"):
        backend.memset(q, b, 1, nbytes=10, offset=95)
    with pytest.raises(TypeError, match="src must be a Buffer or an array"):
        backend.copy(q, b, [1, 2, 3], 3)
    # An offset past the end with no nbytes made a negative count: an empty memset, no error.
    with pytest.raises(ValueError, match=r"offset=150 is past the end of buffer #\d+ \(100 bytes\)"):
        backend.memset(q, b, 9, offset=150)
    backend.free(b)


def test_destroyed_queue_and_event_refused(backend):
    q = backend.create_queue("doomed")
    e = backend.create_event()
    backend.destroy_queue(q)
    backend.destroy_event(e)
    b = backend.alloc(8)
    with pytest.raises(RuntimeError, match="doomed was destroyed"):
        backend.memset(q, b, 0)
    with pytest.raises(RuntimeError, match="destroyed"):
        backend.destroy_queue(q)
    with pytest.raises(RuntimeError, match="was destroyed"):
        backend.query_event(e)
    backend.free(b)


def test_foreign_event_queue_and_buffer_refused(backend):
    other = CPUBackend()
    q, oq = backend.create_queue(), other.create_queue()
    e_other = other.create_event()
    with pytest.raises(ValueError, match="belongs to another backend"):
        backend.record_event(e_other, q)
    with pytest.raises(ValueError, match="belongs to another backend"):
        backend.synchronize(oq)
    ob = other.alloc(8)
    with pytest.raises(ValueError, match="belongs to"):
        backend.free(ob)
    mine = backend.alloc(8)
    with pytest.raises(ValueError, match=r"src=buffer #\d+ belongs to CPUBackend"):  # (numpy's copyto error)
        backend.copy(q, mine, ob, 8)
    with pytest.raises(ValueError, match=r"dst=buffer #\d+ belongs to CPUBackend"):
        backend.copy(q, ob, mine, 8)
    backend.free(mine)


def test_freeing_an_allocator_block_with_the_backend_says_whose_it_is(backend):
    from vtnumba.memory import CachingAllocator

    alloc = CachingAllocator(backend)
    block = alloc.allocate(64, backend.create_queue())
    with pytest.raises(ValueError, match=r"was not made by this backend's alloc.*CachingAllocator.free\(block\)"):
        backend.free(block)  # it said "double free" of a block nobody had freed
    alloc.free(block)


def test_flag_words_must_be_contiguous(backend):
    q = backend.create_queue()
    flags = backend.asarray(np.zeros(8, np.uint32))
    with pytest.raises(ValueError, match=r"flags must be a contiguous uint32 array"):
        backend.write_value32(q, flags[::2], 1, 5)
    with pytest.raises(ValueError, match=r"flags must be a contiguous uint32 array"):
        backend.wait_value32(q, flags[::2], 1, 5)
    backend.synchronize(q)


def test_default_backend_after_close_and_device_spellings():
    from vtnumba.backend import DeviceType, default_backend

    saved = registry.try_get_backend(CPU)  # (other tests hold the process's default: leave it open)
    be = CPUBackend()
    registry.register_backend(CPU, be)
    try:
        assert default_backend(CPU) is be
        assert default_backend("cpu") is be and default_backend(DeviceType.CPU) is be
        with pytest.raises(TypeError, match=r"device=0 must be a Device, a DeviceType, or a string like"):
            default_backend(0)  # was taken for "no device"
        be.close()
        fresh = default_backend(CPU)  # a closed backend refuses all work: it is replaced
        assert fresh is not be and not fresh.closed
        assert registry.get_backend(CPU) is fresh
        fresh.close()
    finally:
        if saved is not None:
            registry.register_backend(CPU, saved)
        else:
            registry.unregister_backend(CPU)


def test_double_free_and_use_after_free(backend):
    b = backend.alloc(32)
    backend.free(b)
    with pytest.raises(RuntimeError, match="already freed"):
        backend.free(b)
    with pytest.raises(RuntimeError, match="already freed"):
        b.view(np.uint8)
    p = backend.alloc(16)
    with pytest.raises(ValueError, match="not pinned"):
        backend.free_pinned(p)


def test_elapsed_needs_recorded_events():
    b = CPUBackend()
    e1, e2 = b.create_event(), b.create_event()
    with pytest.raises(RuntimeError, match="never recorded"):
        b.elapsed_ms(e1, e2)


# ---------------------------------------------------------------- devices and registry
def test_device_validation():
    assert Device(DeviceType.CUDA, 3).index == 3
    assert Device("cpu", 0) == CPU
    with pytest.raises(ValueError, match="index=16 out of range"):
        Device(DeviceType.CUDA, MAX_DEVICES_PER_TYPE)
    with pytest.raises(ValueError, match="index=-1"):
        Device(DeviceType.CPU, -1)
    with pytest.raises(TypeError, match="index"):
        Device(DeviceType.CPU, 1.0)
    with pytest.raises(ValueError, match="not a DeviceType"):
        Device("tpu", 0)


def test_registry_by_type_and_device():
    saved = {d: try_get_backend(d) for d in registry.registered_devices()}
    try:
        for d in list(saved):
            unregister_backend(d)
        assert try_get_backend(DeviceType.CUDA) is None
        with pytest.raises(RuntimeError, match="no backend registered for device cuda:0"):
            get_backend(DeviceType.CUDA)
        with pytest.raises(RuntimeError, match="no backend registered for device cuda:5"):
            get_backend(Device(DeviceType.CUDA, 5))
        cpu = CPUBackend()
        register_backend(DeviceType.CPU, cpu)
        # The type-level slot is index 0.
        assert get_backend(Device(DeviceType.CPU, 0)) is cpu
        assert get_backend(DeviceType.CPU) is cpu
        cpu2 = CPUBackend(Device(DeviceType.CPU, 2))
        register_backend(Device(DeviceType.CPU, 2), cpu2)
        assert get_backend(Device(DeviceType.CPU, 2)) is cpu2 and get_backend(DeviceType.CPU) is cpu
        with pytest.raises(ValueError, match="serves cpu devices"):
            register_backend(DeviceType.CUDA, cpu)
        with pytest.raises(ValueError, match="already registered"):
            register_backend(DeviceType.CPU, CPUBackend(), replace=False)
        # A backend serves the device it was made for, and only while open.
        with pytest.raises(ValueError, match=r"serves cpu:2, not cpu:0"):
            register_backend(DeviceType.CPU, cpu2)
        closed = CPUBackend()
        closed.close()
        with pytest.raises(ValueError, match="is closed; register a new one"):
            register_backend(DeviceType.CPU, closed)
        buf = DeviceResourceOps.alloc(CPU, 128)
        q = vtnumba.create_queue(CPU)
        comm = vtnumba.create_queue(CPU, "comm", priority="high")
        assert buf.backend is cpu and q.backend is cpu and (comm.name, comm.priority) == ("comm", "high")
        vtnumba.free(CPU, buf)
        vtnumba.destroy_queue(CPU, q)
        vtnumba.destroy_queue(CPU, comm)
        with pytest.raises(TypeError, match="must be a Device, a DeviceType, or a string like"):
            get_backend(42)
    finally:
        for d in registry.registered_devices():
            unregister_backend(d)
        for d, b in saved.items():
            if not b.closed:
                register_backend(d, b)


def test_public_names_on_package():
    # The top level re-exports the runtime's names, loaded on first use: the very objects of
    # the modules that define them.
    import importlib

    for name in ("Backend", "get_backend", "try_get_backend", "register_backend", "Device", "DeviceType",
                 "DeviceResourceOps", "alloc", "free", "create_queue", "destroy_queue", "CUDABackend"):
        home = "vtnumba.backend.cuda" if name == "CUDABackend" else "vtnumba.backend"
        assert getattr(vtnumba, name) is getattr(importlib.import_module(home), name), name
    assert {"alloc", "CUDABackend", "select_target"} <= set(dir(vtnumba))
    with pytest.raises(AttributeError, match="module 'vtnumba' has no attribute 'no_such_name'"):
        vtnumba.no_such_name  # noqa: B018


def test_a_closed_backend_refuses_work_instead_of_hanging(backend):
    """After close() a threaded cpu backend's workers are gone: a copy was accepted and the
    synchronize after it waited forever.  Every backend now refuses new work by name, and
    teardown (free, destroy_queue, close again) still works."""
    q = backend.create_queue("before-close")
    buf = backend.alloc(64)
    backend.close()
    assert backend.closed
    src = np.arange(64, dtype=np.uint8)
    for what, call in (("copy", lambda: backend.copy(q, buf, src, 64)),
                       ("synchronize", lambda: backend.synchronize(q)),
                       ("create_queue", lambda: backend.create_queue()),
                       ("alloc", lambda: backend.alloc(8)),
                       ("alloc_pinned", lambda: backend.alloc_pinned(8))):
        with pytest.raises(RuntimeError, match=rf"{re.escape(backend.name)} on .* was closed; make a new backend"):
            call()
    backend.free(buf)
    backend.destroy_queue(q)
    backend.close()  # twice: harmless


def test_a_queue_name_must_be_a_string(backend):
    with pytest.raises(TypeError, match="name=5 must be a str"):
        backend.create_queue(5)


def test_views_events_and_copies_refuse_what_they_cannot_do(backend):
    buf = backend.alloc(16)
    q = backend.create_queue("minor")
    with pytest.raises(TypeError, match="dtype=object cannot view raw memory"):
        buf.view(object, (1,))
    with pytest.raises(ValueError, match=r"offset=17 is past the end of buffer #\d+ \(16 bytes\)"):
        buf.view(np.uint8, None, 17)
    with pytest.raises(TypeError, match=r"blocking='yes' must be True or False"):
        backend.create_event(blocking="yes")
    with pytest.raises(ValueError, match="dst is a read-only numpy array"):
        backend.copy(q, np.frombuffer(b"x" * 16, np.uint8), buf, 16)
    backend.destroy_queue(q)
    backend.free(buf)


def test_a_failed_end_capture_keeps_the_graph_captured_before(backend):
    # end_capture destroyed the kept graph first, then found the queue was not capturing:
    # replay() afterwards said "nothing captured".  (No capture runs here; the kept graph
    # stands in for one captured earlier.)
    from vtnumba.backend.base import GraphHandle

    q = backend.create_queue("not-capturing")
    kept = GraphHandle(backend, object())
    backend._default_graph = kept
    with pytest.raises(RuntimeError, match="is not capturing"):
        backend.end_capture(q)
    assert backend._default_graph is kept and not kept.destroyed
    backend._default_graph = None
    backend.destroy_queue(q)


class _RecordingCaptureBackend(CPUBackend):
    """A cpu backend that pretends to capture graphs, recording the primitives the base class
    calls -- so the capture lifecycle (what synchronize, destroy_queue and close do while a
    capture is open) is tested without the GPU that really captures."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def supports_graph_capture(self) -> bool:
        return True

    def _begin_capture(self, q):
        self.calls.append(("begin", q.name))
        return q.name

    def _end_capture(self, q, state):
        self.calls.append(("end", state))
        return ("graph", state)

    def _discard_capture(self, q, state):
        self.calls.append(("discard", state))

    def _destroy_graph(self, native):
        self.calls.append(("destroy", native))


def test_a_capture_in_progress_is_never_synchronized_and_is_discarded_on_teardown():
    # On a GPU, a synchronize of a capturing stream fails and invalidates the capture, a
    # destroyed queue left its capture open, and close() synchronized into the capture.
    b = _RecordingCaptureBackend()
    q, side = b.create_queue("cap"), b.create_queue("side")
    b.begin_capture(q)
    with pytest.raises(RuntimeError, match=r"synchronize\(cap\): the queue is capturing a graph"):
        b.synchronize(q)
    with pytest.raises(RuntimeError, match=r"synchronize\(\): queue\(s\) cap are capturing"):
        b.synchronize()
    b.synchronize(side)  # other queues are not affected
    b.end_capture(q)     # kept as the default graph
    b.synchronize(q)
    b.synchronize()
    b.begin_capture(side)
    b.destroy_queue(side)  # its capture is discarded, not left open
    assert b.calls == [("begin", "cap"), ("end", "cap"), ("begin", "side"), ("discard", "side")]
    b.synchronize()        # nothing is capturing any more
    b.begin_capture(q)
    b.close()              # the open capture is discarded and the kept graph destroyed
    assert b.calls[-3:] == [("begin", "cap"), ("discard", "cap"), ("destroy", ("graph", "cap"))]
    b.close()              # twice: harmless, nothing destroyed twice
    assert len(b.calls) == 7


def test_flag_writes_and_waits_are_refused_while_capturing_and_not_queued():
    # Captured, a flag write would store its old epoch again at every replay, and a flag wait
    # would hold a replayed graph with no deadline the host knows of.
    b = _RecordingCaptureBackend()
    q, other = b.create_queue("cap"), b.create_queue("other")
    flags = np.zeros(2, np.uint32)
    b.begin_capture(q)
    with pytest.raises(RuntimeError, match=r"write_value32 on .*cap.* while it is capturing a graph"):
        b.write_value32(q, flags, 0, 5)
    with pytest.raises(RuntimeError, match=r"wait_value32 on .*cap.* while it is capturing a graph"):
        b.wait_value32(q, flags, 1, 1, timeout_s=0.1)
    assert flags.tolist() == [0, 0]
    b.write_value32(other, flags, 1, 1)   # a queue that is not capturing is not affected
    b.wait_value32(other, flags, 1, 1, timeout_s=1)
    b.end_capture(q)
    b.write_value32(q, flags, 0, 5)       # nor is the queue once its capture ended
    assert flags.tolist() == [5, 1]
    b.close()


@pytest.mark.parametrize("threaded", [False, True], ids=["cpu", "cpu-threaded"])
def test_query_queue_says_whether_everything_submitted_has_finished(threaded):
    b = CPUBackend(threaded=threaded)
    q = b.create_queue("qq")
    assert b.query_queue(q)  # nothing submitted
    if threaded:
        gate = threading.Event()
        b.launch_host_func(q, gate.wait)
        b.launch_host_func(q, lambda: 1 / 0)  # a failure counts as finished; synchronize says it
        assert not b.query_queue(q)
        gate.set()
        for _ in range(2000):
            if b.query_queue(q):
                break
            time.sleep(0.001)
        assert b.query_queue(q)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            b.synchronize(q)
    else:
        b.launch_host_func(q, lambda: None)  # runs inline
        assert b.query_queue(q)
    with pytest.raises(TypeError):
        b.query_queue("qq")
    b.flush_pending(q)  # submission is immediate on cpu: nothing batched up, nothing to do
    b.flush_pending()
    with pytest.raises(TypeError, match="q must be a Queue, got str"):
        b.flush_pending("qq")
    b.destroy_queue(q)
    with pytest.raises(RuntimeError, match="q=qq was destroyed; create a new queue"):
        b.query_queue(q)
    with pytest.raises(RuntimeError, match="q=qq was destroyed; create a new queue"):
        b.flush_pending(q)
    b.close()


def test_backends_take_a_device_written_as_text(device_backend_factory):
    # CPUBackend("cpu") was "AttributeError: 'str' object has no attribute 'type'", while the
    # registry's functions all take "cpu" and "cuda:0".
    b = CPUBackend("cpu")
    assert b.device == CPU
    b.close()
    with pytest.raises(ValueError, match="device=cuda:0 must be a CPU device for CPUBackend"):
        CPUBackend("cuda:0")
    with pytest.raises(ValueError, match="device='gpu' is not a device; expected 'cpu', 'cuda' or 'cuda:N'"):
        CPUBackend("gpu")
    from vtnumba.backend.cuda import CUDABackend

    with pytest.raises(ValueError, match="device=cpu:0 must be a CUDA device for CUDABackend"):
        CUDABackend("cpu")


def test_a_host_function_waiting_for_its_own_threaded_queue_is_an_error_not_a_hang():
    """The worker would wait for itself forever (found by a lifecycle probe: synchronize,
    destroy_queue or close inside a host function hung the caller too).  A GPU refuses CUDA
    calls from a host function the same way."""
    b = CPUBackend(threaded=True)
    q = b.create_queue()
    for inside in (lambda: b.synchronize(q), lambda: b.synchronize(), lambda: b.destroy_queue(q)):
        b.launch_host_func(q, inside)
        with pytest.raises(RuntimeError, match=r"a host function running on queue .* waited for that same queue"):
            b.synchronize(q)
    b.close()


@pytest.mark.parametrize("threaded", [False, True], ids=["cpu", "cpu-threaded"])
def test_close_finishes_closing_when_queued_work_failed(threaded):
    """close() raised the queued error and stayed half-open (closed False, workers running):
    only a second close() closed it.  Now it closes, then raises."""
    import threading

    before = threading.active_count()
    b = CPUBackend(threaded=threaded)
    q = b.create_queue()
    if threaded:
        b.launch_host_func(q, lambda: 1 / 0)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            b.close()
    else:
        b.close()
    assert b.closed and threading.active_count() == before
    with pytest.raises(RuntimeError, match="was closed"):
        b.create_queue()


def test_a_threaded_backend_dropped_without_close_ends_its_workers():
    """The worker held its queue, and so the backend, strongly: each backend dropped without
    close() kept its threads (and itself) for the life of the process."""
    import gc
    import threading
    import time

    before = threading.active_count()
    for _ in range(5):
        b = CPUBackend(threaded=True)
        q = b.create_queue()
        b.launch_host_func(q, lambda: None)
        b.synchronize(q)
        del b, q
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_copies_refuse_what_is_not_a_buffer_or_an_array_on_every_backend(device_backend):
    # The simulator "copied" into a numpy scalar (a temporary) and reported success; a
    # memoryview was an AttributeError there; an object array a numpy error naming nothing.
    for be in (CPUBackend(), device_backend):
        q = be.create_queue()
        buf = be.alloc(64)
        for bad in (np.float32(0), memoryview(bytearray(64))):
            with pytest.raises(TypeError, match=r"dst must be a Buffer or an array, got (float32|memoryview)"):
                be.copy(q, bad, buf, 4)
        with pytest.raises(TypeError, match=r"dst holds Python objects \(dtype object\)"):
            be.copy(q, np.empty(8, object), buf, 8)
        be.free(buf)
        be.destroy_queue(q)


def test_buffer_views_of_huge_shapes_are_refused_by_size():
    # np.prod in int64 wrapped: (2**32 + 1) * (2**32 - 1) came out as 2**64 - 1 -> reshape error.
    be = CPUBackend()
    buf = be.alloc(64)
    for shape in ((2**32 + 1, 2**32 - 1), (2**64 + 16,)):
        with pytest.raises(ValueError, match=r"view of shape=.* needs \d+ bytes but buffer #\d+ has only 64"):
            buf.view(np.uint8, shape)
    be.close()


def test_supported_dtypes_checks_its_target_and_compute_capability():
    from vtnumba.backend.dtype import DType, check_dtype_supported, supported_dtypes

    assert DType.BFLOAT16 in supported_dtypes("cuda", (9, 0))
    with pytest.raises(TypeError, match=r"compute_capability=\[9, 0\] must be a \(major, minor\) tuple"):
        check_dtype_supported("bf16", "cuda", [9, 0])
    with pytest.raises(ValueError, match=r"target='gpu' is not a target; expected one of cpu, cudasim, cuda"):
        supported_dtypes("gpu")


@pytest.mark.parametrize("shape", [(), (1,), (3, 2)])
def test_asarray_keeps_the_shape_and_contents_of_any_array(backend, shape):
    # np.ascontiguousarray turns a 0-d array into shape (1,): asarray gave back (1,) for ().
    rng = np.random.default_rng()
    host = rng.standard_normal(shape).astype(np.float32)
    for source in (host, host.T):  # a transposed (non-contiguous) source too
        dev = backend.asarray(source)
        back = np.array(backend.to_host(dev))
        assert dev.shape == source.shape and back.shape == source.shape
        np.testing.assert_array_equal(back, source)


@pytest.mark.parametrize("bad", [np.array(["a"]), np.array([object()]), np.zeros(2, [("x", "f4")])])
def test_asarray_refuses_what_device_memory_cannot_hold_like_empty(backend, bad):
    with pytest.raises(TypeError, match=r"host.dtype=.* cannot be held in device memory; expected a number type"):
        backend.asarray(bad)


def test_a_threaded_backend_dropped_without_close_leaves_no_worker_queue_entries():
    # Each threaded queue is counted (weakly) in what every free waits for; backends dropped
    # without close() left their entries behind until some free swept them, so they piled up
    # in a process that made queues but freed nothing (found by a leak probe: ~2.5 entries a
    # cycle).  Making a queue sweeps them now too -- and no weak-reference callback takes the
    # lock, which garbage collection may set off on a thread that already holds it.
    import gc

    from vtnumba.backend import base

    gc.collect()
    before = len(base._worker_queues)
    for _ in range(5):
        b = CPUBackend(threaded=True)
        q = b.create_queue("dropped")
        b.launch_host_func(q, lambda: None)
        b.synchronize(q)
        del b, q
    gc.collect()
    keep = CPUBackend(threaded=True)
    keep.create_queue("kept")
    assert len(base._worker_queues) <= before + 2  # the kept backend's queues, no dropped ones
    keep.close()

    def collect_inside_the_lock():
        with base._worker_queues_lock:
            gc.collect()

    gc.disable()
    try:
        b = CPUBackend(threaded=True)
        b.create_queue("garbage")
        del b  # (cyclic garbage with a worker queue: collected inside the lock below)
        t = threading.Thread(target=collect_inside_the_lock, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "garbage collection inside the lock deadlocked"
    finally:
        gc.enable()
