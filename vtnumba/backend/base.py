"""The Backend seam: one abstract class every device implements (vllm.cpp: ``vt/backend.h``).

An inference engine talks to hardware through a narrow interface: allocate, copy, make
queues (streams), record and wait on events, capture graphs.  This module defines that
interface with Pythonic names for ``vt::Backend``'s methods, plus the small handle classes it
passes around:

* :class:`Buffer` -- memory returned by ``alloc``/``alloc_pinned``; usable by kernels on its
  target through :meth:`Buffer.view` (a numpy view on cpu, a device array on cuda/cudasim);
* :class:`Queue`  -- an ordered stream of work (a CUDA stream, or a host queue);
* :class:`Event`  -- a marker recorded into a queue; completes when the queue reaches it;
* :class:`GraphHandle` -- a captured sequence of queue work that can be replayed.

Semantics every backend keeps (they are what the comments of ``vt/backend.h`` promise):

* work on one queue runs in submission order; work on two queues is unordered unless a
  ``queue_wait_event`` orders it;
* ``record_event(e, q)`` captures "everything submitted to q so far"; re-recording moves
  the marker; ``query_event`` never blocks; ``synchronize_event`` blocks until it fires;
* an error inside queued work is *sticky*: it is raised by the next ``synchronize`` --
  where work runs after the call that queued it (GPU streams, threaded cpu queues).  A
  synchronous queue (the cpu target's default mode, the simulator) runs the work inside
  that call, so the call itself raises the error, as a plain function would;
* ``write_value32(q, flags, i, v)`` stores ``v`` into a 32-bit flag word once ``q`` gets
  there (after everything before it is visible), and ``wait_value32(q, flags, i, v)`` makes
  later work on ``q`` wait until that word reaches ``v`` -- the stream memory operations a
  GPU uses to order work between processes without the host (see :mod:`vtnumba.dist.queue_flags`).

What a backend *can* do is declared as data, :class:`Capabilities` (``backend.capabilities``):
upper layers ask it -- "can the host read your memory in place?", "is this the simulator?"
-- and never probe types or numba internals themselves.

Validation happens here, at the public boundary, so every backend rejects bad input with
the same clear message naming the argument.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vtnumba import trace
from vtnumba.backend import address_ranges
from vtnumba.backend.arrays import (address_of, byte_span, check_int, check_nbytes, check_seconds, check_shape,
                                    host_view, is_c_contiguous, is_int, numeric_dtype)
from vtnumba.backend.device import Device, DeviceType

_ids = itertools.count(1)
QUEUE_PRIORITIES = ("normal", "high")  # see Backend.create_queue


# Queues whose work runs later on a host thread (threaded cpu queues), of every backend in the
# process.  Their queued work may touch memory *by address* -- a batched copy's descriptors are
# plain integers, and it may address any backend's buffers -- so a free keeps the memory until
# each of them has passed the point of the free (see Backend.free).  A GPU's cuMemFree waits
# for the device the same way.  (A dict of weak references under a lock, not a WeakSet: a
# WeakSet's iteration is Python code, and a queue made or stopped on another thread meanwhile
# raised "Set changed size during iteration" -- inside free, after the memory was dropped.)
_worker_queues: dict[int, "weakref.ref[Queue]"] = {}
_worker_queues_lock = threading.Lock()


def add_worker_queue(q: "Queue") -> None:
    """Count ``q`` (a queue whose work runs later, on a thread of its own) in what a free waits for."""
    with _worker_queues_lock:
        # Entries of queues dropped without stop (their workers have ended) go here, or at the
        # next free -- not from a weak reference's callback: that would run inside garbage
        # collection, perhaps on a thread that holds this very lock.
        _forget_dropped_worker_queues()
        _worker_queues[id(q)] = weakref.ref(q)


def _forget_dropped_worker_queues() -> None:
    """Under ``_worker_queues_lock``: drop the entries whose queues are gone."""
    for key in [k for k, ref in _worker_queues.items() if ref() is None]:
        del _worker_queues[key]


def remove_worker_queue(q: "Queue") -> None:
    """Stop counting ``q`` (it was stopped)."""
    with _worker_queues_lock:
        _worker_queues.pop(id(q), None)


def _keep_past_queued_host_work(memory) -> None:
    """Hold ``memory`` (a freed buffer's array) until every busy worker queue has passed here."""
    with _worker_queues_lock:
        queues = [ref() for ref in _worker_queues.values()]
        if None in queues:  # (queues dropped without stop: their workers have ended)
            _forget_dropped_worker_queues()
    for q in queues:
        if q is not None and q.busy():
            q.put("free (memory kept until here)", lambda _kept=memory: None, marker=True)


# Who wants to hear about every use of memory on a queue (the hazard checker of vtnumba.memory,
# while it is active): ``observer(backend, queue, [(address, nbytes), ...])`` after each copy,
# memset and submit that names the memory it touches.  Empty -- and so free -- otherwise.
_use_observers: list[Callable] = []


def add_use_observer(fn: Callable) -> None:
    """Call ``fn(backend, queue, ranges)`` after every queued use of memory (see :meth:`Backend.submit`)."""
    if fn not in _use_observers:
        _use_observers.append(fn)


def remove_use_observer(fn: Callable) -> None:
    """Stop calling ``fn`` (a no-op if it was not registered)."""
    if fn in _use_observers:
        _use_observers.remove(fn)


def observing_uses() -> bool:
    """Is anyone listening (so that describing a use is worth its cost)?"""
    return bool(_use_observers)


def _range_of(obj, offset: int = 0, nbytes: int | None = None) -> tuple[int, int] | None:
    """(address, nbytes) of a Buffer or array (None where it has no address, e.g. a scalar)."""
    if isinstance(obj, tuple) and len(obj) == 2:
        return int(obj[0]), int(obj[1])
    try:
        start = obj.ptr if isinstance(obj, Buffer) else address_of(obj)
    except (TypeError, ValueError, RuntimeError):
        return None
    size = int(obj.nbytes) - offset if nbytes is None else nbytes
    return int(start) + offset, size


#: Largest value a 32-bit flag word holds; queue flags count epochs well below it (see wait_value32).
FLAG_MAX = (1 << 32) - 1
_UINT32 = np.dtype(np.uint32)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once, so no other layer has to guess from types."""

    #: The host can read and write this backend's memory in place (cpu; numba's simulator, whose
    #: "device" memory is host memory).  False on a real GPU: bytes must be copied to be seen.
    host_addressable: bool
    #: Kernels run in numba's CUDA simulator (one launch at a time, synchronously; times measure
    #: the simulator, not a GPU).
    simulator: bool
    #: The kind of array its kernels take, ``"numpy"`` (host references) or ``"device"`` (numba
    #: device arrays, real or simulated).
    kernel_arrays: str
    #: Queued work may still be running after the call that queued it returned (threaded cpu
    #: queues, GPU streams); False means every queue runs its work at once, on the caller's thread.
    async_queues: bool
    #: Work on a second queue can overlap work on the first.
    aux_stream: bool
    #: ``begin_capture``/``end_capture``/``replay`` are available (only on a real GPU).
    graph_capture: bool
    #: Host and device share one address space (no copies needed).
    unified_memory: bool


class Buffer:
    """A block of memory owned by one backend on one device.

    ``array`` is the raw storage as a 1-D ``uint8`` array of the target's kind (numpy on cpu,
    a numba device array on cuda/cudasim); ``view`` reinterprets a byte range as typed
    elements for kernels.  A freed buffer refuses every use.
    """

    def __init__(self, backend: "Backend", device: Device, nbytes: int, array, *, pinned: bool = False,
                 ptr: int | None = None, owner: Any = None):
        self.backend = backend
        self.device = device
        self.nbytes = nbytes
        self.pinned = pinned
        self.id = next(_ids)
        self._array = array
        self._ptr = ptr
        self._owner = owner  # whatever keeps the memory alive (a larger slab, a numba allocation)
        self.freed = False
        # Live bytes are registered so that raw-pointer copies can be checked against them --
        # until free().  (The backend keeps every buffer it made until then: one dropped without
        # free() is a leak that Backend.live_buffers() shows, not memory given back behind a
        # queue that may still write it by address.  A CachingAllocator keeps its live blocks
        # the same way.  The finalizer runs only when the keeper itself is collected.)
        self._range = None
        if ptr and nbytes:
            token = address_ranges.register(ptr, nbytes, f"buffer #{self.id} on {device}")
            self._range = weakref.finalize(self, address_ranges.unregister, token)

    @property
    def array(self):
        """The raw storage, a 1-D ``uint8`` array (numpy on cpu, a device array on cuda/cudasim).

        Raises RuntimeError once the buffer is freed.
        """
        self._check_live("buffer")
        return self._array

    @property
    def ptr(self) -> int:
        """The address of the first byte (host address on cpu/cudasim, device address on cuda)."""
        self._check_live("buffer")
        return self._ptr if self._ptr is not None else 0

    def _check_live(self, what: str) -> None:
        if self.freed:
            raise RuntimeError(f"{what} #{self.id} ({self.nbytes} bytes on {self.device}) was already freed")

    def view(self, dtype=np.uint8, shape=None, offset: int = 0):
        """A typed view of ``nbytes`` starting at byte ``offset``, shaped ``shape``.

        Without ``shape`` the view covers the rest of the buffer.  The view aliases the
        buffer's memory: kernels that write it write the buffer.
        """
        self._check_live("buffer")
        dtype, shape, count, offset = self._view_args(dtype, shape, offset, "buffer")
        raw = self._array[offset:offset + count * dtype.itemsize]
        return raw.view(dtype).reshape(shape) if count else raw.view(dtype)[:0].reshape(shape)

    def _view_args(self, dtype, shape, offset, what: str) -> tuple[np.dtype, tuple, int, int]:
        """``view``'s arguments checked against this memory's ``nbytes``: ``(dtype, shape, count, offset)``."""
        dtype = numeric_dtype("dtype", dtype)
        offset = check_nbytes("offset", offset)
        if offset > self.nbytes:
            raise ValueError(f"offset={offset} is past the end of {what} #{self.id} ({self.nbytes} bytes)")
        if shape is None:
            shape = ((self.nbytes - offset) // dtype.itemsize,)
        shape = check_shape("shape", shape)
        count = math.prod(shape)  # (Python ints: numpy's int64 product wraps for huge shapes)
        need = count * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"offset={offset} is not a multiple of {dtype.name}'s itemsize {dtype.itemsize}")
        if offset + need > self.nbytes:
            raise ValueError(
                f"view of shape={shape} {dtype.name} at offset={offset} needs {need} bytes but {what} #{self.id} "
                f"has only {self.nbytes - offset} bytes after the offset")
        return dtype, shape, count, offset

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        kind = "pinned " if self.pinned else ""
        return f"<{kind}Buffer #{self.id} {self.nbytes} B on {self.device} ({state})>"


class Queue:
    """An ordered queue of work on one device (a CUDA stream, or a host queue)."""

    def __init__(self, backend: "Backend", name: str | None = None):
        self.backend = backend
        self.id = next(_ids)
        self.name = name or f"queue{self.id}"
        self.destroyed = False
        self.priority = "normal"  #: "normal" or "high" (see Backend.create_queue)

    def __repr__(self) -> str:
        return f"<Queue {self.name} on {self.backend.device}{' (destroyed)' if self.destroyed else ''}>"


class Event:
    """A marker in a queue: recorded on one queue, waited for by the host or by another queue.

    ``blocking`` is the upstream flag (``cudaEventBlockingSync``: the host sleeps in
    ``synchronize_event`` instead of spinning); vtnumba keeps it on the event, but no backend
    acts on it: cpu events always sleep on a ``threading.Event``, and numba-cuda creates its
    events without the flag, so ``synchronize_event`` on a GPU spins as CUDA's default does.

    ``timing`` is the inverse of ``cudaEventDisableTiming``: an event that only orders work
    and tells the host when it got there (most events: the allocator's, the peer flags')
    needs no timestamp, and on a GPU one without it is cheaper to record and to wait for.
    Only events created with ``timing=True`` can be passed to :meth:`Backend.elapsed_ms`.
    """

    def __init__(self, backend: "Backend", blocking: bool = False, timing: bool = True):
        self.backend = backend
        self.blocking = blocking
        self.timing = timing
        self.id = next(_ids)
        self.destroyed = False
        self.recorded = False  # an event never recorded counts as complete (CUDA semantics)

    def __repr__(self) -> str:
        return f"<Event #{self.id} on {self.backend.device}{' (destroyed)' if self.destroyed else ''}>"


class EventMark:
    """One recording of an event on the host side: fires once, remembers when (host backends and
    the simulator use it; a GPU event keeps that state in the driver)."""

    __slots__ = ("done", "time_ns")

    def __init__(self):
        #: A :class:`threading.Event`, set when the mark fires; waiters block on it.
        self.done = threading.Event()
        #: The host clock (:func:`vtnumba.trace.now_ns`) when the mark fired; 0 before.
        self.time_ns = 0

    def fire(self) -> None:
        """Record the host time and wake everyone waiting on ``done``."""
        self.time_ns = trace.now_ns()
        self.done.set()


#: More bytes than any machine's memory (numpy itself refuses arrays of 2**63 bytes or more).
MAX_ALLOCATION_BYTES = 1 << 60


def _allocation_size(nbytes) -> int:
    nbytes = check_nbytes("nbytes", nbytes)
    if nbytes > MAX_ALLOCATION_BYTES:
        raise ValueError(f"nbytes={nbytes} is more memory than any device has; expected at most 2**60 bytes")
    return nbytes


class GraphHandle:
    """A captured graph that can be replayed on a queue until destroyed."""

    def __init__(self, backend: "Backend", native: Any):
        self.backend = backend
        self.native = native
        self.id = next(_ids)
        self.destroyed = False


class Backend(abc.ABC):
    """The device seam.  Subclasses implement the ``_``-prefixed primitives; the public
    methods validate arguments and keep the bookkeeping every backend shares."""

    #: The kind of device this backend serves; each subclass sets it.
    device_type: DeviceType

    def __init__(self, device: Device):
        self.device = device
        self._lock = threading.RLock()
        self._live_buffers: dict[int, Buffer] = {}
        self._queues: dict[int, Queue] = {}  # the live queues, by id
        self._events: set[int] = set()
        self._capturing: dict[int, tuple[Queue, Any]] = {}  # queue id -> (queue, the capture's state)
        self._default_graph: GraphHandle | None = None
        self._side_queue: Queue | None = None  # see _flag_side_queue
        self.closed = False  #: set by :meth:`close`; a closed backend takes no more work

    # ------------------------------------------------------------------ description
    @property
    def name(self) -> str:
        """A short name for messages and traces, the class name (subclasses add their mode)."""
        return type(self).__name__

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend can do (see :class:`Capabilities`)."""

    @abc.abstractmethod
    def device_capability(self) -> tuple[int, int]:
        """(major, minor) compute capability; (0, 0) for the CPU."""

    def unified_memory(self) -> bool:
        """True when host and device share one address space (no copies needed)."""
        return self.capabilities.unified_memory

    def supports_aux_stream(self) -> bool:
        """Can work on a second queue overlap work on the first?"""
        return self.capabilities.aux_stream

    def supports_graph_capture(self) -> bool:
        """Can this backend capture and replay graphs (:attr:`Capabilities.graph_capture`; a real GPU only)?"""
        return self.capabilities.graph_capture

    # ------------------------------------------------------------------ arrays
    def asarray(self, host: np.ndarray):
        """A copy of the numpy array ``host`` in this backend's memory, as an array its kernels
        take (numpy on cpu, a device array on cuda and in the simulator).  Synchronous."""
        self._check_open()
        if not isinstance(host, np.ndarray):
            raise TypeError(f"host must be a numpy array, got {type(host).__name__}")
        numeric_dtype("host.dtype", host.dtype, use="be held in device memory")  # (as empty() refuses it)
        # (ascontiguousarray makes a 0-d array 1-d: the copy keeps the caller's shape.)
        return self._asarray(np.ascontiguousarray(host).reshape(host.shape))

    def empty(self, shape, dtype=np.float32):
        """A new uninitialised array of ``shape`` in this backend's memory (kernel-usable)."""
        self._check_open()
        return self._empty(check_shape("shape", shape), numeric_dtype("dtype", dtype))

    def to_host(self, arr) -> np.ndarray:
        """``arr``'s contents as a numpy array: the memory itself where the host can address it
        (cpu, simulator), a synchronous device-to-host copy on a real GPU.

        It reads what is there *now*: work still queued that writes ``arr`` is not waited
        for (on a GPU the copy goes through the legacy default stream, which vtnumba's
        queues -- non-blocking streams -- are not ordered with).  Synchronize the queues
        that write ``arr`` first.
        """
        view = host_view(arr)
        if view is not None:
            return view
        return self._to_host(arr)

    def _asarray(self, host: np.ndarray):
        return host.copy()

    def _empty(self, shape: tuple, dtype: np.dtype):
        return np.empty(shape, dtype=dtype)

    def _to_host(self, arr) -> np.ndarray:
        raise TypeError(f"{self.name} cannot read {type(arr).__module__}.{type(arr).__name__} on the host")

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int) -> Buffer:
        """Allocate ``nbytes`` of device memory, 64-byte aligned."""
        self._check_open()
        nbytes = _allocation_size(nbytes)
        buf = self._alloc(nbytes)
        with self._lock:
            self._live_buffers[buf.id] = buf
        return buf

    def free(self, buf: Buffer) -> None:
        """Release ``buf`` (made by :meth:`alloc` or :meth:`alloc_pinned` of this backend).

        From then on every use of ``buf`` raises RuntimeError, and so does a second ``free``.
        """
        self._check_own_buffer("buf", buf)
        with self._lock:
            if buf.id not in self._live_buffers and not buf.freed:
                allocator = getattr(buf, "allocator", None)
                where = (f"{type(allocator).__name__}.free(block) gives it back" if allocator is not None
                         else "free only what alloc/alloc_pinned returned")
                raise ValueError(f"buf=buffer #{buf.id} ({buf.nbytes} bytes) was not made by this backend's "
                                 f"alloc or alloc_pinned; {where}")
            if buf.freed:
                raise RuntimeError(f"double free: buffer #{buf.id} ({buf.nbytes} bytes) was already freed")
            del self._live_buffers[buf.id]
            buf.freed = True
        if buf._range is not None:
            buf._range()  # unregister now (the finalizer runs at most once)
        memory = buf._array
        self._free(buf)
        if _worker_queues:
            _keep_past_queued_host_work(memory)

    def flush_frees(self) -> None:
        """Hand back now the memory this process has let go of but the device runtime still holds.

        On a GPU :meth:`free` only drops the array: numba queues its ``cuMemFree`` and runs the
        queue in batches, from whichever later call tips it over -- so the cost of a free lands
        on some other call.  Call this after :meth:`free` where the code that frees must pay
        (a benchmark of the stock allocation path).  Inside :meth:`defer_frees` it does
        nothing: holding the frees back is what that block is for.  A no-op where memory is
        host memory.
        """

    def alloc_pinned(self, nbytes: int) -> Buffer:
        """Page-locked host memory (0 bytes still returns a valid, freeable block)."""
        self._check_open()
        nbytes = _allocation_size(nbytes)
        buf = self._alloc_pinned(nbytes)
        with self._lock:
            self._live_buffers[buf.id] = buf
        return buf

    def free_pinned(self, buf: Buffer) -> None:
        """Release a buffer made by :meth:`alloc_pinned`; ValueError for one that is not pinned."""
        if isinstance(buf, Buffer) and not buf.pinned:
            raise ValueError(f"free_pinned(buf) got buffer #{buf.id}, which is not pinned; use free()")
        self.free(buf)

    def memset(self, q: Queue, buf: Buffer, value: int, nbytes: int | None = None, offset: int = 0) -> None:
        """Set ``nbytes`` bytes of ``buf`` from ``offset`` to ``value`` (0..255), in queue order."""
        self._check_queue(q)
        self._check_own_buffer("buf", buf)
        if not is_int(value) or not 0 <= int(value) <= 255:
            raise ValueError(f"value={value!r} must be a byte value, an int in 0..255")
        offset = check_nbytes("offset", offset)
        if offset > buf.nbytes:
            raise ValueError(f"offset={offset} is past the end of buffer #{buf.id} ({buf.nbytes} bytes)")
        nbytes = buf.nbytes - offset if nbytes is None else check_nbytes("nbytes", nbytes)
        if offset + nbytes > buf.nbytes:
            raise ValueError(f"memset of nbytes={nbytes} at offset={offset} runs past the end of buffer "
                             f"#{buf.id} ({buf.nbytes} bytes)")
        self._memset(q, buf, int(value), nbytes, offset)
        if _use_observers:
            self._notify_use(q, [_range_of(buf, offset, nbytes)])

    def copy(self, q: Queue, dst, src, nbytes: int, *, dst_offset: int = 0, src_offset: int = 0) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` in queue order (H2D, D2H, D2D or H2H).

        ``dst``/``src`` are :class:`Buffer` objects or contiguous arrays (numpy on the host,
        device arrays on cuda).  Asynchronous on queues that are: keep both alive and
        unchanged until the queue has passed the copy.
        """
        self._check_queue(q)
        nbytes = check_nbytes("nbytes", nbytes)
        dst_offset = check_nbytes("dst_offset", dst_offset)
        src_offset = check_nbytes("src_offset", src_offset)
        d_size = self._extent("dst", dst)
        s_size = self._extent("src", src)
        if isinstance(dst, np.ndarray) and not dst.flags.writeable:
            raise ValueError("dst is a read-only numpy array (np.frombuffer of bytes, a broadcast view ...); "
                             "expected memory the copy may write")
        if dst_offset + nbytes > d_size:
            raise ValueError(f"copy of nbytes={nbytes} at dst_offset={dst_offset} runs past the end of dst "
                             f"({d_size} bytes)")
        if src_offset + nbytes > s_size:
            raise ValueError(f"copy of nbytes={nbytes} at src_offset={src_offset} runs past the end of src "
                             f"({s_size} bytes)")
        self._copy(q, dst, src, nbytes, dst_offset, src_offset)
        if _use_observers:
            self._notify_use(q, [_range_of(dst, dst_offset, nbytes), _range_of(src, src_offset, nbytes)])

    def _extent(self, name: str, obj) -> int:
        if isinstance(obj, Buffer):
            self._check_own_buffer(name, obj)
            return obj.nbytes
        nbytes = getattr(obj, "nbytes", None)
        dtype = getattr(obj, "dtype", None)
        if nbytes is None or dtype is None or getattr(obj, "shape", None) is None or isinstance(obj, np.generic):
            # (A numpy scalar has nbytes too, but a copy into it lands in a temporary; a
            # memoryview has no dtype to view its bytes by.)
            raise TypeError(f"{name} must be a Buffer or an array, got {type(obj).__name__}")
        if np.dtype(dtype).hasobject:
            raise TypeError(f"{name} holds Python objects (dtype {np.dtype(dtype)}); expected an array of numbers "
                            "or bytes to copy")
        flags = getattr(obj, "flags", None)
        if isinstance(flags, dict):  # (a simulator array's flags are a dict)
            flags = flags.get("C_CONTIGUOUS", True)
        elif flags is not None:
            flags = flags["C_CONTIGUOUS"]
        if flags is not None and not flags:
            raise ValueError(f"{name} must be C-contiguous")
        return int(nbytes)

    # ------------------------------------------------------------------ queues
    def create_queue(self, name: str | None = None, *, priority: str = "normal") -> Queue:
        """A new queue: a non-blocking CUDA stream on a GPU, a host queue on cpu (a worker thread in
        threaded mode).  ``name`` labels it in traces and messages (default ``queue<id>``).

        ``priority="high"``: on a GPU, a stream of the device's greatest priority -- when both
        have work waiting, the block scheduler hands free SMs to its kernels first.  That is
        what lets a few small communication kernels run *beside* a large matmul instead of in
        its tail (TPSP's exchange queue).  Host queues have no such scheduler: there it is
        only recorded (:attr:`Queue.priority`).
        """
        self._check_open()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name={name!r} must be a str (a label for traces and messages) or None")
        if priority not in QUEUE_PRIORITIES:
            raise ValueError(f"priority={priority!r}; expected one of {', '.join(map(repr, QUEUE_PRIORITIES))}")
        q = self._create_queue(name, priority)
        q.priority = priority
        with self._lock:
            self._queues[q.id] = q
        return q

    def live_queues(self) -> list[Queue]:
        """The queues made by :meth:`create_queue` and not destroyed yet (the backend's own
        included), in the order they were made."""
        with self._lock:
            return list(self._queues.values())

    def destroy_queue(self, q: Queue) -> None:
        """Wait for the queue's work, then release it.  Destroying twice is an error."""
        if self.closed and isinstance(q, Queue) and q.backend is self and not q.destroyed:
            # Teardown after close(): its work finished there; only the release is left.
            with self._lock:
                self._queues.pop(q.id, None)
            q.destroyed = True
            self._destroy_queue(q)
            return
        self._check_queue(q)
        if q.id in self._capturing:
            # Its work was being recorded, not run: nothing to wait for, and a capture left
            # open would keep the stream (and the graph built so far) for good.
            self._discard_capture(q, self._capturing.pop(q.id)[1])
        try:
            self.synchronize(q)
        finally:
            with self._lock:
                self._queues.pop(q.id, None)
                q.destroyed = True  # (with the pop: whoever finds the queue gone also finds it destroyed)
            self._destroy_queue(q)

    def synchronize(self, q: Queue | None = None) -> None:
        """Block until all work submitted to ``q`` (or every queue, if None) has finished."""
        if q is None:
            if self._capturing:
                raise RuntimeError(f"synchronize(): queue(s) {self._capturing_names()} are capturing a graph, and "
                                   "a synchronize would break the capture; end_capture first")
            self._synchronize_all()
            return
        self._check_queue(q)
        if q.id in self._capturing:
            # (A capturing stream records its work instead of running it: waiting for it is
            # an error that also invalidates the capture.)
            raise RuntimeError(f"synchronize({q.name}): the queue is capturing a graph; its work runs when the "
                               "graph is replayed -- end_capture first, then synchronize after replay")
        self._synchronize(q)

    def _capturing_names(self) -> str:
        return ", ".join(sorted(q.name for q, _ in self._capturing.values()))

    def order_after_default_stream(self, q: Queue) -> None:
        """Make later work on ``q`` wait for work already queued outside vtnumba's queues.

        A no-op here: cpu work that arrives outside a queue has finished when its call
        returns.  The CUDA backend overrides it, because its queues are non-blocking streams
        that the legacy default stream (where numba's own copies and launches go) does not
        order.
        """
        self._check_queue(q)

    def order_default_stream_after(self, q: Queue) -> None:
        """The other direction: make work queued later outside vtnumba's queues (numba's
        default-stream launches and copies) wait for what is queued on ``q`` now.

        A no-op here, for the same reason as :meth:`order_after_default_stream`; the CUDA
        backend makes the legacy default stream wait for an event recorded on ``q``.
        """
        self._check_queue(q)

    def queue_error(self, q: Queue) -> BaseException | None:
        """The sticky error of ``q`` if queued work on it has failed, else None.  Never blocks
        and does not clear the error (``synchronize`` raises and clears it)."""
        self._check_queue(q)
        return self._queue_error(q)

    def _queue_error(self, q: Queue) -> BaseException | None:
        return getattr(q, "error", None)

    def flush_pending(self, q: Queue | None = None) -> None:
        """Hand any batched-up work to the device now (a no-op where submission is immediate)."""
        if q is not None:
            self._check_queue(q)

    def submit(self, q: Queue, fn: Callable[[Any], None], name: str = "op", *, uses=(), **trace_args) -> None:
        """Run ``fn(native_stream)`` in queue order.

        This is how kernels and host functions reach a queue.  On the cpu backend ``fn``
        does the work itself (on the queue's thread in threaded mode); on cuda it *launches*
        device work into the stream it is given, which is then ordered like any copy.
        ``uses`` names the memory the work touches (Buffers, arrays, or ``(address, nbytes)``
        pairs), so that a hazard checker can see cross-queue uses the caller did not report.
        """
        self._check_queue(q)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._submit(q, fn, name, trace_args)
        if _use_observers and uses:
            self._notify_use(q, [_range_of(u) for u in uses if u is not None])

    def _notify_use(self, q: Queue, ranges) -> None:
        ranges = [r for r in ranges if r is not None and r[1] > 0]
        for fn in list(_use_observers):
            fn(self, q, ranges)

    def launch_host_func(self, q: Queue, fn: Callable[[], None], name: str = "host_func") -> None:
        """Run a host function once everything before it on ``q`` has finished (cuLaunchHostFunc).

        An exception raised by ``fn`` is sticky on ``q``: the next ``synchronize(q)`` raises it
        (on a synchronous queue, where ``fn`` runs inside this call, this call raises it).
        """
        self._check_queue(q)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._launch_host_func(q, fn, name)

    # ------------------------------------------------------------------ flags in queue order
    def defer_frees(self):
        """A context manager: while it is open, memory this process lets go of is not handed
        back to the device; it goes back when the last such block closes.

        Wrap in it the host work that queues waits which only a *later* host action -- this
        rank's or a peer's -- will satisfy (a flag the host raises after queuing more, a
        peer's signal, a deadline's release).  On a GPU, freeing device memory
        (``cuMemFree``) waits for every stream of the context to finish; if one of them is
        held by such a wait, the free would never return and the action that would release
        the stream would never run.  numba frees memory (and destroys events) whenever its
        list of pending frees grows long, from inside any call that drops an array or an
        event -- so the frees must be held back, not just avoided here.  A no-op where memory
        is host memory.
        """
        return contextlib.nullcontext()

    def write_value32(self, q: Queue, flags, index: int, value: int) -> None:
        """Once ``q`` reaches this point, store ``value`` into the 32-bit word ``flags[index]``.

        Everything queued on ``q`` before is complete *and visible* before the store (a
        release / system-wide fence), so a peer that sees the value may read what ``q``
        wrote.  ``flags`` is a 1-D ``uint32`` array of this backend's kind -- possibly a
        *peer's* memory (a CUDA IPC mapping, a shared-memory view).  On a GPU this is
        ``cuStreamWriteValue32``: the stream itself writes, no host thread is involved.
        """
        self._check_queue(q)
        self._refuse_flags_in_capture(q, "write_value32")
        index, value = self._check_flag(flags, index, value)
        self._write_value32(q, flags, index, value)

    def _refuse_flags_in_capture(self, q: Queue, what: str) -> None:
        # A captured flag operation would run at every replay, where the host no longer sees
        # it: a replayed write stores the same old epoch again (a flag that only grows would
        # go back), and a replayed wait has no deadline -- nobody could release it if the
        # peer never signals -- while the deadline the capture set would run out on its own.
        if q.id in self._capturing:
            raise RuntimeError(f"{what} on {q} while it is capturing a graph: flag writes and waits cannot be "
                               "captured (each replay would repeat them unseen by the host); queue them outside "
                               "the capture")

    def wait_value32(self, q: Queue, flags, index: int, value: int, *, timeout_s: float = 60.0) -> None:
        """Make later work on ``q`` wait until ``flags[index] >= value`` (32-bit, cyclic).

        The comparison is CUDA's ``CU_STREAM_WAIT_VALUE_GEQ``: ``(int32)(flags[index] - value)
        >= 0``, i.e. "at least value" as long as the two are less than 2**31 apart -- epoch
        counters that only grow.  On a GPU this is ``cuStreamWaitValue32``: the stream waits
        in hardware and cannot time out by itself, so the host keeps the deadline: a
        ``synchronize`` of that queue (or of an event recorded after the wait) polls instead
        of blocking, and once ``timeout_s`` has passed with the word short it stores the
        value into the word -- the only way to free the stream -- and raises RuntimeError
        naming the word (the work queued after the wait ran without its input).  Host
        queues wait by polling and fail after ``timeout_s``: inline on a synchronous queue,
        on the queue's thread (a sticky error) on a threaded one.
        :mod:`vtnumba.dist.queue_flags` builds its failure handling on top: it watches the
        peers too, and releases their waits when a call fails.
        """
        self._check_queue(q)
        self._refuse_flags_in_capture(q, "wait_value32")
        index, value = self._check_flag(flags, index, value, store=False)
        timeout_s = check_seconds("timeout_s", timeout_s)
        self._wait_value32(q, flags, index, value, timeout_s)

    def release_flag_word(self, flags, index: int, value: int, *, timeout_s: float = 10.0) -> None:
        """Store ``value`` into ``flags[index]`` now, from a queue nothing waits on; return once it is stored.

        This is how a wait that will never be satisfied -- its peer died, its deadline passed --
        is ended: a GPU stream's :meth:`wait_value32` cannot be cancelled, only satisfied.  Two
        rules make it safe on a stuck device:

        * the store goes through a queue of the backend's own (non-blocking on a GPU, so not
          ordered behind the stuck stream), never through one that may itself be waiting;
        * it is waited for by polling an event with a deadline, never in a blocking driver
          call: streams share a few hardware queues, and if the GPU scheduled this one behind
          a stuck one the call must still end -- RuntimeError after ``timeout_s``.

        Used by the backend's own flag-wait deadlines and by :mod:`vtnumba.dist.queue_flags`
        when a call fails.  The work queued behind a released wait runs on whatever the flag
        guarded: whoever releases it must make sure its results are not used.
        """
        index, value = self._check_flag(flags, index, value)
        timeout_s = check_seconds("timeout_s", timeout_s)
        with self.defer_frees():  # a stream is stuck until this store lands: nothing may wait for it
            q = self._flag_side_queue()
            self._write_value32(q, flags, index, value)
            self._finish_side_queue(q, timeout_s, f"storing {value} into flag word {index}")

    def read_flag_word(self, flags, index: int, *, timeout_s: float = 10.0) -> int:
        """The word ``flags[index]`` as it is now, read past any stuck queue.

        Memory the host can read in place (host backends, the simulator) is read there.  A
        GPU's is copied through the backend's own queue into a pinned word and waited for by
        polling -- the rules of :meth:`release_flag_word` -- so reading a word that a stuck
        stream waits on (an error message naming the flags that never came) cannot block:
        RuntimeError after ``timeout_s``.
        """
        index, _ = self._check_flag(flags, index, 0, store=False)
        timeout_s = check_seconds("timeout_s", timeout_s)
        view = host_view(flags)
        if view is not None:
            return int(view[index])
        return self._read_flag_word(flags, index, timeout_s)

    def _read_flag_word(self, flags, index: int, timeout_s: float) -> int:
        raise NotImplementedError(f"{self.name} keeps flag words only in host memory")

    def _flag_side_queue(self) -> Queue:
        """The backend's queue for reading and storing flag words past a stuck stream (made on
        first use, kept for the backend's life; releases are rare and on failure paths)."""
        with self._lock:  # (re-entrant: create_queue takes it too)
            if self._side_queue is None or self._side_queue.destroyed:
                self._side_queue = self.create_queue("flag-side")
            return self._side_queue

    def _finish_side_queue(self, q: Queue, timeout_s: float, what: str) -> None:
        """Wait for what was just queued on the side queue ``q``, polling with a deadline."""
        from vtnumba.backend.polling import poll_until

        ev = self.create_event(timing=False)  # one per call: two threads may release at once
        try:
            self.record_event(ev, q)
            poll_until(lambda: self.query_event(ev), timeout_s,
                       lambda waited: f"{self.name}: {what} did not finish within {waited:.3g} s (its queue is held "
                                      "up behind a stuck one)")
        finally:
            self.destroy_event(ev)
        self.synchronize(q)  # done: returns at once, and raises the queue's error if the store failed

    def _check_flag(self, flags, index, value, *, store: bool = True) -> tuple[int, int]:
        # ``store``: the call writes the word (a read-only array -- np.frombuffer of bytes --
        # must not be written through its raw address, which is all a flag store uses).
        if (type(flags) is np.ndarray and flags.dtype is _UINT32 and flags.ndim == 1 and flags.flags.c_contiguous
                and flags.flags.aligned and (flags.flags.writeable or not store)
                and type(index) is int and 0 <= index < flags.shape[0] and type(value) is int
                and 0 <= value <= FLAG_MAX):
            # The usual call, a word of a host flag area and two Python ints, in a few reads:
            # a fused call queues a dozen waits and writes.  (Anything else: the checks below.)
            return index, value
        if getattr(flags, "ndim", None) != 1 or np.dtype(getattr(flags, "dtype", None)) != np.uint32:
            raise TypeError(f"flags must be a 1-D uint32 array, got {type(flags).__name__} "
                            f"dtype={getattr(flags, 'dtype', None)} ndim={getattr(flags, 'ndim', None)}")
        if not is_c_contiguous(flags):  # (the flag kernels and the driver's stream ops address it as one range)
            raise ValueError("flags must be a contiguous uint32 array, not a strided view such as flags[::2]")
        # Checked here, on every queue kind: a threaded queue found it only when the store ran,
        # as a sticky error of the queue (and a GPU's stream ops need 4-byte words).  (A GPU
        # array's pointer attribute is cheap to read: every queued flag wait comes through here.)
        address = byte_span(flags)[0]
        if int(flags.shape[0]) and address % 4:
            raise ValueError(f"flags (at address {address:#x}) must be 4-byte aligned for atomic access")
        if store and isinstance(flags, np.ndarray) and not flags.flags.writeable:
            raise ValueError("flags is a read-only array (numpy's writeable flag is off, e.g. np.frombuffer of "
                             "bytes); expected memory a flag store may write")
        index = check_int("index", index, min_value=0, max_value=int(flags.shape[0]) - 1)
        value = check_int("value", value, min_value=0, max_value=FLAG_MAX)
        return index, value

    # ------------------------------------------------------------------ events
    def create_event(self, blocking: bool = False, timing: bool = True) -> Event:
        """A new event.  Until it is first recorded it counts as complete, as in CUDA.

        ``timing=False`` (``cudaEventDisableTiming``): the event orders and signals only --
        cheaper on a GPU -- and :meth:`elapsed_ms` refuses it.
        """
        for name, value in (("blocking", blocking), ("timing", timing)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name}={value!r} must be True or False")  # ("no" would be truthy)
        ev = self._create_event(bool(blocking), bool(timing))
        with self._lock:
            self._events.add(ev.id)
        return ev

    def destroy_event(self, e: Event) -> None:
        """Release ``e``; any later use of it, a second destroy included, raises RuntimeError."""
        self._check_event(e)
        with self._lock:
            self._events.discard(e.id)
        e.destroyed = True
        self._destroy_event(e)

    def record_event(self, e: Event, q: Queue) -> None:
        """Mark "everything submitted to ``q`` so far": ``e`` fires when ``q`` gets there.

        Re-recording moves the mark; a ``queue_wait_event`` already issued keeps waiting for the old one.
        """
        self._check_event(e)
        self._check_queue(q)
        e.recorded = True
        self._record_event(e, q)

    def synchronize_event(self, e: Event) -> None:
        """Block until ``e``'s latest recording has fired (at once if it was never recorded).

        It does not raise a queue's sticky error; :meth:`synchronize` does.
        """
        self._check_event(e)
        self._synchronize_event(e)

    def query_event(self, e: Event) -> bool:
        """True once the event's queue has passed it (never blocks)."""
        self._check_event(e)
        return self._query_event(e)

    def query_queue(self, q: Queue) -> bool:
        """True when everything submitted to ``q`` so far has finished (``cudaStreamQuery``;
        never blocks).  A failed operation counts as finished: :meth:`synchronize` raises it.
        A queue that is capturing a graph is never idle (its work runs at replay)."""
        self._check_queue(q)
        if q.id in self._capturing:
            # Its work is being recorded, not run -- so not idle; and asking the driver about a
            # capturing stream is an error that also invalidates the capture.
            return False
        return self._query_queue(q)

    def _query_queue(self, q: Queue) -> bool:
        # (Where a backend cannot tell, a queue is never known to be idle: callers then take
        # the careful path -- an event, a wait.)
        return False

    def queue_wait_event(self, q: Queue, e: Event) -> None:
        """Make later work on ``q`` wait until ``e`` (as recorded now) has fired."""
        self._check_queue(q)
        self._check_event(e)
        self._queue_wait_event(q, e)

    def elapsed_ms(self, start: Event, end: Event) -> float:
        """Milliseconds between two completed events (blocks until both fired)."""
        self._check_event(start, "start")
        self._check_event(end, "end")
        for name, ev in (("start", start), ("end", end)):
            if not ev.timing:
                raise RuntimeError(f"elapsed_ms: event {name} (#{ev.id}) was created with timing=False: it has no "
                                   "timestamp (create_event(timing=True) for events you time)")
            if not ev.recorded:
                raise RuntimeError(f"elapsed_ms: event {name} (#{ev.id}) was never recorded")
        return self._elapsed_ms(start, end)

    # ------------------------------------------------------------------ graphs
    def begin_capture(self, q: Queue) -> None:
        """Start capturing the work submitted to ``q`` into a graph instead of running it.

        RuntimeError where graphs are not supported (see :meth:`supports_graph_capture`) or when
        ``q`` is already capturing.  Launch each kernel once before capturing: a first launch
        compiles, and compiling would try to synchronize inside the capture.  While ``q``
        captures, :meth:`launch_host_func` (on a GPU), :meth:`write_value32` and
        :meth:`wait_value32` on it are refused: every replay would repeat them where the host
        cannot see them.  So are, on a GPU, copies a graph cannot hold: host to host (numpy's,
        on this thread) and between the device and pageable host memory (staged by the
        driver) -- capture copies with pinned memory (:meth:`alloc_pinned`).
        """
        self._check_queue(q)
        if not self.supports_graph_capture():
            raise RuntimeError(f"{self.name} on {self.device} does not support graph capture "
                               "(only a real CUDA GPU does); check supports_graph_capture() first")
        if q.id in self._capturing:
            raise RuntimeError(f"{q} is already capturing; end_capture first")
        self._capturing[q.id] = (q, self._begin_capture(q))

    def end_capture_graph(self, q: Queue) -> GraphHandle:
        """End capture on ``q`` and return a handle to the captured graph."""
        self._check_queue(q)
        if q.id not in self._capturing:
            raise RuntimeError(f"{q} is not capturing; call begin_capture first")
        _, state = self._capturing.pop(q.id)
        return GraphHandle(self, self._end_capture(q, state))

    def replay_graph(self, q: Queue, graph: GraphHandle) -> None:
        """Launch the captured ``graph`` on ``q``, in queue order; it can be replayed until destroyed."""
        self._check_queue(q)
        if not isinstance(graph, GraphHandle) or graph.backend is not self:
            raise ValueError("graph must be a GraphHandle made by this backend's end_capture_graph")
        if graph.destroyed:
            raise RuntimeError(f"graph #{graph.id} was destroyed")
        self._replay(q, graph.native)

    def destroy_graph(self, graph: GraphHandle) -> None:
        """Release a captured graph; replaying or destroying it afterwards raises RuntimeError."""
        if not isinstance(graph, GraphHandle) or graph.backend is not self:
            raise ValueError("graph must be a GraphHandle made by this backend")
        if graph.destroyed:
            raise RuntimeError(f"graph #{graph.id} was already destroyed")
        graph.destroyed = True
        self._destroy_graph(graph.native)

    def end_capture(self, q: Queue) -> None:
        """vllm.cpp's single-graph API: end capture and keep the graph as the default one."""
        # End the new capture first: if that fails (the wrong queue, a capture that broke),
        # the graph kept from before must still be there to replay.
        graph = self.end_capture_graph(q)
        old, self._default_graph = self._default_graph, graph
        if old is not None and not old.destroyed:
            self.destroy_graph(old)

    def replay(self, q: Queue) -> None:
        """Replay the graph :meth:`end_capture` kept on ``q``; RuntimeError if there is none."""
        if self._default_graph is None or self._default_graph.destroyed:
            raise RuntimeError("replay: nothing captured; call begin_capture/end_capture first")
        self.replay_graph(q, self._default_graph)

    def _begin_capture(self, q):  # pragma: no cover - only real CUDA implements capture
        raise NotImplementedError

    def _end_capture(self, q, state):  # pragma: no cover
        raise NotImplementedError

    def _discard_capture(self, q, state) -> None:  # pragma: no cover - only real CUDA captures
        """End a capture whose graph nobody will use (the queue is destroyed, the backend closed)."""
        raise NotImplementedError

    def _replay(self, q, native):  # pragma: no cover
        raise NotImplementedError

    def _destroy_graph(self, native):  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------ teardown
    def live_buffers(self) -> list[Buffer]:
        """The buffers allocated by this backend and not yet freed (a snapshot, e.g. to find leaks)."""
        with self._lock:
            return list(self._live_buffers.values())

    def close(self) -> None:
        """Synchronize every queue, then take no more work: allocating, creating a queue and
        using one raise RuntimeError from now on (outstanding buffers stay owned by their
        users, and may still be freed).  Closing twice is harmless."""
        if self.closed:
            return
        # Captures still open are abandoned (their graphs were never ended, so nobody holds
        # them), and the graph end_capture kept goes too: nothing can replay it any more.
        for q, state in list(self._capturing.values()):
            self._discard_capture(q, state)
        self._capturing.clear()
        if self._default_graph is not None and not self._default_graph.destroyed:
            self.destroy_graph(self._default_graph)
        try:
            self._synchronize_all()
        finally:
            # Closed even when queued work failed: the error is this call's to raise, but a
            # backend left half-open (its workers running, closed False) needed a second close().
            self.closed = True
            # The flag side queue is the backend's own (the callers' queues stay theirs to destroy).
            side, self._side_queue = self._side_queue, None
            if side is not None and not side.destroyed:
                self.destroy_queue(side)  # (closed: released without another synchronize)

    def _check_open(self) -> None:
        if self.closed:
            # (On threaded cpu queues the workers are gone: queued work would never run, and a
            # synchronize would wait forever.)
            raise RuntimeError(f"{self.name} on {self.device} was closed; make a new backend")

    # ------------------------------------------------------------------ validation helpers
    def _check_queue(self, q) -> None:
        self._check_open()
        if not isinstance(q, Queue):
            raise TypeError(f"q must be a Queue, got {type(q).__name__}")
        if q.backend is not self:
            raise ValueError(f"q={q} belongs to another backend object ({q.backend.name} on {q.backend.device}), "
                             f"not this {self.name} on {self.device}: a queue works only with the backend that "
                             "created it")
        if q.destroyed or q.id not in self._queues:
            raise RuntimeError(f"q={q.name} was destroyed; create a new queue")

    def _check_event(self, e, name: str = "e") -> None:
        if not isinstance(e, Event):
            raise TypeError(f"{name} must be an Event, got {type(e).__name__}")
        if e.backend is not self:
            raise ValueError(f"{name}=event #{e.id} belongs to another backend ({e.backend.name} on "
                             f"{e.backend.device}), not {self.name} on {self.device}")
        if e.destroyed or e.id not in self._events:
            raise RuntimeError(f"{name}=event #{e.id} was destroyed")

    def _check_own_buffer(self, name: str, buf) -> None:
        if not isinstance(buf, Buffer):
            raise TypeError(f"{name} must be a Buffer, got {type(buf).__name__}")
        if buf.backend is not self:
            raise ValueError(f"{name}=buffer #{buf.id} belongs to {buf.backend.name} on {buf.device}, "
                             f"not {self.name} on {self.device}")
        if buf.freed:
            raise RuntimeError(f"{name}=buffer #{buf.id} was already freed")

    # ------------------------------------------------------------------ primitives
    @abc.abstractmethod
    def _alloc(self, nbytes: int) -> Buffer: ...

    @abc.abstractmethod
    def _free(self, buf: Buffer) -> None: ...

    @abc.abstractmethod
    def _alloc_pinned(self, nbytes: int) -> Buffer: ...

    @abc.abstractmethod
    def _memset(self, q: Queue, buf: Buffer, value: int, nbytes: int, offset: int) -> None: ...

    @abc.abstractmethod
    def _copy(self, q: Queue, dst, src, nbytes: int, dst_offset: int, src_offset: int) -> None: ...

    @abc.abstractmethod
    def _create_queue(self, name: str | None, priority: str) -> Queue: ...

    @abc.abstractmethod
    def _destroy_queue(self, q: Queue) -> None: ...

    @abc.abstractmethod
    def _synchronize(self, q: Queue) -> None: ...

    @abc.abstractmethod
    def _synchronize_all(self) -> None: ...

    @abc.abstractmethod
    def _submit(self, q: Queue, fn, name: str, trace_args: dict) -> None: ...

    @abc.abstractmethod
    def _launch_host_func(self, q: Queue, fn, name: str) -> None: ...

    @abc.abstractmethod
    def _write_value32(self, q: Queue, flags, index: int, value: int) -> None: ...

    @abc.abstractmethod
    def _wait_value32(self, q: Queue, flags, index: int, value: int, timeout_s: float) -> None: ...

    @abc.abstractmethod
    def _create_event(self, blocking: bool, timing: bool) -> Event: ...

    @abc.abstractmethod
    def _destroy_event(self, e: Event) -> None: ...

    @abc.abstractmethod
    def _record_event(self, e: Event, q: Queue) -> None: ...

    @abc.abstractmethod
    def _synchronize_event(self, e: Event) -> None: ...

    @abc.abstractmethod
    def _query_event(self, e: Event) -> bool: ...

    @abc.abstractmethod
    def _queue_wait_event(self, q: Queue, e: Event) -> None: ...

    @abc.abstractmethod
    def _elapsed_ms(self, start: Event, end: Event) -> float: ...
