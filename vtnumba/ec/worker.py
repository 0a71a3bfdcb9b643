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
* **Completions** (``build_connector_worker_meta``): a transfer is reported only once its
  *own* end event fired, front of the queue first, each exactly once; its queue, events
  and descriptor buffers go back to their pools at that moment.  Until then the
  descriptors (read when the copy runs) and the saved outputs stay referenced.
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
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vtnumba import trace
from vtnumba.backend.address_ranges import register, unregister
from vtnumba.backend.arrays import array_kind, cdiv, check_int
from vtnumba.backend.base import Backend, Buffer, Event, Queue
from vtnumba.ec.descriptors import DescriptorBufferPool, DescriptorBuffers, coalesce_runs
from vtnumba.ec.destination import LoadDestination, LoadDestinations
from vtnumba.ec.metadata import ECConnectorMetadata, ECWorkerMetadata
from vtnumba.ec.region import ECSharedRegion
from vtnumba.memory import CachingAllocator
from vtnumba.memory.copy_engine import address_of, batched_copy, prepare

__all__ = ["ECWorker", "Transfer"]


@dataclass
class Transfer:
    """One batched copy in flight.

    Its queue, events and descriptor buffers are held until ``end_event`` fires; only then
    are they recycled and ``completions`` (mm_hashes for saves, transfer ids for loads)
    reported.  ``start_event``/``end_event`` bracket the copy, so its duration is known.
    """

    direction: str                 #: "save" or "load"
    start_event: Event             #: recorded just before the batched copy
    end_event: Event               #: recorded just after it: the transfer is done when it fires
    completions: list              #: what to report then: mm_hashes (saves) or transfer ids (loads)
    bufs: DescriptorBuffers        #: the descriptors the copy reads
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
    name = f"encoder_cache[{mm_hash!r}]"
    allocated = num_blocks * region.block_size_bytes
    if isinstance(src, Buffer):
        total = int(src.nbytes)
        if total % region.block_size_bytes:
            raise ValueError(f"{name} is a Buffer of {total} bytes, not a whole number of rows of "
                             f"{region.block_size_bytes} bytes (hidden_size={region.hidden_size} x "
                             f"{region.dtype.name})")
    else:
        array_kind(name, src)  # a numpy or numba device array (TypeError otherwise)
        dtype, shape = src.dtype, src.shape
        if np.dtype(dtype) != region.dtype:
            raise ValueError(f"{name} has dtype {np.dtype(dtype).name}; the region holds "
                             f"{region.dtype.name} rows (the consumer would read the bytes as "
                             f"{region.dtype.name}): convert the output first")
        if len(shape) != 2 or shape[1] != region.hidden_size:
            raise ValueError(f"{name} has shape {tuple(shape)}; expected [rows, {region.hidden_size}] "
                             f"(one row of hidden_size={region.hidden_size} per block)")
        total = int(shape[0]) * region.block_size_bytes
    if total > allocated:
        rows = total // region.block_size_bytes
        raise ValueError(f"{name} has {rows} rows ({total} bytes) but mm_hash={mm_hash!r} was allocated "
                         f"{num_blocks} blocks ({allocated} bytes); the scheduler sizes an entry by its row "
                         "count -- request_save(mm_hash, rows) with the output's rows")
    return total


class ECWorker:
    """The worker side of the encoder-cache connector (see module docstring)."""

    def __init__(self, region: ECSharedRegion, *, backend: Backend | None = None, compute_queue: Queue | None = None,
                 tp_rank: int = 0, dtype=None, allocator: Any = "auto", pin_memory: bool = True):
        if not isinstance(region, ECSharedRegion):
            raise TypeError(f"region must be an ECSharedRegion, got {type(region).__name__}")
        if region.closed:
            raise RuntimeError(f"{region.label} was already cleaned up")
        tp_rank = check_int("tp_rank", tp_rank, min_value=0)
        if backend is None:
            from vtnumba.backend.default import default_backend

            backend = default_backend()
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
        self.backend = backend
        self._region = region
        # The model dtype: loads reinterpret raw int8 blocks as it.  The region records it.
        self.dtype = np.dtype(region.dtype if dtype is None else dtype)
        if self.dtype != region.dtype:
            raise ValueError(f"dtype={self.dtype.name} differs from the region's dtype={region.dtype.name}")
        self.hidden_size = region.hidden_size
        self.block_size = region.block_size_bytes
        if pin_memory:
            region.pin_memory(backend)  # a no-op off real GPUs; each process pins its own mapping
        # Every TP rank holds the same encoder output; one writer is enough.
        self.tp_rank = tp_rank
        self.is_save_rank = tp_rank == 0
        self._own_compute_queue = compute_queue is None
        self.compute_queue = compute_queue if compute_queue is not None else backend.create_queue("ec-compute")
        self._buf_pool = DescriptorBufferPool()
        prepare(backend)  # compile the host copy loop now, not inside the first timed copy
        # Load buffers come from a caching allocator with record_stream (vtnumba.memory), as
        # vLLM's come from torch's; allocator=None uses backend.alloc per load instead.
        self._own_allocator = isinstance(allocator, str)
        if self._own_allocator:
            if allocator != "auto":
                raise ValueError(f"allocator={allocator!r}; expected 'auto', None or a CachingAllocator")
            allocator = CachingAllocator(backend)
        self.allocator = allocator
        self._destinations = LoadDestinations(backend, self.compute_queue, allocator)
        # The save batch being filled this step.
        self._save_bufs: DescriptorBuffers | None = None
        self._save_queue: Queue | None = None
        self._save_count = 0
        self._save_bytes = 0
        self._save_mm_hashes: list[str] = []
        self._save_sources: list = []
        self._save_ranges: list = []
        # Separate deques per direction: saves and loads can be in flight at the same time.
        self._inflight_saves: deque[Transfer] = deque()
        self._inflight_loads: deque[Transfer] = deque()
        self._queue_pool: list[Queue] = []
        self._event_pool: list[Event] = []
        self._all_queues: list[Queue] = []
        self._lock = threading.Lock()
        self._shut_down = False
        self.stats = {d: {"transfers": 0, "entries": 0, "bytes": 0, "descriptors": 0, "copy_ms": 0.0}
                      for d in ("save", "load")}
        # The last completed transfers, newest last: (direction, entries, bytes, descriptors, ms).
        self.history: deque[tuple] = deque(maxlen=256)

    # ------------------------------------------------------------------ pools
    def _acquire_queue(self) -> Queue:
        if self._queue_pool:
            return self._queue_pool.pop()
        q = self.backend.create_queue(f"ec-copy{len(self._all_queues)}")
        self._all_queues.append(q)
        return q

    def _acquire_event(self) -> Event:
        return self._event_pool.pop() if self._event_pool else self.backend.create_event()

    def _check_live(self, op: str) -> None:
        if self._shut_down:
            raise RuntimeError(f"ECWorker.{op} after shutdown()")

    # ------------------------------------------------------------------ producer path
    def save_caches(self, encoder_cache: dict, mm_hash: str, connector_metadata: ECConnectorMetadata) -> None:
        """Write copy descriptors for ``encoder_cache[mm_hash]`` into this step's save batch.

        Nothing is copied yet: :meth:`flush_saves` issues the whole batch as one copy.  The
        output is kept referenced until that copy has finished.
        """
        self._check_live("save_caches")
        if not self.is_save_rank:
            return
        block_ids = connector_metadata.saves.get(mm_hash)
        if block_ids is None:
            return  # not scheduled for saving (already cached, or no room)
        if mm_hash not in encoder_cache:
            raise KeyError(f"save_caches: mm_hash {mm_hash!r} is scheduled for saving but encoder_cache has no "
                           "output for it")
        ids = self._region.check_block_ids(block_ids, f"saves[{mm_hash!r}]")
        src = encoder_cache[mm_hash]
        total_bytes = _check_output(src, mm_hash, self._region, int(ids.size))
        block_size = self.block_size

        if self._save_bufs is None:
            total = sum(len(v) for v in connector_metadata.saves.values())
            self._save_bufs = self._buf_pool.acquire(total)
            self._save_queue = self._acquire_queue()
            self._save_mm_hashes = []
            self._save_sources = []
        bufs = self._save_bufs
        if self._save_count + ids.size > bufs.capacity:
            raise RuntimeError(f"save_caches({mm_hash!r}): this step's saves need more than the "
                               f"{bufs.capacity} descriptors sized from the metadata; pass the same "
                               "connector_metadata to every save_caches call of a step")

        # Entries may be sized by placeholder count, larger than the output: blocks the
        # output never reaches get no descriptor.
        n_used = cdiv(total_bytes, block_size)
        if n_used:
            src_addr = address_of(src)
            # The copy runs later, by address: declare the output live until it has (see the
            # copy engine's range check).
            self._save_ranges.append(register(src_addr, total_bytes, f"encoder output {mm_hash!r}"))
            src_base = np.uint64(src_addr)
            dst_base = np.uint64(self._region.base_ptr)
            slots, first_blocks, num_blocks = coalesce_runs(ids[:n_used])
            run_bytes = num_blocks * block_size
            # vLLM's worker trims the last run to the output's end; _check_output lets only whole rows
            # through, so here this only restates that the copy ends with the output.
            run_bytes[-1] = total_bytes - slots[-1] * block_size
            self._save_count = bufs.add_copies(
                self._save_count,
                src_base + slots.astype(np.uint64) * np.uint64(block_size),
                dst_base + first_blocks.astype(np.uint64) * np.uint64(block_size),
                run_bytes)
        self._save_bytes += total_bytes
        self._save_mm_hashes.append(mm_hash)
        self._save_sources.append(src)

    def flush_saves(self) -> None:
        """Issue this step's saves as one batched copy gated behind the compute queue."""
        self._check_live("flush_saves")
        if not self._save_mm_hashes:
            return
        bufs, q, n = self._save_bufs, self._save_queue, self._save_count
        with trace.span("ec.flush_saves", "ec", "host", entries=len(self._save_mm_hashes), bytes=self._save_bytes,
                        descriptors=n):
            # The outputs were produced on the compute queue: the copy must not start before it.
            gate = self._acquire_event()
            self.backend.record_event(gate, self.compute_queue)
            self.backend.queue_wait_event(q, gate)
            start, end = self._acquire_event(), self._acquire_event()
            self.backend.record_event(start, q)
            batched_copy(bufs.src_ptrs[:n], bufs.dst_ptrs[:n], bufs.sizes[:n], queue=q, backend=self.backend)
            self.backend.record_event(end, q)
        self._inflight_saves.append(Transfer(
            "save", start, end, self._save_mm_hashes, bufs, q, self._save_bytes, n, gate_event=gate,
            keepalive=self._save_sources, ranges=self._save_ranges))
        self._save_bufs, self._save_queue = None, None
        self._save_count, self._save_bytes = 0, 0
        self._save_mm_hashes, self._save_sources, self._save_ranges = [], [], []

    # ------------------------------------------------------------------ consumer path
    def start_load_caches(self, encoder_cache: dict, connector_metadata: ECConnectorMetadata) -> None:
        """Copy every load of the step from the region into one device buffer, in one batch.

        Every scheduled load is copied, even if ``encoder_cache`` already has the hash: each
        participating rank must report each transfer exactly once.
        """
        self._check_live("start_load_caches")
        if not connector_metadata.loads:
            return
        with trace.span("ec.start_load_caches", "ec", "host", entries=len(connector_metadata.loads)):
            self._start_loads(encoder_cache, connector_metadata)

    def _start_loads(self, encoder_cache: dict, connector_metadata: ECConnectorMetadata) -> None:
        items = [(h, tid, self._region.check_block_ids(ids, f"loads[{h!r}]"))
                 for h, (tid, ids) in connector_metadata.loads.items()]
        block_size = self.block_size
        # Sorted by first block: entries adjacent in the region land adjacent in the
        # destination and coalesce.  Every loop below follows this order.
        load_items = sorted(items, key=lambda it: int(it[2][0]) if it[2].size else -1)
        total_blocks = sum(int(ids.size) for _, _, ids in load_items)

        q = self._acquire_queue()
        start, end = self._acquire_event(), self._acquire_event()
        dest = self._destinations.allocate(total_blocks * block_size, q)
        bufs = self._buf_pool.acquire(total_blocks)
        slots, first_blocks, num_blocks = coalesce_runs(
            np.concatenate([ids for _, _, ids in load_items]) if load_items else np.zeros(0, np.int64))
        n = bufs.add_copies(
            0,
            np.uint64(self._region.base_ptr) + first_blocks.astype(np.uint64) * np.uint64(block_size),
            np.uint64(dest.ptr) + slots.astype(np.uint64) * np.uint64(block_size),
            num_blocks * block_size)
        self.backend.record_event(start, q)
        # The region is written by another process and nothing earlier on this queue
        # touches it, so the driver may read it out of stream order.
        batched_copy(bufs.src_ptrs[:n], bufs.dst_ptrs[:n], bufs.sizes[:n], queue=q, backend=self.backend,
                     src_access_order="any")
        self.backend.record_event(end, q)
        self._inflight_loads.append(Transfer(
            "load", start, end, [tid for _, tid, _ in load_items], bufs, q, total_blocks * block_size, n,
            destination=dest))

        # Per-hash views of the contiguous buffer, as [rows, hidden] in the model dtype.
        offset = 0
        for mm_hash, _, ids in load_items:
            rows = int(ids.size)
            encoder_cache[mm_hash] = self._destinations.view(dest, self.dtype, (rows, self.hidden_size),
                                                             offset * block_size)
            offset += rows
        self._destinations.seal(dest)
        # Kernels queued on the compute queue from now on see the loaded bytes.
        self.backend.queue_wait_event(self.compute_queue, end)

    @staticmethod
    def _release_sources(t: Transfer) -> None:
        """The copy has finished: its sources need neither keeping alive nor declaring live."""
        t.keepalive.clear()
        for token in t.ranges:
            unregister(token)
        t.ranges.clear()

    # ------------------------------------------------------------------ completions
    def _collect_finished(self, inflight: deque[Transfer]) -> list:
        """Pop transfers whose end event fired, front first; recycle; return their completions.

        Conservative: a later transfer that finished first waits behind the front one and
        is reported on a later poll -- so every completion is real and reported once.
        """
        done: list = []
        while inflight and self.backend.query_event(inflight[0].end_event):
            t = inflight.popleft()
            done.extend(t.completions)
            st = self.stats[t.direction]
            st["transfers"] += 1
            st["entries"] += len(t.completions)
            st["bytes"] += t.num_bytes
            st["descriptors"] += t.num_descriptors
            ms = self.backend.elapsed_ms(t.start_event, t.end_event)
            st["copy_ms"] += ms
            self.history.append((t.direction, len(t.completions), t.num_bytes, t.num_descriptors, ms))
            if t.destination is not None:
                self._destinations.copy_finished(t.destination)
            self._release_sources(t)
            self._buf_pool.release(t.bufs)
            self._queue_pool.append(t.queue)
            self._event_pool.extend(e for e in (t.start_event, t.end_event, t.gate_event) if e is not None)
        return done

    def build_connector_worker_meta(self) -> ECWorkerMetadata | None:
        """Report the copies that finished on this rank since the last call; None if none did."""
        with self._lock:
            saves = self._collect_finished(self._inflight_saves)
            loads = self._collect_finished(self._inflight_loads)
            self._destinations.reclaim()
        if not saves and not loads:
            return None
        return ECWorkerMetadata(completed_saves=saves, completed_loads=loads)

    def inflight(self) -> tuple[int, int]:
        """(saves, loads) transfers issued and not yet reported."""
        return len(self._inflight_saves), len(self._inflight_loads)

    def wait(self, max_inflight: int = 0) -> None:
        """Block until at most ``max_inflight`` transfers per direction are still running.

        ``wait()`` waits for everything; ``wait(2)`` is back-pressure for a pipeline that
        keeps two copies in flight.  Finished transfers are still reported normally by
        :meth:`build_connector_worker_meta`.
        """
        check_int("max_inflight", max_inflight, min_value=0)
        for inflight in (self._inflight_saves, self._inflight_loads):
            pending = list(inflight)
            # Transfers on one direction finish in any order (separate pooled queues), so
            # wait for all but the newest max_inflight.
            for t in pending[:max(len(pending) - max_inflight, 0)]:
                self.backend.synchronize_event(t.end_event)

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Drain in-flight copies, then release queues, events and unreferenced load buffers."""
        if self._shut_down:
            return
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
            for token in self._save_ranges:
                unregister(token)
            self._save_bufs, self._save_queue = None, None
            self._save_count, self._save_bytes, self._save_mm_hashes, self._save_sources = 0, 0, [], []
            self._save_ranges = []
        self._destinations.drain()
        if self._own_allocator:
            self.allocator.empty_cache()  # views still alive keep their own bytes (numpy base)
        for q in self._all_queues:
            self.backend.destroy_queue(q)
        self._all_queues.clear()
        self._queue_pool.clear()
        for e in self._event_pool:
            self.backend.destroy_event(e)
        self._event_pool.clear()
        if self._own_compute_queue:
            self.backend.destroy_queue(self.compute_queue)

    def __enter__(self) -> "ECWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
