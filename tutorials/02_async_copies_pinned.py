"""Async copies and pinned memory
===============================

What it does: moves data host -> device -> host with asynchronous copies on two queues,
overlapping a copy with compute, and shows what "asynchronous" obliges you to do: keep
the source alive and unchanged until the queue has passed the copy.

Run it::

    mpiexec -n 2 python tutorials/02_async_copies_pinned.py [--target cpu|cudasim|cuda]

Key insight: a copy call returns before the bytes have moved.  Only an event (or a
synchronize) tells you they have.  Pinned (page-locked) host memory is what lets a GPU
copy engine run the copy on its own, while the GPU computes.
"""

# %%
# Set up: the target's backend (threaded queues on cpu so that copies really run in the
# background), a pinned staging buffer per direction, and a device buffer.
from vtnumba.apps.tutorial import start  # first: it shares the cores between ranks before numpy loads BLAS

import numpy as np  # noqa: E402

lesson = start("02 async copies and pinned memory")

from vtnumba import CPUBackend, default_backend  # noqa: E402

backend = CPUBackend(threaded=True) if lesson.target == "cpu" else default_backend()
n = 4096 if lesson.target == "cudasim" else 1 << 22  # float32 elements
nbytes = n * 4
h2d_q, d2h_q = backend.create_queue("h2d"), backend.create_queue("d2h")
pinned_in, pinned_out = backend.alloc_pinned(nbytes), backend.alloc_pinned(nbytes)
dev = backend.alloc(nbytes)
lesson.say(f"pinned buffers: {pinned_in}, {pinned_out}; device buffer: {dev}")

# %%
# Fill the pinned input, copy it to the device on the h2d queue, and time it with two
# events.  The copy call returns at once; the events tell us when it really ran.
rng = np.random.default_rng(100 + lesson.rank)
data = rng.standard_normal(n).astype(np.float32)
pinned_in.view(np.float32)[:] = data
t0, t1, t2 = (backend.create_event() for _ in range(3))
backend.record_event(t0, h2d_q)
backend.copy(h2d_q, dev, pinned_in, nbytes)
backend.record_event(t1, h2d_q)

# %%
# The d2h queue must not read the device buffer before the h2d copy finished: it waits
# on ``t1``.  Then it copies back into the second pinned buffer.
backend.queue_wait_event(d2h_q, t1)
backend.copy(d2h_q, pinned_out, dev, nbytes)
backend.record_event(t2, d2h_q)
backend.synchronize_event(t2)
h2d_ms, total_ms = backend.elapsed_ms(t0, t1), backend.elapsed_ms(t0, t2)
gbs = nbytes / (h2d_ms / 1e3) / 1e9 if h2d_ms > 0 else float("inf")
lesson.say(f"H2D {nbytes / 2**20:.1f} MiB in {h2d_ms:.3f} ms ({gbs:.1f} GB/s); round trip {total_ms:.3f} ms")
lesson.check(np.array_equal(pinned_out.view(np.float32), data), "round trip is byte-exact")

# %%
# The hazard: overwrite the *source* of an asynchronous copy before the queue ran it,
# and the copy moves the new bytes, not the ones you meant.  On threaded queues we can
# hold the copy behind a gate to make the race deterministic.
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

for e in (t0, t1, t2):
    backend.destroy_event(e)
backend.free_pinned(pinned_in)
backend.free_pinned(pinned_out)
backend.free(dev)
lesson.say("done")
