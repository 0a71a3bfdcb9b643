"""The hazard checker: catch the missing ``record_stream`` (and uses after free) as they happen.

A caching allocator only knows the queue a block was allocated on.  When a block is also
used on another queue and freed without :meth:`~vtnumba.memory.CachingAllocator.record_stream`,
its memory goes straight back to the pool, the next ``allocate`` hands it out, and the new
owner overwrites bytes the other queue has not read yet.  Nothing fails; the data is just
wrong, sometimes.  This checker turns that into a message.

It is opt-in (bookkeeping costs an event per queue per freed block):
``VTNUMBA_CHECK_HAZARDS=1`` (or ``=raise``: raise at the hazard) or ``=record`` (collect the
reports instead) for the whole process, or ``with check_hazards():``;
``with hazard_checks_off():`` switches it off again inside a block.

What it tracks, per block:

* the **queues that used it**: the owner (noted by ``allocate``), every queue passed to
  ``record_stream`` (*covered*: the allocator will wait for it), every queue whose copies,
  memsets and kernels touched the block's memory -- the Backend API reports them while a
  checker is active (:func:`vtnumba.backend.add_use_observer`) -- and every queue reported
  with :func:`vtnumba.memory.note_use` (for work that reaches a queue some other way);
* at ``free``, an **event on each of those queues**, so "has that use completed?" has an answer.

What it reports (a :class:`HazardReport`; raised as :class:`HazardError` or collected in
``checker.reports``, as configured):

* ``reuse-before-complete`` -- ``allocate`` hands out memory overlapping a freed block whose
  use on *another* queue has not completed: the missing ``record_stream``;
* ``use-after-free`` -- ``note_use`` on a block that was already freed.

Limits, stated honestly: the check runs on the host when memory is handed out, so it sees
real timing -- on synchronous queues (vllm.cpp's cpu semantics, the simulator) every use has
completed and nothing is flagged, even where a GPU would race.  Ordering made with
``queue_wait_event`` is invisible to it; if you order a reuse that way, ``record_stream``
anyway (it is cheap) or expect a report.  Views taken before ``free`` and used after it
escape it; ``Block`` objects themselves refuse every use once freed.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from vtnumba.backend.base import Queue, add_use_observer, remove_use_observer

_MODES = ("raise", "record")


@dataclass
class HazardReport:
    """One detected hazard: what happened, to which blocks, on which queues, and the fix."""

    #: ``"reuse-before-complete"`` (memory reissued while another queue still uses it, usually a
    #: missing ``record_stream``) or ``"use-after-free"``.
    kind: str
    #: The full explanation, naming the blocks and queues and, for a missing ``record_stream``, the fix.
    message: str
    #: The id of the block being used or handed out.
    block_id: int
    #: The freed block whose memory it overlaps (``reuse-before-complete``); None for a use after free.
    other_block_id: int | None
    #: Names of the queues involved (the new owner's and the one still using the memory, or the using queue).
    queues: list[str] = field(default_factory=list)


class HazardError(RuntimeError):
    """Raised for a hazard when the checker runs in ``raise`` mode."""

    def __init__(self, report: HazardReport):
        super().__init__(report.message)
        self.report = report


class _Uses:
    """The queues that used one live block, which of them record_stream covers, and where the
    block's memory is (so uses reported by address can be matched to it)."""

    __slots__ = ("queues", "covered", "block", "start", "end")

    def __init__(self, block):
        self.queues: dict[int, Queue] = {block.queue.id: block.queue}
        self.covered: set[int] = set()
        self.block = block
        self.start = block.ptr
        self.end = block.ptr + block.size


@dataclass
class _Retired:
    """A freed block's memory range and, per queue that used it, an event recorded at free."""

    block_id: int
    desc: str
    owner: Queue
    offset: int
    size: int
    uses: list  # [(queue, event, covered)]

    def done(self, backend) -> bool:
        return all(backend.query_event(ev) for _, ev, _ in self.uses)


def _describe(block) -> str:
    return f"block #{block.id} ({block.nbytes} B, allocated on queue '{block.queue.name}')"


class HazardChecker:
    """Tracks block uses across queues; see the module docstring.

    ``on_hazard="raise"`` raises :class:`HazardError` at the offending call (``allocate``
    then gives the memory back first); ``"record"`` appends to :attr:`reports` and lets the
    program continue -- useful to *see* the corruption the hazard causes.
    """

    def __init__(self, on_hazard: str = "raise"):
        if on_hazard not in _MODES:
            raise ValueError(f"on_hazard={on_hazard!r} must be one of {', '.join(_MODES)}")
        self.on_hazard = on_hazard
        #: Every hazard found so far, in order -- in ``"raise"`` mode too (each is also raised).
        self.reports: list[HazardReport] = []
        self._lock = threading.RLock()
        self._live: dict[int, _Uses] = {}              # block id -> queues that used it
        self._retired: dict[int, list[_Retired]] = {}  # segment id -> freed ranges still in flight
        self._freed: dict[int, str] = {}               # block id -> description (for use-after-free)

    # ------------------------------------------------------------------ hooks (allocator)
    def on_allocate(self, block) -> None:
        """Check that ``block``'s memory is not still needed by a freed block's queue."""
        with self._lock:
            found = []
            records = self._retired.get(block.segment_id, [])
            for rec in list(records):
                if rec.done(block.backend):
                    self._drop(records, rec)
                    continue
                if rec.offset < block.offset + block.size and block.offset < rec.offset + rec.size:
                    for q, ev, covered in rec.uses:
                        if q is not block.queue and not block.backend.query_event(ev):
                            found.append((rec, q, covered))
            self._live[block.id] = _Uses(block)
        try:
            self._report_reuses(block, found)
        except BaseException:
            # Raised: allocate gives the memory back, so the block never reaches its caller --
            # a live entry left behind would match the next legal use of these addresses.
            with self._lock:
                self._live.pop(block.id, None)
            raise

    def _report_reuses(self, block, found) -> None:
        for rec, q, covered in found:
            if covered:
                msg = (f"allocator bug: {_describe(block)} reuses the memory of freed {rec.desc} before the "
                       f"event recorded on queue '{q.name}' by record_stream completed")
            else:
                msg = (f"hazard: {_describe(block)} was handed memory (segment #{block.segment_id} "
                       f"+{block.offset:#x}) that freed {rec.desc} still needs: work on queue '{q.name}' that "
                       f"used block #{rec.block_id} had not completed when it was freed, and the allocator "
                       f"only knew about queue '{rec.owner.name}'. Fix: call record_stream(block #{rec.block_id}, "
                       f"{q.name}) before free(block #{rec.block_id}), so its memory is reused only after "
                       f"'{q.name}' has finished with it.")
            self._report(HazardReport("reuse-before-complete", msg, block.id, rec.block_id,
                                      [block.queue.name, q.name]))

    def on_free(self, block) -> None:
        """Record an event on every queue that used ``block`` and remember its range."""
        with self._lock:
            uses = self._live.pop(block.id, None)
            self._freed[block.id] = _describe(block)
            if len(self._freed) > 4096:  # bounded memory: forget the oldest descriptions
                self._freed.pop(next(iter(self._freed)))
            if uses is None:  # allocated before this checker was active
                return
            backend = block.backend
            self._forget_finished()  # (every segment's: one that empty_cache released is never freed into again)
            recorded = []
            for qid, q in uses.queues.items():
                # A destroyed queue was drained, and an idle one has finished everything it was
                # given: their uses are complete.  (An event recorded now on an idle queue would
                # still read "not fired" until the queue got to it -- on a threaded queue, or a
                # GPU stream a few microseconds later -- and the next allocation would report a
                # hazard that is not there.)
                if q.destroyed or backend.closed:
                    continue  # (a closed backend drained every queue: its frees stay legal)
                try:
                    if backend.query_queue(q):
                        continue
                    ev = backend.create_event(timing=False)  # orders only: never timed
                    try:
                        backend.record_event(ev, q)
                    except BaseException:
                        backend.destroy_event(ev)
                        raise
                except RuntimeError:
                    if q.destroyed:
                        continue  # destroyed by another thread meanwhile: drained, its uses complete
                    raise
                recorded.append((q, ev, qid in uses.covered))
            if recorded:
                self._retired.setdefault(block.segment_id, []).append(
                    _Retired(block.id, _describe(block), block.queue, block.offset, block.size, recorded))

    def note_use(self, block, queue: Queue, *, covered: bool = False) -> None:
        """``block`` is used by work submitted to ``queue`` (``covered``: via record_stream)."""
        with self._lock:
            if block.freed:
                desc = self._freed.get(block.id, f"block #{block.id}")
                msg = (f"use after free: {desc} is used on queue '{queue.name}' after it was freed; its "
                       f"memory may already belong to another block. Fix: submit the work before free, and "
                       f"call record_stream(block #{block.id}, {queue.name}) so the memory outlives it.")
                report = HazardReport("use-after-free", msg, block.id, None, [queue.name])
            else:
                uses = self._live.get(block.id)
                if uses is None:
                    uses = self._live[block.id] = _Uses(block)
                uses.queues[queue.id] = queue
                if covered:
                    uses.covered.add(queue.id)
                return
        self._report(report)

    def on_use(self, backend, queue: Queue, ranges) -> None:
        """A copy, memset or kernel on ``queue`` touches ``ranges`` ((address, nbytes) pairs):
        note a use of every live block they overlap, as ``note_use`` would -- the Backend
        API reports these (see :func:`vtnumba.backend.add_use_observer`), so a cross-queue
        use cannot escape the checker just because nobody called ``note_use``."""
        with self._lock:
            hits = [u.block for u in self._live.values()
                    if u.block.backend is backend and queue.id not in u.queues
                    and any(a < u.end and u.start < a + n for a, n in ranges)]
        for block in hits:
            self.note_use(block, queue)

    # ------------------------------------------------------------------ housekeeping
    def pending(self) -> int:
        """How many freed blocks still have uses in flight."""
        with self._lock:
            self._forget_finished()
            return sum(len(v) for v in self._retired.values())

    def _forget_finished(self) -> None:
        # Under the lock.  Records of finished uses, with their events, go -- of every segment:
        # pruning only the segment being freed into or allocated from kept the records (and the
        # backend's events) of segments the allocator had released, for good.
        for segment_id, records in list(self._retired.items()):
            for rec in [r for r in records if r.done(r.uses[0][1].backend)]:
                self._drop(records, rec)
            if not records:
                del self._retired[segment_id]

    def close(self) -> None:
        """Destroy the checker's events and forget everything."""
        with self._lock:
            for records in self._retired.values():
                for rec in records:
                    for _, ev, _ in rec.uses:
                        if not ev.destroyed:
                            ev.backend.destroy_event(ev)
            self._retired.clear()
            self._live.clear()
            self._freed.clear()

    def _drop(self, records: list, rec: _Retired) -> None:
        records.remove(rec)
        for _, ev, _ in rec.uses:
            ev.backend.destroy_event(ev)

    def _report(self, report: HazardReport) -> None:
        with self._lock:
            self.reports.append(report)
        if self.on_hazard == "raise":
            raise HazardError(report)


# ---------------------------------------------------------------------- activation
# The innermost entry is in force; ``None`` entries switch checking off (hazard_checks_off).
_stack: list[HazardChecker | None] = []
_stack_lock = threading.Lock()


def active_checker() -> HazardChecker | None:
    """The checker in force (innermost ``check_hazards`` or the environment's), or None."""
    return _stack[-1] if _stack else None


def _observe_use(backend, queue, ranges) -> None:
    checker = active_checker()
    if checker is not None:
        checker.on_use(backend, queue, ranges)


def _listen_while_active() -> None:
    # The backends describe every queued use only while someone listens: register the
    # observer while a checker is in force, and only then (it costs a call per operation).
    if any(e is not None for e in _stack):
        add_use_observer(_observe_use)
    else:
        remove_use_observer(_observe_use)


@contextmanager
def _pushed(entry):
    with _stack_lock:
        _stack.append(entry)
        _listen_while_active()
    try:
        yield entry
    finally:
        with _stack_lock:
            # Remove this very entry (identity, not equality: several None entries may nest).
            del _stack[max(i for i, e in enumerate(_stack) if e is entry)]
            _listen_while_active()


@contextmanager
def check_hazards(on_hazard: str = "raise"):
    """Check for hazards inside the ``with`` block (process-wide); yields the checker."""
    checker = HazardChecker(on_hazard)
    try:
        with _pushed(checker):
            yield checker
    finally:
        checker.close()


@contextmanager
def hazard_checks_off():
    """No checking inside the ``with`` block, even under ``VTNUMBA_CHECK_HAZARDS=1``
    (for demonstrations of the unchecked hazard)."""
    with _pushed(None):
        yield


def mode_from_env() -> str | None:
    """``VTNUMBA_CHECK_HAZARDS``: ``"raise"``, ``"record"`` or None (off); anything else is a
    ValueError naming the variable."""
    value = os.environ.get("VTNUMBA_CHECK_HAZARDS", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    if value in ("1", "true", "yes", "on", "raise"):
        return "raise"
    if value == "record":
        return "record"
    raise ValueError(f"VTNUMBA_CHECK_HAZARDS={value!r} is not understood; expected 1/raise, record, or 0")


_env_mode = mode_from_env()
if _env_mode is not None:
    _stack.append(HazardChecker(_env_mode))
    _listen_while_active()
