"""The CPU backend: host memory, and queues that are either synchronous or real threads.

vllm.cpp's semantics (``threaded=False``, the default): every queue operation runs at once, on
the calling thread, so an event is complete the moment it is recorded.  Simple, and what
vllm.cpp's CPU backend does -- but it hides every ordering bug, because nothing is ever
"still running".

Threaded mode (``CPUBackend(threaded=True)`` or ``VTNUMBA_CPU_QUEUES=threaded``): each
queue is a worker thread that runs its operations in order.  Events complete when their
queue reaches them, ``query_event`` really can answer False, ``queue_wait_event`` really
blocks the waiting queue, and ``elapsed_ms`` measures real time.  numpy and BLAS release
the GIL for large copies and matmuls, so two queues genuinely overlap.  This is the mode
in which a missing ``record_stream`` or ``queue_wait_event`` shows up without a GPU.
"""

from __future__ import annotations

import mmap
import os
import queue as _queue
import threading
import weakref

import numpy as np

from vtnumba import trace
from vtnumba.backend.atomics import load_acquire, store_release
from vtnumba.backend.base import (Backend, Buffer, Capabilities, Event, EventMark, Queue, add_worker_queue,
                                  remove_worker_queue)
from vtnumba.backend.device import CPU, Device, DeviceType, as_device
from vtnumba.backend.polling import WaitTimeout, poll_until

ALIGNMENT = 64


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """A 1-D uint8 array of ``nbytes`` whose first byte is ``alignment``-aligned."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


def host_bytes(obj, name: str = "array") -> np.ndarray:
    """The bytes of a Buffer or contiguous host array, as a flat uint8 view (no copy)."""
    if isinstance(obj, Buffer):
        return obj.array
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"{name} must be a Buffer or a numpy array on the cpu backend, got {type(obj).__name__}")
    if not obj.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous")
    return obj.reshape(-1).view(np.uint8)


def flag_reached(current: int, value: int) -> bool:
    """CUDA's cyclic ``GEQ`` on 32-bit words: ``(int32)(current - value) >= 0``."""
    return ((int(current) - int(value)) & 0xFFFFFFFF) < 0x80000000


def wait_flag_word(flags: np.ndarray, index: int, value: int, timeout_s: float, who: str) -> None:
    """Poll ``flags[index]`` (acquire loads) until it reaches ``value``; WaitTimeout after ``timeout_s``.

    The host twin of ``cuStreamWaitValue32``: the acquire load keeps every later read of
    this thread after the flag, so data published before the flag is seen.
    """
    poll_until(lambda: flag_reached(load_acquire(flags, index), value), timeout_s,
               lambda waited: f"{who}: waited {waited:.3g} s for flag word {index} to reach {value}; it is "
                              f"{load_acquire(flags, index)}", error=WaitTimeout)


class _CPUEvent(Event):
    def __init__(self, backend, blocking, timing):
        super().__init__(backend, blocking, timing)
        self.mark = EventMark()
        self.mark.fire()  # never recorded = complete, as in CUDA


def _work(ops: _queue.SimpleQueue, queue_ref) -> None:
    """A threaded queue's worker: run its operations in order until told to stop (None)."""
    while True:
        item = ops.get()
        queue = queue_ref() if item is not None else None
        if queue is None:  # stopped, or the queue was dropped without close()
            return
        queue._execute(*item)
        queue._finished_one()
        # Nothing of the queue (or of the work, whose closures may hold buffers) stays
        # referenced while the worker waits for the next operation.
        del item, queue


class _CPUQueue(Queue):
    """A host queue.  In threaded mode it owns a worker thread and a FIFO of operations."""

    def __init__(self, backend, name, threaded: bool):
        super().__init__(backend, name)
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._submitted = 0
        self._completed = 0
        self._ops: _queue.SimpleQueue | None = None
        if threaded:
            self._ops = _queue.SimpleQueue()
            # The worker holds this queue only weakly: a queue (and its backend) dropped without
            # close() is collected, and the finalizer then ends the worker.  A strong reference
            # kept queue, backend and thread alive for the rest of the process.
            self._thread = threading.Thread(target=_work, args=(self._ops, weakref.ref(self)),
                                            name=f"vtnumba-{self.name}", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._ops.put, None)
            add_worker_queue(self)  # (a free anywhere keeps its memory past this queue's work)

    # Work runs either inline (sync mode) or on the worker; both paths trace the same way.
    def _execute(self, name: str, fn, args: dict, marker: bool = False) -> None:
        rec = trace.RECORDER
        t0 = trace.now_ns() if rec is not None else 0
        try:
            # After a failure the queue is poisoned until synchronized: work is skipped, but
            # markers (event records) still fire, so nobody waits forever on an event of a
            # failed queue -- as on a GPU, where a failed stream's events complete with an error.
            if self.error is None or marker:
                fn()
        except BaseException as exc:  # noqa: BLE001 - sticky error, re-raised by synchronize
            self.error = exc
        finally:
            if rec is not None:
                rec.add(name, "queue", f"cpu:{self.name}", t0, trace.now_ns(), args)

    def put(self, name: str, fn, args: dict | None = None, marker: bool = False) -> None:
        if self._ops is None:
            # Synchronous (vllm.cpp's) mode: run now and let errors reach the caller directly.
            if trace.RECORDER is None:
                fn()  # (no span object per operation when nothing records: a fused call queues dozens)
                return
            with trace.span(name, "queue", f"cpu:{self.name}", **(args or {})):
                fn()
            return
        with self._cond:
            self._submitted += 1
        self._ops.put((name, fn, args or {}, marker))

    def _finished_one(self) -> None:
        with self._cond:
            self._completed += 1
            self._cond.notify_all()

    def drain(self) -> None:
        if self._ops is not None:
            if threading.current_thread() is self._thread:
                # A host function of this queue waiting for the queue: it would wait for itself
                # forever.  (A GPU refuses CUDA calls from a host function the same way.)
                raise RuntimeError(f"a host function running on queue {self.name} waited for that same queue; "
                                   "it can only finish after the function returns -- synchronize from outside")
            with self._cond:
                self._cond.wait_for(lambda: self._completed == self._submitted)
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"an operation on queue {self.name} failed: {err!r}") from err

    def busy(self) -> bool:
        with self._cond:
            return self._completed != self._submitted

    def stop(self) -> None:
        if self._ops is not None:
            remove_worker_queue(self)
            self._ops.put(None)
            if threading.current_thread() is not self._thread:  # (the worker itself ends after this op)
                self._thread.join()


def threaded_from_env() -> bool:
    """``VTNUMBA_CPU_QUEUES``: ``sync`` (the default) or ``threaded``; anything else is a
    ValueError naming the variable (a typo silently gave synchronous queues)."""
    value = os.environ.get("VTNUMBA_CPU_QUEUES", "").strip().lower()
    if value not in ("", "sync", "threaded"):
        raise ValueError(f"VTNUMBA_CPU_QUEUES={value!r} is not understood; expected sync or threaded")
    return value == "threaded"


class CPUBackend(Backend):
    """Host memory and host queues (see the module docstring for the two queue modes)."""

    #: Always :attr:`DeviceType.CPU <vtnumba.backend.device.DeviceType.CPU>`.
    device_type = DeviceType.CPU

    def __init__(self, device: Device | str = CPU, threaded: bool | None = None):
        device = as_device(device)  # ("cpu" too, as the registry's functions take it)
        if device.type is not DeviceType.CPU:
            raise ValueError(f"device={device} must be a CPU device for CPUBackend")
        super().__init__(device)
        if threaded is None:
            threaded = threaded_from_env()
        elif not isinstance(threaded, (bool, np.bool_)):  # ("no" would be truthy: threaded queues)
            raise TypeError(f"threaded={threaded!r} must be True, False or None (None: $VTNUMBA_CPU_QUEUES)")
        self.threaded = bool(threaded)
        self._all_queues: dict[int, _CPUQueue] = {}

    @property
    def name(self) -> str:
        """``"CPUBackend"``, or ``"CPUBackend(threaded)"`` when each queue has its own worker thread."""
        return "CPUBackend(threaded)" if self.threaded else "CPUBackend"

    @property
    def capabilities(self) -> Capabilities:
        # Only threaded queues run asynchronously and can overlap; synchronous ones run
        # everything in turn, on the caller's thread.
        return Capabilities(host_addressable=True, simulator=False, kernel_arrays="numpy",
                            async_queues=self.threaded, aux_stream=self.threaded, graph_capture=False,
                            unified_memory=True)

    def device_capability(self) -> tuple[int, int]:
        return (0, 0)

    # ---------------------------------------------------------------- memory
    def _alloc(self, nbytes: int) -> Buffer:
        arr = aligned_empty(nbytes)
        return Buffer(self, self.device, nbytes, arr, ptr=arr.ctypes.data)

    def _alloc_pinned(self, nbytes: int) -> Buffer:
        # Host memory is already "pinned" from the CPU's point of view; a zero-byte request
        # still gets a real (aligned, empty) block that free_pinned accepts.
        arr = aligned_empty(nbytes)
        # Page-locked memory is resident from the start (a GPU driver maps every page when it
        # allocates or registers it); fresh numpy memory is mapped lazily, one page fault per
        # 4 KiB page at its first touch -- which would otherwise land in the first copy.
        arr[::mmap.PAGESIZE] = 0
        return Buffer(self, self.device, nbytes, arr, pinned=True, ptr=arr.ctypes.data)

    def _free(self, buf: Buffer) -> None:
        # numpy frees the memory with the last reference.  (Work still queued on a worker thread
        # may write it by address: Backend.free keeps it until every busy queue has passed.)
        buf._array = None

    def _memset(self, q, buf, value, nbytes, offset) -> None:
        view = buf.array[offset:offset + nbytes]
        q.put("memset", lambda: view.fill(value), {"bytes": nbytes})

    def _copy(self, q, dst, src, nbytes, dst_offset, src_offset) -> None:
        d = host_bytes(dst, "dst")[dst_offset:dst_offset + nbytes]
        s = host_bytes(src, "src")[src_offset:src_offset + nbytes]
        q.put("copy", lambda: np.copyto(d, s), {"bytes": nbytes})

    # ---------------------------------------------------------------- queues
    def _create_queue(self, name, priority) -> Queue:
        q = _CPUQueue(self, name, self.threaded)  # (priority: recorded only -- see create_queue)
        self._all_queues[q.id] = q
        return q

    def _destroy_queue(self, q) -> None:
        self._all_queues.pop(q.id, None)
        q.stop()

    def _synchronize(self, q) -> None:
        rec = trace.RECORDER
        t0 = trace.now_ns() if rec is not None else 0
        q.drain()
        if rec is not None:
            rec.add("synchronize", "host", "host", t0, trace.now_ns(), {"queue": q.name})

    def _synchronize_all(self) -> None:
        # Every queue is drained even when one raises (close() relies on it); the first error
        # is raised after.
        first = None
        for q in list(self._all_queues.values()):
            try:
                q.drain()
            except BaseException as exc:  # (re-raised below, after the other queues)
                first = first or exc
        if first is not None:
            raise first

    def _submit(self, q, fn, name, trace_args) -> None:
        q.put(name, lambda: fn(None), trace_args)

    def _launch_host_func(self, q, fn, name) -> None:
        q.put(name, fn)

    # ---------------------------------------------------------------- flags in queue order
    def _write_value32(self, q, flags, index, value) -> None:
        # The release store orders everything this queue did before it (on its worker thread,
        # or inline) ahead of the flag, for any reader in this or another process.
        q.put("write_value32", lambda: store_release(flags, index, value), {"index": index, "value": value})

    def _wait_value32(self, q, flags, index, value, timeout_s) -> None:
        q.put("wait_value32", lambda: wait_flag_word(flags, index, value, timeout_s, f"queue {q.name}"),
              {"index": index, "value": value})

    # ---------------------------------------------------------------- events
    def _create_event(self, blocking, timing) -> Event:
        return _CPUEvent(self, blocking, timing)

    def _destroy_event(self, e) -> None:
        pass

    def _record_event(self, e, q) -> None:
        mark = EventMark()
        e.mark = mark  # later waits see this recording; earlier waiters keep the old mark
        q.put("record_event", mark.fire, {"event": e.id}, marker=True)

    def _synchronize_event(self, e) -> None:
        e.mark.done.wait()

    def _query_event(self, e) -> bool:
        return e.mark.done.is_set()

    def _query_queue(self, q) -> bool:
        return not q.busy()  # (a synchronous queue ran everything as it was submitted)

    def _queue_wait_event(self, q, e) -> None:
        mark = e.mark  # capture the recording as of now, like cudaStreamWaitEvent
        q.put("wait_event", mark.done.wait, {"event": e.id})

    def _elapsed_ms(self, start, end) -> float:
        start.mark.done.wait()
        end.mark.done.wait()
        return (end.mark.time_ns - start.mark.time_ns) / 1e6

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
        finally:  # (the workers stop even when queued work failed: close() raises that after)
            for q in list(self._all_queues.values()):
                q.stop()
