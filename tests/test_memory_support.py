"""Helpers shared by the memory tests (this file holds no tests).

* :func:`make_backend` -- the backends every core memory test runs on: sync and threaded
  cpu, and the device target (numba's simulator, or the GPU under ``VTNUMBA_TARGET=cuda``);
* :func:`read` / :func:`write` -- a block's or view's bytes to and from the host, through
  the backend (a GPU's memory cannot be read in place; copies work on every backend);
* :class:`Holder` -- keeps a queue "still running", so events recorded behind it stay
  incomplete.  On threaded cpu queues that is real: a host function waits at a gate on
  the queue's thread.  On a real GPU it is real too: the stream waits on a flag word
  (``wait_value32``) that release raises from another queue.  Synchronous backends (seed
  cpu, the simulator) finish every operation before returning, so there the holder
  *emulates* a lagging GPU stream: ``query_event`` answers False for events recorded on
  the held queue until release.
"""

import threading

import numpy as np

from vtnumba.backend import CPUBackend

KINDS = ["cpu", "cpu-threaded", "device"]


def make_backend(kind, device_backend_factory):
    """A backend of ``kind``; "device" comes from conftest's ``device_backend_factory`` fixture."""
    if kind == "cpu":
        return CPUBackend()
    if kind == "cpu-threaded":
        return CPUBackend(threaded=True)
    return device_backend_factory()


def read(backend, arr) -> np.ndarray:
    """``arr``'s contents as numpy (in place where the host can read it, else a copy)."""
    return backend.to_host(arr)


def write(backend, arr, values) -> None:
    """Store ``values`` (broadcast to ``arr``'s shape) into ``arr`` in place, like a kernel would."""
    src = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=arr.dtype), arr.shape))
    q = backend.create_queue("write")
    backend.copy(q, arr, src, src.nbytes)
    backend.synchronize(q)
    backend.destroy_queue(q)


class Holder:
    def __init__(self, backend):
        self.backend = backend
        self.threaded = getattr(backend, "threaded", False)
        # A real GPU's streams run on their own: hold them on a flag word in device memory.
        self.on_device = not self.threaded and backend.capabilities.async_queues
        self._gates: list[threading.Event] = []
        self._held: set[int] = set()        # queue ids (emulated mode)
        self._pending: set[int] = set()     # event ids recorded on held queues (emulated mode)
        if self.on_device:
            self._word = backend.asarray(np.zeros(1, np.uint32))
            self._opener = backend.create_queue("test-gate")
            self._epoch = 1  # what held queues wait for; raised by release
        elif not self.threaded:
            real_record, real_query = backend.record_event, backend._query_event
            real_idle = backend._query_queue

            def record_event(e, q):
                real_record(e, q)
                if q.id in self._held:
                    self._pending.add(e.id)
                else:
                    self._pending.discard(e.id)

            def query(e):
                return e.id not in self._pending and real_query(e)

            def idle(q):  # a held queue has work it has not done (query_queue)
                return q.id not in self._held and real_idle(q)

            backend.record_event = record_event
            backend._query_event = query
            backend._query_queue = idle

    def hold(self, q) -> None:
        if self.on_device:
            self.backend.wait_value32(q, self._word, 0, self._epoch, timeout_s=60)
        elif self.threaded:
            gate = threading.Event()
            self._gates.append(gate)
            self.backend.launch_host_func(q, lambda: gate.wait(10.0), name="test-gate")
        else:
            self._held.add(q.id)

    def release(self) -> None:
        if self.on_device:
            self.backend.write_value32(self._opener, self._word, 0, self._epoch)
            self._epoch += 1
        for gate in self._gates:
            gate.set()
        self._gates.clear()
        self._held.clear()
        self._pending.clear()
        self.backend.synchronize()

    def close(self) -> None:
        self.release()
        if self.on_device:
            self.backend.destroy_queue(self._opener)
        elif not self.threaded:
            for name in ("record_event", "_query_event", "_query_queue"):
                self.backend.__dict__.pop(name, None)
