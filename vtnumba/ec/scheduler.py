"""ECScheduler: the scheduler side of the encoder-cache connector, for producer, consumer or both.

Upstream: ``ECCPUScheduler`` in vLLM's CPU connector.  It turns "this request needs the
encoder output of ``mm_hash``" into per-step :class:`~vtnumba.ec.ECConnectorMetadata` for
the workers, and the workers' :class:`~vtnumba.ec.ECWorkerMetadata` back into cache state.

Roles:

* ``producer`` (the encoder process) owns the :class:`~vtnumba.ec.EmbeddingCache`:
  :meth:`~ECScheduler.request_save` allocates one block per embedding row and schedules a
  save; a completed save marks the entry ready.  It also serves a remote consumer's reads:
  :meth:`~ECScheduler.grant_read` pins a ready entry and returns its block ids (so it cannot
  be evicted while the consumer copies it), :meth:`~ECScheduler.release_read` unpins it.
* ``consumer`` (the prefill process) has no cache of its own -- the blocks belong to the
  producer.  :meth:`~ECScheduler.request_load` takes the block ids the producer granted
  and schedules a load under a fresh transfer id.  When every tensor-parallel rank has
  reported that transfer, :meth:`~ECScheduler.update_connector_output` lists the entry as
  *released*, and the caller tells the producer to unpin it.
* ``both`` (one process does both, vLLM's ``ec_both``): the same, with the pin taken and
  released in the local cache.

Exactly-once release: a load's expected report count is set at dispatch; each report
counts down -- once per rank: a rank's report handed in again is ignored -- and at zero the
transfer is *forgotten before* the pin is released, so a replayed or late report finds no
transfer and is ignored too (both counted in ``stats["stale_reports"]``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import numpy as np

from vtnumba.backend.arrays import check_int, is_int
from vtnumba.ec.embedding_cache import EmbeddingCache
from vtnumba.ec.metadata import ECConnectorMetadata, ECWorkerMetadata

__all__ = ["ECScheduler", "ECUpdate", "ROLES"]

ROLES = ("producer", "consumer", "both")


@dataclass
class ECUpdate:
    """What one :meth:`ECScheduler.update_connector_output` changed."""

    ready: list[str] = field(default_factory=list)     #: saves that completed: now readable
    released: list[str] = field(default_factory=list)  #: loads every rank finished: pin released / to release


class ECScheduler:
    """The scheduler side of the encoder-cache connector for ``role`` producer, consumer or both
    (see the module docstring for what each role does)."""

    def __init__(self, role: str, num_blocks: int, *, expected_load_reports: int = 1,
                 cache: EmbeddingCache | None = None):
        if role not in ROLES:
            raise ValueError(f"role={role!r}; expected one of {', '.join(ROLES)}")
        num_blocks = check_int("num_blocks", num_blocks, min_value=0)
        if not is_int(expected_load_reports) or expected_load_reports < 1:
            raise ValueError(f"expected_load_reports={expected_load_reports!r} must be an int >= 1 "
                             "(the number of tensor-parallel ranks that load each entry)")
        self.role = role
        self.num_blocks = int(num_blocks)
        self.is_producer = role in ("producer", "both")
        self.is_consumer = role in ("consumer", "both")
        if cache is not None and not isinstance(cache, EmbeddingCache):
            raise TypeError(f"cache must be an EmbeddingCache or None, got {type(cache).__name__}")
        if cache is not None and cache.num_blocks != self.num_blocks:
            raise ValueError(f"cache has {cache.num_blocks} blocks but num_blocks={num_blocks}")
        if cache is not None and not self.is_producer:
            raise ValueError("cache= is for a producer or both scheduler; a consumer has none (the producer "
                             "owns the blocks and the pins)")  # (it was ignored)
        # A consumer-only scheduler has no cache: the producer owns the blocks and the pins.
        # (not ``cache or ...``: an empty cache is falsy, and a shared one starts empty)
        self.cache = (cache if cache is not None else EmbeddingCache(self.num_blocks)) if self.is_producer else None
        self.expected_load_reports = int(expected_load_reports)
        self._lock = threading.Lock()
        self._pending_saves: dict[str, np.ndarray] = {}
        self._pending_loads: dict[str, tuple[int, np.ndarray]] = {}
        # transfer_id -> [mm_hash, reports still outstanding, the ranks that reported it]
        self._load_acks: dict[int, list] = {}
        self._transfer_ids = itertools.count()
        # mm_hash -> pins grant_read took and release_read has not dropped: only those may be
        # released by a reader (a 'both' scheduler's own loads hold pins of their own).
        self._granted: dict[str, int] = {}
        self.stats = {"saves_scheduled": 0, "saves_completed": 0, "saves_without_room": 0,
                      "loads_scheduled": 0, "loads_completed": 0, "reads_granted": 0, "reads_refused": 0,
                      "stale_reports": 0}

    # ------------------------------------------------------------------ producer side
    def _need(self, flag: bool, op: str, role: str) -> None:
        if not flag:
            raise RuntimeError(f"{op} needs a {role} scheduler; this one has role={self.role!r}")

    def request_save(self, mm_hash: str, num_rows: int) -> np.ndarray | None:
        """Allocate ``num_rows`` blocks for a new encoder output and schedule its save.

        Returns the block ids, or None when no save is scheduled: the entry already exists
        (cached, or its save is in flight), or the region has no room even after eviction.
        An entry of more rows than the whole region has blocks could never be saved:
        ValueError.
        """
        self._need(self.is_producer, "request_save", "producer")
        if not isinstance(mm_hash, str):
            raise TypeError(f"mm_hash={mm_hash!r} must be a str")
        num_rows = check_int("num_rows", num_rows, min_value=0)  # (one block per row: the cache says n_blocks)
        with self._lock:
            if mm_hash in self._pending_saves or self.cache.lookup(mm_hash) is not None:
                return None
            try:
                entry = self.cache.alloc(mm_hash, num_rows)
            except ValueError:
                if mm_hash in self.cache:  # another scheduler sharing the cache took it since the lookup
                    return None
                raise
            if entry is None:
                self.stats["saves_without_room"] += 1
                return None
            self._pending_saves[mm_hash] = entry.block_array
            self.stats["saves_scheduled"] += 1
            return entry.block_array

    def grant_read(self, mm_hash: str) -> np.ndarray | None:
        """Pin a ready entry for a (remote) reader and return its block ids; None if not ready/absent."""
        self._need(self.is_producer, "grant_read", "producer")
        with self._lock:
            ids = self.cache.pin_if_ready(mm_hash)
            self.stats["reads_granted" if ids is not None else "reads_refused"] += 1
            if ids is not None:
                self._granted[mm_hash] = self._granted.get(mm_hash, 0) + 1
        return ids

    def release_read(self, mm_hash: str) -> None:
        """Unpin an entry granted by :meth:`grant_read` (KeyError if unknown).

        RuntimeError for an entry with no read granted and not yet released: its pins are a
        ``both`` scheduler's own loads', which :meth:`update_connector_output` drops -- taking
        one here made that call fail later, dropping the other reports of its step.
        """
        self._need(self.is_producer, "release_read", "producer")
        with self._lock:
            if self._granted.get(mm_hash, 0) == 0:
                if self.cache.lookup(mm_hash) is None:
                    self.cache.unpin(mm_hash)  # (its KeyError names the unknown mm_hash)
                raise RuntimeError(f"release_read({mm_hash!r}): no read of it was granted (grant_read) and not "
                                   "yet released; pins of this scheduler's own loads are released by "
                                   "update_connector_output")
            self.cache.unpin(mm_hash)
            self._granted[mm_hash] -= 1
            if not self._granted[mm_hash]:
                del self._granted[mm_hash]

    def has_cache_item(self, mm_hash: str) -> bool:
        """Is ``mm_hash`` ready in the local cache (producer / both)?"""
        if self.cache is None:
            return False
        entry = self.cache.lookup(mm_hash)
        return entry is not None and entry.ready

    # ------------------------------------------------------------------ consumer side
    def request_load(self, mm_hash: str, block_ids=None) -> int | None:
        """Schedule a load of ``mm_hash`` and return its fresh transfer id.

        ``both``: pins the local entry (``block_ids`` must be None); returns None if it is not
        ready.  ``consumer``: ``block_ids`` are the ids the producer granted (and pinned).
        Returns None as well if a load of ``mm_hash`` is already scheduled this step.
        """
        self._need(self.is_consumer, "request_load", "consumer")
        if not isinstance(mm_hash, str):
            raise TypeError(f"mm_hash={mm_hash!r} must be a str")
        with self._lock:
            if mm_hash in self._pending_loads:
                return None
            if self.role == "both":
                if block_ids is not None:
                    raise ValueError("role='both' pins its own cache entry; call request_load(mm_hash) "
                                     "without block_ids")
                ids = self.cache.pin_if_ready(mm_hash)
                if ids is None:
                    return None
            else:
                if block_ids is None:
                    raise ValueError(f"request_load({mm_hash!r}): a consumer needs the block_ids the producer "
                                     "granted for it")
                raw = np.asarray(block_ids)
                if raw.ndim != 1:  # (a [[0, 1], [2, 3]] was flattened into a 4-row load)
                    raise ValueError(f"request_load({mm_hash!r}): block_ids must be a flat list of block ids, "
                                     f"got shape {raw.shape}")
                # Whole numbers only: np.asarray(..., dtype=int64) would turn 1.7 into block 1.
                # (Python ints past int64 arrive as dtype object: ints still, out of range below.)
                if raw.size and raw.dtype.kind not in "iu" and not (raw.dtype == object
                                                                   and all(is_int(v) for v in raw)):
                    raise TypeError(f"request_load({mm_hash!r}): block_ids={block_ids!r} must be int block ids, "
                                    f"got dtype {raw.dtype}")
                # The range is checked before the int64 conversion, which would wrap 2**64 - 1 to -1.
                outside = (raw < 0) | (raw >= self.num_blocks)
                if raw.size and outside.any():
                    raise ValueError(f"request_load({mm_hash!r}): block id {int(raw[outside][0])} is outside the "
                                     f"region's 0..{self.num_blocks - 1}")
                ids = raw.astype(np.int64)
            tid = next(self._transfer_ids)
            self._pending_loads[mm_hash] = (tid, ids)
            self._load_acks[tid] = [mm_hash, self.expected_load_reports, set()]
            self.stats["loads_scheduled"] += 1
            return tid

    def cancel_load(self, mm_hash: str) -> bool:
        """Take back a load scheduled this step and not dispatched yet (a caller whose batch
        of requests failed part-way); returns whether there was one.  ``both``: unpins it."""
        self._need(self.is_consumer, "cancel_load", "consumer")
        with self._lock:
            pending = self._pending_loads.pop(mm_hash, None)
            if pending is None:
                return False
            del self._load_acks[pending[0]]
            self.stats["loads_scheduled"] -= 1
            if self.role == "both":
                self.cache.unpin(mm_hash)
            return True

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self) -> ECConnectorMetadata:
        """Hand this step's scheduled saves and loads to the workers (and forget them here)."""
        with self._lock:
            meta = ECConnectorMetadata(saves=self._pending_saves, loads=self._pending_loads)
            self._pending_saves, self._pending_loads = {}, {}
        return meta

    def update_connector_output(self, worker_meta: ECWorkerMetadata | None) -> ECUpdate:
        """Apply the workers' completion reports (aggregated over ranks)."""
        update = ECUpdate()
        if worker_meta is None:
            return update
        if not isinstance(worker_meta, ECWorkerMetadata):
            raise TypeError(f"worker_meta must be ECWorkerMetadata or None, got {type(worker_meta).__name__}")
        with self._lock:
            for mm_hash in worker_meta.completed_saves:
                entry = self.cache.lookup(mm_hash) if self.cache is not None else None
                if entry is None or entry.ready:
                    self.stats["stale_reports"] += 1  # discarded meanwhile, or a replay
                    continue
                self.cache.mark_ready(mm_hash)
                self.stats["saves_completed"] += 1
                update.ready.append(mm_hash)
            loads = worker_meta.completed_loads
            ranks = worker_meta.load_ranks if len(worker_meta.load_ranks) == len(loads) else [None] * len(loads)
            for tid, rank in zip(loads, ranks):
                pending = self._load_acks.get(tid)
                if pending is None:
                    self.stats["stale_reports"] += 1  # already released, or never dispatched here
                    continue
                if rank is not None:
                    if rank in pending[2]:
                        self.stats["stale_reports"] += 1  # this rank's report, handed in again
                        continue
                    pending[2].add(rank)
                pending[1] -= 1
                if pending[1] > 0:
                    continue
                # Forget the transfer *before* releasing, so a replayed report is stale.
                del self._load_acks[tid]
                mm_hash = pending[0]
                if self.role == "both":
                    self.cache.unpin(mm_hash)
                self.stats["loads_completed"] += 1
                update.released.append(mm_hash)
        return update

    def outstanding_loads(self) -> dict[int, tuple[str, int]]:
        """transfer_id -> (mm_hash, reports still expected), for loads dispatched and not released."""
        with self._lock:
            return {tid: (h, n) for tid, (h, n, _) in self._load_acks.items()}

    def has_pending_work(self) -> bool:
        """True while a scheduled save/load is undispatched or unconfirmed (keep stepping)."""
        with self._lock:
            if self._pending_saves or self._pending_loads or self._load_acks:
                return True
        # Saves in flight (not-ready) and reads in flight (pinned) both need more steps.
        return self.cache is not None and self.cache.has_held_entries()

    def shutdown(self) -> None:
        """Forget everything scheduled and not yet confirmed (the workers have stopped).

        Its blocks come back too: an entry whose save was never confirmed is discarded, and
        (``both``) the pins of this scheduler's own loads are dropped -- otherwise those blocks
        stayed held for good and :meth:`has_pending_work` stayed True.  Reads granted to a
        remote consumer (:meth:`grant_read`) stay pinned until its :meth:`release_read`.
        """
        with self._lock:
            own_loads = [h for h, _, _ in self._load_acks.values()]  # (scheduled or dispatched, not released)
            self._pending_saves.clear()
            self._pending_loads.clear()
            self._load_acks.clear()
            if self.cache is None:
                return
            if self.role == "both":
                for mm_hash in own_loads:
                    self.cache.unpin(mm_hash)
            for mm_hash in self.cache.not_ready():
                self.cache.discard(mm_hash)
