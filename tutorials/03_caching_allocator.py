"""The caching allocator and record_stream
=========================================

What it does: allocates and frees device memory through vtnumba's stream-ordered caching
allocator -- size classes, segments, splitting, per-queue reuse -- and then breaks it on
purpose: a copy on a side queue reads a block that the main queue frees and reuses.  You
see the corrupted bytes, the hazard checker's message, and ``record_stream`` fixing both.
Last, a step arena and what running out of memory looks like.  Two figures: the segment
map as the blocks are carved, freed and merged, and the timeline of the hazard.

**Builds on:** :doc:`02_async_copies_pinned` (copies that run later than the call).
Next: :doc:`04_matmul_ladder`.

Run it::

    mpiexec -n 2 python tutorials/03_caching_allocator.py            # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/03_caching_allocator.py --target cudasim
    python tutorials/03_caching_allocator.py                         # one rank

Key insight: a caching allocator only knows the queue a block was allocated on.  Freed
memory is reused at once by that queue -- safe, because that queue runs in order -- but
work on *any other* queue is invisible to it, unless you declare it with ``record_stream``.
"""

# %%
# The allocator
# -------------
#
# Every rank runs the same lesson on its own device memory; rank 0 tells it.  The
# allocator sits on top of the target's backend: it asks ``backend.alloc`` for big
# *segments* and hands out *blocks* carved out of them.
import threading
import time

from vtnumba.apps.tutorial import human_bytes, start  # first: it shares the cores before numpy loads BLAS

# isort: split
import numpy as np  # noqa: E402

lesson = start("03 the caching allocator and record_stream")

from vtnumba import CPUBackend, default_backend  # noqa: E402
from vtnumba.memory import (  # noqa: E402
    AllocatorOutOfMemory,
    ArenaOverflowError,
    CachingAllocator,
    StepArena,
    check_hazards,
    hazard_checks_off,
    note_use,
)

backend = default_backend()
main = backend.create_queue("main")
alloc = CachingAllocator(backend)
lesson.say(f"allocator on {backend.name}")
snapshots = []  # (what happened, the segment map right after) -- drawn in a figure below


def snap(what: str, kind: str | None = None) -> None:
    snapshots.append((what, [seg for seg in alloc.segment_map() if kind is None or seg["kind"] == kind]))

# %%
# Size classes and reuse
# ----------------------
#
# A request is rounded up to a multiple of 512 bytes; small requests are
# cut from a 2 MiB segment.  The first allocation is a *miss* (a new segment from the
# backend); after a free, the same size on the same queue is a *hit*: the same address,
# no backend call.
b = alloc.allocate(1000, main)
first_ptr = b.ptr
lesson.say(f"allocate(1000) -> {b.size}-byte block at {b.ptr:#x}; reserved {alloc.stats()['reserved_bytes']} B")
snap("allocate(1000): a 2 MiB small segment, one block")
alloc.free(b)
b = alloc.allocate(1000, main)
s = alloc.stats()
lesson.say(f"free + allocate(1000) again -> {b.ptr:#x}; hits={s['cache_hits']} misses={s['cache_misses']}")
lesson.check(b.ptr == first_ptr and s["cache_hits"] == 1, "same queue, same size: the memory is reused at once")
alloc.free(b)

# %%
# Splitting and coalescing
# ------------------------
#
# Three blocks sit back to back in one segment.  Freeing them
# merges the free neighbours again, so the segment is one free piece -- ready for a large
# request.  ``segment_map()`` shows the layout (offset:size:state).
blocks = [alloc.allocate(n, main) for n in (4096, 100, 70_000)]


def layout():
    return "; ".join(" ".join(f"{p['offset']}:{p['size']}:{p['state']}" for p in seg["pieces"])
                     for seg in alloc.segment_map())


lesson.say(f"three live blocks: {layout()}")
snap("three live blocks: 4096, 100 and 70,000 bytes")
alloc.free(blocks[1])
snap("the middle one freed: a hole between two live blocks")
for blk in (blocks[0], blocks[2]):
    alloc.free(blk)
lesson.say(f"after freeing them: {layout()}")
snap("all three freed: the free neighbours merged into one piece")
lesson.check(len(alloc.segment_map()[0]["pieces"]) == 1, "free neighbours coalesce into one piece")

# Large requests (>= 1 MiB) get segments rounded to 2 MiB; a bigger cached piece is split.
big = alloc.allocate(8 << 20, main)
alloc.free(big)
part = alloc.allocate(3 << 20, main)
snap("8 MiB freed, then 3 MiB asked: the cached 8 MiB piece is split", kind="large")
s = alloc.stats()
lesson.say(f"8 MiB freed, then 3 MiB asked: served from the cached 8 MiB piece (hit), splits={s['splits']}, "
           f"reserved={s['reserved_bytes'] >> 20} MiB")
lesson.check(s["reserved_bytes"] == (8 << 20) + (2 << 20), "the 3 MiB block came out of the cached 8 MiB segment")

COLORS = {"live": "#2ca02c", "free": "#d9d9d9", "waiting": "#ff7f0e"}


def draw_segments(plt):
    rows = [(what, seg) for what, segs in snapshots for seg in segs]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.2))
    for y, (what, seg) in enumerate(rows):
        # A schematic, not to scale: every piece gets at least a tenth of the bar, so that a
        # 512-byte block next to a 2 MiB free rest is still visible; the labels give sizes.
        widths = [max(piece["size"] / seg["size"], 0.1) for piece in seg["pieces"]]
        left = 0.0
        for piece, width in zip(seg["pieces"], widths):
            width /= sum(widths)
            ax.barh(y, width, left=left, height=0.6, color=COLORS[piece["state"]], edgecolor="black", linewidth=0.5)
            ax.text(left + width / 2, y, f"{human_bytes(piece['size'])}\n{piece['state']}", ha="center", va="center",
                    fontsize=6.5)
            left += width
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{what}\n(segment #{seg['segment']}, {human_bytes(seg['size'])}, {seg['kind']})"
                        for what, seg in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.0)
    ax.set_xticks([])
    ax.set_xlabel("the pieces of the segment in address order (widths not to scale)")
    ax.set_title("03: the caching allocator's segments, step by step (rank 0)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return fig


lesson.figure("segments.png", "The segment map after each step of this section: blocks (green) are carved out "
              "of segments, freed pieces (grey) merge with free neighbours, and a large cached piece is split "
              "for a smaller large request.", draw_segments)

# %%
# A block is a buffer
# -------------------
#
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
# The hazard
# ----------
#
# This needs queues that really run in the background, so it uses the
# threaded cpu backend whatever the target (each queue is a worker thread).  The scenario
# is the one vLLM's encoder-cache worker (``ECCPUWorker``, see :doc:`../origins`) guards
# against: main writes an "embedding" into a block; a copy on a side queue will read it
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
    time.sleep(0.005)                              # (so that the timeline shows the side queue held)
    gate.set()                                     # now let the side copy run
    hz.synchronize(q_side)
    halloc.free(again)
    return out, waiting


def show(a):
    return " ".join(f"{v:#04x}" for v in a[:4]) + " ..."


with hazard_checks_off():  # (even if VTNUMBA_CHECK_HAZARDS is set: we want to see the damage)
    with lesson.timeline("hazard.png",
                         "The hazard on each rank's threaded queues.  The side queue's copy is held at a gate "
                         "(green) while the main queue frees the block, allocates the same memory again and "
                         "memsets it (blue); when the gate opens, the side copy reads the new owner's bytes.",
                         title="03: a copy on a side queue reads a block the main queue already reused"):
        out, _ = scenario(use_record_stream=False)

lesson.say(f"without record_stream, checker off: the side copy read {show(out)} "
           f"(the embedding was {OLD:#04x}; {NEW:#04x} is what main wrote after reusing the memory)")
lesson.check((out == NEW).all(), "the hazard is real: the copy read the new owner's bytes")

# %%
# The checker
# -----------
#
# ``check_hazards("record")`` (or ``VTNUMBA_CHECK_HAZARDS=record``) keeps a
# list instead of raising; the default ``"raise"`` stops at the bad allocation.
with check_hazards("record") as checker:
    out, _ = scenario(use_record_stream=False)
lesson.say("with the checker on, it says:\n    " + checker.reports[0].message)
lesson.check(len(checker.reports) == 1 and "record_stream(block #" in checker.reports[0].message,
             "the checker names the block, the queues and the fix")

# %%
# The fix: record_stream
# ----------------------
#
# With ``record_stream(block, side)`` the free records an event on the side queue; the
# block waits for it (``blocks_waiting_on_events``) and main gets other memory.  Here is
# all of it -- ``record_stream`` only notes the queue, ``free`` records the events:
#
# .. vt-source:: vtnumba.memory.allocator.CachingAllocator.record_stream
#
# .. vt-source:: vtnumba.memory.allocator.CachingAllocator.free
with check_hazards() as checker:
    out, waiting = scenario(use_record_stream=True)
lesson.say(f"with record_stream: side read {show(out)}, {waiting} block waited on its event, "
           f"{len(checker.reports)} hazards")
lesson.check((out == OLD).all() and waiting == 1 and not checker.reports, "record_stream keeps the bytes intact")
hz.close()

# %%
# A step arena
# ------------
#
# One slab, bump allocation at 64-byte-aligned offsets, ``reset()`` once
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
# Out of memory
# -------------
#
# ``limit_bytes`` caps what the allocator may reserve (the cpu backend
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
# Giving memory back
# ------------------
#
# ``empty_cache`` gives every free segment back to the backend.
released = alloc.empty_cache()
lesson.say(f"empty_cache released {released >> 20} MiB; reserved now {alloc.stats()['reserved_bytes']} B")
lesson.check(alloc.stats()["reserved_bytes"] == 0, "everything free went back to the backend")
backend.destroy_queue(main)
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * The first ``allocate(1000)`` is a miss that reserves a 2 MiB segment; the second, after
#   a free, is a hit at the same address.
# * The segment figure: three green blocks at the start of one segment, a grey hole after
#   the middle one is freed, one grey piece once all are freed; then an 8 MiB segment whose
#   cached piece is split into a 3 MiB live block and a 5 MiB free rest.
# * Without ``record_stream`` the side copy reads ``0xcd`` (the new owner's bytes); the
#   checker names the block, both queues and the fix; with it, ``0xab`` and one block that
#   waited on its event.  In the hazard timeline the main queue's memset of the reused
#   memory runs while the side queue is still held at its gate.
#
# Common issues
# -------------
#
# * On synchronous queues (the default cpu backend, the simulator) every copy has finished
#   before ``free`` returns, so the hazard never shows -- and a missing ``record_stream``
#   goes unnoticed until it runs on a GPU.  Test on threaded queues, with
#   ``VTNUMBA_CHECK_HAZARDS=raise``.
# * ``record_stream`` after ``free`` raises: the block must still be live.
# * A block that waits on an event of a queue that never gets there (held forever) never
#   returns to the pool; ``empty_cache(wait_s=...)`` polls for a while, then leaves it.
#
# Try next
# --------
#
# 1. In ``scenario``, replace ``halloc.record_stream(block, q_side)`` by
#    ``hz.synchronize(q_side)`` before the free.  The bytes are right again -- what does the
#    host lose by waiting, compared with recording an event?
# 2. Allocate 600 KiB, 700 KiB and 800 KiB on ``main`` and draw the segment map again: which
#    requests share a small segment, and which get their own?
