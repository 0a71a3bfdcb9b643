"""QueueFlags: epoch flags that *queues* raise and wait for -- device-side signalling between ranks.

Upstream concept (vLLM's TPSP): the P2P workspace has, next to the data slots, a small flag area per rank;
a GPU stream raises a flag in a peer's area right after the kernel that produced the data,
and the peer's stream waits for it before the kernel that consumes the data.  No host thread
stands between two chunks: the host only *queues* the waits and the writes, and the streams
order themselves across processes.

Layout: every rank owns ``len(names) * tp`` 32-bit words in peer memory of the *data*
backend (:class:`PeerBuffers`: CUDA IPC device memory on a GPU, shared host memory
otherwise).  Word ``(name, source)`` in rank ``r``'s area is written only by rank
``source`` and read by its owner ``r`` -- one writer per word, so a plain store is enough::

    flags.signal(q, "inbox_ready", g + 1)           # on q: after what q did so far, tell every rank
    flags.wait(q, "inbox_ready", g + 1)             # on q: go on once every rank said so

Both are :meth:`~vtnumba.backend.Backend.write_value32` / ``wait_value32`` calls, i.e.
``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` on a GPU (the write carries a system-wide
fence, so the data the queue wrote before is visible to the peer first), a release store /
acquire-polling wait in queue order on the host targets.

Epochs, not booleans: a flag holds a counter that only grows (the protocol's step number),
and a wait is "at least e" -- nothing is ever reset, so no reset can race with a set.

**One call** of a protocol built on these flags goes: :meth:`QueueFlags.handshake` (on
the host: every rank publishes what it is about to do -- shapes, say -- and gets everybody's,
so a mismatch fails on every rank *before* anything is queued), then the queued
``signal``/``wait`` steps, then :meth:`QueueFlags.finish`.

**Failure.**  A stream that waits for a peer that died waits forever: it cannot time out.
So every queue that waits on these flags is finished by :meth:`~QueueFlags.finish`, which
polls events with a deadline instead of blocking, and watches the peers' *abort stamps*
(host memory, :class:`PeerSignals`).  When a peer aborted this call, or the deadline
passed, it :meth:`releases <QueueFlags.release>` every wait -- it stores :data:`RELEASED`
(larger than any epoch) into all the words its own queues could be waiting on, and into its
own source words in every peer's area -- so every stream involved drains (computing garbage
that nobody will use), and then raises an error naming the rank and the flags that were
missing.  A rank that fails stamps its abort *before* releasing, so a peer whose wait was
released always sees the stamp: the whole group fails together, no result computed from
released flags is ever returned, no stream is left blocked, and ``close()`` can run.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from vtnumba.backend.arrays import host_view, is_int
from vtnumba.backend.atomics import store_release
from vtnumba.backend.polling import WaitTimeout, poll_until
from vtnumba.dist.comm import DEFAULT, agree_errors, barrier, resolve_timeout
from vtnumba.dist.failures import PeerAborted, raise_peer_report
from vtnumba.dist.peer_buffers import PeerBuffers
from vtnumba.dist.signals import PeerSignals, flag_names_error

#: The value a released flag word holds.  Waits compare cyclically (int32 difference >= 0),
#: so it must stay within 2**31 of every epoch it releases: epochs stay below it.
RELEASED = 1 << 30

#: Seconds between the re-releases of this rank's own words while a failing rank drains its
#: queues (see :meth:`QueueFlags._drain`).
RERELEASE_S = 0.05

#: What :meth:`QueueFlags.missing` says when every awaited flag has arrived.
NOTHING_MISSING = "every awaited flag has arrived"


class QueueFlagsError(RuntimeError):
    """A queue-ordered exchange failed on this rank or a peer (raised after releasing every wait)."""


class QueuePeerAborted(QueueFlagsError, PeerAborted):
    """The exchange failed because a peer aborted it: this rank stops because of that peer."""


class QueueFlags:
    """32-bit epoch flags in peer memory, raised and awaited in queue order (collective constructor).

    ``backend`` is the data backend (its queues do the writes and waits; its peer memory
    holds the words; None: the default backend).  ``host_signals`` is an open :class:`PeerSignals` of the same group
    used for abort stamps (one is made and owned if not given).
    """

    def __init__(self, group, names, backend, *, timeout_s: float = DEFAULT,
                 host_signals: PeerSignals | None = None):
        names_t, err = flag_names_error(names)
        agree_errors(err, group, context="QueueFlags", timeout_s=timeout_s)
        self.group = group
        self.names = names_t
        self.backend = backend
        self.timeout_s = timeout_s = resolve_timeout(timeout_s)
        self._index = {name: k for k, name in enumerate(names_t)}
        words = len(names_t) * group.size
        self._pb = PeerBuffers(words * 4, group, backend, timeout_s=timeout_s)
        self.backend = self._pb.backend  # (backend=None: the default backend, which PeerBuffers chose)
        # Each rank's flag area as a flat uint32 array of the backend's kind (index = group rank).
        self._areas = self._pb.views(np.uint32, (words,))
        self._zero_own_area()
        barrier(group, timeout_s)  # every area is zeroed before any rank can signal into it
        self._own_signals = host_signals is None
        self.host = PeerSignals(group, ("call",), timeout_s=timeout_s) if host_signals is None else host_signals
        #: The last value this rank queued a wait for, per ``(name, source)`` -- what an error
        #: message reports as "expected" when a peer never delivered.
        self.expected: dict[tuple[str, int], int] = {}
        self._events: dict[int, object] = {}  # queue id -> the event finish() records there
        #: The host epoch of the call in progress, set by :meth:`handshake` and cleared when :meth:`finish`
        #: succeeds; None before the first call and between calls (a failed call leaves it set).
        self.call_epoch: int | None = None

    # ------------------------------------------------------------------ one call
    def handshake(self, meta, timeout_s: float | None = None) -> list[tuple[int, ...]]:
        """Host, collective: publish ``meta`` (up to 8 ints) and return every rank's, indexed by
        rank.  Marks the start of a call (its epoch is what a failure stamps).  ``timeout_s``:
        how long to wait for the peers (default: these flags' ``timeout_s``)."""
        self._check_open()
        host = self.host
        epoch = host.next_epoch()
        self.call_epoch = epoch
        bank = epoch % 2  # see PeerSignals: a fast rank's next call cannot overwrite this one's
        host.set_meta(meta, bank)  # ordered before the flag below by its release store
        host.set_all("call", epoch, include_self=True)
        host.wait("call", epoch, timeout_s=timeout_s)  # fails fast if a peer stamped an abort for this call
        return [host.meta(r, bank) for r in range(self.group.size)]

    def _zero_own_area(self) -> None:
        # Fresh shm pages read as zero, but device memory does not: clear our words before any
        # peer can write into them (the barrier after this keeps every peer waiting until then).
        local = self._areas[self.group.rank]
        host = host_view(local)
        if host is not None:
            host.fill(0)
            return
        # Device memory: zero it on a queue of our own, and wait for it.  Not numba's plain
        # copy_to_device: that is a legacy-stream copy from pageable memory, which may return
        # before the bytes land -- and neither the peers' flag writes nor our own non-blocking
        # streams are ordered after it, so a late zero could wipe out a flag.
        be = self.backend
        q = be.create_queue("queue-flags-zero")
        try:
            zeros = np.zeros(local.shape, np.uint32)
            be.copy(q, local, zeros, zeros.nbytes)
        finally:
            be.destroy_queue(q)  # waits for the copy

    # ------------------------------------------------------------------ helpers
    def _slot(self, name: str, source: int) -> int:
        try:
            return self._index[name] * self.group.size + source
        except KeyError:
            raise ValueError(f"unknown flag name={name!r}; these QueueFlags have {list(self.names)}") from None

    def _ranks(self, ranks, what: str) -> list[int]:
        n = self.group.size
        if ranks is None:
            return list(range(n))
        out = [ranks] if isinstance(ranks, (int, np.integer)) and not isinstance(ranks, bool) else list(ranks)
        for r in out:
            if not is_int(r) or not 0 <= r < n:
                raise ValueError(f"{what}={ranks!r} must be group ranks in 0..{n - 1} of group {self.group.name!r}")
        return [int(r) for r in out]

    def _check_epoch(self, value: int) -> int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"flag value {value!r} must be an int epoch")  # ('3' failed at '<=' unnamed)
        value = int(value)
        if not 0 <= value < RELEASED:
            raise ValueError(f"flag value {value} must be an epoch in 0..{RELEASED - 1}; reopen the flags "
                             "(close and create them again) before the epochs run out")
        return value

    # ------------------------------------------------------------------ queue-ordered signalling
    def signal(self, q, name: str, value: int, targets=None) -> None:
        """Queue on ``q``: raise this rank's word ``name`` to ``value`` in every target's area
        (default: every rank, this one included) once ``q`` has done everything before."""
        self._check_open()
        value = self._check_epoch(value)
        for r in self._ranks(targets, "targets"):
            self.backend.write_value32(q, self._areas[r], self._slot(name, self.group.rank), value)

    def wait(self, q, name: str, value: int, sources=None) -> None:
        """Queue on ``q``: later work waits until every source (default: every rank) raised ``name``
        to at least ``value`` in this rank's area."""
        self._check_open()
        if is_int(value) and value <= 0:
            return  # every word starts at 0: "at least 0" needs no wait (step g-1 of chunk 0)
        value = self._check_epoch(value)
        me = self.group.rank
        for s in self._ranks(sources, "sources"):
            self.expected[(name, s)] = value
            self.backend.wait_value32(q, self._areas[me], self._slot(name, s), value, timeout_s=self.timeout_s)

    # ------------------------------------------------------------------ finishing and failing
    def received(self) -> dict[tuple[str, int], int]:
        """This rank's words as the host sees them now: ``{(name, source): value}``.

        Device words are read one by one through the backend's side queue, with a deadline
        (:meth:`~vtnumba.backend.Backend.read_flag_word`): this runs for error messages while a
        stream may be stuck on these very words, and a plain device-to-host copy has no deadline.
        """
        self._check_open()
        area = self._areas[self.group.rank]
        words = host_view(area)
        if words is None:
            be = self.backend
            words = [be.read_flag_word(area, k, timeout_s=min(self.timeout_s, 10.0)) for k in self._own_slots()]
        return {(name, s): int(words[self._slot(name, s)]) for name in self.names for s in range(self.group.size)}

    def missing(self) -> str:
        """The awaited flags that have not arrived (for error messages), or a note that all have."""
        if self.closed:  # (used while reporting another error: it must not raise one of its own)
            return "unknown (the flags were closed)"
        try:
            got = self.received()
        except RuntimeError as exc:  # (a device read that did not finish: the message goes on without it)
            return f"unknown (the flag words could not be read: {exc})"
        short = [f"{name!r} from rank {s}: {got[(name, s)]} (waited for {want})"
                 for (name, s), want in sorted(self.expected.items()) if got[(name, s)] < want]
        return "; ".join(short) if short else NOTHING_MISSING

    def _failure_epoch(self) -> int:
        """The call a failure of this rank belongs to: the one in progress, or -- between calls --
        the next one, whose handshake the peers will wait in."""
        return self.call_epoch if self.call_epoch is not None else self.host.epoch + 1

    def _aborted_peers(self) -> list[int]:
        # A stamp equal to this call's epoch means that peer failed *this* call; a larger one
        # means it finished this call and failed a later one -- our result is still whole.
        e = self.call_epoch

        def scan() -> list[int]:
            return [r for r in range(self.group.size) if r != self.group.rank and self.host.abort_stamp(r) == e]

        aborted = scan()
        if not aborted:
            return aborted
        # One pass reads the stamps one after the other, so it can miss the rank that failed
        # first and see only a peer that aborted *because of it* (stamped between our two
        # reads).  Such a peer relayed the first failure's stamp before its own (fail), so
        # a second pass sees it and the message names the rank that failed first.
        return scan()

    def finish(self, queues, *, what: str = "the exchange") -> None:
        """Wait until every queue in ``queues`` has done its queued work -- polling with a
        deadline and watching for peers that abort, never blocking in a driver call -- then
        synchronize them.

        Three things end the call with an error instead, after :meth:`fail` (stamp this rank's
        abort, release every wait, drain ``queues``): a peer aborted this call
        (QueueFlagsError), the deadline passed (QueueFlagsError naming the missing flags), or
        a queued operation of this rank failed (a RuntimeError chained to its error; a
        QueueFlagsError if it was a host queue's wait that ran out of time).
        """
        be = self.backend
        events = self._record(queues)
        failure: str | None = None

        peer_aborted = False

        def done() -> bool:
            nonlocal failure, peer_aborted
            # Aborts first: a wait released by a failing peer lets the queues finish, but
            # what they computed is garbage -- that must fail, not return.
            aborted = self._aborted_peers()
            if aborted:
                peer_aborted = True
                who = ", ".join(str(r) for r in aborted)
                failure = (f"rank {self.group.rank} of group {self.group.name!r}: rank {who} aborted during {what} "
                           "(it raised an error or timed out; see its message)")
                return True
            # A queued operation of ours failed: its queue skips the rest (signals included),
            # so the other queues -- here and on the peers -- would wait for flags that never come.
            if any(be.queue_error(q) is not None for q in queues):
                return True
            return all(be.query_event(ev) for ev in events)

        try:
            poll_until(done, self.timeout_s,
                       lambda waited: f"rank {self.group.rank} of group {self.group.name!r}: {what} did not finish "
                                      f"within {waited:.3g} s",
                       error=QueueFlagsError)
        except QueueFlagsError as exc:
            failure = str(exc)
        if failure is None:
            done()  # the queues finished; check once more that no peer aborted meanwhile
        queued = next((e for e in (be.queue_error(q) for q in queues) if e is not None), None)
        if failure is None and queued is None:
            try:
                for q in queues:
                    be.synchronize(q)  # a GPU's sticky context error would surface here
            except BaseException:
                self.fail(queues)
                raise
            self.call_epoch = None
            return
        missing = self.missing()  # before fail() releases the words
        self.fail(queues)
        if failure is not None and missing != NOTHING_MISSING:
            failure = f"{failure}; missing flags: {missing}"
        if failure is not None and peer_aborted:
            raise_peer_report()  # the failing rank's own report, if it comes soon: it names the cause
            raise QueuePeerAborted(failure)  # (this rank did not fail: it stops because of the peer)
        if failure is not None:
            raise QueueFlagsError(failure)
        if isinstance(queued, WaitTimeout):  # a host queue's own wait ran out of time
            raise QueueFlagsError(f"rank {self.group.rank} of group {self.group.name!r}: {what} did not finish: "
                                  f"{queued}; missing flags: {missing}") from queued
        raise RuntimeError(f"rank {self.group.rank} of group {self.group.name!r}: a queued operation of {what} "
                           f"failed: {queued!r}") from queued

    def _record(self, queues) -> list:
        """An event recorded now on each queue (one reusable event per queue)."""
        be = self.backend
        events = []
        for q in queues:
            ev = self._events.get(q.id)
            if ev is None:
                ev = self._events[q.id] = be.create_event(timing=False)
            be.record_event(ev, q)
            events.append(ev)
        return events

    def fail(self, queues=()) -> None:
        """This rank gives up: stamp the abort, release every wait, drain ``queues``.

        The order matters.  (0) The aborts of peers that gave up on this call before us are
        relayed, so nobody blames us for their failure.  (1) The abort stamp comes first, so a
        peer whose wait on us gets released always finds the stamp and fails instead of
        returning garbage.  (2) Our own
        area is released, so our queues' waits pass and they run to their end.  (3) We wait
        (bounded) for our queues to drain: until then they may still write epochs into the
        peers' areas.  (4) Only then are our words in the peers' areas released -- no later
        write of ours can overwrite the release.  Safe to call more than once, after any error.

        Never raises on account of a release: it runs on a path that already failed, and the
        caller's error is the one to report.  A word that cannot be stored (a peer's mapping
        gone bad, a device queue that does not answer) is skipped with a RuntimeWarning, and
        the others are still released -- the peers do not depend on it, since each of them
        also finds our abort stamp (host memory, written first) within its own deadline.
        """
        if self._pb.closed:
            return
        me, n = self.group.rank, self.group.size
        epoch = self._failure_epoch()
        # Peers that already gave up on this call are passed on before our own stamp (see
        # PeerSignals.relay_abort): whoever finds our stamp then finds theirs too, and names
        # the rank that failed first instead of us, who may only have reacted to it.
        for r in range(n):
            if r != me and self.host.abort_stamp(r) == epoch:
                self.host.relay_abort(r)
        self.host.abort(epoch)
        # Our streams (and the peers') may be stuck until the releases below land: a free of
        # device memory meanwhile would wait for them for good (Backend.defer_frees).
        with self.backend.defer_frees():
            # A device store that timed out means the backend's side queue is held up behind a
            # stuck stream: every later one would wait its full deadline too, so device words
            # are skipped from then on (host words are plain stores and always go through).
            side_stuck = isinstance(self._release_or_warn(me, self._own_slots()), QueueFlagsError)
            self._drain(queues, rerelease=not side_stuck)
            skipped = []
            for r in range(n):
                if r == me:
                    continue
                if side_stuck and host_view(self._areas[r]) is None:
                    skipped.append(r)
                    continue
                err = self._release_or_warn(r, [self._slot(name, me) for name in self.names])
                side_stuck = side_stuck or isinstance(err, QueueFlagsError)
            if skipped:
                warnings.warn(f"rank {me} of group {self.group.name!r}: did not release its flag words in the areas "
                              f"of ranks {skipped}: the flag side queue did not answer; they end their waits when "
                              "they find the abort stamp or their deadline passes", RuntimeWarning, stacklevel=2)

    def _own_slots(self) -> range:
        """Every word of this rank's area: the ones its queues may wait on."""
        return range(len(self.names) * self.group.size)

    def _release_or_warn(self, rank: int, slots, timeout_s: float | None = None,
                         warn: bool = True) -> Exception | None:
        """:meth:`_release_words`, best effort (see :meth:`fail`): the error -- with a warning,
        if ``warn`` -- if it failed, else None.  (A QueueFlagsError: a device store timed out.)"""
        try:
            self._release_words(rank, slots, timeout_s)
            return None
        except Exception as exc:  # noqa: BLE001 - a failure path: report, go on with the other words
            if not warn:
                return exc
            whose = "its own" if rank == self.group.rank else f"rank {rank}'s"
            warnings.warn(f"rank {self.group.rank} of group {self.group.name!r}: could not release {whose} flag "
                          f"words {list(slots)} ({type(exc).__name__}: {exc}); a queue waiting on them ends only "
                          "when its rank finds the abort stamp or its deadline passes", RuntimeWarning, stacklevel=3)
            return exc

    def _drain(self, queues, rerelease: bool = True) -> None:
        """Let ``queues`` finish (their waits are released), polling with the deadline; never raise.

        While it waits, our own area is released again every :data:`RERELEASE_S`: a peer still
        running this call -- it has not seen our abort yet -- may store an epoch of its own over
        a word we released, and if our queue had not passed that wait yet it would stop there
        again.  The peer's next epoch may never come (its queue waits for a signal that ours,
        stopped, never sends), and the two queues would hold each other until both deadlines
        passed.  Storing RELEASED again is safe: only our queues read these words.
        (``rerelease=False``: the side queue did not answer the first release; do not try again.)
        """
        be = self.backend
        me = self.group.rank
        # Host areas cost one store a word: re-release at each interval.  Device areas take a
        # store on the side queue each, waited for: keep that bounded too.
        retry_timeout = min(self.timeout_s, RERELEASE_S * 10)
        try:
            events = self._record(queues)
            next_release = time.perf_counter() + RERELEASE_S

            def drained() -> bool:
                nonlocal next_release
                if all(be.query_event(ev) for ev in events):
                    return True
                if rerelease and time.perf_counter() >= next_release:
                    # (quietly: the first release already warned if the words cannot be stored)
                    self._release_or_warn(me, self._own_slots(), retry_timeout, warn=False)
                    next_release = time.perf_counter() + RERELEASE_S
                return False

            poll_until(drained, self.timeout_s, lambda waited: f"queues did not drain within {waited:.3g} s")
            for q in queues:
                try:
                    be.synchronize(q)
                except RuntimeError:
                    pass  # the queue's own error is (or was) reported by the caller
        except Exception:  # noqa: BLE001 - draining is best effort on a path that already failed
            pass

    def release(self) -> None:
        """Store :data:`RELEASED` into every word this rank's queues may wait on (its own area)
        and into its own source word in every peer's area, so no stream stays blocked on a flag
        (see :meth:`fail` for the order a failing rank uses)."""
        if self.closed:  # nothing left to release: close() ran after every queue had finished
            return
        me, n = self.group.rank, self.group.size
        with self.backend.defer_frees():  # (see fail)
            for r in range(n):
                slots = self._own_slots() if r == me else [self._slot(name, me) for name in self.names]
                self._release_words(r, slots)

    def _release_words(self, rank: int, slots, timeout_s: float | None = None) -> None:
        area = self._areas[rank]
        host = host_view(area)
        for slot in slots:
            if host is not None:
                store_release(host, slot, RELEASED)
            else:
                self._release_device_word(area, slot, self.timeout_s if timeout_s is None else timeout_s)

    def _release_device_word(self, area, slot: int, timeout_s: float) -> None:
        # A blocked stream cannot be asked to do it: the backend stores the word from a queue
        # of its own, polling with the deadline (see Backend.release_flag_word).
        try:
            self.backend.release_flag_word(area, slot, RELEASED, timeout_s=timeout_s)
        except WaitTimeout as exc:
            raise QueueFlagsError(f"rank {self.group.rank}: releasing flag word {slot}: {exc}") from None

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._pb.closed:
            raise RuntimeError(f"QueueFlags on group {self.group.name!r} are closed")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run; the flags must not be used after that."""
        return self._pb.closed

    def close(self) -> None:
        """Collective: release the flag memory (idempotent)."""
        for ev in self._events.values():
            self.backend.destroy_event(ev)
        self._events = {}
        self._areas = []
        try:
            self._pb.close()
        finally:
            if self._own_signals:
                self.host.close()

    def __repr__(self) -> str:
        return f"<QueueFlags {list(self.names)} on group {self.group.name!r} via {self.backend.name}>"


__all__ = ["QueueFlags", "QueueFlagsError", "QueuePeerAborted", "RELEASED"]
