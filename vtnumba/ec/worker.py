"""ECWorker: moves encoder outputs between the device and the shared region, in batches.

Upstream: vLLM's ``ECCPUWorker`` (``ec_connector/cpu/worker``), behaviour kept line by line:

* **Producer** (``save_caches`` + ``flush_saves``): only tensor-parallel rank 0 saves (every
  rank holds the same encoder output; one writer saves host memory bandwidth).
  ``save_caches`` checks the output is what the region holds (its dtype, ``[rows, hidden]``
  rows) and fits its blocks, then writes copy descriptors in bulk: consecutive blocks
  coalesce into one run, and blocks the output never reaches (an entry sized by placeholder
  count, larger than the output) get no descriptor.  ``flush_saves`` issues the step's saves
  as ONE batched copy on a pooled queue that first waits for the compute queue (which
  produced the outputs), bracketed by start/end events.
* **Consumer** (``start_load_caches``): ONE batched copy for all of the step's loads into
  one contiguous destination buffer -- loads sorted by first block so neighbours in the
  region coalesce -- then per-``mm_hash`` views reinterpreted as the model dtype
  ``[rows, hidden]``.  The compute queue waits for the copy's end event, and the buffer is
  registered against the compute queue (see :mod:`vtnumba.ec.destination`).
* **The compute queue** is the caller's (``compute_queue=``), the queue its encoder runs on.
  Without one the worker makes its own, and -- since nobody else queues work there -- ties
  it to the default stream, upstream's "current stream": saves wait for what the default
  stream has queued, the default stream waits for each load, and a load buffer is released
  only after the default stream's reads (no-ops off a real GPU).
* **Completions** (``build_connector_worker_meta``): a transfer is reported only once its
  *own* end event fired, front of the queue first, each exactly once; its queue, events
  and descriptor buffers go back to their pools at that moment.  Until then the saved
  outputs (read when the copy runs) and the descriptors (the seed's lifetime: see
  :mod:`vtnumba.ec.descriptors`) stay referenced.
* ``shutdown`` waits for every in-flight transfer and releases the pools.

Differences from vLLM's, each for a reason: the worker is given its region (so tests and
demos can share one mapping) and does not clean it up -- its creator does; it runs on any
vtnumba backend (cpu sync or threaded queues, the simulator, a real GPU); it keeps each
saved output referenced until its copy finished (the no-allocator equivalent of the
upstream ``src.record_stream(save_stream)``); a step whose saves are all empty (zero
bytes) still reports them, where vLLM's worker would never report them; and an output that does
not fit its blocks, or whose dtype or row width differs from the region's, is a
``ValueError`` -- vLLM's ``assert`` vanishes under ``python -O``, and then the copy
would write into another entry's blocks (or the consumer would read the bytes as the wrong
dtype).

What one step costs, and where it went
--------------------------------------

A step moves one entry or a few, and for entries of a few MiB the copy itself takes tens
of microseconds on a CPU, about as long as a pile of small Python costs: building
descriptors, recording events, checking addresses, bookkeeping.  So the hot path is kept
short, each piece on purpose:

* inputs are checked once, here, at the public boundary: the output's dtype and shape, the
  block ids' type -- and their range inside the compiled pass that also builds the
  descriptors (:meth:`~vtnumba.ec.DescriptorBuffers.add_block_runs`), so a list of
  thousands of ids costs one call, not a dozen numpy operations;
* descriptor buffers, copy queues and events come from pools, so a step allocates almost
  nothing; an output already inside live memory (a backend Buffer) is not registered again;
  on synchronous queues a load reuses the previous step's buffer once the caller dropped
  its views -- the same buffer object, whose views are counted by the reference count of
  its owner array on the host, so nothing runs when a view dies and the step allocates no
  memory (:mod:`vtnumba.ec.destination`);
* **synchronous queues** (the cpu target's default mode, and the simulator): every queued
  operation runs on the spot, on this thread, so the compute queue has finished its work
  before a save is issued and a copy has finished when ``batched_copy`` returns.  Events
  would fire at the very moment they are recorded; the worker records none, times the
  copy with the host clock, and files the completions for the next report (no
  :class:`Transfer`, nothing to poll).  Since nothing is in flight once a call returns,
  each direction keeps one descriptor buffer for all its steps; and on the cpu target,
  where a copy queue would only run the copy on the spot, the worker runs it itself
  (:func:`~vtnumba.memory.copy_engine.runs_inline`): no queue, the address check and the
  copy in one compiled call -- for a step's one entry, together with building the
  descriptors (:meth:`~vtnumba.ec.DescriptorBuffers.copy_block_runs`), and for a save from a
  numpy array with reading its address, too.  The rules are the same --
  a completion is still reported by :meth:`build_connector_worker_meta`, after the copy,
  exactly once -- they just need no machinery;
* on **asynchronous queues** (threaded cpu queues, a real GPU) nothing of that holds, and
  every event of the list above is recorded: gate, start, end.

:attr:`ECWorker.step_us` keeps the host time of recent steps' calls, so the fixed cost
per step can be read off a running worker (``vtnumba bench ec`` reports it).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import numpy as np

from vtnumba import trace
from vtnumba.backend.address_ranges import register, unregister
from vtnumba.backend.arrays import array_kind, cdiv, check_int, dtype_labels, is_c_contiguous, numeric_dtype
from vtnumba.backend.base import Backend, Buffer, Event, Queue
from vtnumba.ec.descriptors import (BadBlockId, DescriptorBufferPool, DescriptorBuffers, RepeatedBlockId,
                                    prepare_descriptors)
from vtnumba.ec.destination import LoadDestination, LoadDestinations
from vtnumba.ec.metadata import ECConnectorMetadata, ECWorkerMetadata
from vtnumba.ec.region import ECSharedRegion, block_id_array
from vtnumba.memory import CachingAllocator
from vtnumba.memory.copy_engine import batched_copy, host_copy_now, live_address, prepare, runs_inline

__all__ = ["ECWorker", "Transfer"]

_INT64 = np.dtype(np.int64)


@dataclass(slots=True)
class Transfer:
    """One batched copy in flight on an asynchronous queue.

    Its queue, events and descriptor buffers are held until ``end_event`` fired, and only
    then recycled and ``completions`` (mm_hashes for saves, transfer ids for loads)
    reported.  ``start_event``/``end_event`` bracket the copy, so its duration is known.
    (A copy on a synchronous queue is finished when it is issued: it never becomes a
    Transfer -- see the module docstring.)
    """

    direction: str                 #: "save" or "load"
    start_event: Event             #: recorded just before the batched copy
    end_event: Event               #: recorded just after it: done when it fires
    completions: list              #: what to report then: mm_hashes (saves) or transfer ids (loads)
    bufs: DescriptorBuffers        #: the step's descriptors, back to the pool when it completes
    queue: Queue                   #: the pooled copy queue it runs on
    num_bytes: int                 #: bytes moved
    num_descriptors: int           #: copy descriptors (block runs)
    gate_event: Event | None = None  #: saves: the compute queue's event the copy waits for
    keepalive: list = field(default_factory=list)      #: saved outputs read by the copy
    ranges: list = field(default_factory=list)         #: their address-range registrations
    destination: LoadDestination | None = None         #: loads: the buffer written by the copy


def _check_output(src, mm_hash: str, region: ECSharedRegion, num_blocks: int) -> int:
    """The byte count of the encoder output ``src`` saved into ``num_blocks`` blocks; ValueError
    unless it is what the region holds and fits.

    The region stores raw bytes, and the consumer reinterprets them as the region's dtype
    and ``hidden_size``: an output of another dtype or row width would be *accepted* by a
    byte copy and read back as garbage, and an output larger than its blocks would spill
    into the blocks of whichever entry follows.  A raw :class:`Buffer` (no dtype) must be a
    whole number of rows.
    """
    block_size = region.block_size_bytes
    if isinstance(src, Buffer):
        total = int(src.nbytes)
        if total % block_size:
            raise ValueError(f"encoder_cache[{mm_hash!r}] is a Buffer of {total} bytes, not a whole number of rows "
                             f"of {block_size} bytes (hidden_size={region.hidden_size} x {region.dtype.name})")
    else:
        if type(src) is not np.ndarray:
            array_kind(f"encoder_cache[{mm_hash!r}]", src)  # a numba device array (TypeError otherwise)
        dtype, shape = src.dtype, src.shape
        if dtype != region.dtype:
            theirs, ours = dtype_labels(dtype, region.dtype)  # ('>f4' and '<f4' are both 'float32')
            raise ValueError(f"encoder_cache[{mm_hash!r}] has dtype {theirs}; the region holds {ours} rows (the "
                             f"consumer would read the bytes as {ours}): convert the output first")
        if len(shape) != 2 or shape[1] != region.hidden_size:
            raise ValueError(f"encoder_cache[{mm_hash!r}] has shape {tuple(shape)}; expected "
                             f"[rows, {region.hidden_size}] (one row of hidden_size={region.hidden_size} per block)")
        if not is_c_contiguous(src):  # (the copy reads it by address, as one byte range)
            raise ValueError(f"encoder_cache[{mm_hash!r}] (shape {tuple(shape)}) must be C-contiguous; save a "
                             "contiguous copy")
        total = int(shape[0]) * block_size
    if total > num_blocks * block_size:
        raise ValueError(f"encoder_cache[{mm_hash!r}] has {total // block_size} rows ({total} bytes) but "
                         f"mm_hash={mm_hash!r} was allocated {num_blocks} blocks ({num_blocks * block_size} bytes); "
                         "the scheduler sizes an entry by its row count -- request_save(mm_hash, rows) with the "
                         "output's rows")
    return total


def _bad_load_id(mm_hash: str, exc: BadBlockId) -> ValueError:
    """The error a load reports for a block id outside the region (nothing was copied)."""
    return ValueError(f"loads[{mm_hash!r}] contains block id {exc.block_id}, outside the region's "
                      f"0..{exc.num_blocks - 1}")


def _bad_save_id(mm_hash: str, exc: BadBlockId | RepeatedBlockId) -> ValueError:
    """The error a save reports for a block id outside the region, or one the step already
    writes (nothing was copied)."""
    if isinstance(exc, BadBlockId):
        return ValueError(f"saves[{mm_hash!r}] contains block id {exc.block_id}, outside the region's "
                          f"0..{exc.num_blocks - 1}")
    return ValueError(f"saves[{mm_hash!r}] writes block {exc.block_id} (index {exc.index}) that this step already "
                      "writes -- for this entry or another: one entry's rows would silently replace the other's; "
                      "every saved block must be distinct")


def _block_id_array(block_ids, mm_hash: str, kind: str) -> np.ndarray:
    """``block_ids`` of ``kind[mm_hash]`` as a 1-D C-contiguous int64 array (see
    :func:`~vtnumba.ec.region.block_id_array`).  Their *range* is checked where the
    descriptors are built (:meth:`DescriptorBuffers.add_block_runs`)."""
    if type(block_ids) is np.ndarray and block_ids.dtype == _INT64 and block_ids.ndim == 1 \
            and block_ids.flags.c_contiguous:
        return block_ids  # the scheduler's arrays pass as they are: this runs every step
    return block_id_array(block_ids, f"{kind}[{mm_hash!r}]")


def _not_metadata(connector_metadata) -> TypeError:
    return TypeError(f"connector_metadata must be the ECConnectorMetadata of this step (the scheduler's "
                     f"build_connector_meta()), got {type(connector_metadata).__name__}")


def _not_a_cache(encoder_cache) -> TypeError:
    return TypeError(f"encoder_cache must be a dict of mm_hash -> encoder output, got {type(encoder_cache).__name__}")


# What a load-buffer allocator must offer (LoadDestinations calls them): CachingAllocator's methods.
_ALLOCATOR_METHODS = ("allocate", "free", "record_stream", "process_events")


class ECWorker:
    """The worker side of the encoder-cache connector (see module docstring)."""

    def __init__(self, region: ECSharedRegion, *, backend: Backend | None = None, compute_queue: Queue | None = None,
                 tp_rank: int = 0, dtype=None, allocator: Any = "auto", pin_memory: bool = True):
        if not isinstance(region, ECSharedRegion):
            raise TypeError(f"region must be an ECSharedRegion, got {type(region).__name__}")
        if region.closed:
            raise RuntimeError(f"{region.label} was already cleaned up")
        tp_rank = check_int("tp_rank", tp_rank, min_value=0)
        if not isinstance(pin_memory, (bool, np.bool_)):  # ("no" is a true string: it would pin)
            raise TypeError(f"pin_memory={pin_memory!r} must be True or False")
        if backend is None:
            from vtnumba.backend.default import default_backend

            backend = default_backend()
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
        # Every argument is checked before anything is done (the region told of this worker,
        # its memory pinned), so a refused worker leaves nothing behind.
        # The model dtype: loads reinterpret raw int8 blocks as it.  The region records it.
        model_dtype = region.dtype if dtype is None else numeric_dtype("dtype", dtype)
        if model_dtype != region.dtype:
            raise ValueError(f"dtype={model_dtype.name} differs from the region's dtype={region.dtype.name}")
        if compute_queue is not None and (not isinstance(compute_queue, Queue) or compute_queue.backend is not backend):
            raise ValueError(f"compute_queue={compute_queue!r} must be a Queue of this worker's backend ({backend.name})")
        if isinstance(allocator, str):
            if allocator != "auto":
                raise ValueError(f"allocator={allocator!r}; expected 'auto', None or a CachingAllocator")
        elif allocator is not None:
            missing = [m for m in _ALLOCATOR_METHODS if not callable(getattr(allocator, m, None))]
            if missing:
                raise TypeError(f"allocator must be 'auto', None or a CachingAllocator; {type(allocator).__name__} "
                                f"has no {', '.join(missing)}")
        self.backend = backend
        self._region = region
        region._workers.add(self)  # its cleanup waits for this worker's copies in flight
        self.dtype = model_dtype
        self.hidden_size = region.hidden_size
        self.block_size = region.block_size_bytes
        caps = backend.capabilities
        # Synchronous queues run every operation on the spot (see the module docstring):
        # no events needed, the copy is done when batched_copy returns.
        self.synchronous = not caps.async_queues
        if pin_memory:
            # Page-locked region memory is what lets a GPU's copy engine read and write it
            # directly (and asynchronously); a no-op off real GPUs, and each process pins its
            # own mapping.
            region.pin_memory(backend)
        # Every TP rank holds the same encoder output; one writer is enough.
        self.tp_rank = tp_rank
        self.is_save_rank = tp_rank == 0
        self._own_compute_queue = compute_queue is None
        self.compute_queue = compute_queue if compute_queue is not None else backend.create_queue("ec-compute")
        self._buf_pool = DescriptorBufferPool()
        # Synchronous queues: a copy is over when its call returns, so each direction keeps one
        # descriptor buffer for all its steps instead of borrowing from the pool (index 0 saves, 1 loads).
        self._kept_bufs: list[DescriptorBuffers | None] = [None, None]
        # Compile the host copy loop and the descriptor builder now, not inside the first timed step.
        prepare(backend)
        prepare_descriptors()
        # Load buffers come from a caching allocator with record_stream (vtnumba.memory), as
        # vLLM's come from torch's; allocator=None uses backend.alloc per load instead.
        self._own_allocator = isinstance(allocator, str)
        if self._own_allocator:
            allocator = CachingAllocator(backend)
        self.allocator = allocator
        self._destinations = LoadDestinations(backend, self.compute_queue, allocator,
                                              follow_default_stream=self._own_compute_queue)
        # The save batch being filled this step.
        self._save_bufs: DescriptorBuffers | None = None
        self._save_queue: Queue | None = None
        self._save_count = 0
        self._save_bytes = 0
        # Descriptors of the batch already copied by save_caches (a step's only save on the cpu
        # target, see save_caches), and the host time that took.
        self._save_copied = 0
        self._save_copy_ns = 0
        self._save_mm_hashes: list[str] = []
        self._save_sources: list = []
        self._save_ranges: list = []
        # Separate deques per direction: saves and loads can be in flight at the same time.
        self._inflight_saves: deque[Transfer] = deque()
        self._inflight_loads: deque[Transfer] = deque()
        # Synchronous queues: copies that finished when they were issued, waiting for the
        # next report -- their completions, and how many transfers they came from.
        self._finished_saves: list = []
        self._finished_loads: list = []
        self._unreported = [0, 0]  # (saves, loads)
        self._queue_pool: list[Queue] = []
        self._event_pool: list[Event] = []
        self._all_queues: list[Queue] = []
        self._lock = threading.Lock()
        self._shut_down = False
        self.stats = {d: {"transfers": 0, "entries": 0, "bytes": 0, "descriptors": 0, "copy_ms": 0.0}
                      for d in ("save", "load")}
        # The last completed transfers, newest last: (direction, entries, bytes, descriptors, ms).
        self.history: deque[tuple] = deque(maxlen=256)
        #: Host time (microseconds) of the worker's calls in recent steps, newest last, per kind:
        #: ``"save"`` (save_caches + flush_saves of a step), ``"load"`` (start_load_caches),
        #: ``"report"`` (a build_connector_worker_meta that reported something).  The copy's own
        #: duration is in :attr:`history`; what is left is the fixed cost of a step.
        self.step_us: dict[str, deque] = {k: deque(maxlen=256) for k in ("save", "load", "report")}
        self._save_t0 = 0
        # Blocks this step's saves write, marked with the step's epoch (see add_block_runs).
        self._save_marks: np.ndarray | None = None
        self._save_epoch = 0

    # ------------------------------------------------------------------ pools
    def _acquire_queue(self) -> Queue:
        if self._queue_pool:
            return self._queue_pool.pop()
        q = self.backend.create_queue(f"ec-copy{len(self._all_queues)}")
        self._all_queues.append(q)
        return q

    def _acquire_descriptors(self, direction: int, n: int) -> DescriptorBuffers:
        """Room for ``n`` descriptors of a step in ``direction`` (0 saves, 1 loads)."""
        if not self.synchronous:
            return self._buf_pool.acquire(n)  # in flight after the call: back only once its copy finished
        bufs = self._kept_bufs[direction]
        if bufs is None or len(bufs.sizes) < n:
            bufs = self._kept_bufs[direction] = self._buf_pool.acquire(n)
        return bufs

    def _release_descriptors(self, bufs: DescriptorBuffers) -> None:
        """Descriptors no copy will read any more (kept by the worker on synchronous queues)."""
        if not self.synchronous:
            self._buf_pool.release(bufs)

    def _acquire_event(self) -> Event:
        return self._event_pool.pop() if self._event_pool else self.backend.create_event()

    def _check_live(self, op: str) -> None:
        if self._shut_down:
            raise RuntimeError(f"ECWorker.{op} after shutdown()")

    # ------------------------------------------------------------------ producer path
    def save_caches(self, encoder_cache: dict, mm_hash: str, connector_metadata: ECConnectorMetadata) -> None:
        """Write copy descriptors for ``encoder_cache[mm_hash]`` into this step's save batch.

        Nothing is copied yet: :meth:`flush_saves` issues the whole batch as one copy.  The
        output is kept referenced until that copy has finished.  (One exception, which changes
        nothing a caller sees: on the cpu target's synchronous queues a step's only save *is*
        its whole batch, and the queue would copy it on the spot -- so it is copied here, in
        the compiled call that builds its descriptors, and :meth:`flush_saves` files it.)
        """
        t0 = perf_counter_ns()
        if self._shut_down:
            self._check_live("save_caches")
        if not self.is_save_rank:
            return
        try:
            saves = connector_metadata.saves
            block_ids = saves.get(mm_hash)
        except AttributeError:
            raise _not_metadata(connector_metadata) from None
        if block_ids is None:
            return  # not scheduled for saving (already cached, or no room)
        try:
            src = encoder_cache.get(mm_hash)
        except AttributeError:
            raise _not_a_cache(encoder_cache) from None
        if src is None:
            raise KeyError(f"save_caches: mm_hash {mm_hash!r} is scheduled for saving but encoder_cache has no "
                           "output for it")
        ids = _block_id_array(block_ids, mm_hash, "saves")
        region = self._region
        total_bytes = _check_output(src, mm_hash, region, ids.size)
        if self._save_bufs is None and len(saves) == 1 and type(src) is np.ndarray and self.synchronous \
                and runs_inline(self.backend):
            return self._save_now(mm_hash, src, ids, total_bytes, t0)
        block_size = self.block_size
        # Entries may be sized by placeholder count, larger than the output: blocks the
        # output never reaches get no descriptor (vLLM's worker trims the last run to the
        # output's end the same way).  The address is read before anything of the step's
        # batch is taken: a freed Buffer raises here, leaving the batch as it was.
        n_used = cdiv(total_bytes, block_size)  # blocks the output reaches
        src_addr, src_live = live_address(src, total_bytes) if n_used else (0, True)

        bufs = self._save_bufs
        fresh = bufs is None
        if fresh:
            # The first save of the step: descriptors for every scheduled block of the step,
            # and a new epoch for the marks of the blocks it writes.
            self._new_save_epoch()
            bufs = self._save_bufs = self._acquire_descriptors(0, sum(map(len, saves.values())))
            self._save_t0 = t0
        count = self._save_count
        # The step's one save, from a live Buffer, on the cpu target: copied now (see the
        # docstring; a numpy output took _save_now above).
        copy_now = fresh and len(saves) == 1 and src_live and self.synchronous and runs_inline(self.backend)
        try:
            if count + ids.size > len(bufs.sizes):
                raise RuntimeError(f"save_caches({mm_hash!r}): this step's saves need more than the "
                                   f"{len(bufs.sizes)} descriptors sized from the metadata; pass the same "
                                   "connector_metadata to every save_caches call of a step")
            if copy_now:  # nothing left for the flush but the report
                c0 = perf_counter_ns()
                self._save_count = self._save_copied = bufs.copy_block_runs(
                    ids, n_used, region.num_blocks, region.base_ptr, src_addr, block_size, total_bytes, True,
                    marks=self._save_marks, epoch=self._save_epoch, check_flat=src_live)
                self._save_copy_ns = perf_counter_ns() - c0
            else:
                self._save_count = bufs.add_block_runs(count, ids, n_used, region.num_blocks, region.base_ptr,
                                                       src_addr, block_size, total_bytes, True,
                                                       marks=self._save_marks, epoch=self._save_epoch)
        except BaseException as exc:
            if fresh:  # nothing of this step is in the batch yet: give its resources back
                self._release_save_batch()
            if isinstance(exc, (BadBlockId, RepeatedBlockId)):
                raise _bad_save_id(mm_hash, exc) from None
            raise
        if not src_live and not copy_now:
            # The copy runs later, by address, and the copy engine checks every address it
            # touches against live memory: declare an output it does not know (an array the
            # caller made) live until the copy has finished.  Backend buffers already are.
            self._save_ranges.append(register(src_addr, total_bytes, f"encoder output {mm_hash!r}"))
        self._save_bytes += total_bytes
        self._save_mm_hashes.append(mm_hash)
        self._save_sources.append(src)

    def _new_save_epoch(self) -> tuple[np.ndarray, int]:
        """A step's first save: a new epoch for the marks of the blocks the step writes (see
        add_block_runs); ``(marks, epoch)``."""
        if self._save_marks is None:  # (4 bytes a block, allocated by the first save: loaders need none)
            self._save_marks = np.zeros(self._region.num_blocks, np.uint32)
        self._save_epoch = self._save_epoch % 0xFFFFFFFF + 1  # 1 .. 2**32-1 (0 is "never")
        return self._save_marks, self._save_epoch

    def _save_now(self, mm_hash: str, src: np.ndarray, ids: np.ndarray, total_bytes: int, t0: int) -> None:
        """The usual step on the cpu target's synchronous queues -- one save, from a numpy array --
        copied on the spot: reading the output's address, building its descriptors, checking the
        region's side and copying are one compiled call (:meth:`~vtnumba.ec.DescriptorBuffers.copy_block_runs`
        given the output's bytes).  The output side needs no check: its address and size come
        from the array itself, which this call holds.  The batch is then this one save, already
        copied, and :meth:`flush_saves` only files it."""
        region = self._region
        block_size = self.block_size
        marks, epoch = self._new_save_epoch()
        bufs = self._acquire_descriptors(0, ids.size)
        c0 = perf_counter_ns()
        try:
            n = bufs.copy_block_runs(ids, cdiv(total_bytes, block_size), region.num_blocks, region.base_ptr,
                                     src.view(np.uint8), block_size, total_bytes, True, marks=marks, epoch=epoch)
        except (BadBlockId, RepeatedBlockId) as exc:  # (nothing was copied; the step's batch is still empty)
            raise _bad_save_id(mm_hash, exc) from None
        self._save_copy_ns = perf_counter_ns() - c0
        self._save_bufs, self._save_count, self._save_copied = bufs, n, n
        self._save_bytes, self._save_t0 = total_bytes, t0
        self._save_mm_hashes.append(mm_hash)

    def _release_save_batch(self) -> None:
        """Give the step's save batch back -- descriptors, queue, output registrations -- and
        start an empty one (after a synchronous copy, or when the batch is dropped)."""
        if self._save_bufs is not None:
            self._release_descriptors(self._save_bufs)
        if self._save_queue is not None:
            self._queue_pool.append(self._save_queue)
        for token in self._save_ranges:
            unregister(token)
        self._save_bufs, self._save_queue = None, None
        self._save_count = self._save_bytes = self._save_copied = self._save_copy_ns = 0
        self._save_mm_hashes, self._save_sources, self._save_ranges = [], [], []

    def flush_saves(self) -> None:
        """Issue this step's saves as one batched copy gated behind the compute queue.

        If the copy engine refuses the batch (its address check raises before anything is
        copied), the step's saves are dropped -- nothing will report them -- and the error
        propagates; the worker stays usable for the next step.
        """
        if self._shut_down:
            self._check_live("flush_saves")
        if not self._save_mm_hashes:
            if self._save_bufs is not None:
                self._release_save_batch()
            return
        bufs, n = self._save_bufs, self._save_count
        hashes, nbytes = self._save_mm_hashes, self._save_bytes
        be = self.backend
        t0 = perf_counter_ns()
        gate = start = end = None
        done = self._save_copied  # descriptors save_caches already copied (see there)
        try:
            if done and done == n:
                pass  # all of it (a step's only save on the cpu target)
            elif self.synchronous and runs_inline(be):
                # The cpu target's synchronous queues: a copy queue would run the copy on the
                # spot, on this thread -- so run it here, the address checks and the copy in
                # one compiled call, and skip the queue.
                host_copy_now(bufs.src_ptrs[done:], bufs.dst_ptrs[done:], bufs.sizes[done:], n - done)
            else:
                start, end, gate = self._queue_saves(bufs, done, n)
        except BaseException:
            # Refused before anything was copied (or interrupted before it was queued): the
            # step's saves are dropped -- nothing will report them -- and the worker carries on.
            self._release_save_batch()
            raise
        if end is None:
            # Synchronous queues: the compute queue's work already ran, and the step's copy
            # is finished now -- no gate, no events, nothing to keep.  The completions wait for
            # the next report; the resources go straight back.
            t1 = perf_counter_ns()
            self._finished_now(0, hashes, nbytes, n, (t1 - t0 + self._save_copy_ns) / 1e6)
            self._release_save_batch()
        else:
            t1 = perf_counter_ns()
            # Until the end event fires, the descriptors and the outputs stay referenced.
            self._inflight_saves.append(Transfer(
                "save", start, end, hashes, bufs, self._save_queue, nbytes, n, gate_event=gate,
                keepalive=self._save_sources, ranges=self._save_ranges))
            self._save_mm_hashes, self._save_sources, self._save_ranges = [], [], []
            self._save_bufs = self._save_queue = None
            self._save_count = self._save_bytes = 0
        if trace.RECORDER is not None:
            trace.record("ec.flush_saves", "ec", "host", t0, t1, entries=len(hashes), bytes=nbytes, descriptors=n)
        self.step_us["save"].append((t1 - self._save_t0) / 1e3)

    def _queue_saves(self, bufs: DescriptorBuffers, first: int, n: int) -> tuple:
        """The step's batched save copy -- descriptors ``first .. n-1`` -- on a pooled copy queue;
        its ``(start, end, gate)`` events (all None on a synchronous queue, where it ran on the spot)."""
        be = self.backend
        q = self._save_queue = self._acquire_queue()
        gate = start = end = None
        try:
            if not self.synchronous:
                # The outputs were produced on the compute queue: the copy must not start before it.
                if self._own_compute_queue:
                    # Nobody else queues on a compute queue the worker made itself: the outputs
                    # came from the default stream (numba's launches and copies), vLLM's
                    # "current stream" -- so the gate follows that too.
                    be.order_after_default_stream(self.compute_queue)
                gate = self._acquire_event()
                be.record_event(gate, self.compute_queue)
                be.queue_wait_event(q, gate)
                start, end = self._acquire_event(), self._acquire_event()
                be.record_event(start, q)
            batched_copy(bufs.src_ptrs[first:n], bufs.dst_ptrs[first:n], bufs.sizes[first:n], queue=q, backend=be)
        except BaseException:
            self._event_pool.extend(e for e in (gate, start, end) if e is not None)
            raise
        if end is not None:  # (the copy is queued: from here on, its end event says when it is over)
            be.record_event(end, q)
        return start, end, gate

    def _finished_now(self, direction: int, completions: list, num_bytes: int, num_descriptors: int,
                      ms: float) -> None:
        """A synchronous copy finished as it was issued: count it and queue its completions
        for the next :meth:`build_connector_worker_meta` (``direction``: 0 saves, 1 loads)."""
        with self._lock:  # a report on another thread swaps the lists and resets the counts together
            (self._finished_loads if direction else self._finished_saves).extend(completions)
            self._unreported[direction] += 1
        self._count_finished("load" if direction else "save", len(completions), num_bytes, num_descriptors, ms)

    def _count_finished(self, direction: str, entries: int, num_bytes: int, num_descriptors: int, ms: float) -> None:
        st = self.stats[direction]
        st["transfers"] += 1
        st["entries"] += entries
        st["bytes"] += num_bytes
        st["descriptors"] += num_descriptors
        st["copy_ms"] += ms
        self.history.append((direction, entries, num_bytes, num_descriptors, ms))

    # ------------------------------------------------------------------ consumer path
    def start_load_caches(self, encoder_cache: dict, connector_metadata: ECConnectorMetadata) -> None:
        """Copy every load of the step from the region into one device buffer, in one batch.

        Every scheduled load is copied, even if ``encoder_cache`` already has the hash: each
        participating rank must report each transfer exactly once.
        """
        t0 = perf_counter_ns()
        if self._shut_down:
            self._check_live("start_load_caches")
        try:
            loads = connector_metadata.loads
        except AttributeError:
            raise _not_metadata(connector_metadata) from None
        if not loads:
            return
        if not isinstance(encoder_cache, dict):  # (the loads are stored into it)
            raise _not_a_cache(encoder_cache)
        self._start_loads(encoder_cache, loads)
        t1 = perf_counter_ns()
        if trace.RECORDER is not None:
            trace.record("ec.start_load_caches", "ec", "host", t0, t1, entries=len(loads))
        self.step_us["load"].append((t1 - t0) / 1e3)

    def _start_loads(self, encoder_cache: dict, loads: dict) -> None:
        # The step's entries as parallel lists -- mm_hashes, transfer ids (what the report
        # completes), block ids -- in the order they are copied.
        if len(loads) == 1:  # the usual step: one entry, nothing to sort
            (h, (tid, ids)), = loads.items()
            ids = _block_id_array(ids, h, "loads")
            if self.synchronous and runs_inline(self.backend):
                return self._load_now(encoder_cache, h, tid, ids)
            hashes, tids, id_arrays = [h], [tid], [ids]
            total_blocks = ids.size
        else:
            items = [(h, tid, _block_id_array(ids, h, "loads")) for h, (tid, ids) in loads.items()]
            # Sorted by first block: entries adjacent in the region land adjacent in the
            # destination and coalesce.
            items.sort(key=lambda it: int(it[2][0]) if it[2].size else -1)
            hashes, tids, id_arrays = [it[0] for it in items], [it[1] for it in items], [it[2] for it in items]
            total_blocks = sum(ids.size for ids in id_arrays)
        region = self._region
        block_size = self.block_size
        num_blocks, region_base = region.num_blocks, region.base_ptr
        be = self.backend
        q = self._acquire_queue()
        nbytes = total_blocks * block_size
        dest = self._destinations.allocate(nbytes, q)
        bufs = self._acquire_descriptors(1, total_blocks)
        n, flat = 0, dest.ptr
        try:
            for h, ids in zip(hashes, id_arrays):
                k = ids.size
                # The destination is one flat buffer: entry after entry, in the sorted order.
                n = bufs.add_block_runs(n, ids, k, num_blocks, region_base, flat, block_size, k * block_size,
                                        False, True)
                flat += k * block_size
        except BadBlockId as exc:
            # Nothing was copied: everything taken for this step goes back, unused.
            self._release_descriptors(bufs)
            self._queue_pool.append(q)
            self._destinations.cancel(dest)
            raise _bad_load_id(h, exc) from None
        # Per-hash views of the contiguous buffer, as [rows, hidden] in the model dtype --
        # cut now, while this step's objects are still in the CPU's caches (a copy of a few
        # MiB evicts them), and handed out once the copy has been issued without an error.
        views = self._destinations.views(dest, self.dtype, self.hidden_size,
                                         [total_blocks] if len(id_arrays) == 1 else [ids.size for ids in id_arrays])
        self._destinations.seal(dest)
        start = end = None
        try:
            c0 = perf_counter_ns()
            if not self.synchronous:
                start, end = self._acquire_event(), self._acquire_event()
                be.record_event(start, q)
            # The region is written by another process and nothing earlier on this queue
            # touches it, so the driver may read it out of stream order.
            batched_copy(bufs.src_ptrs[:n], bufs.dst_ptrs[:n], bufs.sizes[:n], queue=q, backend=be,
                         src_access_order="any")
        except BaseException:
            # Refused before anything was copied (or interrupted before it was queued): the
            # views go unused, and everything taken for this step goes back.
            del views[:]
            self._event_pool.extend(e for e in (start, end) if e is not None)
            self._release_descriptors(bufs)
            self._queue_pool.append(q)
            self._destinations.cancel(dest)
            raise
        if end is None:
            # Done on return (see flush_saves): report at the next poll, recycle now.
            self._finished_now(1, tids, nbytes, n, (perf_counter_ns() - c0) / 1e6)
            self._destinations.copy_finished(dest)
            self._release_descriptors(bufs)
            self._queue_pool.append(q)
        else:
            be.record_event(end, q)
            self._inflight_loads.append(Transfer("load", start, end, tids, bufs, q, nbytes, n, destination=dest))
        for h, arr in zip(hashes, views):
            encoder_cache[h] = arr
        if end is not None:
            # Kernels queued on the compute queue from now on see the loaded bytes.  (On
            # synchronous queues the copy is already done: later kernels see them anyway.)
            be.queue_wait_event(self.compute_queue, end)
            if self._own_compute_queue:
                # ...and so does the default stream, where a caller that never saw the worker's
                # compute queue launches its kernels and reads the views back (copy_to_host).
                be.order_default_stream_after(self.compute_queue)

    def _load_now(self, encoder_cache: dict, mm_hash: str, tid: int, ids: np.ndarray) -> None:
        """The usual step on the cpu target's synchronous queues -- one entry -- done on the spot:
        building its descriptors, checking their addresses and copying are one compiled call on
        this thread (:meth:`~vtnumba.ec.DescriptorBuffers.copy_block_runs`); no copy queue, and
        nothing left to recycle.  Same rules as the general path above: nothing reaches
        ``encoder_cache`` unless the copy was made, and the report comes at the next poll."""
        k = ids.size
        block_size = self.block_size
        nbytes = k * block_size
        region = self._region
        dest = self._destinations.allocate(nbytes, self.compute_queue)
        bufs = self._acquire_descriptors(1, k)
        # Cut before the copy, while this step's objects are still in the CPU's caches (a copy
        # of a few MiB evicts them).
        view, = self._destinations.views(dest, self.dtype, self.hidden_size, [k])
        c0 = perf_counter_ns()
        try:
            n = bufs.copy_block_runs(ids, k, region.num_blocks, region.base_ptr, dest.ptr, block_size, nbytes, False)
        except BaseException as exc:
            del view  # (nothing was copied: the buffer has no user, and goes back)
            self._destinations.cancel(dest)
            if isinstance(exc, BadBlockId):
                raise _bad_load_id(mm_hash, exc) from None
            raise
        c1 = perf_counter_ns()
        self._destinations.copy_finished(dest)
        encoder_cache[mm_hash] = view
        self._finished_now(1, [tid], nbytes, n, (c1 - c0) / 1e6)

    @staticmethod
    def _release_sources(t: Transfer) -> None:
        """The copy has finished: its sources need neither keeping alive nor declaring live."""
        t.keepalive.clear()
        if t.ranges:
            for token in t.ranges:
                unregister(token)
            t.ranges.clear()

    # ------------------------------------------------------------------ completions
    def _collect_finished(self, inflight: deque[Transfer], done: list) -> None:
        """Pop transfers that are done, front first; recycle; append their completions to ``done``.

        Conservative: a later transfer that finished first waits behind the front one and
        is reported on a later poll -- so every completion is real and reported once.
        """
        be = self.backend
        while inflight:
            t = inflight[0]
            end = t.end_event
            if not be.query_event(end):
                return
            inflight.popleft()
            done.extend(t.completions)
            self._count_finished(t.direction, len(t.completions), t.num_bytes, t.num_descriptors,
                                 be.elapsed_ms(t.start_event, end))
            self._event_pool.append(t.start_event)
            self._event_pool.append(end)
            if t.gate_event is not None:
                self._event_pool.append(t.gate_event)
            if t.destination is not None:
                self._destinations.copy_finished(t.destination)
            self._release_sources(t)
            self._buf_pool.release(t.bufs)
            self._queue_pool.append(t.queue)

    def build_connector_worker_meta(self) -> ECWorkerMetadata | None:
        """Report the copies that finished on this rank since the last call; None if none did."""
        t0 = perf_counter_ns()
        with self._lock:
            # Synchronous copies finished when they were issued; asynchronous ones are
            # collected here, front first.
            saves, loads = self._finished_saves, self._finished_loads
            self._finished_saves, self._finished_loads = [], []
            self._unreported[0] = self._unreported[1] = 0
            if self._inflight_saves:
                self._collect_finished(self._inflight_saves, saves)
            if self._inflight_loads:
                self._collect_finished(self._inflight_loads, loads)
            # Load buffers whose views (and compute-queue reads) are done go back -- but on
            # synchronous queues one buffer alone would only become the spare, kept for the
            # next load as it is now, which takes it back in place: nothing to do for it.
            dests = self._destinations
            if not (self.synchronous and dests.live_count() == 1):
                dests.reclaim()
        if not saves and not loads:
            return None
        meta = ECWorkerMetadata(completed_saves=saves, completed_loads=loads, load_ranks=[self.tp_rank] * len(loads))
        self.step_us["report"].append((perf_counter_ns() - t0) / 1e3)
        return meta

    def inflight(self) -> tuple[int, int]:
        """(saves, loads) transfers issued and not yet reported."""
        return (len(self._inflight_saves) + self._unreported[0], len(self._inflight_loads) + self._unreported[1])

    def wait(self, max_inflight: int = 0) -> None:
        """Block until at most ``max_inflight`` transfers per direction are still running.

        ``wait()`` waits for everything; ``wait(2)`` is back-pressure for a pipeline that
        keeps two copies in flight.  Finished transfers are still reported normally by
        :meth:`build_connector_worker_meta`.
        """
        if max_inflight != 0:
            check_int("max_inflight", max_inflight, min_value=0)
        for inflight in (self._inflight_saves, self._inflight_loads):
            pending = list(inflight)
            # Transfers on one direction finish in any order (separate pooled queues), so
            # wait for all but the newest max_inflight.
            for t in pending[:max(len(pending) - max_inflight, 0)]:
                self.backend.synchronize_event(t.end_event)  # (a synchronous copy never becomes a Transfer)

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Drain in-flight copies, then release queues, events and unreferenced load buffers."""
        if self._shut_down:
            return
        # A backend closed first (a teardown in that order) already finished every copy, and
        # refuses all work: only this worker's own bookkeeping is left to release.
        live = not self.backend.closed
        if live:
            self.wait()
        self._shut_down = True
        # The copies are done; their completions are dropped (nobody is stepping any more)
        # and their resources return to the pools, to be destroyed below.
        for t in (*self._inflight_saves, *self._inflight_loads):
            if t.destination is not None:
                self._destinations.copy_finished(t.destination)
            self._release_sources(t)
            self._event_pool.extend(e for e in (t.start_event, t.end_event, t.gate_event) if e is not None)
        self._inflight_saves.clear()
        self._inflight_loads.clear()
        if self._save_bufs is not None:  # descriptors written but never flushed: dropped
            self._release_save_batch()
        if live:
            self._destinations.drain()
            if self._own_allocator:
                # drain()'s frees wait (record_stream) on events they have just recorded: wait
                # for them (bounded), or empty_cache would release nothing and the allocator's
                # segments and events would outlive the worker, in the backend, for good.
                self.allocator.empty_cache(wait_s=10.0)  # (views still alive keep their own bytes)
        for q in self._all_queues:
            self.backend.destroy_queue(q)  # (after close() as well: only released then)
        self._all_queues.clear()
        self._queue_pool.clear()
        if live:
            for e in self._event_pool:
                self.backend.destroy_event(e)
        self._event_pool.clear()
        if self._own_compute_queue:
            self.backend.destroy_queue(self.compute_queue)

    def __enter__(self) -> "ECWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
