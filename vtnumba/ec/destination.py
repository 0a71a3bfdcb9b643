"""Load destinations: the device buffers loads copy into, and when they may be freed.

Upstream: the ``dst_buf.record_stream(compute_stream)`` line in ``ECCPUWorker.start_load_caches``.

A load copies every entry of the step into *one* contiguous device buffer (on a copy
queue) and hands out per-``mm_hash`` views of it; the model then reads those views on the
*compute* queue.  The buffer is in use by two queues.  A caching allocator only tracks the
queue a block was allocated on, so if the buffer went back to the pool the moment the
last view died, a later allocation could overwrite it while reads queued on the compute
queue still need it.  ``record_stream`` closes that hole: "before reusing this memory,
also wait for everything queued on the compute queue *at the time it is freed*".

This module implements exactly that rule for a step's load buffer:

1. the buffer may be returned only after (a) the load copy's end event fired and (b) no
   handed-out view (nor anything sliced from one) is alive any more;
2. at that moment an event is recorded on the compute queue; the memory is returned when
   that event fires -- or, with a caching allocator, the allocator is told
   ``record_stream(block, compute_queue)`` at allocation and does the waiting itself.

"No view is alive" is detected exactly on the host targets: a buffer's views are cut from
an *owner* array of its own, ``np.frombuffer`` over a ``memoryview`` of the buffer.  numpy
gives a view the array it was cut from as its base, collapsing chains of views down to the
first array that owns its memory -- but it stops at an array whose own base is not an
array, and the owner's base is the memoryview.  So every numpy array derived from the
views, however indirectly, holds a reference to the owner, and the owner's reference count
says how many there are: when it is back to what it was before any view existed, none is
alive -- the same count a tensor's storage keeps.  (The count is read when the buffer is
asked about -- at a poll, or when a load looks for a buffer to reuse -- one
``sys.getrefcount``; nothing runs when a view dies, and the owner lives as long as the
buffer, so a reused buffer keeps its owner.)

On a real GPU the views are numba device arrays, and numba has the same refcount: a device
array's memory is a ``MemoryPointer``, and every array sliced, reshaped or re-typed from
it takes a reference on the pointer it came from (``OwnedPointer``).  So each step's views
are cut from a pointer of its own -- an ``AutoFreePointer`` over the step's bytes that owns
nothing and whose "free" only flips the flag -- and the flag flips when the last array
derived from any view is gone.  (A finalizer on each handed-out view would fire while a
slice of it still reads the buffer.)  Until then the pointer's finalizer also keeps the
device allocation referenced, so a buffer handed over to its views at shutdown stays valid.

**Synchronous queues** (the cpu target's default mode, the simulator: every queued
operation runs on the spot) make step 2 empty: whatever the compute queue was given has
already run, so the event would fire the moment it is recorded.  There the buffer is
reusable as soon as (a) and (b) hold, and instead of handing it back to the allocator it
is kept as the *spare* and reused -- the same :class:`LoadDestination`, owner and all -- by
the next load that fits: a one-buffer cache in front of the caching allocator, which saves
each step the allocator's round trip (a new Block, its address registration, the pool
bookkeeping).  A hazard checker, when one is watching, sees the full path: no spare,
``record_stream`` as upstream.
"""

from __future__ import annotations

import functools
import sys
import threading

import numpy as np

from vtnumba.backend.arrays import host_view, wrap_host_memory
from vtnumba.backend.base import Backend, Event, Queue, observing_uses
from vtnumba.memory.copy_engine import address_of

__all__ = ["LoadDestination", "LoadDestinations"]


class LoadDestination:
    """A step's contiguous load buffer -- reused by later steps on synchronous queues (see the
    module docstring for its life)."""

    __slots__ = ("memory", "ptr", "nbytes", "capacity", "copy_done", "views_pointer", "release_event",
                 "from_allocator", "freed", "_views_dead", "_owner", "_owner_refs")

    def __init__(self, memory, ptr: int, nbytes: int, capacity: int | None = None):
        self.memory = memory          #: a Buffer (or an allocator block) holding the bytes
        self.ptr = ptr                #: address of its first byte
        self.nbytes = nbytes          #: bytes this step's load uses
        #: bytes the memory holds (more than ``nbytes`` when a larger spare was reused)
        self.capacity = nbytes if capacity is None else capacity
        self.copy_done = False        #: the load's end event fired
        self.views_pointer = None     #: real GPU: the numba pointer every view is cut from (see module docstring)
        self.release_event: Event | None = None  #: recorded on the compute queue once (a) and (b) held
        self.from_allocator = False   #: the memory came from the caching allocator (else backend.alloc)
        self.freed = False            #: the memory went back (or became the spare)
        self._views_dead = False      # real GPU: set by a finalizer when the last derived array died
        self._owner = None            # host targets: the owner array every view is cut from
        self._owner_refs = 0          # host targets: the owner's reference count with no view alive

    def own(self, memory_bytes: np.ndarray) -> None:
        """Host targets: cut this buffer's views from an owner over ``memory_bytes`` (a flat
        uint8 array of all of its capacity), and note its reference count with no view alive."""
        self._owner = np.frombuffer(memoryview(memory_bytes), np.uint8, self.capacity)
        self._owner_refs = self._owner_references()

    def _owner_references(self) -> int:
        # Always read through this one method, so the count it is compared with was taken
        # the same way (an interpreter may skip the reference a call argument takes).
        return sys.getrefcount(self._owner)

    @property
    def views_dead(self) -> bool:
        """No view handed out for this buffer -- nor any array derived from one -- is alive."""
        if self._owner is not None:
            return self._owner_references() <= self._owner_refs
        return self._views_dead

    @views_dead.setter
    def views_dead(self, value: bool) -> None:
        self._views_dead = value  # (on the host the owner's count decides: see the getter)

    def __repr__(self) -> str:
        return (f"<LoadDestination {self.nbytes} B copy_done={self.copy_done} views_dead={self.views_dead} "
                f"freed={self.freed}>")


class LoadDestinations:
    """Allocates load buffers, hands out typed views, and frees buffers once it is safe."""

    def __init__(self, backend: Backend, compute_queue: Queue, allocator=None, *, follow_default_stream: bool = False):
        self.backend = backend
        self.compute_queue = compute_queue
        self.allocator = allocator
        #: The views are read on the default stream too (the worker made its compute queue
        #: itself, so callers launch elsewhere): a buffer is released only after the default
        #: stream's work queued by then, as well as the compute queue's.
        self.follow_default_stream = follow_default_stream
        # The backend declares what its memory is: host-addressable memory (cpu, simulator)
        # gets exact view tracking through numpy; a real GPU's gets one views pointer per
        # buffer, whose finalizer runs when the last array cut from any of its views is gone.
        caps = backend.capabilities
        self._host = caps.host_addressable
        self._simulator = caps.simulator
        self._synchronous = not caps.async_queues
        self._lock = threading.Lock()
        self._live: list[LoadDestination] = []
        # Synchronous queues: the last reclaimed buffer, kept for the next load that fits.
        self._spare: LoadDestination | None = None
        self.freed_count = 0    #: buffers whose step is over (returned, or kept as the spare)
        self.spare_reuses = 0   #: loads that reused the spare instead of allocating

    # ------------------------------------------------------------------ allocation and views
    def allocate(self, nbytes: int, copy_queue: Queue) -> LoadDestination:
        """A load buffer of ``nbytes``, written by ``copy_queue`` and read on the compute queue."""
        if self._synchronous:
            dest = self._reuse_spare(nbytes)
            if dest is not None:
                return dest
        from_allocator = self.allocator is not None and nbytes > 0
        if from_allocator:
            # Allocated for the copy queue, which writes it first...
            memory = self.allocator.allocate(nbytes, copy_queue)
            if not (self._synchronous and not observing_uses()):
                # ...and, as upstream: dst_buf.record_stream(compute_stream) -- the allocator waits
                # for the compute queue's reads before it reissues this memory.  (Synchronous
                # queues have run those reads already; see the module docstring.)
                self.allocator.record_stream(memory, self.compute_queue)
        else:
            memory = self.backend.alloc(nbytes)
        dest = LoadDestination(memory, address_of(memory) if nbytes else 0, nbytes)
        dest.from_allocator = from_allocator
        if self._host:
            dest.own(self._host_array(memory))
        with self._lock:
            self._live.append(dest)
        return dest

    def _reuse_spare(self, nbytes: int) -> LoadDestination | None:
        """Synchronous queues: the spare, now this load's buffer, if it fits (else None)."""
        with self._lock:  # (a report on another thread may be making a buffer the spare)
            if self._spare is None and len(self._live) == 1:
                prev = self._live[0]
                if prev.copy_done and nbytes <= prev.capacity and prev.views_dead and not observing_uses():
                    # The usual step: the one buffer, whose views the previous step's caller just
                    # dropped before asking for more.  Its step is over, and it serves this one
                    # as it is -- in place, warm in the cache, one buffer instead of two.
                    self.freed_count += 1
                    self.spare_reuses += 1
                    prev.nbytes = nbytes
                    prev.copy_done = False
                    return prev
        if self._spare is None and self._live:
            self.reclaim()  # several buffers, or one that does not fit: the free ones become the spare
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        if nbytes <= spare.capacity and not observing_uses():
            # (Its views are dead: it became the spare only once they were, or was never viewed.)
            self.spare_reuses += 1
            spare.nbytes = nbytes
            spare.copy_done = spare.freed = False
            with self._lock:
                self._live.append(spare)
            return spare
        self._give_back(spare)  # too small (or a checker is watching): back to where it came from
        return None

    def _host_array(self, memory) -> np.ndarray:
        arr = getattr(memory, "array", memory)
        view = host_view(arr)  # numpy itself, or the numpy memory behind a simulated array
        if view is None:
            raise TypeError(f"load buffer {type(arr).__name__} is not host-addressable")
        return view

    def views(self, dest: LoadDestination, dtype, hidden: int, row_counts: list) -> list:
        """Typed ``[rows, hidden]`` arrays on the target, one per count in ``row_counts``, lying one
        after another from ``dest``'s first byte (a step's entries, in the order they were copied)."""
        dtype = np.dtype(dtype)
        row_bytes = hidden * dtype.itemsize
        if self._host:
            # One typed [rows, hidden] array of the whole step laid on the owner's first bytes
            # (its base is the owner, like any view's), then a row slice per entry: one numpy
            # call per entry instead of three (slice, view, reshape) -- this runs every step.
            total = sum(row_counts)
            if total * row_bytes > dest.capacity:
                raise ValueError(f"views of {total} rows of {row_bytes} bytes do not fit the {dest.capacity}-byte "
                                 "load buffer")
            rows = np.ndarray((total, hidden), dtype, dest._owner)
            if not self._simulator and len(row_counts) == 1:
                return [rows]  # the usual step: one entry, the whole array
            out, r = [], 0
            for k in row_counts:
                arr = rows[r:r + k]
                out.append(wrap_host_memory(arr) if self._simulator else arr)  # in place in the simulator
                r += k
            return out
        out, offset = [], 0
        for k in row_counts:
            out.append(_gpu_view(dest, dtype, (k, hidden), offset, k * row_bytes))
            offset += k * row_bytes
        return out

    def seal(self, dest: LoadDestination) -> None:
        """All views are handed out: from now on only they keep the buffer in use.  (On the
        host nothing changes: the owner's count already tells.)"""
        if not self._host and dest.views_pointer is None:  # no view was handed out
            dest.views_dead = True

    def copy_finished(self, dest: LoadDestination) -> None:
        """The load copy into ``dest`` has finished (its end event fired)."""
        dest.copy_done = True

    def cancel(self, dest: LoadDestination) -> None:
        """``dest`` was allocated but nothing was (or will be) copied into it, and it has no
        views: it is free at once."""
        dest.copy_done = dest.views_dead = True
        self._free(dest)

    # ------------------------------------------------------------------ freeing
    def reclaim(self) -> int:
        """Free every buffer whose copy finished, whose views died and whose compute-queue
        reads are done.  Non-blocking; returns how many were freed."""
        if self.allocator is not None and not self._synchronous:
            # Let the allocator take back blocks whose compute-queue events have fired.
            self.allocator.process_events()
        if not self._live:
            return 0
        freed = 0
        with self._lock:
            candidates = [d for d in self._live if d.copy_done and d.views_dead]
        if candidates and self.follow_default_stream and not self._synchronous:
            # The release events below (and the allocator's, for record_stream) are recorded on
            # the compute queue: make it cover the default stream's reads of the views first.
            self.backend.order_after_default_stream(self.compute_queue)
        for dest in candidates:
            if dest.from_allocator or self._synchronous:
                # The allocator holds it back until the compute queue caught up (record_stream);
                # synchronous queues have caught up already.
                self._free(dest)
                freed += 1
                continue
            if dest.release_event is None:
                # record_stream's rule: wait for what the compute queue has queued *now*.
                dest.release_event = self.backend.create_event(timing=False)
                self.backend.record_event(dest.release_event, self.compute_queue)
            if self.backend.query_event(dest.release_event):
                self._free(dest)
                freed += 1
        return freed

    def _free(self, dest: LoadDestination) -> None:
        keep = self._synchronous and dest.capacity and not observing_uses()
        with self._lock:
            if dest.freed or not (dest.copy_done and dest.views_dead):
                # (Checked again under the lock: a load on another thread may have taken it
                # back -- copied into it, cut views -- since the caller saw it free; see
                # _reuse_spare.)
                return
            dest.freed = True
            self._live.remove(dest)
            self.freed_count += 1
            if keep:
                # Keep it for the next load (see the module docstring); the previous spare goes
                # back.  (Swapped under the lock: a load on another thread may be taking it.)
                old, self._spare = self._spare, dest
        dest.views_pointer = None  # its views are gone (or handed the memory over, see drain)
        if dest.release_event is not None:
            self.backend.destroy_event(dest.release_event)
            dest.release_event = None
        if not keep:
            self._give_back(dest)
        elif old is not None:
            self._give_back(old)

    def _give_back(self, dest: LoadDestination) -> None:
        dest._owner = None  # no view is alive (the memory may be reissued): nothing to count any more
        if dest.from_allocator:
            self.allocator.free(dest.memory)
        else:
            self.backend.free(dest.memory)

    def live_count(self) -> int:
        """How many buffers are not freed yet (the length of :meth:`pending`, without the copy)."""
        return len(self._live)

    def pending(self) -> list[LoadDestination]:
        """The buffers not freed yet."""
        with self._lock:
            return list(self._live)

    def drain(self) -> int:
        """Shutdown: wait for the compute queue, free every buffer nobody views any more.

        Buffers whose views are still alive are left to their views: on the host the views
        own the memory (the backend no longer tracks it), so nothing dangles.
        """
        self.backend.synchronize(self.compute_queue)
        n = 0
        for dest in self.pending():
            dest.copy_done = True
            if dest.views_dead:
                if dest.release_event is not None and not self.backend.query_event(dest.release_event):
                    self.backend.synchronize_event(dest.release_event)
                self._free(dest)
                n += 1
            elif not dest.from_allocator:
                # Hand the memory over to the views.  backend.free only drops the backend's
                # reference: the views still reference the bytes (the numpy base on the
                # host; on a GPU the views pointer, whose finalizer holds numba's
                # allocation), so nothing dangles and nothing leaks.
                with self._lock:
                    dest.freed = True
                    self._live.remove(dest)
                self.backend.free(dest.memory)
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            self._give_back(spare)
        return n


def _gpu_view(dest: LoadDestination, dtype: np.dtype, shape: tuple, offset: int, nbytes: int):
    """A C-contiguous ``shape`` array of ``dtype`` on ``dest``'s bytes at ``offset``, made on
    ``dest``'s views pointer, so that it and everything derived from it hold a reference there.
    (Built directly from the pointer: one device array per view, no slice/view/reshape chain.)"""
    if nbytes == 0 or not dest.ptr:
        return dest.memory.view(dtype, shape, offset)  # an empty view reads no bytes: nothing to keep in use
    if offset + nbytes > dest.capacity:
        raise ValueError(f"a view of {nbytes} bytes at offset {offset} does not fit the {dest.capacity}-byte "
                         "load buffer")
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.cudadrv.driver import AutoFreePointer

    from vtnumba.backend.cuda import current_context

    if dest.views_pointer is None:
        from cuda.bindings import driver as cu

        # Owns no memory: its "free" (run when the last reference goes) marks the views dead.
        # The finalizer's arguments keep the real allocation alive until then.
        keep = getattr(dest.memory, "array", dest.memory)
        dest.views_pointer = AutoFreePointer(current_context(), cu.CUdeviceptr(dest.ptr), dest.capacity,
                                             finalizer=functools.partial(_views_died, dest, keep))
    owned = dest.views_pointer.view(offset, offset + nbytes)  # an OwnedPointer: one reference
    strides, step = [], dtype.itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return DeviceNDArray(shape, tuple(reversed(strides)), dtype, gpu_data=owned)


def _views_died(dest: LoadDestination, _allocation) -> None:
    # Runs when the last array derived from the step's views is gone, on whatever thread:
    # only flip the flag (the worker's next poll frees the buffer).
    dest.views_dead = True
