"""The copy engine's batched_copy: many (src, dst, nbytes) descriptors in one queued call, vs. its host
reference -- and the address check that turns a bad pointer into an error instead of a crash."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from vtnumba.backend.address_ranges import LIVE, registered
from vtnumba.backend.cpu import CPUBackend
from vtnumba.memory import CachingAllocator
from vtnumba.memory.copy_engine import (
    address_of,
    batched_copy,
    batched_copy_reference,
    check_descriptors,
    host_batched_copy,
    is_live,
    live_address,
)

POISON = 0xAB


@pytest.fixture(params=["cpu-sync", "cpu-threaded", "device"])
def backend(request, device_backend_factory):
    be = device_backend_factory() if request.param == "device" else CPUBackend(threaded=request.param == "cpu-threaded")
    yield be
    be.close()


def _write(backend, buf, data: np.ndarray) -> None:
    """Fill a buffer through the backend (works for device memory the host cannot address)."""
    q = backend.create_queue("fill")
    backend.copy(q, buf, data, data.nbytes)
    backend.destroy_queue(q)


def _read(backend, buf) -> np.ndarray:
    out = np.empty(buf.nbytes, np.uint8)
    q = backend.create_queue("read")
    backend.copy(q, out, buf, buf.nbytes)
    backend.destroy_queue(q)
    return out


def _random_descriptors(rng, n, src_size, dst_size):
    """n copies with random sizes (some 0), into disjoint destination ranges."""
    sizes = rng.integers(0, 97, size=n)
    sizes[rng.random(n) < 0.1] = 0
    # Disjoint destination ranges: a random permutation of slots of width 97, then a random gap.
    slots = rng.permutation(dst_size // 97)[:n]
    dst_off = slots * 97 + rng.integers(0, 97 - sizes + 1)
    src_off = rng.integers(0, src_size - sizes + 1)
    return src_off.astype(np.int64), dst_off.astype(np.int64), sizes.astype(np.int64)


@pytest.mark.parametrize("n", [1, 7, 33, 65])
def test_random_descriptors_into_poisoned_destination(backend, rng, n):
    src = backend.alloc(4096)
    dst = backend.alloc(97 * 80)
    q = backend.create_queue("t")
    s = rng.integers(0, 256, 4096, dtype=np.uint8)
    _write(backend, src, s)
    _write(backend, dst, np.full(dst.nbytes, POISON, np.uint8))
    so, do, sz = _random_descriptors(rng, n, 4096, dst.nbytes)
    src_ptrs = (src.ptr + so).astype(np.uint64)
    dst_ptrs = (dst.ptr + do).astype(np.int64)  # int64 and uint64 both accepted
    total = batched_copy(src_ptrs, dst_ptrs, sz, queue=q, backend=backend)
    backend.synchronize(q)
    assert total == int(sz.sum())

    expect = np.full(dst.nbytes, POISON, np.uint8)
    for a, b, k in zip(so, do, sz):
        expect[b:b + k] = s[a:a + k]
    np.testing.assert_array_equal(_read(backend, dst), expect)
    backend.destroy_queue(q)


@pytest.mark.parametrize("n", [1, 33])
def test_host_reference_agrees_byte_for_byte(rng, n):
    """The reference (same signature, one ctypes.memmove per descriptor) vs the batched host loop."""
    backend = CPUBackend(threaded=True)
    src, dst, ref = backend.alloc(4096), backend.alloc(97 * 80), backend.alloc(97 * 80)
    src.array[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst.array[:] = POISON
    ref.array[:] = POISON
    so, do, sz = _random_descriptors(rng, n, 4096, dst.nbytes)
    q = backend.create_queue("t")
    batched_copy((src.ptr + so).astype(np.uint64), (dst.ptr + do).astype(np.uint64), sz, queue=q, backend=backend)
    batched_copy_reference((src.ptr + so).astype(np.uint64), (ref.ptr + do).astype(np.uint64), sz, queue=q,
                           backend=backend)
    np.testing.assert_array_equal(ref.array, dst.array)
    backend.close()


def test_no_queue_means_done_on_return(rng):
    be = CPUBackend(threaded=True)
    a = rng.integers(0, 256, 1000, dtype=np.uint8)
    b = np.zeros(1000, np.uint8)
    with registered(a), registered(b):  # arrays the caller made: declared live for the copy
        batched_copy([a.ctypes.data], [b.ctypes.data], [1000], backend=be)
    np.testing.assert_array_equal(a, b)
    be.close()


def test_runs_in_queue_order_on_threaded_queues(rng):
    """The copy waits behind earlier work on its queue and is visible after synchronize."""
    be = CPUBackend(threaded=True)
    q = be.create_queue("gated")
    gate = threading.Event()
    be.launch_host_func(q, lambda: gate.wait(10))
    a, b = be.alloc(4096).array, be.alloc(4096).array
    a[:] = rng.integers(1, 256, 4096, dtype=np.uint8)
    b[:] = 0
    done = be.create_event()
    batched_copy(np.array([a.ctypes.data], np.uint64), np.array([b.ctypes.data], np.uint64),
                 np.array([4096], np.uint64), queue=q, backend=be)
    be.record_event(done, q)
    assert not be.query_event(done)
    assert not b.any(), "the copy ran before the work queued ahead of it"
    gate.set()
    be.synchronize(q)
    np.testing.assert_array_equal(a, b)
    be.close()


def test_empty_batch_and_zero_sizes_are_noops(backend):
    q = backend.create_queue()
    assert batched_copy(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64), q, backend) == 0
    # A null address is fine when its size is 0.
    assert batched_copy([0], [0], [0], q, backend) == 0
    # Plain empty lists (np.asarray([]) is float64): a step with nothing to copy.
    assert batched_copy([], [], [], q, backend) == 0
    backend.destroy_queue(q)


def test_a_freed_allocator_block_is_no_longer_a_valid_target():
    # The block stayed registered as live memory after free() and empty_cache(), whose
    # segment went back to the backend: the copy passed the check and crashed the process.
    be = CPUBackend()
    q = be.create_queue()
    src = be.alloc(4 << 20)
    alloc = CachingAllocator(be)
    block = alloc.allocate(4 << 20, q)
    ptr, n = block.ptr, block.nbytes
    batched_copy([src.ptr], [ptr], [n], backend=be)
    alloc.free(block)
    alloc.empty_cache()
    with pytest.raises(ValueError, match="not inside any live allocation"):
        batched_copy([src.ptr], [ptr], [n], backend=be)
    be.close()


def test_a_closed_backend_copies_nothing():
    be = CPUBackend()  # synchronous: the copy would run inline, where no queue is checked
    q = be.create_queue()
    a, b = be.alloc(64), be.alloc(64)
    be.close()
    for queue in (q, None):
        with pytest.raises(RuntimeError, match="was closed"):
            batched_copy([a.ptr], [b.ptr], [8], queue, be)


def test_overlapping_source_and_destination_within_one_descriptor(rng):
    a = rng.integers(0, 256, 100, dtype=np.uint8)
    expect = a.copy()
    expect[10:60] = a[0:50]
    with registered(a):
        batched_copy([a.ctypes.data], [a.ctypes.data + 10], [50], backend=CPUBackend())
    np.testing.assert_array_equal(a, expect)  # memmove semantics


# ---------------------------------------------------------------------------- the address check
def test_an_address_outside_every_allocation_is_an_error_not_a_crash(backend):
    """Without the check, copying from 0x1000 kills the process (SIGSEGV) -- or, on a GPU, leaves
    its CUDA context dead after an illegal memory access."""
    dst = backend.alloc(64)
    q = backend.create_queue("bad")
    with pytest.raises(ValueError, match=r"src_ptrs\[0\] = 0x1000 with sizes\[0\] = 8: .*not inside any live"):
        batched_copy([0x1000], [dst.ptr], [8], queue=q, backend=backend)
    with pytest.raises(ValueError, match=r"dst_ptrs\[0\]"):
        batched_copy([dst.ptr], [0x1000], [8], queue=q, backend=backend)
    backend.destroy_queue(q)


def test_a_range_that_runs_past_its_allocation_is_refused(backend):
    src, dst = backend.alloc(64), backend.alloc(256)
    with pytest.raises(ValueError, match=r"src_ptrs\[1\].*buffer #"):
        batched_copy([src.ptr, src.ptr + 32], [dst.ptr, dst.ptr + 64], [32, 33], backend=backend)
    with pytest.raises(ValueError, match=r"dst_ptrs\[0\]"):
        batched_copy([src.ptr], [dst.ptr + 200], [64], backend=backend)


@pytest.mark.parametrize("copy", [batched_copy, batched_copy_reference])
@pytest.mark.parametrize("which", ["src", "dst"])
def test_a_range_whose_end_wraps_past_2_64_is_refused_not_copied(backend, copy, which):
    """address + size in uint64 wraps for a huge size or a pointer of -1 (0xff..ff): a check of
    ``end <= reach`` took the wrapped end as inside (the reference then crashed the process)."""
    a, b = backend.alloc(64), backend.alloc(64)
    for ptr, size in ((a.ptr, 2**64 - 1), (-1, 8), (a.ptr + 8, 2**64 - 8)):
        src, dst = ([ptr], [b.ptr]) if which == "src" else ([b.ptr], [ptr])
        named = which if size == 8 else "src"  # a huge size overruns both; the source is checked first
        with pytest.raises(ValueError, match=rf"{named}_ptrs\[0\] = .*not inside any live allocation"):
            copy(src, dst, [size], backend=backend)


def test_a_bad_descriptor_anywhere_means_nothing_is_copied(backend, rng):
    """The check runs over the whole batch before the first byte moves (on synchronous queues
    in the same compiled call as the copy): good descriptors before a bad one copy nothing."""
    src, dst = backend.alloc(256), backend.alloc(256)
    data = rng.integers(0, 256, 256, dtype=np.uint8)
    _write(backend, src, data)
    poison = np.full(256, 0xAB, np.uint8)
    _write(backend, dst, poison)
    q = backend.create_queue("bad-last")
    with pytest.raises(ValueError, match=r"src_ptrs\[2\]"):
        batched_copy([src.ptr, src.ptr + 64, 0x1000], [dst.ptr, dst.ptr + 64, dst.ptr + 128], [64, 64, 8],
                     queue=q, backend=backend)
    backend.synchronize(q)
    np.testing.assert_array_equal(_read(backend, dst), poison)
    backend.destroy_queue(q)


def test_backends_used_in_turn_each_copy_their_own_way(rng):
    """The copy engine remembers how the last backend copies (inline or through its queues);
    alternating between a synchronous and a threaded backend must not mix the two up."""
    sync, threaded = CPUBackend(), CPUBackend(threaded=True)
    try:
        for step in range(4):
            for be in (sync, threaded):
                src, dst = be.alloc(128), be.alloc(128)
                data = rng.integers(0, 256, 128, dtype=np.uint8)
                _write(be, src, data)
                q = be.create_queue("turn")
                gate = threading.Event()
                if be is threaded:  # the copy must wait in its queue behind the gate
                    be.launch_host_func(q, lambda: gate.wait(10))
                assert batched_copy([src.ptr], [dst.ptr], [128], queue=q, backend=be) == 128
                if be is threaded:
                    assert not np.array_equal(dst.array, data), "the copy ran ahead of its queue"
                    gate.set()
                be.synchronize(q)
                np.testing.assert_array_equal(_read(be, dst), data)
                be.destroy_queue(q)
    finally:
        sync.close()
        threaded.close()


def test_freed_memory_is_no_longer_a_valid_target(backend):
    src, dst = backend.alloc(64), backend.alloc(64)
    batched_copy([src.ptr], [dst.ptr], [64], backend=backend)
    src_ptr = src.ptr
    backend.free(src)
    with pytest.raises(ValueError, match="not inside any live allocation"):
        batched_copy([src_ptr], [dst.ptr], [64], backend=backend)


def test_freeing_a_buffer_that_queued_copies_still_target_waits_for_them_not_a_crash():
    # The queued copy holds plain addresses: the free released the memory at once and the
    # copies behind it wrote into freed pages -- a segmentation fault on the queue's thread.
    # Now a threaded queue keeps the memory until it has passed the free (in a subprocess:
    # a crash must fail this test, not end the test run).
    code = """
import faulthandler, numpy as np
faulthandler.enable()
from vtnumba.backend.cpu import CPUBackend
from vtnumba.memory.copy_engine import batched_copy
be = CPUBackend(threaded=True)
dst, src, q = be.alloc(1 << 26), be.alloc(1 << 26), be.create_queue()
src.array[:] = 7
for _ in range(5):
    batched_copy([src.ptr], [dst.ptr], [1 << 26], queue=q, backend=be)
be.free(dst)
be.synchronize(q)
be.close()
print("done")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "VTNUMBA_TRACE"})
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stdout + proc.stderr


def _run_without_crashing(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", "import faulthandler; faulthandler.enable()\n" + code],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "VTNUMBA_TRACE"})
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stdout + proc.stderr


@pytest.mark.parametrize("other", ["CPUBackend()", "CPUBackend(threaded=True)"])
def test_a_copy_queued_on_one_backend_keeps_another_backends_freed_buffer_alive(other):
    # The addresses may be any backend's buffers: a free on a synchronous backend (which has no
    # busy queue of its own) released the memory that a copy queued on another backend's
    # worker thread -- held behind a gate -- then wrote into: a segmentation fault.
    _run_without_crashing(f"""
import gc, threading
import numpy as np
from vtnumba.backend.cpu import CPUBackend
from vtnumba.memory.copy_engine import batched_copy
x, y = CPUBackend(threaded=True), {other}
qx = x.create_queue("x")
n = 64 << 20  # large: numpy maps it on its own, and the free unmaps it
src, dst = x.alloc(n), y.alloc(n)
src.array[:] = 7
gate = threading.Event()
x.launch_host_func(qx, gate.wait)
batched_copy([src.ptr], [dst.ptr], [n], qx, x)
y.free(dst)
del dst
gc.collect()
gate.set()
x.synchronize(qx)
x.close(); y.close()
print("done")
""")


def test_a_queued_copy_uses_the_descriptors_it_was_given_not_what_they_became():
    # The descriptors were checked at the call, but a worker thread read the caller's arrays
    # when the copy ran: reusing them meanwhile sent an unchecked address to memmove.
    be = CPUBackend(threaded=True)
    q = be.create_queue()
    a, b = be.alloc(4096), be.alloc(4096)
    a.array[:] = np.arange(4096) % 251
    b.array[:] = POISON
    src, dst = np.array([a.ptr], np.uint64), np.array([b.ptr], np.uint64)
    n = np.array([4096], np.uint64)
    gate = threading.Event()
    be.launch_host_func(q, gate.wait)
    batched_copy(src, dst, n, q, be)
    dst[0], n[0] = a.ptr, 1  # (an address of a live buffer, so a crash is not what this shows)
    gate.set()
    be.synchronize(q)
    assert np.array_equal(b.array, np.arange(4096) % 251)
    be.close()


def test_an_address_below_every_known_range_is_not_said_to_be_above_one():
    # The message named "the known range starting closest below it" -- a range above it.
    be = CPUBackend()
    buf = be.alloc(64)
    assert min(start for start, _, _ in LIVE._ranges.values()) > 0x10
    with pytest.raises(ValueError, match=r"the known range nearest \(every known range starts above it\) is"):
        batched_copy([buf.ptr], [0x10], [8], backend=be)
    with pytest.raises(ValueError, match=r"the known range starting closest below it is buffer #\d+ on cpu:0 at"):
        batched_copy([buf.ptr], [buf.ptr + 60], [8], backend=be)  # runs past the end of buf
    be.free(buf)


def test_registration_is_undone_after_the_with_block():
    a = np.zeros(64, np.uint8)
    before = len(LIVE)
    with registered(a, "a test array"):
        assert len(LIVE) == before + 1
    assert len(LIVE) == before
    with pytest.raises(ValueError, match="not inside any live allocation"):
        batched_copy([a.ctypes.data], [a.ctypes.data + 32], [8], backend=CPUBackend())


@pytest.mark.parametrize("bad, exc, words", [
    (dict(sizes=np.array([4, -1])), ValueError, ["sizes[1]=-1", "negative"]),
    (dict(sizes=np.array([4])), ValueError, ["differ in length", "len(sizes)=1"]),
    (dict(src_ptrs=np.array([1.0, 2.0])), TypeError, ["src_ptrs", "integer", "float64"]),
    (dict(dst_ptrs=np.zeros((2, 1), np.uint64) + 8), ValueError, ["dst_ptrs", "1-D"]),
    (dict(dst_ptrs=np.array([8, 0], np.uint64)), ValueError, ["dst_ptrs[1]", "null address", "sizes[1]=4"]),
    (dict(src_ptrs=np.array([True, True])), TypeError, ["src_ptrs", "bool"]),
])
def test_bad_descriptors_are_refused(bad, exc, words):
    args = dict(src_ptrs=np.array([8, 16], np.uint64), dst_ptrs=np.array([8, 16], np.uint64),
                sizes=np.array([4, 4], np.int64))
    args.update(bad)
    with pytest.raises(exc) as ei:
        check_descriptors(args["src_ptrs"], args["dst_ptrs"], args["sizes"])
    for w in words:
        assert w in str(ei.value)
    with pytest.raises(exc):  # batched_copy validates before touching anything
        batched_copy(args["src_ptrs"], args["dst_ptrs"], args["sizes"], backend=CPUBackend())


def test_bad_arguments():
    be = CPUBackend()
    with pytest.raises(ValueError, match="src_access_order='sideways'"):
        batched_copy([8], [8], [0], backend=be, src_access_order="sideways")
    with pytest.raises(TypeError, match="backend must be a Backend"):
        batched_copy([8], [8], [0], backend="cpu")
    with pytest.raises(TypeError, match="queue must be a vtnumba Queue"):
        batched_copy([8], [8], [1], queue="q0", backend=be)


def test_high_bit_addresses_survive_as_uint64():
    """Device addresses can have the high bit set: int64 input is reinterpreted, not converted."""
    ptrs = np.array([-8], dtype=np.int64)
    src, _, _ = check_descriptors(ptrs, ptrs, np.array([0]))
    assert src.dtype == np.uint64 and int(src[0]) == 2**64 - 8


def test_address_of(rng, device_backend):
    be = CPUBackend()
    buf = be.alloc(64)
    assert address_of(buf) == buf.ptr
    a = rng.standard_normal(8)
    assert address_of(a) == a.ctypes.data
    with pytest.raises(ValueError, match="C-contiguous"):
        address_of(a[::2])
    with pytest.raises(TypeError, match="cannot take the address"):
        address_of([1, 2])
    dbuf = device_backend.alloc(64)
    assert address_of(dbuf.view(np.float32, (16,))) == dbuf.ptr


def test_host_loop_matches_ctypes_reference(rng):
    src = rng.integers(0, 256, 5000, dtype=np.uint8)
    d1 = np.full(5000, POISON, np.uint8)
    d2 = d1.copy()
    so, do, sz = _random_descriptors(rng, 40, 5000, 5000)
    s = (src.ctypes.data + so).astype(np.uint64)
    host_batched_copy(s, (d1.ctypes.data + do).astype(np.uint64), sz.astype(np.uint64))
    with registered(src), registered(d2):
        batched_copy_reference(s, (d2.ctypes.data + do).astype(np.uint64), sz, backend=CPUBackend())
    np.testing.assert_array_equal(d1, d2)
    assert (d1 != POISON).any()


@pytest.mark.cuda
def test_real_gpu_batched_copy_h2d_and_d2h(rng, device_backend, monkeypatch):
    from cuda.bindings import driver as cu

    from vtnumba.memory.copy_engine import cuda_batch_api_available

    be = device_backend
    # The batch must go through cuMemcpyBatchAsync itself: the per-descriptor fallback would
    # pass this test too, and hide a broken batch call.
    assert cuda_batch_api_available(), "the driver and cuda.bindings have no cuMemcpyBatchAsync (driver >= 12.8)"
    singles = []
    real_single = cu.cuMemcpyAsync
    monkeypatch.setattr(cu, "cuMemcpyAsync", lambda *a: singles.append(a) or real_single(*a))
    q = be.create_queue()
    host = be.alloc_pinned(4096)
    host.array[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    dev = be.alloc(4096)
    back = be.alloc_pinned(4096)
    back.array[:] = POISON
    so = np.array([0, 1000, 3000], np.int64)
    sz = np.array([1000, 2000, 1096], np.int64)
    batched_copy((host.ptr + so).astype(np.uint64), (dev.ptr + so).astype(np.uint64), sz, q, be,
                 src_access_order="any")
    batched_copy((dev.ptr + so).astype(np.uint64), (back.ptr + so).astype(np.uint64), sz, q, be)
    be.synchronize(q)
    np.testing.assert_array_equal(back.array, host.array)
    assert not singles, f"{len(singles)} descriptors fell back to cuMemcpyAsync"


def test_live_address_is_address_of_and_is_live_in_one_call(rng):
    """What the encoder-cache worker asks of every output it saves, answered by one compiled call
    for numpy arrays -- the same answers as the two separate questions."""
    be = CPUBackend()
    try:
        buf = be.alloc(4096)
        inside = buf.view(np.float32, (16, 64))           # backend memory: live
        mine = rng.standard_normal((8, 16)).astype(np.float16)  # the caller's own array: not known
        for arr, nbytes in ((inside, 4096), (inside[4:], 3072), (mine, mine.nbytes)):
            addr, live = live_address(arr, nbytes)
            assert addr == address_of(arr) and live == is_live(addr, nbytes)
        assert live_address(inside, 4096)[1] and not live_address(inside, 4097)[1]  # one byte past the buffer
        assert not live_address(mine, mine.nbytes)[1]
        with registered(mine):
            assert live_address(mine, mine.nbytes) == (address_of(mine), True)
        assert live_address(buf, 4096) == (buf.ptr, True)  # a Buffer: the general path
    finally:
        be.close()


def test_unregister_never_waits_for_the_lock():
    """A Buffer's finalizer unregisters its range, and the garbage collector may run it inside
    an allocation made by a thread holding the table's lock (the sorted table is built under
    it).  Unregistering must then not wait for the lock -- that thread would wait for itself."""
    from vtnumba.backend.address_ranges import AddressRanges

    ranges = AddressRanges()
    token = ranges.register(0x1000, 64, "x")
    keep = ranges.register(0x2000, 64, "y")
    starts_before = ranges._table()[0].tolist()

    def finalizer_inside_the_lock():
        with ranges._lock:         # as if the collector ran the finalizer inside _table()
            ranges.unregister(token)

    t = threading.Thread(target=finalizer_inside_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "unregister waited for a lock its own thread holds"
    assert starts_before == [0x1000, 0x2000]
    assert ranges._table()[0].tolist() == [0x2000] and len(ranges) == 1  # applied by the next caller
    ranges.unregister(keep)
    ranges.unregister(keep)  # idempotent
    assert len(ranges) == 0 and ranges._table()[0].size == 0


def test_a_driver_without_the_bound_batch_function_falls_back_to_one_copy_per_descriptor(monkeypatch):
    # cuda.bindings 13 binds the CUDA 13 revision of cuMemcpyBatchAsync and raises when the
    # driver (12.8, 12.9) lacks it: the batch must still be copied, one cuMemcpyAsync per
    # descriptor, and the batch API left alone from then on.  (Driver calls stood in for.)
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as cu

    from vtnumba.memory import copy_engine

    def missing(*args):
        raise RuntimeError('Function "cuMemcpyBatchAsync" not found')

    copies = []
    monkeypatch.setattr(cu, "cuMemcpyBatchAsync", missing)
    monkeypatch.setattr(cu, "cuMemcpyAsync", lambda d, s, n, h: copies.append((int(d), int(s), n)) or
                        (cu.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(copy_engine, "_cuda_context", lambda: None)
    monkeypatch.setattr(copy_engine, "_cuda_batch_ok", True)  # as if the version check had passed
    stream = 0x7F00  # a queue's stream (not the legacy NULL stream, which the batch API refuses)
    with pytest.warns(RuntimeWarning, match="cuMemcpyBatchAsync is not usable with this driver"):
        copy_engine._cuda_batched_copy(stream, ([0x1000, 0x2000], [0x3000, 0x4000], [64, 32]), "stream")
    assert copies == [(0x3000, 0x1000, 64), (0x4000, 0x2000, 32)]
    assert copy_engine._cuda_batch_ok is False
    copies.clear()
    copy_engine._cuda_batched_copy(stream, ([0x1000, 0x2000], [0x3000, 0x4000], [64, 32]), "stream")  # no warning
    assert copies == [(0x3000, 0x1000, 64), (0x4000, 0x2000, 32)]


def test_a_batch_on_the_legacy_null_stream_is_copied_one_by_one(monkeypatch, recwarn):
    # cuMemcpyBatchAsync refuses stream 0 (the legacy default stream): a queue there -- the numba
    # memory-manager plugin's default pool -- must not try it at all, nor turn it off for others.
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as cu

    from vtnumba.memory import copy_engine

    batches, copies = [], []
    monkeypatch.setattr(cu, "cuMemcpyBatchAsync",
                        lambda *a: batches.append(a) or (cu.CUresult.CUDA_ERROR_INVALID_VALUE,))
    monkeypatch.setattr(cu, "cuMemcpyAsync", lambda d, s, n, h: copies.append((int(d), int(s), n, int(h))) or
                        (cu.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(copy_engine, "_cuda_context", lambda: None)
    monkeypatch.setattr(copy_engine, "_cuda_batch_ok", True)
    copy_engine._cuda_batched_copy(0, ([0x1000, 0x2000], [0x3000, 0x4000], [64, 32]), "stream")
    assert batches == [] and copies == [(0x3000, 0x1000, 64, 0), (0x4000, 0x2000, 32, 0)]
    assert copy_engine._cuda_batch_ok is True and not recwarn.list


def test_runs_inline_only_where_a_queue_would_copy_on_the_spot_unwatched(device_backend):
    """Who may run checked_host_copy itself: the cpu target's synchronous queues, with nobody
    watching -- not threaded queues, not the simulator or a GPU, not under tracing."""
    from vtnumba import trace
    from vtnumba.memory.copy_engine import runs_inline

    sync, threaded, other = CPUBackend(), CPUBackend(threaded=True), CPUBackend()
    try:
        q = sync.create_queue("q")
        assert runs_inline(sync) and runs_inline(sync, q)
        assert not runs_inline(sync, other.create_queue("not its own"))
        assert not runs_inline(threaded) and not runs_inline(device_backend)
        with trace.recording():
            assert not runs_inline(sync, q)
        sync.destroy_queue(q)
        assert not runs_inline(sync, q)
    finally:
        for be in (sync, threaded, other):
            be.close()
    assert not runs_inline(sync)  # a closed backend copies nothing


def test_host_copy_now_copies_the_first_count_descriptors_or_nothing(rng):
    from vtnumba.memory.copy_engine import host_copy_now

    src = rng.integers(0, 256, 300, dtype=np.uint8)
    dst = np.full(300, POISON, np.uint8)
    with registered(src), registered(dst):
        s = np.array([src.ctypes.data, src.ctypes.data + 100, 0], np.uint64)
        d = np.array([dst.ctypes.data + 7, dst.ctypes.data + 150, 0], np.uint64)
        n = np.array([50, 101, 4], np.uint64)  # the third (a null pair) lies past count
        assert host_copy_now(s, d, n, 2) == 151
        np.testing.assert_array_equal(dst[7:57], src[:50])
        np.testing.assert_array_equal(dst[150:251], src[100:201])
        assert (dst[:7] == POISON).all() and (dst[57:150] == POISON).all() and (dst[251:] == POISON).all()
        before = dst.copy()
        n[1] = 151  # now runs 1 byte past dst's end
        with pytest.raises(ValueError, match=r"dst_ptrs\[1\]"):
            host_copy_now(s, d, n, 2)
        np.testing.assert_array_equal(dst, before)  # descriptor 0 was fine, but nothing was copied


def test_the_host_loops_are_cached_on_disk_not_compiled_per_process(tmp_path):
    """memmove is called by name (an LLVM intrinsic), not through a process-specific function
    pointer, so numba's disk cache holds the loops: a second process loads them."""
    code = ("from vtnumba.memory.copy_engine import prepare, checked_host_copy, _memmove_loop\n"
            "prepare()\n"
            "print(sum(checked_host_copy.stats.cache_hits.values()), sum(_memmove_loop.stats.cache_hits.values()))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second = ([int(word) for word in r.stdout.split()] for r in runs)
    assert first == [0, 0], "a fresh cache directory cannot hold them yet"
    assert all(hits > 0 for hits in second), f"the second process compiled again: cache hits {second}"


def test_checked_host_copy_checks_only_the_sides_it_is_asked_to(rng):
    """CHECK_DST: a source the caller vouches for (an array it holds) needs no registration; the
    destination is still checked, and a null address on either side is still refused."""
    from vtnumba.memory.copy_engine import CHECK_BOTH, CHECK_DST, CHECK_SRC, checked_host_copy, live_table

    src = rng.integers(0, 256, 64, dtype=np.uint8)       # never registered
    dst = np.full(64, POISON, np.uint8)
    s = np.array([src.ctypes.data], np.uint64)
    d = np.array([dst.ctypes.data], np.uint64)
    n = np.array([64], np.uint64)
    with registered(dst):
        assert checked_host_copy(s, d, n, 1, *live_table(), CHECK_BOTH) == -1  # src not live: refused
        assert checked_host_copy(s, d, n, 1, *live_table(), CHECK_SRC) == -1
        assert (dst == POISON).all()
        assert checked_host_copy(s, d, n, 1, *live_table(), CHECK_DST) == 64
        np.testing.assert_array_equal(dst, src)
        null = np.zeros(1, np.uint64)
        assert checked_host_copy(null, d, n, 1, *live_table(), CHECK_DST) == -1  # a null source: still refused
    assert checked_host_copy(s, d, n, 1, *live_table(), CHECK_DST) == -1  # dst no longer live



def test_a_check_racing_an_unregister_never_sees_the_old_table():
    # unregister() has returned, another thread is applying it, and a lock-free check must not
    # find the old table (which still lists the freed range) beside an empty queue of removals:
    # a copy into just-freed memory would pass.  The removal is held right after it left the
    # queue -- where the table used to be dropped only afterwards.
    import threading
    from collections import deque

    from vtnumba.backend.address_ranges import AddressRanges

    buf = np.zeros(64, np.uint8)
    ranges = AddressRanges()
    token = ranges.register(buf.ctypes.data, 64, "buf")
    ptrs, sizes = np.array([buf.ctypes.data], np.uint64), np.array([64], np.uint64)
    ranges.check("dst", ptrs, sizes)  # the table is built
    popped, release = threading.Event(), threading.Event()

    class HeldQueue(deque):
        def popleft(self):
            item = super().popleft()
            popped.set()
            release.wait(10)
            return item

    ranges._removed = HeldQueue()
    ranges.unregister(token)
    writer = threading.Thread(target=ranges._table)
    writer.start()
    assert popped.wait(10)
    seen = []

    def check():
        try:
            ranges.check("dst", ptrs, sizes)
            seen.append("accepted")
        except ValueError:
            seen.append("refused")

    reader = threading.Thread(target=check)
    reader.start()
    reader.join(0.2)  # (the old code answered at once, from the old table)
    release.set()
    writer.join(10)
    reader.join(10)
    assert seen == ["refused"]
