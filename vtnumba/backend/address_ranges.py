"""Which address ranges are live memory: the check that keeps a raw-pointer copy from crashing the process.

A batched copy (:mod:`vtnumba.memory.copy_engine`) moves bytes between *raw addresses* --
the encoder cache's descriptors are plain integers.  Python cannot tell a good address from
a bad one: on the host a bad one is a segmentation fault that kills the process (and, under
``mpiexec``, the job) without a word; on a GPU it is an illegal memory access that leaves the
process's CUDA context dead, so every later CUDA call fails too.  So every range a copy
would touch is checked first against the ranges this process *knows* are live:

* every :class:`~vtnumba.backend.Buffer` a backend allocates (``alloc``, ``alloc_pinned``) is
  registered until it is freed -- host addresses on ``cpu``/``cudasim``, device addresses on a
  GPU (one unified address space, so the two never collide);
* an encoder-cache region registers its mapping while it is open;
* anything else a copy may touch -- an array the caller made -- is registered for as long
  as the copy may run, with :func:`registered` (a context manager) or :func:`register`.

A descriptor passes when its whole byte range ``[address, address + nbytes)`` lies inside
one registered range.  The check is vectorised (``searchsorted`` over the sorted range
starts), so it costs microseconds per batch, and it raises a ValueError that names the
descriptor, the address and the nearest known range.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from contextlib import contextmanager

import numpy as np

_ids = itertools.count(1)


class AddressRanges:
    """A thread-safe set of ``[start, start + nbytes)`` ranges, each with a description.

    :meth:`unregister` never waits for the lock.  It runs from a Buffer's finalizer, which
    the garbage collector may call *inside* any allocation -- including one made by a thread
    that holds this very lock (building the sorted table allocates arrays).  A blocking
    unregister would then wait for itself forever; instead it queues the token (a deque's
    append is atomic), and whoever takes the lock next applies the queued removals first.
    """

    def __init__(self) -> None:
        self._ranges: dict[int, tuple[int, int, str]] = {}  # token -> (start, end, what)
        self._lock = threading.Lock()
        self._sorted: tuple | None = None
        self._removed: deque[int] = deque()  # tokens unregistered but not yet taken out of _ranges

    def _apply_removals(self) -> None:
        # Under the lock.  A removal queued while this runs (by a finalizer the allocations
        # below set off) stays queued for the next caller: the deque is never left stale.
        # The table is dropped *before* the token leaves the deque: a lock-free reader that
        # finds the deque empty then also finds no stale table (see _table).
        while self._removed:
            if self._ranges.pop(self._removed[0], None) is not None:
                self._sorted = None
            self._removed.popleft()

    def register(self, start: int, nbytes: int, what: str) -> int:
        """Declare ``nbytes`` at ``start`` live; returns a token for :meth:`unregister`."""
        start, nbytes = int(start), int(nbytes)
        if start < 0 or nbytes < 0:
            raise ValueError(f"cannot register {nbytes} bytes at address {start:#x}")
        token = next(_ids)
        entry = (start, start + nbytes, what)
        with self._lock:
            self._apply_removals()
            self._ranges[token] = entry
            self._sorted = None
        return token

    def unregister(self, token: int) -> None:
        """Forget a range (idempotent: an unknown token is ignored).  Never blocks: safe in a
        garbage-collection finalizer (see the class docstring)."""
        self._removed.append(token)

    def _table(self) -> tuple:
        if not self._removed:
            table = self._sorted
            if table is not None:
                # The common case, read without the lock (one attribute read is atomic): every
                # batched copy asks, and the table changes only when memory comes or goes.  The
                # order matters: an unregister() that returned before this call is either still
                # queued (and we take the lock) or applied, its table dropped before its token
                # left the queue -- never an old table with an empty queue.
                return table
        with self._lock:
            self._apply_removals()
            if self._sorted is None:
                items = sorted(self._ranges.values())
                starts = np.array([s for s, _, _ in items], dtype=np.uint64)
                ends = np.array([e for _, e, _ in items], dtype=np.uint64)
                # reach[k]: the furthest end of any range starting at or before starts[k].  A byte
                # range [p, p + n) is inside *some* known range exactly when the ranges starting
                # at or before p reach p + n (ranges may nest: a region inside a larger mapping).
                reach = np.maximum.accumulate(ends) if ends.size else ends
                self._sorted = (starts, ends, reach, [w for _, _, w in items])
            return self._sorted

    def check(self, name: str, ptrs: np.ndarray, sizes: np.ndarray) -> None:
        """ValueError unless ``[ptrs[i], ptrs[i] + sizes[i])`` lies inside one known range for every
        non-empty descriptor ``i`` (``ptrs``/``sizes``: equal-length uint64 arrays)."""
        live = sizes > 0
        if not live.any():
            return
        starts, ends, reach, whats = self._table()
        p, n = ptrs[live], sizes[live]
        idx = np.searchsorted(starts, p, side="right").astype(np.int64) - 1  # last range starting <= p
        if starts.size:
            # reach - p >= n, not reach >= p + n: p + n wraps past 2**64 for a huge size or a
            # negative pointer (-1 arrives as 0xff..ff), and a wrapped end looks inside.
            r = reach[np.maximum(idx, 0)]
            ok = (idx >= 0) & (r >= p) & (r - p >= n)
        else:
            ok = np.zeros(p.size, dtype=bool)
        if ok.all():
            return
        bad = int(np.flatnonzero(~ok)[0])
        i = int(np.flatnonzero(live)[bad])
        addr, size = int(ptrs[i]), int(sizes[i])
        near = ""
        if starts.size:
            k = int(idx[bad])
            where = "starting closest below it" if k >= 0 else "nearest (every known range starts above it)"
            k = max(k, 0)
            near = (f"; the known range {where} is {whats[k]} at {int(starts[k]):#x}..{int(ends[k]):#x} "
                    f"({int(ends[k] - starts[k])} bytes)")
        raise ValueError(f"{name}[{i}] = {addr:#x} with sizes[{i}] = {size}: the range {addr:#x}..{addr + size:#x} "
                         f"is not inside any live allocation this process knows{near}; a raw-pointer copy there "
                         "would crash the process (register memory you made yourself with "
                         "vtnumba.backend.address_ranges.registered)")

    def __len__(self) -> int:
        with self._lock:
            self._apply_removals()
            return len(self._ranges)


#: The process-wide set every backend, region and copy uses.
LIVE = AddressRanges()


def register(start: int, nbytes: int, what: str) -> int:
    """Declare ``[start, start + nbytes)`` live in :data:`LIVE`; returns the token to unregister."""
    return LIVE.register(start, nbytes, what)


def unregister(token: int) -> None:
    """Undo :func:`register`."""
    LIVE.unregister(token)


@contextmanager
def registered(arr, what: str = "caller's array"):
    """Declare a numpy or device array's bytes live for the duration of a ``with`` block."""
    from vtnumba.backend.arrays import address_of

    token = LIVE.register(address_of(arr), int(arr.nbytes), what)
    try:
        yield arr
    finally:
        LIVE.unregister(token)


__all__ = ["AddressRanges", "LIVE", "register", "unregister", "registered"]
