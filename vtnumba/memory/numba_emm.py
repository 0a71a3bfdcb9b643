"""The caching allocator as numba's External Memory Manager (EMM) plugin (cuda target).

With the plugin installed, every ``numba.cuda.device_array`` -- and so every device
allocation vtnumba's CUDA backend makes -- is a block of a :class:`CachingAllocator`.
What numba's plugin interface gives, and what it does not (NBEP 7; docs/concepts/memory.rst):

* ``memalloc(size)`` gets **no stream**.  A stream-ordered allocator must still pick a
  pool, so the plugin takes the thread's current queue (:func:`using_queue`); without one,
  the block belongs to a "legacy default stream" queue.
* Frees arrive from **weakref finalizers at garbage-collection time**, with no stream,
  possibly in the middle of another allocation.  The finalizer therefore only *queues* the
  block (a deque append is safe there); the next ``memalloc`` frees it, with
  ``wait_owner=True``: an event is recorded on the owning stream and the memory is reused
  only once it completed.  A block allocated with no current queue (the legacy-default
  pool: every ``device_array`` outside :func:`using_queue`) may have been used by *any*
  queue -- vtnumba's queues are non-blocking streams, which the legacy stream does not
  wait for -- so its free also records an event on every live queue of the backend: the
  ordering ``cuMemFree``'s implicit device-wide synchronization gave without the plugin.
  Blocks of a named queue that other queues use still need ``record_stream`` (see
  :func:`record_stream_array`).
* The plugin must be set **before the first CUDA context** and cannot be switched later.
* IPC works through numba's ``GetIpcHandleMixin``, because segments come from plain
  ``cuMemAlloc`` (the handle names the segment; the offset travels with it) -- with one
  limit: a process can open a given handle only once, and blocks carved from one segment
  share its handle, so two such blocks exported to the same peer cannot both be opened
  there (``CUDA_ERROR_ALREADY_MAPPED``).  Peer buffers (:class:`vtnumba.dist.PeerBuffers`)
  ask for whole multiples of 2 MiB (:func:`vtnumba.dist.cuda_ipc.ipc_allocation_bytes`),
  so each normally gets a large-pool segment of its own; but a cached larger piece may be
  split between two of them, and then the second can fail to open, and peer memory falls
  back as when it is unavailable.
* The simulator has no EMM at all; the plugin's logic (:class:`_EMMCore`) is therefore
  written against vtnumba's Backend and unit-tested with the cpu backend.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref

from vtnumba.backend.base import Backend, Queue
from vtnumba.memory.allocator import Block, CachingAllocator
from vtnumba.memory.current_queue import current_queue

_raw_ids = itertools.count(1)


class _RawSegment:
    """A ``cuMemAlloc`` allocation: an address and a size, nothing numba-managed on top."""

    def __init__(self, handle, nbytes: int):
        self.id = next(_raw_ids)
        self.handle = handle
        self.ptr = int(handle)
        self.nbytes = nbytes
        self.array = None  # no array view: blocks of raw segments are used through numba arrays


class _DriverSegments:
    """Segments straight from the driver -- not ``device_array``, which would call the plugin."""

    def alloc(self, nbytes: int) -> _RawSegment:
        from numba.cuda.cudadrv.driver import driver

        return _RawSegment(driver.cuMemAlloc(nbytes), nbytes)

    def free(self, seg: _RawSegment) -> None:
        from numba.cuda.cudadrv.driver import driver

        driver.cuMemFree(seg.handle)

    def mem_info(self) -> tuple[int, int]:
        from numba.cuda.cudadrv.driver import driver

        free, total = driver.cuMemGetInfo()
        return int(free), int(total)


class _EMMCore:
    """What the plugin does, independent of numba's classes (so it is testable anywhere).

    ``alloc(size)`` picks the pool from the current queue (else ``default_queue``);
    ``finalizer(block)`` is what numba calls at GC time; ``drain()`` performs the frees.
    """

    def __init__(self, allocator: CachingAllocator, default_queue: Queue):
        self.allocator = allocator
        self.default_queue = default_queue
        self._finalized: collections.deque[Block] = collections.deque()  # append/popleft are atomic
        self._defer = 0
        self._defer_lock = threading.Lock()

    def alloc(self, size: int) -> Block:
        self.drain()
        queue = current_queue() or self.default_queue
        # numba may ask for 0 bytes; a block is never empty, so it gets the smallest one.
        return self.allocator.allocate(max(int(size), 1), queue)

    def finalizer(self, block: Block):
        finalized = self._finalized

        def core():
            # Runs inside the garbage collector, perhaps while this very allocator holds its
            # lock on this thread: touch nothing but the deque.
            finalized.append(block)

        return core

    def drain(self) -> int:
        """Free every block whose numba array died; returns how many."""
        if self._defer:
            return 0
        n = 0
        while True:
            try:
                block = self._finalized.popleft()
            except IndexError:
                return n
            if not block.freed:
                if block.queue is self.default_queue and not self.allocator.backend.closed:
                    # Nobody said which queues used it: wait for every one that exists now.
                    # (Once the backend is closed no queue runs anything: the block is free.)
                    for q in self.allocator.backend.live_queues():
                        if q is not block.queue:
                            self.allocator.record_stream(block, q)
                self.allocator.free(block, wait_owner=True)
                n += 1

    def record_stream_at(self, ptr: int, queue: Queue) -> Block:
        """``record_stream`` for the live block holding address ``ptr`` (a numba array's data
        pointer, which may point inside its block); returns the block.  ValueError if no live
        block of this allocator holds it."""
        for block in self.allocator.live_blocks():
            if block.ptr <= ptr < block.ptr + block.nbytes:
                self.allocator.record_stream(block, queue)
                return block
        raise ValueError(f"record_stream_array: array at {ptr:#x} was not allocated by vtnumba's memory manager "
                         "(or was already freed)")

    @contextlib.contextmanager
    def defer_cleanup(self):
        """numba's defer_cleanup: while active, finalized blocks stay queued."""
        self.hold_frees(1)
        try:
            yield
        finally:
            self.hold_frees(-1)

    def hold_frees(self, n: int) -> None:
        """Count ``n`` more (or, negative, fewer) deferrals under way: frees wait while any is."""
        with self._defer_lock:
            self._defer += n

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes: cached free memory counts as free."""
        self.allocator.process_events()
        stats = self.allocator.stats()
        cached = stats["cached_free_bytes"]
        if self.allocator.limit_bytes is not None:
            total = self.allocator.limit_bytes
            return total - stats["reserved_bytes"] + cached, total
        mem_info = getattr(self.allocator.source, "mem_info", None)
        if mem_info is None:
            raise NotImplementedError("the segment source reports no memory info and no limit_bytes is set")
        free, total = mem_info()
        return free + cached, total

    def reset(self) -> None:
        """numba's reset (context teardown): free what has died, release the cache."""
        self.drain()
        self.allocator.empty_cache(wait_s=self.allocator.oom_wait_s)


# ---------------------------------------------------------------------- numba plugin class
_config: dict = {}
_plugin_cls = None


def numba_memory_manager_class():
    """The ``HostOnlyCUDAMemoryManager`` subclass (built on first use: it imports the real
    ``numba.cuda`` driver, which does not exist in the simulator)."""
    global _plugin_cls
    if _plugin_cls is not None:
        return _plugin_cls
    from numba.cuda.cudadrv import driver as drv

    class VtnumbaMemoryManager(drv.GetIpcHandleMixin, drv.HostOnlyCUDAMemoryManager):
        """numba EMM plugin: device memory from vtnumba's :class:`CachingAllocator`."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)   # numba instantiates once with context=None
            self._core: _EMMCore | None = None
            # Deferrals under way that began before the core existed (see defer_cleanup).
            self._defers_before_core = 0
            self._core_lock = threading.Lock()

        def initialize(self):
            # The allocator is built at the first memalloc instead: creating the backend
            # (streams, events) needs the context that is being initialised right now.
            pass

        def _get_core(self) -> _EMMCore:
            if self._core is None:
                core = _make_core()
                # What numba's own manager does in initialize: size the queue of pending host
                # frees (pinned buffers) by the device's memory.  Left unset, its byte threshold
                # is 0 and every pinned free runs at once, from whatever call dropped the array.
                if self.deallocations.memory_capacity == drv._SizeNotSet:
                    self.deallocations.memory_capacity = core.memory_info()[1]
                with self._core_lock:  # deferrals already under way hold its frees too
                    core.hold_frees(self._defers_before_core)
                    self._core = core
            return self._core

        def memalloc(self, size):
            core = self._get_core()
            block = core.alloc(size)
            ctx = weakref.proxy(self.context) if self.context is not None else None
            mem = drv.AutoFreePointer(ctx, drv.binding.CUdeviceptr(block.ptr), size,
                                      finalizer=self._finalizer(core, block))
            self.allocations[block.ptr] = mem  # keeps `mem` alive while numba's owned pointer lives
            return mem.own()

        def _finalizer(self, core, block):
            allocations, queue_free = self.allocations, core.finalizer(block)
            key = block.ptr

            def finalize():
                allocations.pop(key, None)
                queue_free()

            return finalize

        def get_memory_info(self):
            free, total = self._get_core().memory_info()
            return drv.MemoryInfo(free=free, total=total)

        def reset(self):
            super().reset()
            if self._core is not None:
                self._core.reset()

        @contextlib.contextmanager
        def defer_cleanup(self):
            # No core is made here: this may run inside a host function, on the driver's
            # thread, where making one (a backend, a stream, cuMemGetInfo) is not allowed.
            # Before the core exists nothing of its needs holding back; the deferral is
            # counted, and a core made while it lasts starts out holding its frees.
            with self._core_lock:
                core = self._core
                if core is None:
                    self._defers_before_core += 1
                else:
                    core.hold_frees(1)
            try:
                with super().defer_cleanup():
                    yield
            finally:
                with self._core_lock:
                    if core is None:
                        self._defers_before_core -= 1
                    held = core or self._core  # (a core made meanwhile counted this deferral)
                    if held is not None:
                        held.hold_frees(-1)

        @property
        def core(self) -> _EMMCore:
            return self._get_core()

        @property
        def interface_version(self):
            return 1

    _plugin_cls = VtnumbaMemoryManager
    return _plugin_cls


def _legacy_default_queue(backend) -> Queue:
    """A Queue on the CUDA legacy default stream (stream 0), where numba puts work that
    names no stream.  (The backend has no public constructor for it; we create a queue and
    point it at stream 0.)"""
    from numba import cuda

    q = backend.create_queue("legacy-default")
    if not backend.capabilities.simulator:
        from cuda.bindings import driver as cu

        # Both of the queue's handles must name stream 0: numba's launches and events use
        # q.stream, the driver calls (flags, host functions) q.handle.  The stream made for
        # it goes unused, so it goes now.
        (err,) = cu.cuStreamDestroy(q.handle)
        q.handle = cu.CUstream(0)
        q.stream = cuda.default_stream()
    return q


def _make_core() -> _EMMCore:
    backend = _config.get("backend")
    if backend is None:
        from vtnumba.backend.default import default_backend

        backend = default_backend()
    source = _config.get("segment_source") or _DriverSegments()
    allocator = CachingAllocator(backend, segment_source=source, limit_bytes=_config.get("limit_bytes"))
    from vtnumba.backend.cuda import CUDABackend

    default_q = _legacy_default_queue(backend) if isinstance(backend, CUDABackend) \
        else backend.create_queue("emm-default")
    return _EMMCore(allocator, default_q)


def install_numba_memory_manager(backend: Backend | None = None, *, limit_bytes: int | None = None,
                                 segment_source=None):
    """Make numba allocate device memory through vtnumba's caching allocator.

    Call it once, before anything creates a CUDA context (before the first
    ``device_array``, kernel launch or ``CUDABackend``).  ``backend`` supplies queues and
    events (default: the registered default backend, at first allocation);
    ``segment_source`` supplies segments (default: ``cuMemAlloc``).  Returns the plugin class.

    Without ``backend`` it then makes this process's GPU's context
    (:mod:`vtnumba.backend.device_choice`) current, with the plugin in it: numba's next call
    would otherwise make device 0's, and the first allocation -- which makes the default
    backend, on the process's GPU, from inside numba's call -- could not switch.
    """
    from vtnumba.backend.arrays import simulator_active

    if simulator_active():
        raise RuntimeError("install_numba_memory_manager: numba's CUDA simulator has no external memory "
                           "manager (target 'cudasim'); it is for the 'cuda' target only")
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"backend must be a vtnumba Backend, got {type(backend).__name__}")
    from numba.cuda.cudadrv import driver as drv

    if any(getattr(dev, "primary_context", None) is not None for dev in drv.driver.devices.values()):
        raise RuntimeError("install_numba_memory_manager: a CUDA context already exists, and numba cannot "
                           "switch memory managers afterwards; call it first thing in the process")
    cls = numba_memory_manager_class()
    _config.clear()
    _config.update(backend=backend, limit_bytes=limit_bytes, segment_source=segment_source)
    from numba import cuda

    cuda.set_memory_manager(cls)
    if backend is None:  # (the backend is made inside numba's first allocation: see above)
        from vtnumba.backend.cuda import current_context

        current_context()
    return cls


def record_stream_array(array, queue: Queue) -> None:
    """``record_stream`` for a numba device array that the plugin allocated: ``queue`` uses it
    too, so when the array dies its memory is reused only after ``queue``'s work queued so far
    (see the module docstring; ``_EMMCore.record_stream_at`` does the lookup)."""
    _active_plugin().core.record_stream_at(int(array.__cuda_array_interface__["data"][0]), queue)


def _active_plugin():
    from vtnumba.backend.cuda import current_context

    mm = current_context().memory_manager
    if not hasattr(mm, "core") or not isinstance(mm, numba_memory_manager_class()):
        raise RuntimeError("vtnumba's memory manager is not installed; call install_numba_memory_manager() first")
    return mm
