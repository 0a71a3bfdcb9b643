"""Async copies and pinned memory
===============================

What it does: moves data host -> device -> host with asynchronous copies on two queues,
then splits the work into chunks and runs a three-queue pipeline -- copy in, compute,
copy out -- in which the copies of one chunk overlap the compute of another.  Last, what
"asynchronous" obliges you to do: keep the source alive and unchanged until the queue has
passed the copy.

**Builds on:** :doc:`01_devices_queues_events` (queues, and events that order them).
Next: :doc:`03_caching_allocator`.

Run it::

    mpiexec -n 2 python tutorials/02_async_copies_pinned.py [--target cpu|cudasim|cuda]

Key insight: a copy call returns before the bytes have moved.  Only an event (or a
synchronize) tells you they have.  Pinned (page-locked) host memory is what lets a GPU
copy engine run the copy on its own, while the GPU computes -- so copies and kernels on
different queues overlap.
"""

# %%
# Buffers
# -------
#
# The target's backend (threaded queues on cpu, so that copies really run in the
# background), a pinned staging buffer per direction, and a device buffer.
from vtnumba.apps.tutorial import human_bytes, start  # first: it shares the cores between ranks before numpy loads BLAS

# isort: split
import numpy as np  # noqa: E402

lesson = start("02 async copies and pinned memory")

from vtnumba import CPUBackend, default_backend  # noqa: E402
from vtnumba.kernels import fused_add_rms_norm  # noqa: E402

backend = CPUBackend(threaded=True) if lesson.target == "cpu" else default_backend()
H = 256 if lesson.target == "cudasim" else 1024   # float32 values per row
ROWS = 16 if lesson.target == "cudasim" else 4096  # the simulator runs thousands of CUDA threads a second
n, nbytes = ROWS * H, ROWS * H * 4
h2d_q, d2h_q = backend.create_queue("h2d"), backend.create_queue("d2h")
pinned_in, pinned_out = backend.alloc_pinned(nbytes), backend.alloc_pinned(nbytes)
dev = backend.alloc(nbytes)
lesson.say(f"pinned buffers: {pinned_in}, {pinned_out}; device buffer: {dev}")

# %%
# A round trip, timed with events
# -------------------------------
#
# Fill the pinned input, copy it to the device on the h2d queue, and time it with two
# events.  The copy call returns at once; the events tell us when it really ran.  What a
# copy call does is small -- it puts the copy on the queue (cpu) or hands it to the
# stream (a GPU's copy engine then moves the bytes on its own):
#
# .. vt-source:: vtnumba.backend.cpu.CPUBackend._copy
#
# .. vt-source:: vtnumba.backend.cuda.CUDABackend._copy
#
# The d2h queue must not read the device buffer before the h2d copy finished: it waits
# on ``t1``.  Then it copies back into the second pinned buffer.
#
# One thing first.  On the cpu target "device memory" is host memory, and the OS maps a
# fresh allocation lazily: the first touch of each 4 KiB page is a page fault, a few
# microseconds each -- 4,096 of them in 16 MiB, more than the copy itself.  Pinned buffers
# are resident from the start (the backend touches every page when it allocates them, as
# a GPU driver maps page-locked memory); the device buffer is set once with ``memset``, so
# that the copy below measures the copy.  (A GPU's device memory has no such cost.)
backend.memset(h2d_q, dev, 0, nbytes)
backend.synchronize(h2d_q)
rng = np.random.default_rng(100 + lesson.rank)
data = rng.standard_normal(n).astype(np.float32)
pinned_in.view(np.float32)[:] = data
t0, t1, t2 = (backend.create_event() for _ in range(3))
backend.record_event(t0, h2d_q)
backend.copy(h2d_q, dev, pinned_in, nbytes)
backend.record_event(t1, h2d_q)
backend.queue_wait_event(d2h_q, t1)
backend.copy(d2h_q, pinned_out, dev, nbytes)
backend.record_event(t2, d2h_q)
backend.synchronize_event(t2)
h2d_ms, total_ms = backend.elapsed_ms(t0, t1), backend.elapsed_ms(t0, t2)
gbs = nbytes / (h2d_ms / 1e3) / 1e9 if h2d_ms > 0 else float("inf")
lesson.say(f"H2D {human_bytes(nbytes)} in {h2d_ms:.3f} ms ({gbs:.1f} GB/s); round trip {total_ms:.3f} ms"
           f"{lesson.sim_note}")
lesson.check(np.array_equal(pinned_out.view(np.float32), data), "round trip is byte-exact")

# %%
# A pipeline that overlaps copies with compute
# --------------------------------------------
#
# Split the rows into chunks.  Chunk i goes through three queues: the h2d queue copies it
# in, the compute queue normalises its rows (``fused_add_rms_norm``, the kernel of
# :doc:`05_fused_add_rmsnorm`), the d2h queue copies the result out.  Per chunk, two
# events order the three steps; nothing orders *different* chunks across queues, so while
# the compute queue works on chunk i the h2d queue already copies chunk i+1 and the d2h
# queue copies chunk i-1 out.  The host only queues work and waits once, at the end.
CHUNKS = 4
rows_per = ROWS // CHUNKS
compute_q = backend.create_queue("compute")
y_buf, z_buf, w_buf = backend.alloc(nbytes), backend.alloc(nbytes), backend.alloc(H * 4)
weight = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
backend.copy(compute_q, w_buf, weight, weight.nbytes)
x_rows, y_rows, z_rows = (b.view(np.float32, (ROWS, H)) for b in (dev, y_buf, z_buf))
w_dev = w_buf.view(np.float32, (H,))
for buf in (y_buf, z_buf):  # their first touch, here, not inside the pipeline (see above)
    backend.memset(compute_q, buf, 0, nbytes)
fused_add_rms_norm(x_rows[:1], None, w_dev, 1e-6, out=y_rows[:1], new_residual=z_rows[:1], queue=compute_q)
# (x still holds the round trip's copy of the same data: cleared, a chunk the norm read
# before its copy landed would show in the check below.)
backend.memset(compute_q, dev, 0, nbytes)
backend.synchronize(compute_q)  # a warm-up call: the first one loads (or compiles) the kernel
copied, computed = [backend.create_event() for _ in range(CHUNKS)], [backend.create_event() for _ in range(CHUNKS)]
with lesson.timeline("pipeline.png",
                     f"The chunk pipeline on each rank: {CHUNKS} chunks of {rows_per} rows.  Copies (blue) on the "
                     "h2d and d2h queues overlap the normalisation (green) on the compute queue; each arrow joins "
                     "an event record to the wait it released.",
                     title=f"02: copy in -> compute -> copy out, {CHUNKS} chunks on three queues"):
    for i in range(CHUNKS):
        lo, hi = i * rows_per, (i + 1) * rows_per
        off, size = lo * H * 4, rows_per * H * 4
        backend.copy(h2d_q, dev, pinned_in, size, dst_offset=off, src_offset=off)
        backend.record_event(copied[i], h2d_q)
        backend.queue_wait_event(compute_q, copied[i])
        fused_add_rms_norm(x_rows[lo:hi], None, w_dev, 1e-6, out=y_rows[lo:hi], new_residual=z_rows[lo:hi],
                           queue=compute_q)
        backend.record_event(computed[i], compute_q)
        backend.queue_wait_event(d2h_q, computed[i])
        backend.copy(d2h_q, pinned_out, y_buf, size, dst_offset=off, src_offset=off)
    backend.synchronize(d2h_q)
rows64 = data.reshape(ROWS, H).astype(np.float64)
want = rows64 / np.sqrt((rows64 ** 2).mean(-1, keepdims=True) + 1e-6) * weight
err = float(np.max(np.abs(pinned_out.view(np.float32).reshape(ROWS, H) - want)))
lesson.say(f"pipeline of {CHUNKS} chunks: max |result - float64| = {err:.1e}")
lesson.check(err < 1e-4, "every chunk went in, through the norm and out, in order")

# %%
# The hazard of an asynchronous copy
# ----------------------------------
#
# Overwrite the *source* of an asynchronous copy before the queue ran it, and the copy
# moves the new bytes, not the ones you meant.  On threaded queues we can hold the copy
# behind a gate to make the race deterministic.
import threading  # noqa: E402

if backend.supports_aux_stream() and lesson.target == "cpu":
    gate = threading.Event()
    backend.launch_host_func(h2d_q, gate.wait)
    backend.copy(h2d_q, dev, pinned_in, nbytes)
    pinned_in.view(np.float32)[:] = -1.0  # too early: the copy has not run yet
    gate.set()
    backend.copy(h2d_q, pinned_out, dev, nbytes)
    backend.synchronize(h2d_q)
    raced = bool((pinned_out.view(np.float32) == -1.0).all())
    lesson.say(f"source overwritten before the copy ran -> device got the new bytes: {raced}")
    lesson.check(raced, "the race is real: wait for the copy's event before reusing its source")

for e in [t0, t1, t2] + copied + computed:
    backend.destroy_event(e)
backend.free_pinned(pinned_in)
backend.free_pinned(pinned_out)
for b in (dev, y_buf, z_buf, w_buf):
    backend.free(b)
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * A round trip that is byte-exact; on ``cpu`` the "GB/s" is a host memcpy's speed, on a
#   GPU the PCIe or NVLink rate, on ``cudasim`` a number that means nothing (labelled so).
# * The pipeline timeline: a staircase.  On each rank, chunk i's copy-in (h2d row) ends
#   where an arrow leads to the compute queue's wait; the compute of chunk i runs while the
#   h2d queue is already copying chunk i+1.  The host's ``synchronize`` (bottom row) spans
#   the whole pipeline: the host queued everything up front and waited once.
# * ``source overwritten before the copy ran -> device got the new bytes: True``.
#
# Common issues
# -------------
#
# * No overlap in the picture: the queues are synchronous (the default cpu backend, or the
#   simulator), so each operation finishes before the next is queued.  This lesson uses
#   ``CPUBackend(threaded=True)`` on cpu for that reason.
# * A first copy many times slower than a memcpy on the cpu target: it is paying the page
#   faults of memory nobody touched before (see the first section) -- touch fresh buffers
#   once before timing anything.
# * On a GPU a copy from *pageable* (not pinned) host memory is staged through a driver
#   buffer and may not overlap anything; use ``alloc_pinned`` for buffers you copy often.
# * Freeing or refilling a host buffer right after ``copy`` returns: the copy may not have
#   run yet.  Wait for an event recorded after the copy first.
#
# Try next
# --------
#
# 1. Change ``CHUNKS`` to 1 and to 16.  With one chunk nothing overlaps; with many, each
#    copy is small and the per-operation cost starts to show between the bars.
# 2. Remove ``backend.queue_wait_event(compute_q, copied[i])``: the check fails on some
#    runs, because the norm may read a chunk before it was copied in.
