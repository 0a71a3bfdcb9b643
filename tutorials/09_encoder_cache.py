"""The encoder cache: handing embeddings from an encoder process to a prefill process
==================================================================================

What it does: rank 0 plays a multimodal *encoder* that turns inputs (keyed by ``mm_hash``)
into embedding rows; rank 1 plays the *prefill* process that needs those rows.  Instead of
recomputing them, rank 1 copies them out of a block-structured shared-memory region that
rank 0 filled.  On the way you meet each piece of :mod:`vtnumba.ec`: the two endpoints that
own a side each, the region, the scheduler's block cache with eviction and pins, the
worker's batched copies, completions that are reported only when a copy has really
finished, and the exactly-once release of a pin.

**Builds on:** :doc:`02_async_copies_pinned` (batched copies on queues, and events that say
when they are done) and :doc:`03_caching_allocator` (the load buffers' lifetimes).
Next: :doc:`10_running_on_a_gpu`.

Run it::

    mpiexec -n 2 python tutorials/09_encoder_cache.py               # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/09_encoder_cache.py --target cudasim
    mpiexec -n 3 python tutorials/09_encoder_cache.py               # two consumer ranks

Key insight: the bytes never travel through MPI.  Only small control messages do ("this
entry is ready", "pin it for me, I am reading blocks 12..40", "done, unpin it"); the
embeddings move by memcpy into and out of memory both processes map.
"""

# %%
# Setup.  Every rank runs this file; rank 0 narrates.  Rank 0 is the *producer*, every
# other rank a *consumer* (rank 1 leads; more ranks would be its tensor-parallel ranks).
from vtnumba.apps.tutorial import start  # first: it shares the cores between ranks before numpy loads BLAS

import os  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

lesson = start("09 the encoder cache: producer -> consumer through shared memory", min_ranks=2)

from vtnumba import CPUBackend, default_backend  # noqa: E402
from vtnumba.ec import (  # noqa: E402
    ECConnectorMetadata,
    ECConsumer,
    ECProducer,
    ECScheduler,
    ECWorker,
    ECWorkerMetadata,
    EmbeddingCache,
    coalesce_runs,
    open_ec_shared_region,
)
from vtnumba.backend.arrays import to_host  # noqa: E402

comm = lesson.comm.Dup()  # the endpoints' messages get a communicator of their own
rank = lesson.rank
backend = default_backend()
HIDDEN, DTYPE = 64, np.float16          # one block = one row = 64 x 2 bytes
BLOCK = HIDDEN * np.dtype(DTYPE).itemsize
ROWS = {"cat.jpg": 5, "dog.png": 3, "map.gif": 7, "sky.bmp": 4, "sea.jpg": 6}


def embedding(name: str) -> np.ndarray:
    """What the 'encoder' computes for an input -- deterministic, so rank 1 can check it."""
    seed = sum(name.encode())
    return np.random.default_rng(seed).standard_normal((ROWS[name], HIDDEN)).astype(DTYPE)


def files_named(engine_id: str) -> list[str]:
    """Files in /dev/shm whose name mentions this region's engine id."""
    return [f for f in os.listdir("/dev/shm") if engine_id in f]


snapshots: list = []  # (moment, [(mm_hash, state) or None per block]) -- rank 0's view of its region


def snap(moment: str) -> None:
    """Record which entry holds each block of the region now, and in what state."""
    cells = [None] * region.num_blocks
    for name in ROWS:
        entry = ep.cache.lookup(name)
        if entry is not None:
            for block in entry.block_ids:
                cells[block] = (name, entry.state)
    snapshots.append((moment, cells))


# %%
# 1. The endpoints and their region.  ``ECProducer`` creates the region -- room for 16
# rows, less than the 25 rows of all five inputs, so something will have to be evicted --
# with ``memfd_create``: shared memory that never has a name in ``/dev/shm``.  It sends
# each consumer a *handle* (its pid, the descriptor number, the inode); ``ECConsumer``
# opens ``/proc/<pid>/fd/<fd>``, checks it is the announced inode, owned by this user with
# mode 0600, and that the region's header matches its own model config, then says so.
# When every consumer has mapped it, the producer closes its descriptor: nobody else can
# open the region, the mappings live on, and no crash -- not even ``kill -9`` -- can leave
# a file behind, because there is none.  Every message has a deadline (``timeout_s``).
if rank == 0:
    ep = ECProducer(comm, hidden_size=HIDDEN, dtype=DTYPE, region_bytes=16 * BLOCK, name="tut", backend=backend,
                    timeout_s=lesson.args.timeout)  # the lesson's --timeout (60 s unless told)
else:
    ep = ECConsumer(comm, hidden_size=HIDDEN, dtype=DTYPE, producer=0, backend=backend, timeout_s=lesson.args.timeout)
region = ep.region
if rank == 0:
    lesson.say(f"{region.label}: blocks {region.blocks.shape} int8 ({region.num_blocks} rows of {HIDDEN} x float16); "
               f"files in /dev/shm for it: {files_named(region.engine_id)}")
    # The header guards against a consumer with another model config.  Try it on a
    # second region of our own (comm=None: everything in this process):
    with ECProducer(hidden_size=HIDDEN, dtype=DTYPE, region_bytes=16 * BLOCK, name="tut") as local:
        try:
            open_ec_shared_region(local.handle, hidden_size=HIDDEN * 2, dtype=DTYPE)
            mismatch = "not detected"
        except ValueError as exc:
            mismatch = "ValueError: " + str(exc).split(": ", 1)[1]  # (after the engine id)
    lesson.say(f"opening it with hidden_size={HIDDEN * 2}: {mismatch}")
    ok = f"hidden_size={HIDDEN * 2}" in mismatch and region.path is None and not files_named(region.engine_id)
else:
    ok = region.path is None
lesson.check(ok, "the region has no name in /dev/shm; a consumer with another model config is refused")

# %%
# 2. The scheduler's block cache (the producer owns it).  Blocks are handed out lowest id
# first, ascending, so an entry's blocks are usually one run.  An entry is *not-ready*
# while its save is in flight, *ready* (evictable, oldest first) once saved, and *pinned*
# while someone reads it.  ``alloc`` evicts only if that makes room -- never in vain:
#
# .. vt-source:: vtnumba.ec.embedding_cache.EmbeddingCache.alloc
if rank == 0:
    demo = EmbeddingCache(8)
    a = demo.alloc("a", 3)
    b = demo.alloc("b", 3)
    demo.mark_ready("a")
    demo.mark_ready("b")
    demo.pin("b")
    none = demo.alloc("c", 6)        # a (3, evictable) + 2 free = 5 < 6: refused, nothing evicted
    a_kept = "a" in demo
    c = demo.alloc("c", 5)           # evicts a: 3 + 2 free = 5
    lesson.say(f"a -> {a.block_ids}, b -> {b.block_ids}; alloc(c, 6) -> {none} (a kept: {a_kept}); "
               f"alloc(c, 5) -> {c.block_ids}, evictions={demo.stats.evictions}, b still there: {'b' in demo}")
    ok = none is None and a_kept and c.block_ids == (0, 1, 2, 6, 7) and "b" in demo and demo.stats.evictions == 1
else:
    ok = True
lesson.check(ok, "pinned entries stay, eviction happens only when it makes room")


# %%
# 3. Saving, in one batched copy.  ``request_save`` allocates one block per row; ``save``
# hands the step's outputs to the producer's worker, which turns every run of consecutive
# blocks into ONE copy descriptor (three arrays: source addresses, destination addresses,
# byte counts) and moves them all with one ``batched_copy`` on a pooled queue -- after the
# compute queue, which produced them.  (On the cpu target's synchronous queues, which would
# run the copy on the spot anyway, the worker runs that one copy itself, without a queue;
# a step with a single save is even copied by ``save_caches``, in the compiled call that
# builds its descriptors.)  The worker checks each output first: its dtype and
# row width must be the region's, and it must fit its blocks (else a ValueError).  Finding
# the runs is a few numpy operations (the worker runs a compiled version of the same split,
# checked against this one in the tests):
#
# .. vt-source:: vtnumba.ec.descriptors.coalesce_runs
def encode(names: list[str]) -> dict:
    """'Run the encoder': each output in device memory, written on the compute queue."""
    outputs = {}
    for name in names:
        buf = backend.alloc(ROWS[name] * BLOCK)
        backend.copy(ep.compute_queue, buf, embedding(name), ROWS[name] * BLOCK)
        outputs[name] = buf.view(DTYPE, (ROWS[name], HIDDEN))
    return outputs


if rank == 0:
    try:
        ep.request_save("bad", 2)
        ep.save({"bad": np.zeros((2, HIDDEN), np.float32)})  # float32 rows into a float16 region
        refused = "accepted!"
    except ValueError as exc:
        refused = f"ValueError: {exc}"
    lesson.say(f"a float32 output for this float16 region: {refused} (its blocks went back: "
               f"{ep.cache.num_free_blocks} of {region.num_blocks} free)")
    first = ["cat.jpg", "dog.png", "map.gif"]
    for name in first:
        ep.request_save(name, ROWS[name])
    runs = sum(len(coalesce_runs(ep.cache.lookup(n).block_ids)[0]) for n in first)
    ep.save(encode(first))
    ready = ep.wait_saves()
    snap("3 entries saved: blocks\nhanded out in order")
    stats = ep.worker.stats["save"]
    lesson.say(f"saved {ready} in {stats['transfers']} batched copy with {stats['descriptors']} descriptors "
               f"(= {runs} block runs)")
    ids = ep.cache.lookup("dog.png").block_array
    ok = ready == first and stats["descriptors"] == runs and "dtype float32" in refused
    ok &= np.array_equal(region.blocks[ids].view(DTYPE), embedding("dog.png"))
else:
    ok = True
lesson.check(ok, "one batched copy per step; the bytes are in the region; a wrong output is refused")

# %%
# 4. "Done" means done.  A completion is reported only after the copy's end event fired.
# With threaded cpu queues we can *hold* the compute queue (a kernel still running) and
# watch: ``build_connector_worker_meta`` says nothing, the region is untouched; open the
# gate and the report arrives -- once.  (A worker of our own on the producer's region.)
# What a poll does with the transfers in flight -- front first, each reported once, its
# queue, events and descriptors recycled at that moment:
#
# .. vt-source:: vtnumba.ec.worker.ECWorker._collect_finished
if rank == 0:
    tq = CPUBackend(threaded=True)
    w2 = ECWorker(region, backend=tq)
    gate = threading.Event()
    src = tq.alloc(BLOCK)
    tq.copy(w2.compute_queue, src, np.full(HIDDEN, 7, DTYPE), BLOCK)
    tq.launch_host_func(w2.compute_queue, lambda: gate.wait(10))
    before = region.blocks[15].copy()
    m = ECConnectorMetadata(saves={"probe": [15]})
    w2.save_caches({"probe": src.view(DTYPE, (1, HIDDEN))}, "probe", m)
    w2.flush_saves()
    early = [w2.build_connector_worker_meta() for _ in range(5)]
    untouched = np.array_equal(region.blocks[15], before)
    gate.set()
    w2.wait()
    late = w2.build_connector_worker_meta()
    again = w2.build_connector_worker_meta()
    lesson.say(f"while the compute queue is held: reports={early[0]}, region untouched={untouched}; "
               f"after: {late}; polled again: {again}")
    ok = all(e is None for e in early) and untouched and late.completed_saves == ["probe"] and again is None
    w2.shutdown()
    tq.close()
else:
    ok = True
lesson.check(ok, "completions are reported only after the copy, each exactly once")

# %%
# 5. Producer -> consumer across processes.  Rank 0 announces what is ready; rank 1 asks
# for it; rank 0 *pins* it (``grant``: it cannot be evicted mid-read) and sends the block
# ids; rank 1's ``load`` copies everything granted with one batched copy into one device
# buffer and returns per-hash views ``[rows, hidden]`` in the model dtype; rank 1 checks
# every byte and tells rank 0 to unpin (``release``).  Then rank 0 encodes two more
# inputs: the region is full, so the oldest ready, unpinned entries are evicted to make
# room -- and an entry that was just read counts as young again (it rejoins the eviction
# queue at the back when unpinned), so the unread ``map.gif`` goes first.
if rank == 0:
    ep.send({"ready": {n: ROWS[n] for n in first}}, what="the ready entries")
    wanted = ep.recv(what="the consumer's request")
    grants = {n: ep.grant(n) for n in wanted}
    snap("2 pinned for rank 1's\nload: not evictable")
    lesson.say(f"rank 1 asked for {wanted}; pinned and granted blocks "
               f"{ {n: f'{ids[0]}..{ids[-1]}' for n, ids in grants.items()} }")
    ep.send(grants, what="the grants")
    released = ep.recv(what="the consumer's releases")
    for n in released:
        ep.release(n)
    more = ["sky.bmp", "sea.jpg"]  # 10 more rows into a 16-row region holding 15
    for name in more:
        ep.request_save(name, ROWS[name])
    ep.save(encode(more))
    ready = ep.wait_saves()
    snap("released, 2 more saved:\nthe oldest evicted")
    kept = [n for n in ROWS if n in ep.cache]
    lesson.say(f"rank 1 released {released}; saved {ready}; evicted {ep.cache.stats.evictions} "
               f"entries (oldest first), the cache now holds {kept}")
    ok = released == ["cat.jpg", "dog.png"] and ep.cache.stats.evictions == 2
    ok &= kept == ["dog.png", "sky.bmp", "sea.jpg"]  # map.gif (oldest), then cat.jpg, were evicted
elif ep.is_leader:
    ready = ep.recv(what="the ready entries")["ready"]
    ep.send(["cat.jpg", "dog.png"], what="this prompt's request")  # it needs two of the three images
    loaded = ep.load(ep.recv(what="the grants"))
    ok = all(np.array_equal(to_host(a).view(np.uint16), embedding(n).view(np.uint16)) for n, a in loaded.items())
    ok &= all(loaded[n].shape == (ROWS[n], HIDDEN) and loaded[n].dtype == DTYPE for n in loaded)
    ep.send(list(loaded), what="the releases")
    # The other consumer ranks (under mpiexec -n 3 or more) loaded the same entries in
    # ep.load: nothing more is coming, so end their serve() -- before the check below,
    # which every rank must reach.
    ep.stop_followers()
else:
    # More consumer ranks: load what rank 1 hands out, until it says stop.
    mine = {}
    served = ep.serve(lambda h, arr: mine.update({h: to_host(arr).copy()}))
    ok = served == 2 and all(np.array_equal(a.view(np.uint16), embedding(h).view(np.uint16)) for h, a in mine.items())
lesson.check(ok, "rank 1 loaded byte-exact copies; room was made by evicting only unpinned entries")


def draw_blocks(plt):
    """One row per moment, one cell per block, coloured by the entry that holds it."""
    colours = dict(zip(ROWS, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(9, 0.8 * len(snapshots) + 1.3))
    for y, (moment, cells) in enumerate(snapshots):
        for block, cell in enumerate(cells):
            name, state = cell if cell else ("", "free")
            ax.add_patch(plt.Rectangle((block, y - 0.35), 0.95, 0.7, facecolor=colours.get(name, "#eeeeee"),
                                       edgecolor="black", linewidth=0.5, hatch="///" if state == "pinned" else None))
            ax.text(block + 0.47, y, f"{name.split('.')[0]}\n{state}" if name else "free", ha="center",
                    va="center", fontsize=6, bbox=dict(boxstyle="round,pad=0.15", facecolor="white", alpha=0.8,
                                                       linewidth=0))
    ax.set_xlim(0, len(snapshots[0][1]))
    ax.set_ylim(len(snapshots) - 0.5, -0.5)
    ax.set_xticks([b + 0.47 for b in range(len(snapshots[0][1]))], range(len(snapshots[0][1])), fontsize=7)
    ax.set_yticks(range(len(snapshots)), [m for m, _ in snapshots], fontsize=7)
    ax.set_xlabel("block id (one block = one embedding row)")
    ax.set_title("09: the region's blocks, entry by entry (rank 0's cache)", fontsize=10)
    return fig


if rank == 0:
    # (Figures are drawn on rank 0 only: the other ranks skip this.)
    lesson.figure("region_blocks.png", "The region's 16 blocks after part 3's save, during part 5's load and after "
                  "its second save: which entry holds each block, and its state (hatched: pinned).  The second save reuses the evicted entries' blocks, "
                  "so an entry can end up in more than one run of blocks -- and then costs one copy descriptor "
                  "per run.", draw_blocks)

# %%
# 6. Exactly once.  With two consumer tensor-parallel ranks, every rank loads and reports
# the same transfer id; the pin is released when the *second* report arrives -- and a
# replayed report must not release it again (it would unpin someone else's read).
if rank == 0:
    both = ECScheduler("both", 8, expected_load_reports=2)
    both.request_save("x", 2)
    both.build_connector_meta()
    both.update_connector_output(ECWorkerMetadata(completed_saves=["x"]))
    tid = both.request_load("x")
    both.build_connector_meta()
    steps = [both.update_connector_output(ECWorkerMetadata(completed_loads=[tid])).released for _ in range(3)]
    lesson.say(f"reports 1, 2, 3 (a replay) of transfer {tid} released: {steps}; "
               f"stale reports ignored: {both.stats['stale_reports']}")
    ok = steps == [[], ["x"], []] and not both.cache.lookup("x").pinned
else:
    ok = True
lesson.check(ok, "a pin is released exactly once")

# %%
# Cleanup: each endpoint drains its worker and unmaps the region (the consumer leader
# first tells its other ranks to stop).  The memory goes away with the last mapping; there
# never was a file to remove.
engine_id = region.engine_id
ep.close()
lesson.check(not files_named(engine_id), "nothing of ours in /dev/shm")
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * The region is *anonymous*: ``files in /dev/shm for it: []``; opening it with another
#   ``hidden_size`` is refused with a ``ValueError`` naming both configs.
# * ``alloc(c, 6) -> None (a kept: True)``, then ``alloc(c, 5) -> (0, 1, 2, 6, 7)`` with one
#   eviction: the pinned ``b`` stays.
# * A float32 output is refused (``has dtype float32; the region holds float16 rows``) and
#   its blocks go back (16 of 16 free); three entries are then saved in ONE batched copy
#   with 3 descriptors, one per block run.
# * While the compute queue is held: ``reports=None, region untouched=True``; after it:
#   ``completed_saves=['probe']`` once, then ``None``.
# * Rank 1 asks for two entries, gets them pinned and granted, loads them byte-exact and
#   releases them; the next two saves evict ``map.gif`` and ``cat.jpg``, and the cache holds
#   ``['dog.png', 'sky.bmp', 'sea.jpg']``.
# * The figure: the first save hands out blocks 0..14 in order; the load pins ``cat`` and
#   ``dog`` (hatched); after the second save ``sky`` sits in ``map``'s old blocks 8..11 and
#   ``sea`` in two runs, 0..4 (``cat``'s) and 12 -- two descriptors for one entry.
# * ``released: [[], ['x'], []]`` with one stale report ignored; every check says ``ok``.
#
# Common issues
# -------------
#
# * ``this lesson needs 2 or more processes, got 1``: run it under ``mpiexec -n 2`` (or more: every rank
#   after rank 1 is another consumer rank and loads each entry too).
# * ``ChannelTimeout: rank R gave up waiting for rank P after 60 s``: a rank stopped
#   answering (or was stopped in a debugger for longer than the endpoints' ``timeout_s``);
#   the message names the rank and what was awaited.  The endpoints take the lesson's
#   ``--timeout`` (60 s unless told).
# * ``has dtype ...; the region holds ...`` or ``has shape ...; expected [rows, hidden]``:
#   the producer's outputs must be the region's dtype and row width -- the consumer reads
#   the raw bytes back as exactly that.
# * With ``--target cudasim`` the outputs and the loaded views are simulated device arrays
#   (``to_host`` reads them back) and the copies run under the simulator's launch lock; the
#   lesson prints no timings, so nothing here measures the simulator's speed.
# * A ``vtnumba`` file left in ``/dev/shm`` is not this lesson's region, which never has a
#   name there (:doc:`../troubleshooting` says which programs can leave one).
#
# Try next
# --------
#
# 1. Give the region room for all 25 rows (``region_bytes=25 * BLOCK``): which evictions in
#    part 5 disappear, and what does ``ep.cache.stats`` say?  (Part 5's check then fails:
#    it expects two evictions -- change what it expects.)
# 2. Pin ``map.gif`` on rank 0 before the second save (``ep.grant("map.gif")``): which entry
#    is evicted instead -- and what happens if nothing evictable is left?
# 3. Run ``mpi/ec_disagg.py`` under ``mpiexec -n 3`` and read its per-step report: the same
#    pieces as here, with many steps, eviction under load and a throughput figure.
