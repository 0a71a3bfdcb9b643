"""Devices, queues and events
===========================

What it does: meets the :class:`~vtnumba.backend.Backend` seam -- the one interface an
inference engine uses to talk to a device -- and shows why work is submitted to *queues*
and ordered with *events*.  You hold a queue at a gate and watch an event stay
incomplete behind it; then a consumer queue waits for a producer queue's event, and the
timeline shows the arrow from the recording to the wait it released.

**Builds on:** :doc:`../getting_started` (installing vtnumba and choosing a target).
Next: :doc:`02_async_copies_pinned`.

Run it::

    mpiexec -n 2 python tutorials/01_devices_queues_events.py            # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/01_devices_queues_events.py --target cudasim

Key insight: a queue runs its own work in order, two queues run in no particular order,
and an event recorded on one queue is how another queue (or the host) learns that the
work before it has finished.
"""

# %%
# The backend of the target
# -------------------------
#
# Every rank chooses the target first -- before anything imports ``numba.cuda`` -- and
# then asks the registry for the backend that serves the target's default device.
import threading
import time

from vtnumba.apps.tutorial import start  # first: it shares the cores between ranks before numpy loads BLAS

# isort: split
import numpy as np  # noqa: E402

lesson = start("01 devices, queues and events")

from vtnumba import CPUBackend, Device, DeviceType, default_backend, get_backend, try_get_backend  # noqa: E402

backend = default_backend()
lesson.say(f"default backend: {backend.name} on device {backend.device}")
lesson.say(f"  unified memory: {backend.unified_memory()}, compute capability: {backend.device_capability()}")
lesson.say(f"  registry lookup by type gives the same backend: {get_backend(backend.device.type) is backend}")
lesson.say(f"  a device nobody registered: try_get_backend(cuda:7) -> "
           f"{try_get_backend(Device(DeviceType.CUDA, 7))}")
lesson.check(get_backend(backend.device) is backend, "registry by device and by type agree")

# %%
# A queue, held at a gate
# -----------------------
#
# A *queue* is an ordered stream of work.  The default cpu backend runs work the moment
# it is submitted (synchronous queues); a *threaded* cpu backend gives
# every queue its own worker thread, which is how a GPU stream behaves.  Here is all of
# a threaded queue -- operations go into a FIFO, and one worker thread runs them one
# after another:
#
# .. vt-source:: vtnumba.backend.cpu._CPUQueue.put
#
# .. vt-source:: vtnumba.backend.cpu._work
#
# We use the threaded backend to *see* ordering: we hold a queue at a gate (a host
# function that waits) and look at an event recorded behind it.  ``query_event`` never
# blocks; ``synchronize_event`` does.
if lesson.target == "cpu":
    backend = CPUBackend(threaded=True)
q = backend.create_queue("work")
gate = threading.Event()
before, after = backend.create_event(), backend.create_event()
can_hold = backend.supports_aux_stream()
backend.record_event(before, q)
if can_hold:
    backend.launch_host_func(q, gate.wait, name="gate")
buf = backend.alloc(1 << 20)
backend.memset(q, buf, 0x5A)
backend.record_event(after, q)
held = backend.query_event(after)  # never blocks
if can_hold:
    lesson.say(f"event behind the gate complete? {held}  (False means the queue is really still busy)")
else:  # (the simulator runs each operation as it is queued: there is no gate to hold a queue at)
    lesson.say(f"event complete? {held}  ({backend.name}'s queues run each operation at once: nothing to hold)")
gate.set()
backend.synchronize_event(after)
lesson.say(f"after opening the gate: complete? {backend.query_event(after)}; "
           f"memset took {backend.elapsed_ms(before, after):.3f} ms including the wait{lesson.sim_note}")
if can_hold:
    lesson.check(not held, "query_event is False while the queue is held")
else:
    lesson.check(held, "query_event is True at once: synchronous queues finish as they are given work")
lesson.check(backend.query_event(after), "query_event is True once the queue passed the event")

# %%
# A producer and a consumer, ordered by an event
# ----------------------------------------------
#
# Two queues: the producer writes a buffer, the consumer reads it.  Without an ordering
# the consumer might read before the producer wrote.  ``queue_wait_event(consumer, e)``
# makes all *later* work on the consumer wait for the event as recorded *now*.  On the
# cpu backend an event is a flag that the producer's worker sets when it reaches the
# recording, and the wait is a queue operation that blocks the consumer's worker until
# then:
#
# .. vt-source:: vtnumba.backend.cpu.CPUBackend._record_event
#
# .. vt-source:: vtnumba.backend.cpu.CPUBackend._queue_wait_event
#
# The producer is slow on purpose (a gate that the host opens 20 ms later), so the
# timeline shows the consumer's wait.
producer, consumer = backend.create_queue("producer"), backend.create_queue("consumer")
rng = np.random.default_rng(lesson.rank)
payload = rng.integers(1, 255, 1 << 20, dtype=np.uint8)
dev = backend.alloc(payload.nbytes)
out = np.zeros_like(payload)
with lesson.timeline("producer_consumer.png",
                     "Rank 0 and rank 1, each with a producer and a consumer queue.  The consumer's "
                     "wait_event (red) lasts until the producer's record_event (purple); the arrow joins "
                     "the recording to the wait it released, and only then does the consumer copy.",
                     title="01: a consumer queue waits for a producer queue's event"):
    gate2 = threading.Event()
    if can_hold:
        backend.launch_host_func(producer, gate2.wait, name="slow producer")
    backend.memset(producer, dev, 0)
    backend.copy(producer, dev, payload, payload.nbytes)
    written = backend.create_event(timing=False)  # it only orders the queues: no timestamp needed
    backend.record_event(written, producer)
    backend.queue_wait_event(consumer, written)
    backend.copy(consumer, out, dev, payload.nbytes)
    time.sleep(0.02)  # the host does other work; both queues stay held meanwhile
    gate2.set()
    backend.synchronize(consumer)
lesson.check(np.array_equal(out, payload), "the consumer read the producer's bytes, not stale ones")

# %%
# Bad input is refused
# --------------------
#
# Bad input is refused with a message that names the argument.  Try it:
try:
    backend.alloc(-1)
except ValueError as exc:
    lesson.say(f"alloc(-1) -> ValueError: {exc}")
backend.destroy_queue(q)
try:
    backend.memset(q, buf, 0)
except RuntimeError as exc:
    lesson.say(f"using a destroyed queue -> RuntimeError: {exc}")
for b in (buf, dev):
    backend.free(b)
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * ``event behind the gate complete? False`` on ``cpu`` (threaded queues), and ``True``
#   after the gate opens.  The memset's time includes the time the queue was held.
# * The timeline: on each rank the consumer's red ``wait_event`` bar starts right away and
#   ends a moment after the producer's purple ``record_event``, about 20 ms later; the
#   consumer's ``copy`` comes after it, never before.  The two ranks run the same lesson
#   side by side, each on its own queues.
# * Every ``check`` line says ``ok``.
#
# Common issues
# -------------
#
# * ``query_event`` always True: you are on synchronous queues (the default cpu backend or
#   the simulator), where every operation has finished when the call returns.  Use
#   ``CPUBackend(threaded=True)`` or ``VTNUMBA_CPU_QUEUES=threaded`` to see real ordering
#   on a laptop.
# * A host function that waits forever (a gate nobody opens) blocks its queue and every
#   queue that waits for an event behind it: ``synchronize`` then never returns.
# * On ``cudasim`` the times printed are simulator times (labelled so); they say nothing
#   about a GPU.
#
# Try next
# --------
#
# 1. Delete the ``queue_wait_event`` line and run again: the check fails (the consumer
#    copies zeros before the producer wrote), and the timeline shows the consumer's copy
#    starting before the producer's.
# 2. Record ``written`` *before* the producer's copy instead of after it.  Which bytes does
#    the consumer read now, and where does the arrow point in the timeline?
