"""Helpers shared by the memory tests (this file holds no tests).

* :func:`make_backend` -- the backends every core memory test runs on;
* :func:`host_bytes` -- a block's bytes as a numpy array (zero-copy on cpu and simulator);
* :class:`Holder` -- keeps a queue "still running", so events recorded behind it stay
  incomplete.  On threaded cpu queues that is real: a host function waits at a gate on
  the queue's thread.  Synchronous backends (seed cpu, the simulator) finish every
  operation before returning, so there the holder *emulates* a lagging GPU stream:
  ``query_event`` answers False for events recorded on the held queue until release.
"""

import threading

import numpy as np

from vtnumba.backend import CPUBackend

KINDS = ["cpu", "cpu-threaded", "cudasim"]


def make_backend(kind):
    if kind == "cpu":
        return CPUBackend()
    if kind == "cpu-threaded":
        return CPUBackend(threaded=True)
    from vtnumba.backend.cuda import CUDABackend

    return CUDABackend()


def host_bytes(arr) -> np.ndarray:
    """The host numpy array behind a block's array/view (cpu: itself; simulator: ._ary)."""
    if isinstance(arr, np.ndarray):
        return arr
    from vtnumba.backend.cuda import sim_host_view

    return sim_host_view(arr)


class Holder:
    def __init__(self, backend):
        self.backend = backend
        self.threaded = getattr(backend, "threaded", False)
        self._gates: list[threading.Event] = []
        self._held: set[int] = set()        # queue ids (emulated mode)
        self._pending: set[int] = set()     # event ids recorded on held queues (emulated mode)
        if not self.threaded:
            real_record, real_query = backend.record_event, backend._query_event

            def record_event(e, q):
                real_record(e, q)
                if q.id in self._held:
                    self._pending.add(e.id)
                else:
                    self._pending.discard(e.id)

            def query(e):
                return e.id not in self._pending and real_query(e)

            backend.record_event = record_event
            backend._query_event = query

    def hold(self, q) -> None:
        if self.threaded:
            gate = threading.Event()
            self._gates.append(gate)
            self.backend.launch_host_func(q, lambda: gate.wait(10.0), name="test-gate")
        else:
            self._held.add(q.id)

    def release(self) -> None:
        for gate in self._gates:
            gate.set()
        self._gates.clear()
        self._held.clear()
        self._pending.clear()
        self.backend.synchronize()

    def close(self) -> None:
        self.release()
        if not self.threaded:
            for name in ("record_event", "_query_event"):
                self.backend.__dict__.pop(name, None)
