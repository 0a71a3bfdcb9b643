"""Copy descriptors for the encoder-cache worker: block runs and reusable descriptor buffers.

Upstream: ``_coalesce_runs`` and ``descriptor_buffers.py`` next to vLLM's ``ECCPUWorker``.

A transfer between the shared region and the device moves whole *blocks* (one block = one
token's embedding row).  Copying block by block costs one descriptor per block, and the
per-descriptor overhead dominates such small copies.  Because
:class:`~vtnumba.ec.EmbeddingCache` hands out ascending block ids, an entry's blocks are
mostly *consecutive* in the region, and a run of consecutive blocks is one contiguous
byte range: :func:`coalesce_runs` finds the runs so each run costs one descriptor.

The other side of the copy (the device buffer) is always contiguous, so a run's device
address is derived from its *slot* -- its position in the flat block sequence -- and
advances in lockstep with the region; only the region side ever has to be split.

:class:`DescriptorBuffers` are the three ``uint64`` arrays (source addresses, destination
addresses, byte counts) a batched copy reads; :class:`DescriptorBufferPool` recycles them
across steps, because a batched copy may read them after the call returned (see
:mod:`vtnumba.memory.copy_engine`) and they may only be reused once its end event fired.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vtnumba.backend.arrays import is_int

__all__ = ["coalesce_runs", "DescriptorBuffers", "DescriptorBufferPool"]


def coalesce_runs(block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``block_ids`` into runs of consecutive ids.

    Returns ``(slots, first_blocks, num_blocks)``, one element per run: ``slots[k]`` is the
    run's offset in the flat sequence, ``first_blocks[k]`` its first block id and
    ``num_blocks[k]`` its length.  ``[4, 5, 6, 9, 10, 2]`` gives slots ``[0, 3, 5]``, first
    blocks ``[4, 9, 2]`` and lengths ``[3, 2, 1]``.  An empty input gives three empty arrays.
    """
    ids = np.asarray(block_ids if isinstance(block_ids, np.ndarray) else list(block_ids), dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be a flat sequence of ints, got shape={ids.shape}")
    n = ids.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    # A run breaks wherever the next id is not this id + 1.  Slot 0 always starts a run,
    # so mark it too and let one flatnonzero find every run start.
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(ids[1:] - ids[:-1], 1, out=starts[1:])
    slots = np.flatnonzero(starts)
    num = np.empty_like(slots)
    num[:-1] = slots[1:] - slots[:-1]
    num[-1] = n - slots[-1]
    return slots, ids[slots], num


class DescriptorBuffers(NamedTuple):
    """Three equal-length ``uint64`` arrays: source addresses, destination addresses, sizes."""

    src_ptrs: np.ndarray
    dst_ptrs: np.ndarray
    sizes: np.ndarray

    @property
    def capacity(self) -> int:
        """How many descriptors fit."""
        return int(self.src_ptrs.size)

    def add_copies(self, start: int, src_ptrs, dst_ptrs, sizes) -> int:
        """Write descriptors into slots ``start .. start+n-1`` in bulk; return the next free slot.

        Addresses are added up in ``uint64``: device addresses can have the high bit set,
        which signed arithmetic would reject.
        """
        src = np.asarray(src_ptrs).astype(np.uint64, copy=False)
        n = int(src.size)
        if start < 0 or start + n > self.capacity:
            raise ValueError(f"add_copies of {n} descriptors at start={start} overflows the buffer's "
                             f"capacity {self.capacity}")
        self.src_ptrs[start:start + n] = src
        self.dst_ptrs[start:start + n] = np.asarray(dst_ptrs).astype(np.uint64, copy=False)
        self.sizes[start:start + n] = np.asarray(sizes).astype(np.uint64, copy=False)
        return start + n


class DescriptorBufferPool:
    """A LIFO pool of :class:`DescriptorBuffers`, recycled across steps.

    ``acquire(n)`` returns buffers with capacity >= n: the most recently released ones when
    they are big enough, otherwise fresh ones (a too-small released buffer is dropped, so
    the pool converges on the step's working size).  Thread-safe.
    """

    def __init__(self) -> None:
        self._pool: list[DescriptorBuffers] = []
        self._lock = threading.Lock()
        self.allocations = 0  # fresh buffers made (the tests check reuse through this)
        self.reuses = 0

    def acquire(self, n: int) -> DescriptorBuffers:
        """Buffers with room for at least ``n`` descriptors (recycled when possible)."""
        if not is_int(n) or n < 0:
            raise ValueError(f"n={n!r} must be a non-negative int number of descriptors")
        with self._lock:
            if self._pool:
                bufs = self._pool.pop()
                if bufs.capacity >= n:
                    self.reuses += 1
                    return bufs
            self.allocations += 1
        cap = max(int(n), 1)
        return DescriptorBuffers(np.zeros(cap, np.uint64), np.zeros(cap, np.uint64), np.zeros(cap, np.uint64))

    def release(self, bufs: DescriptorBuffers) -> None:
        """Return buffers whose copy has finished, for reuse."""
        if not isinstance(bufs, DescriptorBuffers):
            raise TypeError(f"bufs must be DescriptorBuffers, got {type(bufs).__name__}")
        with self._lock:
            self._pool.append(bufs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pool)
