"""The encoder cache: handing embeddings from an encoder process to a prefill process
==================================================================================

What it does: rank 0 plays a multimodal *encoder* that turns inputs (keyed by ``mm_hash``)
into embedding rows; rank 1 plays the *prefill* process that needs those rows.  Instead of
recomputing them, rank 1 copies them out of a block-structured shared-memory region that
rank 0 filled.  On the way you meet each piece of :mod:`vtnumba.ec`: the region in
``/dev/shm``, the scheduler's block cache with eviction and pins, the worker's batched
copies, completions that are reported only when a copy has really finished, and the
exactly-once release of a pin.

Run it::

    mpiexec -n 2 python tutorials/09_encoder_cache.py               # cpu target
    mpiexec -n 2 python tutorials/09_encoder_cache.py --target cudasim

Key insight: the bytes never travel through MPI.  Only small control messages do ("this
entry is ready", "pin it for me, I am reading blocks 12..40", "done, unpin it"); the
embeddings move by memcpy into and out of memory both processes map.
"""

# %%
# Setup.  Every rank runs this file; rank 0 narrates.  Control messages go through an
# ``ECChannel`` on a duplicated communicator: point-to-point, pickled, every wait with a
# timeout -- so if one side dies, the other gets an error instead of hanging.
import os
import threading
import time

from vtnumba.apps.tutorial import start  # first: it shares the cores between ranks before numpy loads BLAS

import numpy as np  # noqa: E402

lesson = start("09 the encoder cache: producer -> consumer through /dev/shm")
if lesson.size < 2:
    raise SystemExit("this lesson needs two processes: mpiexec -n 2 python tutorials/09_encoder_cache.py")

from vtnumba import CPUBackend, default_backend  # noqa: E402
from vtnumba.ec import (  # noqa: E402
    ECConnectorMetadata,
    ECRegionConfig,
    ECScheduler,
    ECWorker,
    EmbeddingCache,
    coalesce_runs,
    create_ec_shared_region,
)
from vtnumba.ec.channel import ECChannel  # noqa: E402

comm = lesson.comm.Dup()
ch = ECChannel(comm, timeout_s=30)
rank = lesson.rank
backend = default_backend()
HIDDEN, DTYPE = 64, np.float16          # one block = one row = 64 x 2 bytes
ROWS = {"cat.jpg": 5, "dog.png": 3, "map.gif": 7, "sky.bmp": 4, "sea.jpg": 6}


def embedding(name: str) -> np.ndarray:
    """What the 'encoder' computes for an input -- deterministic, so rank 1 can check it."""
    seed = sum(name.encode())
    return np.random.default_rng(seed).standard_normal((ROWS[name], HIDDEN)).astype(DTYPE)


def to_host(arr):
    if isinstance(arr, np.ndarray):
        return arr
    from vtnumba.backend.cuda import sim_host_view

    return sim_host_view(arr) if hasattr(arr, "_ary") else arr.copy_to_host()


# %%
# 1. The region.  Rank 0 *creates* ``/dev/shm/vtnumba_ec_<engine>.mmap`` (mode 0600,
# ``O_EXCL``: a second creator would be refused) with room for 16 rows -- less than the
# 25 rows of all five inputs, so something will have to be evicted.  Rank 1 *opens* it with
# its own model config; the region's header lets it check dtype and hidden size.  Once
# both have mapped it, the creator unlinks the name: the mapping lives on, and now no
# crash can leave a file behind.
engine = comm.bcast(f"tut{os.getpid()}" if rank == 0 else None, root=0)
block = HIDDEN * np.dtype(DTYPE).itemsize
if rank == 0:
    region = create_ec_shared_region(ECRegionConfig(engine_id=engine, hidden_size=HIDDEN, dtype=DTYPE,
                                                    region_bytes=16 * block, create=True))
comm.Barrier()
mismatch = f"hidden_size={HIDDEN * 2}"  # what ranks other than 0 and 1 report
if rank != 0:
    try:  # a consumer with the wrong model config is told so at open time
        create_ec_shared_region(engine_id=engine, hidden_size=HIDDEN * 2, dtype=DTYPE)
        mismatch = "not detected"
    except ValueError as exc:
        mismatch = str(exc).split(": ", 1)[1][:70]
    region = create_ec_shared_region(engine_id=engine, hidden_size=HIDDEN, dtype=DTYPE)
    if rank == 1:
        ch.send(mismatch, 0)
comm.Barrier()
if rank == 0:
    mode = oct(os.stat(region.path).st_mode & 0o777)
    lesson.say(f"region {region.path}: mode {mode}, blocks {region.blocks.shape} int8 "
               f"({region.num_blocks} rows of {HIDDEN} x float16)")
    mismatch = ch.recv(1)
    lesson.say(f"rank 1 opening with hidden_size={HIDDEN * 2}: {mismatch}...")
    region.unlink()
comm.Barrier()
lesson.check(f"hidden_size={HIDDEN * 2}" in mismatch, "a consumer with another model config is refused")
lesson.check(not os.path.exists(region.path), "the name is gone from /dev/shm, the mapping still works")

# %%
# 2. The scheduler's block cache (rank 0 owns it).  Blocks are handed out lowest id
# first, ascending, so an entry's blocks are usually one run.  An entry is *not-ready*
# while its save is in flight, *ready* (evictable, oldest first) once saved, and *pinned*
# while someone reads it.  ``alloc`` evicts only if that makes room -- never in vain.
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
# 3. Saving, in one batched copy.  The producer's scheduler allocates one block per row
# and puts ``mm_hash -> block_ids`` into this step's metadata; its worker turns every run
# of consecutive blocks into ONE copy descriptor (three arrays: source addresses,
# destination addresses, byte counts) and ``flush_saves`` moves them all with one
# ``batched_copy`` on a pooled queue -- after the compute queue, which produced them.
if rank == 0:
    sched = ECScheduler("producer", region.num_blocks)
    worker = ECWorker(region, backend=backend)
    outputs = {}
    for name in ("cat.jpg", "dog.png", "map.gif"):
        sched.request_save(name, ROWS[name])
        buf = backend.alloc(ROWS[name] * block)
        backend.copy(worker.compute_queue, buf, embedding(name), ROWS[name] * block)  # "the encoder ran"
        outputs[name] = buf.view(DTYPE, (ROWS[name], HIDDEN))
    meta = sched.build_connector_meta()
    for name in meta.saves:
        worker.save_caches(outputs, name, meta)
    worker.flush_saves()
    worker.wait()
    update = sched.update_connector_output(worker.build_connector_worker_meta())
    runs = sum(len(coalesce_runs(ids)[0]) for ids in meta.saves.values())
    lesson.say(f"saved {update.ready} in {worker.stats['save']['transfers']} batched copy with "
               f"{worker.stats['save']['descriptors']} descriptors (= {runs} block runs)")
    ok = update.ready == ["cat.jpg", "dog.png", "map.gif"] and worker.stats["save"]["descriptors"] == runs
    ok &= np.array_equal(region.blocks[meta.saves["dog.png"]].view(DTYPE), embedding("dog.png"))
else:
    ok = True
lesson.check(ok, "one batched copy per step; the bytes are in the region")

# %%
# 4. "Done" means done.  A completion is reported only after the copy's end event fired.
# With threaded cpu queues we can *hold* the compute queue (a kernel still running) and
# watch: ``build_connector_worker_meta`` says nothing, the region is untouched; open the
# gate and the report arrives -- once.
if rank == 0:
    tq = CPUBackend(threaded=True)
    w2 = ECWorker(region, backend=tq)
    gate = threading.Event()
    src = tq.alloc(block)
    tq.copy(w2.compute_queue, src, np.full(HIDDEN, 7, DTYPE), block)
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
# for it; rank 0 *pins* it (so it cannot be evicted mid-read) and grants the block ids;
# rank 1 loads everything granted with one batched copy into one device buffer, gets
# per-hash views ``[rows, hidden]`` in the model dtype, checks every byte, and tells rank 0
# to unpin.  Then rank 0 encodes two more inputs: the region is full, so the oldest ready,
# unpinned entries are evicted to make room -- and an entry that was just read counts as
# young again (it rejoins the eviction queue at the back when unpinned), so the unread
# ``map.gif`` goes first.
if rank == 0:
    ch.send({"ready": {n: ROWS[n] for n in ("cat.jpg", "dog.png", "map.gif")}}, 1)
    wanted = ch.recv(1)
    grants = {n: sched.grant_read(n) for n in wanted}
    lesson.say(f"rank 1 asked for {wanted}; pinned and granted blocks "
               f"{ {n: f'{ids[0]}..{ids[-1]}' for n, ids in grants.items()} }")
    ch.send(grants, 1)
    released = ch.recv(1)
    for n in released:
        sched.release_read(n)
    for name in ("sky.bmp", "sea.jpg"):  # 10 more rows into a 16-row region holding 15
        ids = sched.request_save(name, ROWS[name])
        buf = backend.alloc(ROWS[name] * block)
        backend.copy(worker.compute_queue, buf, embedding(name), ROWS[name] * block)
        outputs[name] = buf.view(DTYPE, (ROWS[name], HIDDEN))
    meta = sched.build_connector_meta()
    for name in meta.saves:
        worker.save_caches(outputs, name, meta)
    worker.flush_saves()
    worker.wait()
    update = sched.update_connector_output(worker.build_connector_worker_meta())
    kept = [n for n in ROWS if n in sched.cache]
    lesson.say(f"rank 1 released {released}; saved {update.ready}; evicted {sched.cache.stats.evictions} "
               f"entries (oldest first), the cache now holds {kept}")
    ok = released == ["cat.jpg", "dog.png"] and sched.cache.stats.evictions == 2
    ok &= kept == ["dog.png", "sky.bmp", "sea.jpg"]  # map.gif (oldest), then cat.jpg, were evicted
elif rank == 1:
    consumer = ECScheduler("consumer", region.num_blocks)
    cworker = ECWorker(region, backend=backend)
    ready = ch.recv(0)["ready"]
    ch.send(["cat.jpg", "dog.png"], 0)      # this prompt needs two of the three images
    grants = ch.recv(0)
    for name, ids in grants.items():
        consumer.request_load(name, ids)
    cache = {}
    cworker.start_load_caches(cache, consumer.build_connector_meta())
    cworker.wait()
    update = consumer.update_connector_output(cworker.build_connector_worker_meta())
    ok = all(np.array_equal(to_host(cache[n]).view(np.uint16), embedding(n).view(np.uint16)) for n in grants)
    ok &= all(cache[n].shape == (ROWS[n], HIDDEN) and cache[n].dtype == DTYPE for n in grants)
    ch.send(update.released, 0)
    cworker.shutdown()
else:
    ok = True
lesson.check(ok, "rank 1 loaded byte-exact copies; room was made by evicting only unpinned entries")

# %%
# 6. Exactly once.  With two consumer tensor-parallel ranks, every rank loads and reports
# the same transfer id; the pin is released when the *second* report arrives -- and a
# replayed report must not release it again (it would unpin someone else's read).
if rank == 0:
    from vtnumba.ec import ECWorkerMetadata

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
# Cleanup: workers drain, the creator's cleanup would unlink (already done), everyone
# unmaps.  Nothing of ours is left in /dev/shm.
if rank == 0:
    worker.shutdown()
region.cleanup()
comm.Barrier()
time.sleep(0)
lesson.check(not any(f.startswith(f"vtnumba_ec_{engine}") for f in os.listdir("/dev/shm")),
             "no region file left in /dev/shm")
lesson.say("done")
