"""CachingAllocator: size classes, per-queue reuse, record_stream, splitting, OOM, bad input.

Every core test runs on the sync cpu backend, threaded cpu queues and the device target
(numba's CUDA simulator, or the GPU under ``VTNUMBA_TARGET=cuda``).
"""

import numpy as np
import pytest

from vtnumba.backend import Buffer, CPUBackend
from vtnumba.memory import SMALL_SEGMENT, AllocatorOutOfMemory, CachingAllocator, round_size
from test_memory_support import KINDS, Holder, make_backend, read, write

MiB = 1 << 20


@pytest.fixture(params=KINDS)
def backend(request, device_backend_factory):
    b = make_backend(request.param, device_backend_factory)
    yield b
    b.close()


@pytest.fixture
def holder(backend):
    h = Holder(backend)
    yield h
    h.close()


def test_round_size():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 4096)] == [512, 512, 512, 1024, 1024, 4096]


def test_size_classes_and_small_segments(backend):
    a = CachingAllocator(backend)
    q = backend.create_queue("main")
    blocks = [a.allocate(n, q) for n in (1, 700, 4096)]
    assert [b.size for b in blocks] == [512, 1024, 4096]
    assert [b.nbytes for b in blocks] == [1, 700, 4096]
    # All three were carved out of one 2 MiB small segment, one after the other.
    assert len({b.segment_id for b in blocks}) == 1
    assert [b.offset for b in blocks] == [0, 512, 1536]
    assert all(b.ptr % 64 == 0 for b in blocks)  # segments are 64-byte aligned, offsets multiples of 512
    s = a.stats()
    assert s["reserved_bytes"] == SMALL_SEGMENT and s["num_segments"] == 1
    assert s["allocated_bytes"] == 512 + 1024 + 4096 and s["requested_bytes"] == 4797
    assert s["cache_misses"] == 1 and s["cache_hits"] == 2 and s["splits"] == 3
    a.check_invariants()
    for b in blocks:
        a.free(b)
    # Freed neighbours coalesce back into one free piece spanning the segment.
    (seg,) = a.segment_map()
    assert seg["pieces"] == [{"offset": 0, "size": SMALL_SEGMENT, "state": "free", "block": None}]
    a.check_invariants()
    assert a.empty_cache() == SMALL_SEGMENT and a.stats()["reserved_bytes"] == 0


def test_same_queue_reuse_is_an_immediate_cache_hit(backend):
    a = CachingAllocator(backend)
    q = backend.create_queue("main")
    b = a.allocate(10_000, q)
    ptr = b.ptr
    backend.memset(q, b, 0x11)  # queued work using the block (may still be running)
    a.free(b)
    hits = a.stats()["cache_hits"]
    b2 = a.allocate(10_000, q)
    assert b2.ptr == ptr, "same queue, same size class: the memory must be reused at once"
    assert a.stats()["cache_hits"] == hits + 1 and a.stats()["num_segments"] == 1
    assert b.freed and not b2.freed and b2.id != b.id
    a.free(b2)
    backend.synchronize(q)


def test_pools_are_per_queue(backend):
    a = CachingAllocator(backend)
    q1, q2 = backend.create_queue("q1"), backend.create_queue("q2")
    b = a.allocate(4096, q1)
    ptr = b.ptr
    a.free(b)
    other = a.allocate(4096, q2)
    assert other.ptr != ptr and other.queue is q2, "another queue must not get q1's freed memory"
    assert a.stats()["num_segments"] == 2
    a.free(other)


def test_cross_queue_reuse_waits_for_recorded_events(backend, holder):
    a = CachingAllocator(backend)
    main, side = backend.create_queue("main"), backend.create_queue("side")
    b = a.allocate(8192, main)
    ptr = b.ptr
    holder.hold(side)                 # the side queue has not reached its work yet
    backend.memset(side, b, 0x22)     # ... work on side that uses the block
    a.record_stream(b, side)
    a.free(b)
    s = a.stats()
    assert s["blocks_waiting_on_events"] == 1 and s["bytes_waiting_on_events"] == 8192
    assert s["events_recorded"] == 1
    early = a.allocate(8192, main)
    assert early.ptr != ptr, "memory reused before the side queue's event completed"
    assert a.process_events() == 0 and a.stats()["blocks_waiting_on_events"] == 1
    a.check_invariants()
    holder.release()
    assert a.process_events() == 1 and a.stats()["blocks_waiting_on_events"] == 0
    late = a.allocate(8192, main)
    assert late.ptr == ptr, "once the event completed, the memory is back in main's pool"
    for blk in (early, late):
        a.free(blk)
    a.check_invariants()


def test_record_stream_own_queue_is_a_no_op(backend):
    a = CachingAllocator(backend)
    q = backend.create_queue()
    b = a.allocate(100, q)
    a.record_stream(b, q)
    a.free(b)
    assert a.stats()["blocks_waiting_on_events"] == 0 and a.stats()["events_recorded"] == 0


def test_destroyed_side_queue_needs_no_event(backend):
    a = CachingAllocator(backend)
    main, side = backend.create_queue("main"), backend.create_queue("side")
    b = a.allocate(100, main)
    a.record_stream(b, side)
    backend.destroy_queue(side)       # drains it: its uses are complete
    a.free(b)
    assert a.stats()["blocks_waiting_on_events"] == 0


def test_a_side_queue_destroyed_during_the_free_needs_no_event(backend, monkeypatch):
    # Another thread destroys the side queue between free's check of it and its event: free
    # raised "q=side was destroyed" with the block half-freed (out of the live set, its piece
    # never back in a pool).  A queue destroyed meanwhile was drained: nothing to wait for.
    a = CachingAllocator(backend)
    main, side = backend.create_queue("main"), backend.create_queue("side")
    b = a.allocate(100, main)
    where = b.ptr
    a.record_stream(b, side)
    real_record = backend.record_event

    def record_after_a_destroy(ev, q):
        if q is side and not side.destroyed:
            backend.destroy_queue(side)  # (what the other thread did, just now)
        return real_record(ev, q)

    monkeypatch.setattr(backend, "record_event", record_after_a_destroy)
    a.free(b)
    assert a.stats()["blocks_waiting_on_events"] == 0
    a.check_invariants()
    again = a.allocate(100, main)  # the piece is back in main's pool
    assert again.ptr == where
    a.free(again)


def test_a_destroyed_queues_memory_goes_to_the_next_queue_that_needs_it(backend, holder):
    # Pools are per queue and queue ids never come back: a queue per step cached each step's
    # memory in a pool nobody asked again -- 50 steps reserved 50 segments (100 MiB of large
    # ones) and never hit the cache.
    a = CachingAllocator(backend)
    for step in range(50):
        q = backend.create_queue(f"step{step}")
        a.free(a.allocate(4096, q))
        a.free(a.allocate(3 * MiB, q))
        backend.destroy_queue(q)
    s = a.stats()
    assert s["num_segments"] == 2 and s["cache_hits"] == 98 and s["allocated_bytes"] == 0, s
    a.check_invariants()
    # Memory another live queue still uses stays out until its event fires, adopted or not.
    q, side = backend.create_queue("owner"), backend.create_queue("side")
    b = a.allocate(8192, q)
    ptr = b.ptr
    holder.hold(side)
    backend.memset(side, b, 0x33)
    a.record_stream(b, side)
    a.free(b)
    backend.destroy_queue(q)
    nxt = backend.create_queue("next")
    early = a.allocate(8192, nxt)
    assert early.ptr != ptr, "memory reused before the side queue's event completed"
    holder.release()
    a.process_events()
    late = a.allocate(8192, nxt)
    assert late.ptr == ptr and late.queue is nxt
    a.free(early)
    a.free(late)
    a.check_invariants()


def test_large_blocks_round_to_2mib_segments_and_split(backend):
    a = CachingAllocator(backend)
    q = backend.create_queue()
    big = a.allocate(3 * MiB + 1, q)             # segment rounded to 4 MiB; rest 1 MiB - 512 is not split
    assert a.stats()["reserved_bytes"] == 4 * MiB and big.size == 4 * MiB
    a.free(big)
    b8 = a.allocate(8 * MiB, q)                    # needs a fresh 8 MiB segment
    a.free(b8)
    splits = a.stats()["splits"]
    part = a.allocate(2 * MiB, q)                  # best fit: the 4 MiB piece, split (rest 2 MiB > 1 MiB)
    assert part.size == 2 * MiB and a.stats()["splits"] == splits + 1
    assert a.stats()["reserved_bytes"] == 12 * MiB
    small = a.allocate(4096, q)                    # small requests never come from large segments
    assert small.segment_id not in {part.segment_id} and a.stats()["reserved_bytes"] == 12 * MiB + SMALL_SEGMENT
    a.check_invariants()
    for blk in (part, small):
        a.free(blk)
    assert a.empty_cache() == 12 * MiB + SMALL_SEGMENT
    assert a.stats()["reserved_bytes"] == 0 and a.stats()["segments_released"] == 3


def test_empty_cache_keeps_segments_with_live_or_waiting_blocks(backend, holder):
    a = CachingAllocator(backend)
    main, side = backend.create_queue("main"), backend.create_queue("side")
    live = a.allocate(4096, main)
    held = a.allocate(2 * MiB, main)
    free_seg = a.allocate(4 * MiB, main)
    a.free(free_seg)
    holder.hold(side)
    a.record_stream(held, side)
    a.free(held)
    assert a.empty_cache() == 4 * MiB
    assert a.stats()["num_segments"] == 2
    holder.release()
    a.free(live)
    assert a.empty_cache() == SMALL_SEGMENT + 2 * MiB and a.stats()["reserved_bytes"] == 0


def test_views_copies_and_memset_on_blocks(backend, rng):
    a = CachingAllocator(backend)
    q = backend.create_queue()
    pad = a.allocate(100, q)                       # so the block under test is not at offset 0
    b = a.allocate(7 * 33 * 4, q)
    assert b.offset == 512
    src = rng.standard_normal((7, 33)).astype(np.float32)
    backend.copy(q, b, src, src.nbytes)            # H2D into a Block, like any Buffer
    out = np.full_like(src, np.nan)
    backend.copy(q, out, b, src.nbytes)
    backend.synchronize(q)
    np.testing.assert_array_equal(out, src)
    view = b.view(np.float32, (7, 33))             # what a kernel gets; aliases the segment
    np.testing.assert_array_equal(read(backend, view), src)
    write(backend, b.view(np.float32, 1, offset=4), 42.0)
    backend.copy(q, out, b, src.nbytes)
    backend.synchronize(q)
    assert out[0, 1] == 42.0
    backend.memset(q, b, 0x7F, nbytes=8)
    backend.synchronize(q)
    assert (read(backend, b.array)[:8] == 0x7F).all() and read(backend, pad.array).size == 100
    with pytest.raises(ValueError, match="block #.* has only"):
        b.view(np.float32, (8, 33))
    a.free(b)
    with pytest.raises(RuntimeError, match="already freed"):
        b.view(np.float32)
    with pytest.raises(RuntimeError, match="already freed"):
        backend.copy(q, out, b, 4)
    a.free(pad)


class _FlakySource:
    """A segment source that runs out of memory after ``budget`` bytes (like a full GPU)."""

    def __init__(self, backend, budget):
        self.backend, self.budget, self.used = backend, budget, 0

    def alloc(self, nbytes):
        if self.used + nbytes > self.budget:
            raise MemoryError(f"fake device out of memory ({nbytes} bytes asked, {self.budget - self.used} left)")
        self.used += nbytes
        return self.backend.alloc(nbytes)

    def free(self, buf):
        self.used -= buf.nbytes
        self.backend.free(buf)


def test_out_of_memory_empties_cache_and_retries_once(backend):
    a = CachingAllocator(backend, limit_bytes=4 * MiB)
    q1, q2 = backend.create_queue("q1"), backend.create_queue("q2")
    first = a.allocate(3 * MiB, q1)
    with pytest.raises(AllocatorOutOfMemory) as err:
        a.allocate(3 * MiB, q1)
    msg = str(err.value)
    assert isinstance(err.value, MemoryError)
    assert "nbytes=3145728" in msg and "limit_bytes=4194304" in msg and "reserved_bytes=4194304" in msg
    assert err.value.stats["allocated_bytes"] == 4 * MiB and a.stats()["oom_retries"] == 1
    # A request that allocated nothing is not a cache miss (a miss makes a new segment).
    assert a.stats()["cache_misses"] == 1 and a.stats()["num_allocs"] == 1
    a.free(first)
    # q2's pool is empty and a new segment would pass the limit: the retry releases q1's
    # cached segment and succeeds.
    second = a.allocate(3 * MiB, q2)
    assert a.stats()["oom_retries"] == 2 and a.stats()["segments_released"] == 1
    a.free(second)


def test_backend_memory_error_is_retried_after_empty_cache(backend):
    source = _FlakySource(backend, budget=4 * MiB)
    a = CachingAllocator(backend, segment_source=source)
    q1, q2 = backend.create_queue("q1"), backend.create_queue("q2")
    b = a.allocate(2 * MiB, q1)
    c = a.allocate(2 * MiB, q1)
    a.free(b)
    d = a.allocate(2 * MiB, q2)          # backend raises MemoryError, the cache is emptied, retry works
    assert a.stats()["oom_retries"] == 1 and source.used == 4 * MiB
    with pytest.raises(AllocatorOutOfMemory, match="the backend refused: MemoryError"):
        a.allocate(2 * MiB, q2)
    for blk in (c, d):
        a.free(blk)
    a.empty_cache()
    assert source.used == 0


def test_out_of_memory_with_event_held_blocks_does_not_hang(backend, holder):
    a = CachingAllocator(backend, limit_bytes=4 * MiB, oom_wait_s=0.2)
    main, side = backend.create_queue("main"), backend.create_queue("side")
    b = a.allocate(4 * MiB, main)
    ptr = b.ptr
    holder.hold(side)
    a.record_stream(b, side)
    a.free(b)
    with pytest.raises(AllocatorOutOfMemory, match="blocks_waiting_on_events=1"):
        a.allocate(4 * MiB, main)
    holder.release()
    again = a.allocate(4 * MiB, main)   # the event fired: the held block is reused
    assert again.ptr == ptr
    a.free(again)


def test_stats_keys():
    a = CachingAllocator(CPUBackend())
    s = a.stats()
    for key in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "cache_hits",
                "cache_misses", "splits", "merges", "blocks_waiting_on_events", "bytes_waiting_on_events",
                "num_segments", "cached_free_bytes", "active_blocks", "oom_retries", "limit_bytes"):
        assert key in s


# ---------------------------------------------------------------------------- bad input
def test_bad_sizes(backend):
    a = CachingAllocator(backend)
    q = backend.create_queue()
    with pytest.raises(ValueError, match=r"nbytes=0 .*expected > 0"):
        a.allocate(0, q)
    with pytest.raises(ValueError, match=r"nbytes=-5"):
        a.allocate(-5, q)
    with pytest.raises(TypeError, match=r"nbytes=1.5 must be an int"):
        a.allocate(1.5, q)
    with pytest.raises(TypeError, match=r"nbytes=True"):
        a.allocate(True, q)
    with pytest.raises(TypeError, match="queue must be a Queue"):
        a.allocate(10, "main")
    assert a.stats()["num_allocs"] == 0


def test_bad_queues_and_blocks(backend):
    a, other_alloc = CachingAllocator(backend), CachingAllocator(backend)
    q = backend.create_queue()
    foreign_backend = CPUBackend()
    fq = foreign_backend.create_queue("foreign")
    with pytest.raises(ValueError, match="queue=foreign belongs to CPUBackend"):
        a.allocate(10, fq)
    dead = backend.create_queue("dead")
    backend.destroy_queue(dead)
    with pytest.raises(RuntimeError, match="queue=dead was destroyed"):
        a.allocate(10, dead)
    b = a.allocate(10, q)
    with pytest.raises(ValueError, match="queue=foreign belongs to"):
        a.record_stream(b, fq)
    with pytest.raises(RuntimeError, match="queue=dead was destroyed"):
        a.record_stream(b, dead)
    with pytest.raises(TypeError, match="block must be a Block"):
        a.free(backend.alloc(10))
    with pytest.raises(TypeError, match="needs a Block"):
        a.record_stream("b", q)
    with pytest.raises(ValueError, match="another CachingAllocator"):
        other_alloc.free(b)
    with pytest.raises(ValueError, match="block of another allocator"):
        other_alloc.record_stream(b, q)
    a.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(b)
    with pytest.raises(RuntimeError, match="record_stream.*already freed"):
        a.record_stream(b, q)
    a.check_invariants()


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="backend must be a vtnumba Backend"):
        CachingAllocator("cpu")
    with pytest.raises(ValueError, match="limit_bytes=0"):
        CachingAllocator(CPUBackend(), limit_bytes=0)
    with pytest.raises(ValueError, match="small_segment=1000 must be a multiple of 512"):
        CachingAllocator(CPUBackend(), small_segment=1000)
    with pytest.raises(ValueError, match="small_segment=512 must be >= 1048576"):
        CachingAllocator(CPUBackend(), small_segment=512)
    # The out-of-memory path's wait: 0 (none) or a positive, finite number of seconds.
    for bad, exc in ((float("nan"), ValueError), (-1, ValueError), (float("inf"), ValueError), ("x", TypeError),
                     (None, TypeError)):
        with pytest.raises(exc, match="oom_wait_s="):
            CachingAllocator(CPUBackend(), oom_wait_s=bad)
        with pytest.raises(exc, match="wait_s="):
            CachingAllocator(CPUBackend()).empty_cache(wait_s=bad)
    assert CachingAllocator(CPUBackend(), oom_wait_s=0).oom_wait_s == 0.0
    assert CachingAllocator(CPUBackend(), oom_wait_s=np.int64(0)).oom_wait_s == 0.0  # numpy's zero too


def test_block_views_check_their_arguments_like_buffer_views(backend):
    # Block.view truncated shape=(2.7,) to 2, took True for 1, and divided by a V0 itemsize.
    a = CachingAllocator(backend)
    b = a.allocate(100, backend.create_queue())
    with pytest.raises(TypeError, match=r"shape"):
        b.view(np.float32, shape=(2.7,))
    with pytest.raises(TypeError, match=r"shape"):
        b.view(np.float32, shape=(True,))
    with pytest.raises(TypeError, match=r"cannot view raw memory"):
        b.view(np.dtype("V0"))
    with pytest.raises(ValueError, match=r"offset=200 is past the end of block #\d+ \(100 bytes\)"):
        b.view(np.float32, offset=200)
    assert b.view(np.float32, shape=(5, 5)).shape == (5, 5)
    a.free(b)


def test_a_block_freed_after_the_backend_closed_goes_back_to_the_pool():
    # close() drained every queue: there is nothing to wait for, and no event can be made any
    # more -- the free raised, and the block ended in no pool (a broken invariant, a lost segment).
    be = CPUBackend()
    q, side = be.create_queue(), be.create_queue()
    a = CachingAllocator(be)
    b = a.allocate(1000, q)
    a.record_stream(b, side)
    w = a.allocate(1000, q)
    be.close()
    a.free(b)
    a.free(w, wait_owner=True)
    a.check_invariants()
    assert a.stats()["allocated_bytes"] == 0 and not be._events


def test_block_is_a_buffer_and_repr(backend):
    a = CachingAllocator(backend)
    q = backend.create_queue("main")
    b = a.allocate(1000, q)
    assert isinstance(b, Buffer) and b.backend is backend and b.device == backend.device
    assert "1000 B (class 1024 B) on queue main" in repr(b) and "(live)" in repr(b)
    a.free(b)
    assert "(freed)" in repr(b)
