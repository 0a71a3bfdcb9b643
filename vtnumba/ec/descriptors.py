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
across steps, so that a step allocates nothing.  The worker hands a step's buffers back when
its transfer completes -- the seed's lifetime, stricter than vtnumba needs:
:func:`~vtnumba.memory.copy_engine.batched_copy` takes the descriptors at the call (a copy
for a cpu queue's thread, Python lists for the driver), so the queued copy never reads them.

:meth:`DescriptorBuffers.add_block_runs` is what the worker calls once per entry: one compiled
(``numba.njit``) pass over the entry's block ids that checks every id against the region,
finds the runs and writes their descriptors straight into the buffers -- and, for a step's
loads (which go into one contiguous buffer), merges an entry's first run into the previous
entry's last descriptor when the two are neighbours in the region.  :func:`coalesce_runs` is the same split in numpy, kept as the reference
the tests compare with.  Why compiled: an entry of a few MiB is hundreds of ids, and the
numpy version costs about ten array operations of a microsecond or more each -- as much
as copying the entry's first few hundred KiB.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numba
import numpy as np

from vtnumba.backend.arrays import is_int
from vtnumba.ec.region import block_id_array
from vtnumba.memory.copy_engine import (
    CHECK_BOTH,
    CHECK_DST,
    CHECK_SRC,
    checked_host_copy,
    live_table,
    raise_bad_descriptor,
)

__all__ = ["coalesce_runs", "DescriptorBuffers", "DescriptorBufferPool", "BadBlockId", "RepeatedBlockId", "NO_MARKS",
           "prepare_descriptors"]


def coalesce_runs(block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``block_ids`` into runs of consecutive ids.

    Returns ``(slots, first_blocks, num_blocks)``, one element per run: ``slots[k]`` is the
    run's offset in the flat sequence, ``first_blocks[k]`` its first block id and
    ``num_blocks[k]`` its length.  ``[4, 5, 6, 9, 10, 2]`` gives slots ``[0, 3, 5]``, first
    blocks ``[4, 9, 2]`` and lengths ``[3, 2, 1]``.  An empty input gives three empty arrays.
    """
    ids = block_id_array(block_ids)  # (ints only, checked and named: 1.5 was truncated to 1)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 62):  # (so the differences below cannot wrap)
        raise ValueError(f"block_ids must be block ids in 0..2**62-1, got {int(ids.min())}..{int(ids.max())}")
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


#: _fill_block_runs' answer when its arguments would take its loop past the arrays.
_DOES_NOT_FIT = -(1 << 62)


@numba.njit(nogil=True, cache=True)
def _fill_block_runs(ids, n_used, num_blocks, region_base, flat_base, block_size, total_bytes,
                     src, dst, sizes, count, flat_is_src, merge, marks, epoch):  # pragma: no cover - compiled
    # The loop below writes by index without bounds checks: first refuse what would take it
    # past the arrays (here, where it costs nothing, rather than in Python before the call).
    n = ids.shape[0]
    if n_used < 0 or n_used > n or count < 0 or count + n_used > sizes.shape[0] or total_bytes < 0 \
            or total_bytes > n_used * block_size or total_bytes <= (n_used - 1) * block_size:
        return _DOES_NOT_FIT
    # Every id must name a block of the region, the ones past the output's end too (they
    # were allocated to this entry; a bad one means bad metadata).  Returns -1 - index of
    # the first bad id, -1 - (len(ids) + index) of the first id already written this step
    # (see below), or the new descriptor count.
    for i in range(n):
        if ids[i] < 0 or ids[i] >= num_blocks:
            return -1 - i
    if marks.shape[0] and marks.shape[0] < num_blocks:
        return _DOES_NOT_FIT  # (marks hold one epoch per block of the region: a shorter array would be written past)
    if marks.shape[0]:
        # Writers (saves) mark each block with the step's epoch: a block marked already is
        # written twice this step -- by this entry or by another -- and one entry's rows would
        # silently replace the other's.  A refused entry takes its marks back.
        for i in range(n):
            if marks[ids[i]] == epoch:
                for k in range(i):
                    marks[ids[k]] = epoch - 1
                return -1 - (n + i)
            marks[ids[i]] = epoch
    # Addresses are added up in uint64 (device addresses may have the high bit set); the
    # callers pass Python ints, so cast once here.
    bs = np.uint64(block_size)
    rb = np.uint64(region_base)
    fb = np.uint64(flat_base)
    i = 0
    while i < n_used:
        j = i + 1
        while j < n_used and ids[j] == ids[j - 1] + 1:
            j += 1
        region = rb + np.uint64(ids[i]) * bs
        flat = fb + np.uint64(i) * bs
        # The last run ends with the output (total_bytes), which may end inside its last block.
        nbytes = np.uint64(total_bytes - i * block_size) if j == n_used else np.uint64(j - i) * bs
        s = flat if flat_is_src else region
        d = region if flat_is_src else flat
        if merge and count > 0 and src[count - 1] + sizes[count - 1] == s and dst[count - 1] + sizes[count - 1] == d:
            sizes[count - 1] += nbytes  # continues the previous descriptor on both sides
        else:
            src[count] = s
            dst[count] = d
            sizes[count] = nbytes
            count += 1
        i = j
    return count


#: ``marks`` for :meth:`DescriptorBuffers.add_block_runs` callers that need no repeat check (readers).
NO_MARKS = np.zeros(0, np.uint32)


@numba.njit(nogil=True, cache=True)
def _fill_and_copy(ids, n_used, num_blocks, region_base, flat_base, block_size, total_bytes, src, dst, sizes,
                   flat_is_src, marks, epoch, starts, reach, sides):  # pragma: no cover - compiled
    # One entry's descriptors from slot 0, then the live-range check of ``sides`` and the
    # copy, in one compiled call.  Returns (descriptors, bytes copied); descriptors < 0 is
    # _fill_block_runs' code for a bad id, bytes < 0 checked_host_copy's for a bad descriptor
    # (nothing copied).
    count = _fill_block_runs(ids, n_used, num_blocks, region_base, flat_base, block_size, total_bytes,
                             src, dst, sizes, 0, flat_is_src, False, marks, epoch)
    if count < 0:
        return count, 0
    return count, checked_host_copy(src, dst, sizes, count, starts, reach, sides)


@numba.njit(nogil=True, cache=True)
def _fill_and_copy_array(flat, ids, n_used, num_blocks, region_base, block_size, total_bytes, src, dst, sizes,
                         flat_is_src, marks, epoch, starts, reach):  # pragma: no cover - compiled
    # _fill_and_copy with the flat side given as an array (a byte view) the caller holds: its
    # address is read here -- no separate call for it -- and its size bounds the copy, so only
    # the region's side needs the live-range check.
    if not flat.flags.c_contiguous or total_bytes > flat.size * flat.itemsize:
        return _DOES_NOT_FIT, 0
    return _fill_and_copy(ids, n_used, num_blocks, region_base, flat.ctypes.data, block_size, total_bytes, src, dst,
                          sizes, flat_is_src, marks, epoch, starts, reach, CHECK_DST if flat_is_src else CHECK_SRC)


class BadBlockId(ValueError):
    """A block id outside the region (raised by :meth:`DescriptorBuffers.add_block_runs`)."""

    def __init__(self, index: int, block_id: int, num_blocks: int):
        super().__init__(f"block id {block_id} at index {index} is outside the region's 0..{num_blocks - 1}")
        self.index = index            #: position of the first bad id in the list
        self.block_id = block_id      #: its value
        self.num_blocks = num_blocks  #: the region's block count


class RepeatedBlockId(ValueError):
    """A block written twice in one step (raised by :meth:`DescriptorBuffers.add_block_runs`
    with ``marks``): by this entry twice, or by this entry and an earlier one."""

    def __init__(self, index: int, block_id: int):
        super().__init__(f"block id {block_id} at index {index} is already written this step")
        self.index = index
        self.block_id = block_id


def prepare_descriptors() -> None:
    """Compile (or load from numba's cache) the descriptor builder now, not inside a timed step."""
    ids = np.zeros(1, np.int64)
    out = np.zeros(1, np.uint64)
    _fill_block_runs(ids, 1, 1, 0, 0, 1, 1, out, out.copy(), out.copy(), 0, True, True, NO_MARKS, 1)
    _fill_and_copy(ids, 0, 1, 0, 0, 1, 0, out, out.copy(), out.copy(), True, NO_MARKS, 1, out, out, CHECK_BOTH)
    # Block ids also arrive read-only (EmbeddingCache shares one frozen array per entry), a
    # type numba compiles apart: warm that one too, or the first real save compiles it.
    frozen = ids.copy()
    frozen.flags.writeable = False
    _fill_block_runs(frozen, 1, 1, 0, 0, 1, 1, out, out.copy(), out.copy(), 0, True, True, NO_MARKS, 1)
    _fill_and_copy(frozen, 0, 1, 0, 0, 1, 0, out, out.copy(), out.copy(), True, NO_MARKS, 1, out, out, CHECK_BOTH)
    # The array form takes an output's byte view: [rows, row bytes], writeable or not.
    rows = np.zeros((1, 1), np.uint8)
    for flat in (rows, rows.view()):
        for block_ids in (ids, frozen):
            _fill_and_copy_array(flat, block_ids, 0, 1, 0, 1, 0, out, out.copy(), out.copy(), True, NO_MARKS, 1, out,
                                 out)
        flat.flags.writeable = False


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
        if not is_int(start):
            raise TypeError(f"start={start!r} must be an int slot")
        arrays = []
        for name, values in (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes)):
            # Whole, non-negative numbers only: -1 became 2**64-1 and 1.5 became 1, silently.
            if isinstance(values, (list, tuple)) and all(is_int(v) for v in values):
                # Python ints, built as uint64 directly: numpy would make [2**63 + 16, 4] float64
                # (a device address with the high bit set, beside small ones), losing bits.
                if any(not 0 <= int(v) < 1 << 64 for v in values):
                    raise ValueError(f"{name}={values!r} holds a value outside 0..2**64-1 (addresses and sizes "
                                     "are never negative)")
                raw = np.array([int(v) for v in values], dtype=np.uint64)
            else:
                try:
                    raw = np.asarray(values) if not isinstance(values, (str, bytes)) else None
                except ValueError:  # (a ragged nested list)
                    raw = None
            if raw is None or raw.ndim != 1 or raw.dtype.kind not in "iu":
                raise TypeError(f"{name}={values!r} must be a flat sequence of whole numbers (addresses, byte counts)")
            # (A device address with the high bit set arrives as uint64: kept as it is.)
            if raw.dtype.kind == "i" and raw.size and raw.min() < 0:
                raise ValueError(f"{name} holds {int(raw.min())}; addresses and sizes are never negative")
            arrays.append(raw.astype(np.uint64, copy=False))
        src, dst, sz = arrays
        n = int(src.size)
        if dst.size != n or sz.size != n:  # (numpy broadcast one destination to every source)
            raise ValueError(f"src_ptrs, dst_ptrs and sizes have {n}, {dst.size} and {sz.size} entries; expected "
                             "one of each per descriptor")
        if start < 0 or start + n > self.capacity:
            raise ValueError(f"add_copies of {n} descriptors at start={start} overflows the buffer's "
                             f"capacity {self.capacity}")
        self.src_ptrs[start:start + n] = src
        self.dst_ptrs[start:start + n] = dst
        self.sizes[start:start + n] = sz
        return start + n

    def add_block_runs(self, count: int, ids: np.ndarray, n_used: int, num_blocks: int, region_base: int,
                       flat_base: int, block_size: int, total_bytes: int, flat_is_src: bool,
                       merge: bool = False, marks: np.ndarray = NO_MARKS, epoch: int = 1) -> int:
        """Write the descriptors of one entry's block runs from slot ``count`` on; return the new count.

        ``ids`` (a 1-D C-contiguous int64 array) are the entry's blocks in the region, each
        checked against ``0 .. num_blocks-1`` (:class:`BadBlockId` otherwise, nothing
        written); the first ``n_used`` of them are copied.  The other side is *flat*: block
        ``ids[i]`` pairs with ``flat_base + i * block_size``.  ``flat_is_src``: a save (device
        output -> region) when True, a load (region -> device buffer) when False.  The last
        run is trimmed so the copy ends at ``flat_base + total_bytes``.  ``merge``: a first run
        that continues descriptor ``count - 1`` on both sides extends it instead of taking a
        slot (a step's loads: neighbours in the region land side by side in one buffer).  The
        caller makes sure ``count + n_used <= capacity`` (one descriptor per block at most).
        ``marks`` (a ``uint32`` array of ``num_blocks`` kept by a writer) and ``epoch`` (its
        step number): every id is marked with the epoch, and one marked already raises
        :class:`RepeatedBlockId` -- two writes of one block in a step (nothing written).
        """
        new = _fill_block_runs(ids, n_used, num_blocks, region_base, flat_base, block_size, total_bytes,
                               self.src_ptrs, self.dst_ptrs, self.sizes, count, flat_is_src, merge, marks, epoch)
        if new < 0:
            self._refused(new, ids, count, n_used, num_blocks, block_size, total_bytes)
        return new

    def copy_block_runs(self, ids: np.ndarray, n_used: int, num_blocks: int, region_base: int,
                        flat_base: int | np.ndarray, block_size: int, total_bytes: int, flat_is_src: bool,
                        marks: np.ndarray = NO_MARKS, epoch: int = 1, check_flat: bool = True) -> int:
        """One entry's block runs -- as :meth:`add_block_runs` writes them from slot 0 -- copied at once,
        on the host, by this thread; returns the number of descriptors.

        For a caller whose copy would run on the spot anyway (a synchronous queue, see
        :func:`~vtnumba.memory.copy_engine.runs_inline`): building the descriptors, checking
        every address against live memory and copying are one compiled call.  Raises
        :class:`BadBlockId` or :class:`RepeatedBlockId` (with ``marks``), or the copy engine's
        ValueError for a descriptor outside live memory, and then nothing was copied.
        ``check_flat=False``: the flat side is an array the caller holds (``flat_base`` read
        from it, ``total_bytes`` within it), so only the region side is checked -- an output
        the copy engine has never heard of needs no registration.  ``flat_base`` may also *be*
        that array (C-contiguous; a ``uint8`` view of a float16 one, which compiled code cannot
        type): its address is then read inside the compiled call -- one call instead of two,
        and after a large copy has evicted the CPU's caches each costs microseconds -- its
        size bounds ``total_bytes``, and ``check_flat`` is moot.
        """
        if type(flat_base) is np.ndarray:
            sides = CHECK_DST if flat_is_src else CHECK_SRC
            count, total = _fill_and_copy_array(flat_base, ids, n_used, num_blocks, region_base, block_size,
                                                total_bytes, self.src_ptrs, self.dst_ptrs, self.sizes, flat_is_src,
                                                marks, epoch, *live_table())
        else:
            sides = CHECK_BOTH if check_flat else (CHECK_DST if flat_is_src else CHECK_SRC)
            count, total = _fill_and_copy(ids, n_used, num_blocks, region_base, flat_base, block_size, total_bytes,
                                          self.src_ptrs, self.dst_ptrs, self.sizes, flat_is_src, marks, epoch,
                                          *live_table(), sides)
        if count < 0:
            self._refused(count, ids, 0, n_used, num_blocks, block_size, total_bytes)
        if total < 0:
            raise_bad_descriptor(self.src_ptrs[:count], self.dst_ptrs[:count], self.sizes[:count], -1 - total, sides)
        return count

    def _refused(self, code: int, ids: np.ndarray, count: int, n_used: int, num_blocks: int, block_size: int,
                 total_bytes: int) -> None:
        """Raise for _fill_block_runs' negative answer ``code`` (nothing was written)."""
        if code == _DOES_NOT_FIT:
            raise ValueError(f"add_block_runs: n_used={n_used}, count={count}, total_bytes={total_bytes} do not fit "
                             f"{ids.shape[0]} ids of {block_size} bytes and {self.sizes.shape[0]} descriptor slots; "
                             "expected n_used <= len(ids), count + n_used <= capacity, the last used block "
                             f"partly filled, marks (if given) of num_blocks={num_blocks} entries, and a flat "
                             "array (if given) C-contiguous and holding total_bytes")
        i = -1 - code  # i < len(ids): a bad id; beyond it, an id already written this step
        if i >= ids.shape[0]:
            raise RepeatedBlockId(i - ids.shape[0], int(ids[i - ids.shape[0]]))
        raise BadBlockId(i, int(ids[i]), num_blocks)


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
        if type(n) is not int and not is_int(n) or n < 0:
            raise ValueError(f"n={n!r} must be a non-negative int number of descriptors")
        with self._lock:
            if self._pool:
                bufs = self._pool.pop()
                if len(bufs.sizes) >= n:
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
