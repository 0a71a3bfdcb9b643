"""Devices, queues and events
===========================

What it does: meets the :class:`~vtnumba.backend.Backend` seam -- the one interface an
inference engine uses to talk to a device -- and shows why work is submitted to *queues*
and ordered with *events*.

Run it::

    mpiexec -n 2 python tutorials/01_devices_queues_events.py            # cpu target
    mpiexec -n 2 python tutorials/01_devices_queues_events.py --target cudasim

Key insight: a queue runs its own work in order, two queues run in no particular order,
and an event recorded on one queue is how another queue (or the host) learns that the
work before it has finished.
"""

# %%
# Every rank chooses the target first -- before anything imports ``numba.cuda`` -- and
# then asks the registry for the backend that serves the target's default device.
import threading

from vtnumba.apps.tutorial import start  # first: it shares the cores between ranks before numpy loads BLAS

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
# A *queue* is an ordered stream of work.  With the seed's synchronous cpu semantics,
# work runs the moment it is submitted; a threaded cpu backend gives every queue its own
# worker thread, which is what a GPU stream behaves like.  We use the threaded one to
# *see* ordering: we hold a queue at a gate (a host function that waits) and look at an
# event recorded behind it.
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
lesson.say(f"event behind the gate complete? {held}  (False means the queue is really still busy)")
gate.set()
backend.synchronize_event(after)
lesson.say(f"after opening the gate: complete? {backend.query_event(after)}; "
           f"memset took {backend.elapsed_ms(before, after):.3f} ms including the wait")
lesson.check((not held) if can_hold else True, "query_event is False while the queue is held")
lesson.check(backend.query_event(after), "query_event is True once the queue passed the event")

# %%
# Two queues, one producer and one consumer.  Without an ordering, the consumer might
# read the buffer before the producer wrote it.  ``queue_wait_event(consumer, e)`` makes
# all *later* work on the consumer wait for the event as recorded *now*.
producer, consumer = backend.create_queue("producer"), backend.create_queue("consumer")
rng = np.random.default_rng(lesson.rank)
payload = rng.integers(1, 255, 1 << 16, dtype=np.uint8)
dev = backend.alloc(payload.nbytes)
backend.memset(producer, dev, 0)
backend.synchronize(producer)
gate2 = threading.Event()
if can_hold:
    backend.launch_host_func(producer, gate2.wait, name="slow-producer")
backend.copy(producer, dev, payload, payload.nbytes)
written = backend.create_event()
backend.record_event(written, producer)
backend.queue_wait_event(consumer, written)
out = np.zeros_like(payload)
backend.copy(consumer, out, dev, payload.nbytes)
gate2.set()
backend.synchronize(consumer)
lesson.check(np.array_equal(out, payload), "the consumer read the producer's bytes, not stale ones")

# %%
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

# %%
# Common issues: if ``query_event`` is always True, you are on synchronous queues (the
# seed's cpu semantics or the simulator, where every launch finishes before returning).
for b in (buf, dev):
    backend.free(b)
lesson.say("done")
