"""EmbeddingCache: which blocks of the shared region hold which encoder output (scheduler side).

Upstream: ``EmbeddingCache`` in vLLM's CPU encoder-cache connector -- a named-entry block cache
with FIFO eviction.  It never touches the region's bytes; it only decides *where* they go.

An entry (keyed by ``mm_hash``) owns a tuple of block ids and is in one of three states::

    alloc ──> not-ready ──mark_ready──> ready (evictable) ──pin──> pinned ──unpin×k──> ready
                  │                          │                        (pins nest)
               discard                 evicted, oldest first, only when an alloc needs room

* **not-ready**: blocks handed out, the save has not finished -- never evicted (the worker
  may be writing into them), never read;
* **ready**: the bytes are in the region; evictable, oldest-ready first;
* **pinned**: someone is reading the blocks (a load in flight) -- never evicted.  Pins nest:
  k ``pin`` calls need k ``unpin`` calls.

``alloc`` only evicts when eviction can make enough room; otherwise it returns ``None`` and
evicts nothing (evicting entries that would not make room loses data for no gain).

Free blocks are kept as sorted runs ``[start, end)`` and an allocation takes the *lowest*
free ids, in ascending order.  That keeps an entry's blocks in few runs of consecutive
ids, which the worker coalesces into a handful of copy descriptors (see
:func:`~vtnumba.ec.coalesce_runs`), and it costs per run, not per block (an entry can be
thousands of rows).  vLLM's pops a LIFO stack, which gives descending ids -- one
descriptor per block.

Every public method takes one lock, so scheduler threads and a read-serving thread can
share one cache.  Unknown keys raise ``KeyError`` naming the key; allocating a key that
already has an entry is a ``ValueError``; state violations (pin a not-ready entry, unpin an
unpinned one, ...) raise ``RuntimeError``.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain

import numpy as np

from vtnumba.backend.arrays import is_int

__all__ = ["CacheEntry", "CacheStats", "EmbeddingCache"]

_NOT_READY = -1


class CacheEntry:
    """One entry.  Read ``block_ids``, ``ready``, ``pinned``, ``pin_count``; mutate only via the cache.

    The blocks are stored as runs ``(start, end)``; ``block_ids`` (a tuple, as in vLLM's)
    and ``block_array`` (an int64 array, what the per-step metadata carries) are built from
    them on first use -- an entry can span thousands of blocks.
    """

    # A dict: the values document the public slots (autodoc and help() show them).
    __slots__ = {"key": "The entry's mm_hash.", "num_blocks": "How many blocks it holds.", "_runs": None,
                 "_pin_count": None, "_ids": None, "_array": None}

    def __init__(self, key: str, runs: list[tuple[int, int]]):
        self.key = key
        self._runs = runs
        self.num_blocks = sum(b - a for a, b in runs)
        self._pin_count = _NOT_READY
        self._ids: tuple[int, ...] | None = None
        self._array: np.ndarray | None = None

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The block ids, ascending, as a tuple."""
        if self._ids is None:
            self._ids = tuple(chain.from_iterable(range(a, b) for a, b in self._runs))
        return self._ids

    @property
    def block_array(self) -> np.ndarray:
        """The block ids as a read-only int64 array (what the per-step metadata carries)."""
        if self._array is None:
            arr = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self._runs]) if self._runs \
                else np.zeros(0, np.int64)
            arr.flags.writeable = False  # shared by everyone who asks; nobody may edit it
            self._array = arr
        return self._array

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The blocks as runs ``(start, end)`` of consecutive ids."""
        return list(self._runs)

    @property
    def ready(self) -> bool:
        """Its save has completed: it can be read."""
        return self._pin_count >= 0

    @property
    def pinned(self) -> bool:
        """Someone is reading it: it cannot be evicted."""
        return self._pin_count > 0

    @property
    def evictable(self) -> bool:
        """Ready and not pinned."""
        return self._pin_count == 0

    @property
    def pin_count(self) -> int:
        """Readers holding it (pins nest)."""
        return max(self._pin_count, 0)

    @property
    def state(self) -> str:
        """``"not-ready"``, ``"ready"`` or ``"pinned"``."""
        return "not-ready" if not self.ready else ("pinned" if self.pinned else "ready")

    def __repr__(self) -> str:
        return f"<CacheEntry {self.key!r} {self.state} pins={self.pin_count} blocks={self.num_blocks}>"


@dataclass
class CacheStats:
    """Counters since construction.  A hit/miss is a read request (``pin_if_ready``)."""

    hits: int = 0            #: read requests that found the entry ready
    misses: int = 0          #: read requests that did not
    evictions: int = 0       #: entries evicted to make room
    evicted_blocks: int = 0  #: their blocks
    allocs: int = 0          #: entries allocated
    failed_allocs: int = 0   #: allocations refused for lack of room (nothing evicted)


class EmbeddingCache:
    """A fixed pool of ``num_blocks`` block ids shared by named entries (see module docstring)."""

    def __init__(self, num_blocks: int):
        if not is_int(num_blocks) or num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks!r} must be a non-negative int")
        self.num_blocks = int(num_blocks)
        self._lock = threading.Lock()
        self._free = _FreeRuns(num_blocks)
        self._entries: dict[str, CacheEntry] = {}
        # Ready and unpinned entries, oldest first: the eviction order.
        self._evictable: OrderedDict[str, None] = OrderedDict()
        self._evictable_blocks = 0
        self.stats = CacheStats()

    # ------------------------------------------------------------------ queries
    def lookup(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` or None (does not count as a hit or miss)."""
        if not isinstance(key, str):
            raise TypeError(f"key={key!r} must be a str (an mm_hash)")
        with self._lock:
            return self._entries.get(key)

    get = lookup

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no entry holds."""
        with self._lock:
            return self._free.count

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks held by ready, unpinned entries (what eviction could free)."""
        with self._lock:
            return self._evictable_blocks

    def has_held_entries(self) -> bool:
        """True while any entry is not-ready (a save in flight) or pinned (a load in flight)."""
        with self._lock:
            return any(not e.ready or e.pinned for e in self._entries.values())

    def not_ready(self) -> list[str]:
        """Keys whose save has not been confirmed (their blocks are held, nothing can read them)."""
        with self._lock:
            return [k for k, e in self._entries.items() if not e.ready]

    def eviction_order(self) -> list[str]:
        """Keys that would be evicted, in the order they would go."""
        with self._lock:
            return list(self._evictable)

    # ------------------------------------------------------------------ transitions
    def alloc(self, key: str, n_blocks: int) -> CacheEntry | None:
        """Give ``key`` ``n_blocks`` blocks (ascending ids), evicting ready entries if needed.

        The new entry is not-ready.  Returns None -- having evicted nothing -- when even
        evicting every evictable entry would not make room.
        """
        if not isinstance(key, str):
            raise TypeError(f"key={key!r} must be a str (an mm_hash)")
        if not is_int(n_blocks) or n_blocks < 0:
            raise ValueError(f"n_blocks={n_blocks!r} must be a non-negative int")
        n_blocks = int(n_blocks)
        if n_blocks > self.num_blocks:
            raise ValueError(f"alloc({key!r}, n_blocks={n_blocks}) can never fit: the region has only "
                             f"{self.num_blocks} blocks")
        with self._lock:
            if key in self._entries:
                raise ValueError(f"alloc({key!r}): the key already has an entry ({self._entries[key].state}); "
                                 "look it up instead of allocating twice")
            if self._free.count + self._evictable_blocks < n_blocks:
                self.stats.failed_allocs += 1
                return None
            self._evict_until(n_blocks)
            entry = CacheEntry(key, self._free.take(n_blocks))
            self._entries[key] = entry
            self.stats.allocs += 1
            return entry

    def mark_ready(self, key: str) -> None:
        """The entry's bytes are in the region: make it readable (and evictable)."""
        with self._lock:
            entry = self._get(key, "mark_ready")
            if entry.ready:
                raise RuntimeError(f"mark_ready({key!r}): the entry is already {entry.state}")
            entry._pin_count = 0
            self._make_evictable(entry)

    def pin(self, key: str) -> np.ndarray:
        """Protect a ready entry from eviction (nested); return its block ids (``block_array``)."""
        with self._lock:
            entry = self._get(key, "pin")
            if not entry.ready:
                raise RuntimeError(f"pin({key!r}): the entry is not ready (its save has not completed)")
            self._pin(entry)
            return entry.block_array

    def pin_if_ready(self, key: str) -> np.ndarray | None:
        """Atomically pin ``key`` if it is present and ready; return its block ids, else None.

        The read path: check and pin under one lock, so an eviction cannot slip in between.
        """
        if not isinstance(key, str):  # (a 5 was a plain miss, counted as one)
            raise TypeError(f"key={key!r} must be a str (an mm_hash)")
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._pin(entry)
            return entry.block_array

    def unpin(self, key: str) -> None:
        """Drop one pin; the last one makes the entry evictable again (youngest in the eviction order)."""
        with self._lock:
            entry = self._get(key, "unpin")
            if not entry.pinned:
                raise RuntimeError(f"unpin({key!r}): the entry is not pinned (it is {entry.state})")
            entry._pin_count -= 1
            if entry._pin_count == 0:
                self._make_evictable(entry)

    def discard(self, key: str) -> None:
        """Drop a not-ready entry (its save failed or was abandoned) and free its blocks."""
        with self._lock:
            entry = self._get(key, "discard")
            if entry.ready:
                raise RuntimeError(f"discard({key!r}): the entry is {entry.state}; ready entries leave only by "
                                   "eviction, pinned ones after unpin")
            del self._entries[key]
            self._release_blocks(entry)

    # ------------------------------------------------------------------ internals (lock held)
    def _get(self, key: str, op: str) -> CacheEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"{op}: no entry for mm_hash {key!r} in the embedding cache")
        return entry

    def _pin(self, entry: CacheEntry) -> None:
        if entry.evictable:
            del self._evictable[entry.key]
            self._evictable_blocks -= entry.num_blocks
        entry._pin_count += 1

    def _make_evictable(self, entry: CacheEntry) -> None:
        # Re-entering the eviction order puts the entry at the young end: an entry that was just
        # read is the last one we want to evict.
        self._evictable[entry.key] = None
        self._evictable_blocks += entry.num_blocks

    def _release_blocks(self, entry: CacheEntry) -> None:
        for a, b in entry._runs:
            self._free.give(a, b)

    def _evict_until(self, n_blocks: int) -> None:
        while self._free.count < n_blocks:
            key, _ = self._evictable.popitem(last=False)  # the oldest ready entry
            entry = self._entries.pop(key)
            self._evictable_blocks -= entry.num_blocks
            self._release_blocks(entry)
            self.stats.evictions += 1
            self.stats.evicted_blocks += entry.num_blocks

    # ------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        with self._lock:
            owned = [b for e in self._entries.values() for b in e.block_ids]
            free = self._free.ids()
            assert len(free) == self._free.count, "free-run count out of sync"
            assert all(a < b for a, b in zip(self._free.starts, self._free.ends)), "an empty free run"
            assert all(b < a for a, b in zip(self._free.starts[1:], self._free.ends)), "free runs unsorted/unmerged"
            assert len(owned) == len(set(owned)), "a block belongs to two entries"
            assert not set(owned) & set(free), "a block is both free and owned"
            assert sorted(owned + free) == list(range(self.num_blocks)), "blocks leaked or duplicated"
            evictable = [k for k, e in self._entries.items() if e.evictable]
            assert set(evictable) == set(self._evictable), "eviction list out of sync with entry states"
            assert self._evictable_blocks == sum(self._entries[k].num_blocks for k in self._evictable)
            for e in self._entries.values():
                assert list(e.block_ids) == sorted(e.block_ids), f"{e.key}: block ids not ascending"
                assert e.block_array.tolist() == list(e.block_ids), f"{e.key}: block_array differs from block_ids"


class _FreeRuns:
    """Free block ids as sorted, merged runs ``[starts[i], ends[i])``; lowest ids go first."""

    __slots__ = ("starts", "ends", "count")

    def __init__(self, num_blocks: int):
        self.starts = [0] if num_blocks else []
        self.ends = [num_blocks] if num_blocks else []
        self.count = num_blocks

    def take(self, n: int) -> list[tuple[int, int]]:
        """Remove the ``n`` lowest free ids (caller checked ``count >= n``); return them as runs."""
        runs = []
        while n:
            a, b = self.starts[0], self.ends[0]
            k = min(n, b - a)
            runs.append((a, a + k))
            if a + k == b:
                del self.starts[0], self.ends[0]
            else:
                self.starts[0] = a + k
            n -= k
            self.count -= k
        return runs

    def give(self, a: int, b: int) -> None:
        """Return the run ``[a, b)``, merging it with free neighbours."""
        i = bisect.bisect_left(self.starts, a)
        merge_left = i > 0 and self.ends[i - 1] == a
        merge_right = i < len(self.starts) and self.starts[i] == b
        if merge_left and merge_right:
            self.ends[i - 1] = self.ends[i]
            del self.starts[i], self.ends[i]
        elif merge_left:
            self.ends[i - 1] = b
        elif merge_right:
            self.starts[i] = a
        else:
            self.starts.insert(i, a)
            self.ends.insert(i, b)
        self.count += b - a

    def ids(self) -> list[int]:
        return [i for a, b in zip(self.starts, self.ends) for i in range(a, b)]
