"""The caching allocator and record_stream
=========================================

What it does: allocates and frees device memory through vtnumba's stream-ordered caching
allocator -- size classes, segments, splitting, per-queue reuse -- and then breaks it on
purpose: a copy on a side queue reads a block that the main queue frees and reuses.  You
see the corrupted bytes, the hazard checker's message, and ``record_stream`` fixing both.
Last, a step arena and what running out of memory looks like.

Run it::

    mpiexec -n 2 python tutorials/03_caching_allocator.py            # cpu target
    mpiexec -n 2 python tutorials/03_caching_allocator.py --target cudasim
    python tutorials/03_caching_allocator.py                         # one rank

Key insight: a caching allocator only knows the queue a block was allocated on.  Freed
memory is reused at once by that queue -- safe, because that queue runs in order -- but
work on *any other* queue is invisible to it, unless you declare it with ``record_stream``.
"""

# %%
# Every rank runs the same lesson on its own device memory; rank 0 tells it.  The
# allocator sits on top of the target's backend: it asks ``backend.alloc`` for big
# *segments* and hands out *blocks* carved out of them.
import threading

from vtnumba.apps.tutorial import start  # first: it shares the cores between ranks before numpy loads BLAS

import numpy as np  # noqa: E402

lesson = start("03 the caching allocator and record_stream")

from vtnumba import CPUBackend, default_backend  # noqa: E402
from vtnumba.memory import (AllocatorOutOfMemory, ArenaOverflowError, CachingAllocator,  # noqa: E402
                            StepArena, check_hazards, hazard_checks_off, note_use)

backend = default_backend()
main = backend.create_queue("main")
alloc = CachingAllocator(backend)
lesson.say(f"allocator on {backend.name}")

# %%
# Size classes.  A request is rounded up to a multiple of 512 bytes; small requests are
# cut from a 2 MiB segment.  The first allocation is a *miss* (a new segment from the
# backend); after a free, the same size on the same queue is a *hit*: the same address,
# no backend call.
b = alloc.allocate(1000, main)
first_ptr = b.ptr
lesson.say(f"allocate(1000) -> {b.size}-byte block at {b.ptr:#x}; reserved {alloc.stats()['reserved_bytes']} B")
alloc.free(b)
b = alloc.allocate(1000, main)
s = alloc.stats()
lesson.say(f"free + allocate(1000) again -> {b.ptr:#x}; hits={s['cache_hits']} misses={s['cache_misses']}")
lesson.check(b.ptr == first_ptr and s["cache_hits"] == 1, "same queue, same size: the memory is reused at once")
alloc.free(b)

# %%
# Splitting and coalescing.  Three blocks sit back to back in one segment.  Freeing them
# merges the free neighbours again, so the segment is one free piece -- ready for a large
# request.  ``segment_map()`` shows the layout (offset:size:state).
blocks = [alloc.allocate(n, main) for n in (4096, 100, 70_000)]


def layout():
    return "; ".join(" ".join(f"{p['offset']}:{p['size']}:{p['state']}" for p in seg["pieces"])
                     for seg in alloc.segment_map())


lesson.say(f"three live blocks: {layout()}")
for blk in blocks:
    alloc.free(blk)
lesson.say(f"after freeing them: {layout()}")
lesson.check(len(alloc.segment_map()[0]["pieces"]) == 1, "free neighbours coalesce into one piece")

# Large requests (>= 1 MiB) get segments rounded to 2 MiB; a bigger cached piece is split.
big = alloc.allocate(8 << 20, main)
alloc.free(big)
part = alloc.allocate(3 << 20, main)
s = alloc.stats()
lesson.say(f"8 MiB freed, then 3 MiB asked: served from the cached 8 MiB piece (hit), splits={s['splits']}, "
           f"reserved={s['reserved_bytes'] >> 20} MiB")
lesson.check(s["reserved_bytes"] == (8 << 20) + (2 << 20), "the 3 MiB block came out of the cached 8 MiB segment")

# %%
# A block is a Buffer: copies take it, and ``view`` gives the typed array a kernel would
# get (numpy on cpu, a device array on cuda/cudasim), aliasing the segment.
rng = np.random.default_rng(3 + lesson.rank)
x = rng.standard_normal((7, 33)).astype(np.float32)
backend.copy(main, part, x, x.nbytes)
back = np.full_like(x, np.nan)
backend.copy(main, back, part, x.nbytes)
backend.synchronize(main)
kind = type(part.view(np.float32, x.shape)).__name__
lesson.say(f"round trip through a block: max |error| = {np.abs(back - x).max()}; block.view gives a {kind}")
lesson.check(np.array_equal(back, x), "a block carries data like any buffer")
alloc.free(part)

# %%
# The hazard.  This needs queues that really run in the background, so it uses the
# threaded cpu backend whatever the target (each queue is a worker thread).  The seed's
# scenario: main writes an "embedding" into a block; a copy on a side queue will read it
# out; main frees the block and allocates again.  We hold the side queue at a gate, so
# its copy certainly has not run when main overwrites the reused memory.
hz = CPUBackend(threaded=True)
OLD, NEW, N = 0xAB, 0xCD, 4096


def scenario(use_record_stream: bool):
    halloc = CachingAllocator(hz)
    q_main, q_side = hz.create_queue("main"), hz.create_queue("side")
    gate = threading.Event()
    block = halloc.allocate(N, q_main)
    hz.memset(q_main, block, OLD)
    written = hz.create_event()
    hz.record_event(written, q_main)
    hz.queue_wait_event(q_side, written)           # side reads only after main wrote ...
    hz.launch_host_func(q_side, lambda: gate.wait(10.0), name="gate")  # ... and not yet
    out = np.zeros(N, np.uint8)
    hz.copy(q_side, out, block, N)                 # the side queue's read, still queued
    note_use(block, q_side)                        # library code tells the hazard checker
    if use_record_stream:
        halloc.record_stream(block, q_side)        # ... and this tells the allocator
    halloc.free(block)
    again = halloc.allocate(N, q_main)             # main allocates again and overwrites
    hz.memset(q_main, again, NEW)
    hz.synchronize(q_main)
    waiting = halloc.stats()["blocks_waiting_on_events"]
    gate.set()                                     # now let the side copy run
    hz.synchronize(q_side)
    halloc.free(again)
    return out, waiting


def show(a):
    return " ".join(f"{v:#04x}" for v in a[:4]) + " ..."


with hazard_checks_off():  # (even if VTNUMBA_CHECK_HAZARDS is set: we want to see the damage)
    out, _ = scenario(use_record_stream=False)

lesson.say(f"without record_stream, checker off: the side copy read {show(out)} "
           f"(the embedding was {OLD:#04x}; {NEW:#04x} is what main wrote after reusing the memory)")
lesson.check((out == NEW).all(), "the hazard is real: the copy read the new owner's bytes")

# %%
# The checker.  ``check_hazards("record")`` (or ``VTNUMBA_CHECK_HAZARDS=record``) keeps a
# list instead of raising; the default ``"raise"`` stops at the bad allocation.
with check_hazards("record") as checker:
    out, _ = scenario(use_record_stream=False)
lesson.say("with the checker on, it says:\n    " + checker.reports[0].message)
lesson.check(len(checker.reports) == 1 and "record_stream(block #" in checker.reports[0].message,
             "the checker names the block, the queues and the fix")

# %%
# The fix.  With ``record_stream(block, side)`` the free records an event on the side
# queue; the block waits for it (``blocks_waiting_on_events``) and main gets other memory.
with check_hazards() as checker:
    out, waiting = scenario(use_record_stream=True)
lesson.say(f"with record_stream: side read {show(out)}, {waiting} block waited on its event, "
           f"{len(checker.reports)} hazards")
lesson.check((out == OLD).all() and waiting == 1 and not checker.reports, "record_stream keeps the bytes intact")
hz.close()

# %%
# A step arena: one slab, bump allocation at 64-byte-aligned offsets, ``reset()`` once
# per step.  Overflow is an error that says how much was asked and how much is left.
with StepArena(backend, 4096) as arena:
    for step in range(2):
        arena.reset()
        h = arena.alloc(33 * 4, np.float32, (33,))
        w = arena.alloc(1000)
        lesson.say(f"step {step}: used {arena.used} B, remaining {arena.remaining} B")
    try:
        arena.alloc(4000)
        overflow = ""
    except ArenaOverflowError as exc:
        overflow = str(exc)
    lesson.say(f"arena.alloc(4000) -> ArenaOverflowError: {overflow}")
    lesson.check("requested 4000 bytes" in overflow, "overflow names the requested and remaining bytes")

# %%
# Out of memory.  ``limit_bytes`` caps what the allocator may reserve (the cpu backend
# would never refuse on its own).  On a miss it empties the cache and retries once, then
# raises an error that carries the stats.
small = CachingAllocator(backend, limit_bytes=4 << 20)
keep = small.allocate(3 << 20, main)
try:
    small.allocate(3 << 20, main)
    oom = ""
except AllocatorOutOfMemory as exc:
    oom = str(exc)
lesson.say(f"second 3 MiB under a 4 MiB limit -> AllocatorOutOfMemory: {oom[:150]} ...")
lesson.check("reserved_bytes=4194304" in oom, "the out-of-memory error reports the stats")
small.free(keep)
small.empty_cache()

# %%
# Done: ``empty_cache`` gives every free segment back to the backend.
released = alloc.empty_cache()
lesson.say(f"empty_cache released {released >> 20} MiB; reserved now {alloc.stats()['reserved_bytes']} B")
lesson.check(alloc.stats()["reserved_bytes"] == 0, "everything free went back to the backend")
backend.destroy_queue(main)
lesson.say("done")

# %%
# Common issues: on synchronous queues (the seed's cpu semantics, the simulator) every
# copy has finished before ``free`` returns, so the hazard never shows -- and a missing
# ``record_stream`` goes unnoticed until it runs on a GPU.  Test on threaded queues.
