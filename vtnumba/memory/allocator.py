"""A stream-ordered caching allocator with ``record_stream`` (the allocator vLLM relies on).

vLLM's encoder-cache worker (``ECCPUWorker``, ``ec_connector/cpu/worker.py``) registers each
buffer "against the stream that is not its own ... without that, the caching allocator would be
free to reissue memory a copy or a queued read still needs, since it only tracks the stream a
buffer was allocated on."
This module is that allocator, small enough to read in one sitting.

How it works (the same design as PyTorch's CUDA caching allocator):

* **Segments.**  Memory comes from the backend in big pieces (``backend.alloc``), called
  segments, and is *never* handed back on ``free`` -- only by :meth:`CachingAllocator.empty_cache`.
  Asking the device for memory is slow (``cudaMalloc`` takes ~100 us and ``cudaFree``
  synchronises the whole device); reusing cached memory costs a dictionary lookup.
* **Size classes.**  A request is rounded up to a multiple of 512 bytes.  Small requests
  (< 1 MiB) are carved out of 2 MiB "small" segments; large ones get a segment rounded up
  to a multiple of 2 MiB, and a large cached piece bigger than a request is *split*.
  Adjacent free pieces of one segment are *coalesced* again when freed.
* **One pool per queue.**  A segment belongs to the queue it was first allocated for, and
  ``free`` returns its pieces to that queue's pool.  The next ``allocate`` on the *same*
  queue may reuse the memory at once, even if kernels that used it are still queued:
  queue order guarantees the new owner's work runs after the old owner's.  When a queue is
  destroyed (which waits for its work), its segments go to the next queue whose own pool
  has no piece that fits: queue ids never come back, so a pool per short-lived queue would never be reused.
* **record_stream.**  That guarantee covers only the allocating queue.  If a block was also
  used on another queue (a copy on a side queue, a read by a second stream), the caller
  must say so with :meth:`CachingAllocator.record_stream`.  At ``free`` the allocator then
  records an event on every such queue and keeps the block out of the pool until all of
  those events have completed (``backend.query_event``).  Forget it, and the memory is
  reissued while the other queue still reads it -- the hazard :mod:`vtnumba.memory.hazards`
  catches.
* **Out of memory.**  When the backend refuses (or ``limit_bytes`` would be exceeded), the
  allocator empties its cache (waiting a little for blocks held by events) and retries
  once; then it raises :class:`AllocatorOutOfMemory`, whose message carries the stats.

Blocks are :class:`~vtnumba.backend.Buffer` objects: ``backend.copy``/``memset`` accept
them, and :meth:`Block.view` gives the typed array kernels use, aliasing the segment.
"""

from __future__ import annotations

import bisect
import numbers
import itertools
import threading
import time

import numpy as np

from vtnumba.backend.arrays import cdiv, check_int, check_seconds
from vtnumba.backend.base import Backend, Buffer, Queue, check_nbytes
from vtnumba.memory import hazards as _hazards

KiB = 1 << 10
MiB = 1 << 20

MIN_BLOCK = 512            # every block size is a multiple of this
SMALL_MAX = 1 * MiB        # requests below this come from the small pool
SMALL_SEGMENT = 2 * MiB    # size of one small-pool segment
LARGE_ROUND = 2 * MiB      # large-pool segments are multiples of this

_FREE, _LIVE, _WAITING = "free", "live", "waiting"
_seg_ids = itertools.count(1)


def round_size(nbytes: int, min_block: int = MIN_BLOCK) -> int:
    """The size class of a request: ``nbytes`` rounded up to a multiple of ``min_block``."""
    if type(nbytes) is not int or type(min_block) is not int or nbytes < 0 or min_block < 1:
        # (The allocator's own calls pass ints it has checked: only a call from outside gets here.)
        nbytes = check_nbytes("nbytes", nbytes)
        min_block = check_int("min_block", min_block, min_value=1)
    return cdiv(nbytes, min_block) * min_block


class AllocatorOutOfMemory(MemoryError):
    """The backend (or ``limit_bytes``) refused memory even after the cache was emptied."""

    def __init__(self, message: str, stats: dict):
        super().__init__(message)
        self.stats = stats


class _Piece:
    """A contiguous byte range of one segment: free (in a pool), live (a Block) or waiting
    (freed, but held until events on other queues complete).  Pieces of a segment form a
    doubly linked list in address order, so neighbours can be coalesced."""

    __slots__ = ("segment", "offset", "size", "prev", "next", "state", "block", "events")

    def __init__(self, segment, offset, size):
        self.segment = segment
        self.offset = offset
        self.size = size
        self.prev = None
        self.next = None
        self.state = _FREE
        self.block = None
        self.events = ()

    @property
    def key(self):
        # Pools are sorted by size first, so bisect finds the best fit.
        return (self.size, self.segment.id, self.offset)


class _Segment:
    """One allocation from the backend, owned by one queue's pool."""

    __slots__ = ("id", "buffer", "queue", "kind", "size", "ptr", "first")

    def __init__(self, buffer, queue, kind, size):
        self.id = next(_seg_ids)
        self.buffer = buffer
        self.queue = queue
        self.kind = kind
        self.size = size
        self.ptr = int(buffer.ptr)
        self.first = _Piece(self, 0, size)


class Block(Buffer):
    """Memory handed out by a :class:`CachingAllocator`.

    ``nbytes`` is what was asked for, ``size`` the size class actually reserved, ``queue``
    the queue whose pool it returns to.  ``view``/``array`` alias the segment, so kernels
    and copies see the block like any buffer.  After :meth:`CachingAllocator.free` the
    block object is dead (``freed``) and every use raises -- the *memory* lives on in the
    cache under a new Block.
    """

    def __init__(self, allocator: "CachingAllocator", piece: _Piece, nbytes: int):
        seg = piece.segment
        super().__init__(allocator.backend, allocator.backend.device, nbytes, None,
                         ptr=seg.ptr + piece.offset, owner=seg.buffer)
        self.allocator = allocator
        self.queue = seg.queue
        self.size = piece.size
        self.offset = piece.offset          # byte offset inside the segment
        self.segment_id = seg.id
        self._piece = piece
        self._stream_uses: dict[int, Queue] = {}   # queues named by record_stream

    @property
    def array(self):
        """The block's bytes as a flat ``uint8`` array of the target's kind (no copy)."""
        self._check_live("block")
        return self._segment_array()[self.offset:self.offset + self.nbytes]

    def _segment_array(self):
        seg_array = getattr(self._owner, "array", None)
        if seg_array is None:
            raise TypeError(f"block #{self.id} lives in raw device memory (numba memory-manager plugin); "
                            "it has no array view -- use the numba array the plugin returned")
        return seg_array

    def view(self, dtype=np.uint8, shape=None, offset: int = 0):
        """A typed view of the block's bytes from ``offset`` (default: all of them), shaped
        ``shape``; implemented as the segment buffer's view at the block's offset."""
        self._check_live("block")
        dtype, shape, _, offset = self._view_args(dtype, shape, offset, "block")  # (Buffer.view's checks)
        self._segment_array()  # raw driver segments have no views
        return self._owner.view(dtype, shape, self.offset + offset)

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return (f"<Block #{self.id} {self.nbytes} B (class {self.size} B) on queue {self.queue.name}, "
                f"segment #{self.segment_id}+{self.offset:#x} ({state})>")


def _is_oom(exc: BaseException) -> bool:
    """MemoryError, or numba's CudaAPIError carrying CUDA_ERROR_OUT_OF_MEMORY."""
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__name__ == "CudaAPIError" and "OUT_OF_MEMORY" in str(getattr(exc, "code", exc))


def _wait_seconds(name: str, value) -> float:
    """A wait of 0 (do not wait) or a positive, finite number of seconds."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and value == 0:
        return 0.0  # (numpy's zeros too: np.int64(0) is a Real, not an int)
    return check_seconds(name, value)


class CachingAllocator:
    """Stream-ordered caching allocator over ``backend`` (see the module docstring).

    ``segment_source`` (default: the backend) is where segments come from: anything with
    ``alloc(nbytes)`` returning an object with ``ptr``/``nbytes`` (and ``view``/``array`` if
    blocks should have views) and ``free(seg)``.  The numba memory-manager plugin passes raw
    ``cuMemAlloc`` memory here.  Queues and events always come from ``backend``.

    ``limit_bytes`` caps the reserved bytes (the cpu backend never runs out on its own);
    ``oom_wait_s`` is how long the out-of-memory path waits for event-held blocks.
    ``small_segment``/``large_round`` change the segment sizes (tests and lessons use small
    ones to see splitting and coalescing at a glance).
    """

    def __init__(self, backend: Backend, *, limit_bytes: int | None = None, segment_source=None,
                 oom_wait_s: float = 2.0, small_segment: int = SMALL_SEGMENT, large_round: int = LARGE_ROUND):
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a vtnumba Backend, got {type(backend).__name__}")
        if limit_bytes is not None:
            limit_bytes = check_nbytes("limit_bytes", limit_bytes, allow_zero=False)
        small_segment = check_nbytes("small_segment", small_segment, allow_zero=False)
        large_round = check_nbytes("large_round", large_round, allow_zero=False)
        for name, value in (("small_segment", small_segment), ("large_round", large_round)):
            if value % MIN_BLOCK:
                raise ValueError(f"{name}={value} must be a multiple of {MIN_BLOCK} bytes")
        if small_segment < SMALL_MAX:
            # A small request can be up to SMALL_MAX - MIN_BLOCK bytes; one segment must hold it.
            raise ValueError(f"small_segment={small_segment} must be >= {SMALL_MAX} (the largest small request)")
        self.backend = backend
        self.source = backend if segment_source is None else segment_source
        self.limit_bytes = limit_bytes
        self.oom_wait_s = _wait_seconds("oom_wait_s", oom_wait_s)
        self.small_segment = small_segment
        self.large_round = large_round
        self._lock = threading.RLock()
        self._segments: dict[int, _Segment] = {}
        self._pools: dict[tuple[int, str], list] = {}      # (queue id, kind) -> sorted piece keys
        self._pieces: dict[tuple, _Piece] = {}             # piece key -> free piece
        self._waiting: list[_Piece] = []                   # freed, held by events
        self._live: dict[int, Block] = {}
        self._c = dict(allocated_bytes=0, requested_bytes=0, reserved_bytes=0, peak_allocated_bytes=0,
                       peak_reserved_bytes=0, cache_hits=0, cache_misses=0, splits=0, merges=0,
                       num_allocs=0, num_frees=0, segments_released=0, oom_retries=0, events_recorded=0)

    # ------------------------------------------------------------------ public API
    def allocate(self, nbytes: int, queue: Queue) -> Block:
        """A block of at least ``nbytes`` bytes for use on ``queue`` (its pool on free)."""
        nbytes = check_nbytes("nbytes", nbytes, allow_zero=False)
        self._check_queue("queue", queue)
        size = round_size(nbytes)
        kind = "small" if size < SMALL_MAX else "large"
        with self._lock:
            if self._waiting:
                # Blocks whose events have fired since we last looked are reusable now.
                self.process_events()
            piece = self._take_cached(queue, kind, size)
            if piece is None and self._adopt_orphans(queue):
                piece = self._take_cached(queue, kind, size)
            if piece is not None:
                self._c["cache_hits"] += 1
            else:
                piece = self._new_segment_or_oom(queue, kind, size, nbytes)
                # (counted once it succeeded: a request that ran out of memory allocated nothing)
                self._c["cache_misses"] += 1
            self._split(piece, size, kind)
            piece.state = _LIVE
            block = Block(self, piece, nbytes)
            piece.block = block
            self._live[block.id] = block
            c = self._c
            c["allocated_bytes"] += piece.size
            c["requested_bytes"] += nbytes
            c["num_allocs"] += 1
            c["peak_allocated_bytes"] = max(c["peak_allocated_bytes"], c["allocated_bytes"])
            checker = _hazards.active_checker()
            if checker is not None:
                try:
                    checker.on_allocate(block)
                except BaseException:
                    # The checker refused this reuse: give the memory back, then report.
                    self._forget_live(block)
                    self._return_to_pool(piece)
                    raise
            return block

    def free(self, block: Block, *, wait_owner: bool = False) -> None:
        """Return ``block`` to its queue's pool.

        Reusable at once by that queue -- unless :meth:`record_stream` named other queues,
        in which case an event is recorded on each of them *now* and the memory stays out
        of the pool until all have completed.  ``wait_owner=True`` also records one on the
        block's own queue: for frees that arrive with no stream (numba finalizers), where
        nothing guarantees that the next user is ordered after the owner's queued work.
        """
        self._check_block("block", block)
        with self._lock:
            if block.freed:  # a racing second free
                raise RuntimeError(f"double free: {block!r} was already freed")
            piece = block._piece
            checker = _hazards.active_checker()
            if checker is not None:
                # Before our own events: the checker's events then fire no later than ours.
                checker.on_free(block)
            queues = [q for q in block._stream_uses.values() if not q.destroyed]
            if wait_owner and not block.queue.destroyed:
                queues.append(block.queue)
            if self.backend.closed:
                queues = []  # close() drained every queue: nothing left to wait for (and no events to make)
            events = []
            try:
                for q in queues:
                    ev = self.backend.create_event(timing=False)  # orders only: never timed
                    try:
                        self.backend.record_event(ev, q)
                    except RuntimeError:
                        self.backend.destroy_event(ev)
                        if not q.destroyed:
                            raise
                        # Destroyed by another thread since the filter above: destroy_queue
                        # drains a queue before it goes, so there is nothing left to wait for.
                        continue
                    events.append(ev)
            except BaseException:
                for ev in events:  # the block stays live, as it was: nothing of this free happened
                    self.backend.destroy_event(ev)
                raise
            self._forget_live(block)
            if not events:
                self._return_to_pool(piece)
                return
            self._c["events_recorded"] += len(events)
            piece.state = _WAITING
            piece.events = tuple(events)
            self._waiting.append(piece)

    def record_stream(self, block: Block, queue: Queue) -> None:
        """Declare that ``block`` is (or will be) used on ``queue``, not only on its own.

        Call it before :meth:`free`; at free time an event is recorded on ``queue`` and the
        memory is reused only after it completes.  Naming the block's own queue is a no-op.
        """
        if not isinstance(block, Block):
            raise TypeError(f"record_stream(block=...) needs a Block from CachingAllocator.allocate, "
                            f"got {type(block).__name__}")
        if block.allocator is not self:
            raise ValueError(f"record_stream(block={block!r}) got a block of another allocator")
        if block.freed:
            raise RuntimeError(f"record_stream(block={block!r}): the block was already freed; "
                               "record streams before free, while the block is live")
        self._check_queue("queue", queue)
        if queue is block.queue:
            return
        with self._lock:
            block._stream_uses[queue.id] = queue
        checker = _hazards.active_checker()
        if checker is not None:
            checker.note_use(block, queue, covered=True)

    def process_events(self) -> int:
        """Return every waiting block whose events have all completed to its pool.

        Never blocks.  ``allocate`` calls it first whenever blocks are waiting; call it
        yourself to see ``blocks_waiting_on_events`` drop.  Returns how many were returned.
        """
        with self._lock:
            done = [p for p in self._waiting if all(self.backend.query_event(e) for e in p.events)]
            for piece in done:
                self._waiting.remove(piece)
                for ev in piece.events:
                    self.backend.destroy_event(ev)
                piece.events = ()
                self._return_to_pool(piece)
            return len(done)

    def empty_cache(self, wait_s: float = 0.0) -> int:
        """Release every entirely free segment to the backend; return the bytes released.

        Blocks held by events are released only once their events completed; with
        ``wait_s > 0`` the call polls up to that long for them first (never forever, so a
        queue held at a gate cannot hang it).
        """
        deadline = time.monotonic() + _wait_seconds("wait_s", wait_s)
        with self._lock:
            self.process_events()
            while self._waiting and time.monotonic() < deadline:
                time.sleep(0.0005)
                self.process_events()
            released = 0
            for seg in list(self._segments.values()):
                head = seg.first
                if head.state == _FREE and head.next is None:  # one free piece spans the segment
                    self._pool_remove(head)
                    del self._segments[seg.id]
                    self.source.free(seg.buffer)
                    self._c["reserved_bytes"] -= seg.size
                    self._c["segments_released"] += 1
                    released += seg.size
            return released

    def stats(self) -> dict:
        """A snapshot of the counters.  ``reserved = allocated + cached_free + waiting``."""
        with self._lock:
            s = dict(self._c)
            s["active_blocks"] = len(self._live)
            s["blocks_waiting_on_events"] = len(self._waiting)
            s["bytes_waiting_on_events"] = sum(p.size for p in self._waiting)
            s["cached_free_bytes"] = sum(p.size for p in self._pieces.values())
            s["num_free_pieces"] = len(self._pieces)
            s["num_segments"] = len(self._segments)
            s["limit_bytes"] = self.limit_bytes
            return s

    def live_blocks(self) -> list[Block]:
        """The blocks handed out and not yet freed (a snapshot; freed blocks awaiting events are not in it)."""
        with self._lock:
            return list(self._live.values())

    def segment_map(self) -> list[dict]:
        """The memory map: per segment, its queue, kind, size and pieces in address order
        (``offset``, ``size``, ``state`` free/live/waiting, ``block`` id or None)."""
        with self._lock:
            out = []
            for seg in self._segments.values():
                pieces, p = [], seg.first
                while p is not None:
                    pieces.append({"offset": p.offset, "size": p.size, "state": p.state,
                                   "block": p.block.id if p.block is not None else None})
                    p = p.next
                out.append({"segment": seg.id, "queue": seg.queue.name, "kind": seg.kind, "size": seg.size,
                            "pieces": pieces})
            return out

    def check_invariants(self) -> None:
        """Walk every segment and check the bookkeeping (raises RuntimeError on a mismatch).

        Pieces tile each segment without gaps or overlaps; no two free neighbours are left
        uncoalesced; the pools hold exactly the free pieces; the counters match the walk.
        """
        with self._lock:
            allocated = free = waiting = reserved = 0
            free_keys = set()
            for seg in self._segments.values():
                reserved += seg.size
                offset, prev, piece = 0, None, seg.first
                while piece is not None:
                    _expect(piece.offset == offset, f"segment #{seg.id}: piece at {piece.offset}, expected {offset}")
                    _expect(piece.prev is prev, f"segment #{seg.id}: broken prev link at {piece.offset}")
                    _expect(piece.size > 0 and piece.size % MIN_BLOCK == 0, f"bad piece size {piece.size}")
                    if piece.state == _FREE:
                        _expect(prev is None or prev.state != _FREE, f"segment #{seg.id}: uncoalesced free pieces")
                        free += piece.size
                        free_keys.add(piece.key)
                    elif piece.state == _LIVE:
                        _expect(piece.block is not None and not piece.block.freed, "live piece without a live block")
                        allocated += piece.size
                    else:
                        _expect(piece in self._waiting, "waiting piece missing from the waiting list")
                        waiting += piece.size
                    offset += piece.size
                    prev, piece = piece, piece.next
                _expect(offset == seg.size, f"segment #{seg.id}: pieces cover {offset} of {seg.size} bytes")
            _expect(free_keys == set(self._pieces), "pool contents differ from the free pieces")
            _expect(sum(len(v) for v in self._pools.values()) == len(self._pieces), "pool index out of sync")
            c = self._c
            _expect(allocated == c["allocated_bytes"], f"allocated_bytes {c['allocated_bytes']} != walked {allocated}")
            _expect(reserved == c["reserved_bytes"], f"reserved_bytes {c['reserved_bytes']} != walked {reserved}")
            _expect(reserved == allocated + free + waiting, "reserved != allocated + free + waiting")
            _expect(c["peak_allocated_bytes"] >= allocated, "peak below current allocation")

    # ------------------------------------------------------------------ pools
    def _take_cached(self, queue: Queue, kind: str, size: int) -> _Piece | None:
        pool = self._pools.get((queue.id, kind))
        if not pool:
            return None
        i = bisect.bisect_left(pool, (size, -1, -1))   # best fit: the smallest piece >= size
        if i == len(pool):
            return None
        piece = self._pieces.pop(pool.pop(i))
        return piece

    def _adopt_orphans(self, queue: Queue) -> bool:
        """Give ``queue`` the segments of destroyed queues; True if there were any.

        Pools are per queue, and a queue's id never comes back: without this, a program that
        makes a queue per step (a timing gate, a request) would cache each step's memory in a
        pool nobody asks again, and reserve a new segment every step.  destroy_queue waited
        for the queue's work, so its free memory is safe on any queue; memory that other
        queues still use waits on their events as before, and a block still live in such a
        segment returns to the new owner's pool when it is freed.
        """
        orphans = [seg for seg in self._segments.values() if seg.queue.destroyed]
        for seg in orphans:
            free = []
            piece = seg.first
            while piece is not None:
                if piece.state == _FREE:
                    self._pool_remove(piece)
                    free.append(piece)
                piece = piece.next
            seg.queue = queue
            for piece in free:
                self._pool_insert(piece)
        return bool(orphans)

    def _pool_insert(self, piece: _Piece) -> None:
        key = piece.key
        bisect.insort(self._pools.setdefault((piece.segment.queue.id, piece.segment.kind), []), key)
        self._pieces[key] = piece

    def _pool_remove(self, piece: _Piece) -> None:
        key = piece.key
        pool = self._pools[(piece.segment.queue.id, piece.segment.kind)]
        del pool[bisect.bisect_left(pool, key)]
        del self._pieces[key]

    def _split(self, piece: _Piece, size: int, kind: str) -> None:
        """Cut ``size`` bytes off the front of ``piece``; the rest goes back to the pool.

        Small pieces are split whenever a minimum block remains; large ones only when
        more than SMALL_MAX remains (a sliver of a large segment would only fragment it).
        """
        rest = piece.size - size
        if rest < MIN_BLOCK or (kind == "large" and rest <= SMALL_MAX):
            return
        tail = _Piece(piece.segment, piece.offset + size, rest)
        tail.prev, tail.next = piece, piece.next
        if piece.next is not None:
            piece.next.prev = tail
        piece.next = tail
        piece.size = size
        self._pool_insert(tail)
        self._c["splits"] += 1

    def _return_to_pool(self, piece: _Piece) -> None:
        """Mark ``piece`` free and merge it with free neighbours of the same segment."""
        piece.state = _FREE
        piece.block = None
        nxt = piece.next
        if nxt is not None and nxt.state == _FREE:
            self._pool_remove(nxt)
            piece.size += nxt.size
            piece.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = piece
            self._c["merges"] += 1
        prev = piece.prev
        if prev is not None and prev.state == _FREE:
            self._pool_remove(prev)
            prev.size += piece.size
            prev.next = piece.next
            if piece.next is not None:
                piece.next.prev = prev
            piece = prev
            self._c["merges"] += 1
        self._pool_insert(piece)

    def _forget_live(self, block: Block) -> None:
        piece = block._piece
        del self._live[block.id]
        block.freed = True
        if block._range is not None:
            # Its bytes stop being live memory now, not when the Block object is collected: a
            # raw-pointer copy into a freed block must be refused -- after empty_cache the
            # segment may be unmapped, and the copy would crash the process.
            block._range()
        block._piece = None
        piece.block = None
        self._c["allocated_bytes"] -= piece.size
        self._c["requested_bytes"] -= block.nbytes
        self._c["num_frees"] += 1

    # ------------------------------------------------------------------ segments and OOM
    def _new_segment_or_oom(self, queue: Queue, kind: str, size: int, nbytes: int) -> _Piece:
        seg_size = self.small_segment if kind == "small" else round_size(size, self.large_round)
        why = self._try_new_segment(queue, kind, seg_size)
        if isinstance(why, _Piece):
            return why
        # Out of memory: give back everything cached (waiting briefly for event-held
        # blocks, which may be what we need), then try once more -- the cache first.
        self._c["oom_retries"] += 1
        self.empty_cache(wait_s=self.oom_wait_s)
        piece = self._take_cached(queue, kind, size)
        if piece is not None:
            return piece
        retry = self._try_new_segment(queue, kind, seg_size)
        if isinstance(retry, _Piece):
            return retry
        stats = self.stats()
        shown = ", ".join(f"{k}={v}" for k, v in stats.items())
        raise AllocatorOutOfMemory(
            f"CachingAllocator out of memory: allocate(nbytes={nbytes}) on queue {queue.name} needs a new "
            f"{seg_size}-byte segment and {retry} (also after emptying the cache); stats: {shown}", stats)

    def _try_new_segment(self, queue: Queue, kind: str, seg_size: int):
        """A fresh segment's single piece, or a string saying why the backend refused."""
        reserved = self._c["reserved_bytes"]
        if self.limit_bytes is not None and reserved + seg_size > self.limit_bytes:
            return f"limit_bytes={self.limit_bytes} would be exceeded ({reserved} bytes reserved)"
        try:
            buf = self.source.alloc(seg_size)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is retried
            if _is_oom(exc):
                return f"the backend refused: {exc!r}"
            raise
        seg = _Segment(buf, queue, kind, seg_size)
        self._segments[seg.id] = seg
        c = self._c
        c["reserved_bytes"] += seg_size
        c["peak_reserved_bytes"] = max(c["peak_reserved_bytes"], c["reserved_bytes"])
        return seg.first

    # ------------------------------------------------------------------ validation
    def _check_queue(self, name: str, queue) -> None:
        if not isinstance(queue, Queue):
            raise TypeError(f"{name} must be a Queue, got {type(queue).__name__}")
        if queue.backend is not self.backend:
            raise ValueError(f"{name}={queue.name} belongs to {queue.backend.name} on {queue.backend.device}, "
                             f"not to this allocator's backend {self.backend.name} on {self.backend.device}")
        if queue.destroyed:
            raise RuntimeError(f"{name}={queue.name} was destroyed")
        if self.backend.closed:  # (a cached block would still be handed out: refuse as the backend does)
            raise RuntimeError(f"this allocator's backend {self.backend.name} on {self.backend.device} was closed; "
                               "make a new backend and allocator")

    def _check_block(self, name: str, block) -> None:
        if not isinstance(block, Block):
            raise TypeError(f"{name} must be a Block from CachingAllocator.allocate, got {type(block).__name__}")
        if block.allocator is not self:
            raise ValueError(f"{name}={block!r} was allocated by another CachingAllocator; free it there")
        if block.freed:
            raise RuntimeError(f"double free: {name}={block!r} was already freed")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"CachingAllocator invariant broken: {what}")


def note_use(block, queue: Queue) -> None:
    """Tell the checker that work on ``queue`` uses ``block`` (cheap no-op when it is off).

    Call it right after submitting the work -- a copy, a kernel -- on a queue that is not
    the block's own.  It does not protect the block (that is ``record_stream``); it lets the
    checker notice when nothing else does.
    """
    if not isinstance(block, Block):
        raise TypeError(f"note_use(block=...) needs a Block from CachingAllocator.allocate, "
                        f"got {type(block).__name__}")
    if not isinstance(queue, Queue):
        raise TypeError(f"note_use(queue=...) needs a Queue, got {type(queue).__name__}")
    if queue.backend is not block.backend:
        raise ValueError(f"note_use(queue={queue.name}) belongs to {queue.backend.name}, not to the block's "
                         f"backend {block.backend.name}")
    checker = _hazards.active_checker()
    if checker is not None:
        checker.note_use(block, queue)
