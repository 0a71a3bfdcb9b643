"""The numba memory-manager plugin: its logic against a cpu "device", its numba class in a
subprocess without the simulator (no GPU needed), and the real install on a GPU."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from vtnumba.backend import CPUBackend
from vtnumba.memory import CachingAllocator, current_queue, install_numba_memory_manager, using_queue
from vtnumba.memory.numba_emm import _EMMCore


@pytest.fixture
def core():
    backend = CPUBackend(threaded=True)
    c = _EMMCore(CachingAllocator(backend, limit_bytes=64 << 20), backend.create_queue("emm-default"))
    yield c
    backend.close()


def test_using_queue_is_thread_local_and_nests():
    be = CPUBackend()
    q1, q2 = be.create_queue("q1"), be.create_queue("q2")
    seen = []
    assert current_queue() is None
    with using_queue(q1):
        with using_queue(q2):
            t = threading.Thread(target=lambda: seen.append(current_queue()))
            t.start()
            t.join()
            assert current_queue() is q2
        assert current_queue() is q1
    assert current_queue() is None and seen == [None]
    with pytest.raises(TypeError, match="using_queue\\(queue='q1'\\) needs a Queue"):
        with using_queue("q1"):
            pass
    be.destroy_queue(q1)
    with pytest.raises(RuntimeError, match="destroyed queue"):
        with using_queue(q1):
            pass


def test_memalloc_takes_the_current_queue(core):
    be = core.allocator.backend
    q = be.create_queue("work")
    default = core.alloc(100)
    with using_queue(q):
        mine = core.alloc(100)
    assert default.queue is core.default_queue and mine.queue is q
    zero = core.alloc(0)                       # numba may ask for 0 bytes
    assert zero.size == 512


def test_finalizer_frees_later_and_waits_for_the_owner(core):
    be = core.allocator.backend
    q = be.create_queue("work")
    with using_queue(q):
        block = core.alloc(4096)
    ptr = block.ptr
    gate = threading.Event()
    be.launch_host_func(q, lambda: gate.wait(10.0))   # a kernel on q still using the memory
    core.finalizer(block)()                           # numba's GC finalizer: only queues the free
    assert not block.freed and core.allocator.stats()["active_blocks"] == 1
    with using_queue(q):
        other = core.alloc(4096)                      # drains: free(wait_owner=True) -> event on q
    assert block.freed and other.ptr != ptr, "reused while the owner's queued work was still running"
    assert core.allocator.stats()["blocks_waiting_on_events"] == 1
    gate.set()
    be.synchronize(q)
    with using_queue(q):
        again = core.alloc(4096)
    assert again.ptr == ptr


def test_record_stream_at_makes_the_free_wait_for_the_other_queue(core):
    # record_stream_array's lookup: a numba array's pointer may point inside its block.
    be = core.allocator.backend
    owner, reader = be.create_queue("owner"), be.create_queue("reader")
    with using_queue(owner):
        block = core.alloc(4096)
    ptr = block.ptr
    assert core.record_stream_at(ptr + 100, reader) is block
    gate = threading.Event()
    be.launch_host_func(reader, lambda: gate.wait(10.0))  # a kernel on the other queue still reads it
    core.finalizer(block)()
    with using_queue(owner):
        other = core.alloc(4096)                          # drains the free: events on owner and reader
    be.synchronize(owner)
    core.allocator.process_events()
    with using_queue(owner):
        third = core.alloc(4096)
    assert ptr not in (other.ptr, third.ptr), "reused while the other queue's queued work was still running"
    gate.set()
    be.synchronize(reader)
    core.finalizer(other)()
    core.finalizer(third)()
    core.drain()
    be.synchronize()
    core.allocator.process_events()
    with using_queue(owner):
        assert ptr in {core.alloc(4096).ptr for _ in range(3)}  # once every queue caught up, it comes back
    with pytest.raises(ValueError, match="was not allocated by vtnumba's memory manager"):
        core.record_stream_at(ptr + (1 << 40), reader)


def test_a_default_pool_free_waits_for_every_queue(core):
    # A device_array made outside using_queue belongs to the legacy-default pool, yet any
    # (non-blocking) queue may have used it: its free waits for all of them, as cuMemFree did.
    be = core.allocator.backend
    q = be.create_queue("work")
    block = core.alloc(4096)
    assert block.queue is core.default_queue
    ptr = block.ptr
    gate = threading.Event()
    be.launch_host_func(q, lambda: gate.wait(10.0))  # a kernel on q still reads the array
    core.finalizer(block)()
    core.drain()                                     # the free: an event on its own queue, and on q
    be.synchronize(core.default_queue)               # its own queue has nothing left to do...
    core.allocator.process_events()
    other = core.alloc(4096)                         # ...but q still reads the memory
    other_ptr = other.ptr
    assert block.freed and other_ptr != ptr, "reused while another queue's queued work was still running"
    gate.set()
    be.synchronize(q)
    core.finalizer(other)()
    core.drain()
    be.synchronize()
    core.allocator.process_events()
    assert core.alloc(4096).ptr in (ptr, other_ptr)  # once every queue caught up, the memory comes back


def test_an_array_that_dies_after_the_backend_closed_is_freed_and_reset_releases_the_cache():
    # numba finalizes arrays whenever the garbage collector gets to them -- after the backend
    # closed, too.  drain() popped such a block and then raised on the closed backend's queues:
    # the block was lost (allocated for good) and reset() never released the cache.
    backend = CPUBackend()
    core = _EMMCore(CachingAllocator(backend), backend.create_queue("emm-default"))
    backend.create_queue("work")
    block = core.alloc(4096)
    backend.close()
    core.finalizer(block)()
    core.reset()
    stats = core.allocator.stats()
    assert block.freed and stats["allocated_bytes"] == 0 and stats["reserved_bytes"] == 0, stats


def test_defer_cleanup_and_memory_info(core):
    block = core.alloc(1000)
    with core.defer_cleanup():
        core.finalizer(block)()
        assert core.drain() == 0 and not block.freed
    assert core.drain() == 1 and block.freed
    core.allocator.backend.synchronize()        # the owner's event fires
    free, total = core.memory_info()
    assert total == 64 << 20 and free == total  # the freed block's segment counts as free (cached)
    core.reset()
    assert core.allocator.stats()["reserved_bytes"] == 0
    no_limit = _EMMCore(CachingAllocator(CPUBackend()), CPUBackend().create_queue())
    with pytest.raises(NotImplementedError, match="no memory info"):
        no_limit.memory_info()


@pytest.mark.simulator_only  # the refusal itself: numba's simulator has no memory-manager hook to install into
def test_install_refuses_the_simulator():
    with pytest.raises(RuntimeError, match="simulator has no external memory manager"):
        install_numba_memory_manager()


PLUGIN_SCRIPT = textwrap.dedent("""
    import gc
    from numba import cuda
    from numba.cuda.cudadrv import driver as drv
    from vtnumba.backend import CPUBackend
    from vtnumba.memory import install_numba_memory_manager

    # A cpu backend plays the device: segments are host memory, queues are threads.
    be = CPUBackend(threaded=True)
    cls = install_numba_memory_manager(be, segment_source=be, limit_bytes=8 << 20)
    assert drv._memory_manager is cls, "numba did not take the plugin"
    mm = cls(context=None)                     # what numba does per context
    assert mm.interface_version == 1
    mm.initialize()
    p = mm.memalloc(1000)
    addr = p.device_pointer_value
    block = mm.core.allocator.live_blocks()[0]
    assert addr == block.ptr and block.nbytes == 1000
    info = mm.get_memory_info()
    assert info.total == 8 << 20 and info.free == (8 << 20) - 1024, info
    # As numba's own manager does: pending host frees are batched by the device's memory size.
    assert mm.deallocations.memory_capacity == 8 << 20
    del p
    gc.collect()                               # numba's finalizer runs: the free is queued
    assert mm.core.allocator.stats()["active_blocks"] == 1
    mm.core.drain()                            # (memalloc does this first) free with an event on the owner
    be.synchronize()                           # ... which fires once the owner queue is idle
    p2 = mm.memalloc(1000)                     # so the memory is reused
    assert p2.device_pointer_value == addr, (hex(p2.device_pointer_value), hex(addr))
    with mm.defer_cleanup():
        pass
    # A deferral makes no core (it may run in a host function, where CUDA calls are not
    # allowed); a core made while one lasts still holds its frees until it ends.
    fresh = cls(context=None)
    with fresh.defer_cleanup():
        assert fresh._core is None, "defer_cleanup made the allocator"
        q3 = fresh.memalloc(1000)
        held = fresh.core.allocator.live_blocks()[-1]
        del q3
        gc.collect()
        assert fresh.core.drain() == 0 and not held.freed, "the free ran inside the deferral"
    assert fresh.core.drain() == 1 and held.freed
    s = mm.core.allocator.stats()
    assert s["cache_hits"] >= 1 and s["active_blocks"] == 1, s
    del p2
    gc.collect()
    mm.reset()
    assert mm.core.allocator.stats()["reserved_bytes"] == 0
    print("plugin ok", s["cache_hits"], s["cache_misses"])
""")


def test_numba_plugin_class_without_gpu():
    """The real numba EMM classes, outside the simulator: set_memory_manager works without a
    GPU, and memalloc/finalizer/reset run against the cpu "device"."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",)}
    env["NUMBA_ENABLE_CUDASIM"] = "0"
    env["VTNUMBA_TARGET"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "plugin ok" in proc.stdout


GPU_SCRIPT = textwrap.dedent("""
    import gc
    import numpy as np
    from vtnumba.memory import install_numba_memory_manager, record_stream_array, using_queue
    install_numba_memory_manager()             # before the first context
    from numba import cuda
    from vtnumba import default_backend
    mm = cuda.current_context().memory_manager
    assert type(mm).__name__ == "VtnumbaMemoryManager"
    be = default_backend()
    q = be.create_queue("work")
    with using_queue(q):
        a = cuda.to_device(np.arange(1000, dtype=np.float32), stream=q.stream)
        ptr = a.__cuda_array_interface__["data"][0]
        del a
        gc.collect()                           # numba's finalizer queues the free
        mm.core.drain()                        # free with an event on q (memalloc does this too)
        be.synchronize(q)                      # the event fires
        b = cuda.device_array(1000, dtype=np.float32, stream=q.stream)
        assert b.__cuda_array_interface__["data"][0] == ptr
    reader = be.create_queue("reader")
    record_stream_array(b, reader)             # b's memory now also waits for the reader queue
    assert reader.id in next(k for k in mm.core.allocator.live_blocks() if k.ptr == ptr)._stream_uses
    buf = be.alloc(4096)                       # the backend's own allocations go through it too
    assert mm.core.allocator.stats()["cache_hits"] >= 1
    print("gpu plugin ok")
""")


@pytest.mark.cuda
def test_install_on_a_real_gpu():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["VTNUMBA_TARGET"] = "cuda"
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "gpu plugin ok" in proc.stdout


def test_blocks_of_raw_driver_segments_have_no_views():
    from vtnumba.memory.numba_emm import _RawSegment

    be = CPUBackend()
    kept = []

    class RawSource:  # like cuMemAlloc: an address and a size, no array
        def alloc(self, nbytes):
            buf = be.alloc(nbytes)
            kept.append(buf)
            return _RawSegment(buf.ptr, nbytes)

        def free(self, seg):
            pass

    a = CachingAllocator(be, segment_source=RawSource())
    b = a.allocate(100, be.create_queue())
    assert b.ptr == kept[0].ptr
    for use in (lambda: b.array, lambda: b.view()):
        with pytest.raises(TypeError, match="raw device memory"):
            use()
    a.free(b)
