"""PeerSignals: flags in shared memory that say "my data is ready" / "I am done with yours".

Upstream concept (vLLM's TPSP): the workspace has, next to the inbox and gather slots, a small flag area
per rank.  A producer writes its data, then raises a flag *in the consumer's flag area*;
the consumer polls its own flags (local memory: cheap) and only then reads the data.

Layout: every rank owns a small host shared-memory segment (made with :class:`PeerBuffers`
over host memory, so the flags are plain host memory on every target) holding

* ``flags[name, source]`` -- int64; written only by rank ``source`` (one writer per slot,
  so no read-modify-write atomics are needed), read by the owner;
* ``abort[source]``      -- the epoch at which ``source`` gave up (so waiters fail fast);
* ``meta[bank][0:8]``    -- eight int64 the *owner* publishes (e.g. the shapes of its
  contribution), read by peers after they saw its flag.  Two banks: a protocol that
  publishes at every epoch uses bank ``epoch % 2``, so a fast rank's next publication can
  never overwrite what a slow peer is still reading (to publish at epoch e+2 the fast rank
  must have seen the slow one's flag for e+1, raised only after it finished reading e).

Epochs, not booleans: a flag holds a monotonically increasing counter.  Step ``e`` of a
protocol sets ``flags = e`` and waits for ``flags >= e``; nothing is ever reset, so there is
no window where a reset races with the next step's set, and a waiter that is late still
sees "at least e".  ``next_epoch()`` hands out 1, 2, 3, ... -- every rank makes the same
sequence of collective calls, so their epochs agree without communication.

Memory ordering (the reason :mod:`vtnumba.backend.atomics` exists): the producer's data
stores must be visible before its flag store, and the consumer's data loads must not be
satisfied before its flag load.  ``set`` is a *release* store and ``wait`` polls with
*acquire* loads.  On x86-64 (TSO: stores are not reordered with stores, loads not with
loads) these are plain moves and the order would hold anyway; on Arm they are
``stlr``/``ldar`` and are what makes it hold.  ``threading`` primitives would not help:
they order threads of one process, not two processes sharing a mapping.  Device work must
be *finished* before its flag is raised: pass ``after=queue`` and ``set`` synchronizes that
queue first (a completed kernel's or copy's writes are visible to the host and to peers).

On a real GPU, kernels could also poll flags in device memory with the notes' idiom
(publish ``atomic.or_(f, 0, 1)``, poll ``while atomic.or_(f, 0, 0) == 0``); this reference
keeps the waits on the host, which is correct on every target and can never spin a GPU
forever.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import check_seconds, is_int
from vtnumba.backend.atomics import load_acquire, store_release
from vtnumba.backend.polling import WaitTimeout, poll_until
from vtnumba.dist.comm import DEFAULT, agree_errors, allgather_bytes, check_group, resolve_timeout
from vtnumba.dist.failures import PeerAborted, raise_peer_report

DEFAULT_NAMES = ("inbox_ready", "gather_ready", "consumed")
META_SLOTS = 8
META_BANKS = 2
ABORT_FOREVER = 1 << 62


def _epoch(what: str, value, most: int = ABORT_FOREVER - 1) -> int:
    """A flag value: an int in ``0 .. most`` (a flag word is an int64, and abort stamps sit
    above every epoch).  1.7 was stored as 1, 2**63 an OverflowError from numpy."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}={value!r} must be an int (flags count epochs)")
    if not 0 <= int(value) <= most:
        raise ValueError(f"{what}={value} must be an epoch in 0..{most}")
    return int(value)


def flag_names_error(names) -> tuple[tuple[str, ...] | None, ValueError | None]:
    """``(names as a tuple, None)``, or ``(None, the error)`` when ``names`` is not a non-empty
    tuple of distinct non-empty strings -- returned, not raised, so that the ranks can compare
    their errors before any of them raises (:func:`vtnumba.dist.agree_errors`)."""
    names_t = tuple(names) if isinstance(names, (list, tuple)) else None
    if names_t is None or not names_t or any(not isinstance(n, str) or not n for n in names_t):
        return None, ValueError(f"names={names!r} must be a non-empty tuple of non-empty strings")
    if len(set(names_t)) != len(names_t):
        return None, ValueError(f"names={names!r} contains duplicates")
    return names_t, None


def _host_backend():
    # Flags are host memory on every target; a private CPU backend gives us shm + numpy views.
    from vtnumba.backend.cpu import CPUBackend

    return CPUBackend()


class PeerSignals:
    """Epoch flags between the ranks of ``group`` (collective constructor; see module docstring).

    ``backend`` is the target the *signalled data* lives on; it is used to synchronize a
    queue before raising a flag (``set(..., after=queue)``).
    """

    def __init__(self, group, names=DEFAULT_NAMES, backend=None, *, timeout_s: float = DEFAULT):
        from vtnumba.dist.peer_buffers import PeerBuffers

        check_group(group)
        names_t, err = flag_names_error(names)
        agree_errors(err, group, context="PeerSignals", timeout_s=timeout_s)
        mine = "\x00".join(names_t).encode()
        everyone = allgather_bytes(mine, group, timeout_s)
        if any(e != mine for e in everyone):
            raise ValueError("PeerSignals(names=...) must be the same on every rank; got "
                             + "; ".join(f"rank {r}: {e.decode().split(chr(0))}" for r, e in enumerate(everyone)))
        self.group = group
        self.names = names_t
        self.backend = backend
        self.timeout_s = timeout_s = resolve_timeout(timeout_s)
        self.epoch = 0
        n = group.size
        self._index = {name: k for k, name in enumerate(names_t)}
        self._nflags = len(names_t) * n
        self._abort_at = self._nflags
        self._meta_at = self._nflags + n
        slots = self._meta_at + META_BANKS * META_SLOTS
        self._pb = PeerBuffers(slots * 8, group, _host_backend(), timeout_s=timeout_s)
        # Each rank's flag area as a flat int64 array (index = group rank).
        self._areas = [p.view(np.int64) for p in self._pb.views(np.uint8, slots * 8)]

    # ------------------------------------------------------------------ helpers
    def _slot(self, name: str, source: int) -> int:
        try:
            return self._index[name] * self.group.size + source
        except KeyError:
            raise ValueError(f"unknown flag name={name!r}; this PeerSignals has {list(self.names)}") from None

    def _rank(self, rank, what: str) -> int:
        if not is_int(rank) or not 0 <= rank < self.group.size:
            raise ValueError(f"{what}={rank!r} must be a group rank in 0..{self.group.size - 1} "
                             f"of group {self.group.name!r}")
        return int(rank)

    def _check_open(self) -> None:
        if self._pb.closed:
            raise RuntimeError(f"PeerSignals on group {self.group.name!r} is closed")

    def _finish(self, queue) -> None:
        if self.backend is None:
            raise ValueError("set(after=queue) needs PeerSignals(backend=...) to synchronize the queue")
        self.backend.synchronize(queue)

    # ------------------------------------------------------------------ epochs
    def next_epoch(self) -> int:
        """The next epoch number (1, 2, ...): identical on every rank that makes the same calls."""
        self.epoch += 1
        return self.epoch

    # ------------------------------------------------------------------ set / get / wait
    def set(self, name: str, target_rank: int, value: int, *, after=None) -> None:
        """Raise ``name`` to ``value`` in ``target_rank``'s flag area (as seen from this rank).

        Release store: every write this rank made before (numpy, or device work on queue
        ``after``, which is synchronized first) is visible to the target before the flag.
        Values must not decrease (flags are epoch counters).
        """
        self._check_open()
        target = self._rank(target_rank, "target_rank")
        slot = self._slot(name, self.group.rank)
        value = _epoch("value", value)
        if after is not None:
            self._finish(after)
        area = self._areas[target]
        current = int(load_acquire(area, slot))
        if value < current:
            raise ValueError(f"set({name!r}, target_rank={target}, value={value}): flags are epoch counters and "
                             f"must not decrease (it is already {current})")
        store_release(area, slot, value)

    def set_all(self, name: str, value: int, *, after=None, include_self: bool = False) -> None:
        """``set`` on every other rank of the group (and on this one with ``include_self``)."""
        if after is not None:
            self._finish(after)  # once, not once per target
        for r in range(self.group.size):
            if r != self.group.rank or include_self:
                self.set(name, r, value)

    def get(self, name: str, source: int) -> int:
        """The value rank ``source`` last set for ``name`` in *this* rank's area (acquire load)."""
        self._check_open()
        slot = self._slot(name, self._rank(source, "source"))
        return int(load_acquire(self._areas[self.group.rank], slot))

    def wait(self, name: str, value: int, source=None, timeout_s: float | None = None) -> None:
        """Block until this rank's flag ``name`` is ``>= value`` from every source.

        ``source``: a group rank, an iterable of ranks, or None for every *other* rank.
        Raises RuntimeError naming rank, flag, expected and seen value after ``timeout_s``
        (default: the constructor's), or at once if a source called :meth:`abort`.
        """
        self._check_open()
        me = self.group.rank
        if source is None:
            sources = [r for r in range(self.group.size) if r != me]
        elif isinstance(source, (int, np.integer)) and not isinstance(source, bool):
            sources = [self._rank(source, "source")]
        else:
            sources = [self._rank(s, "source") for s in source]
        timeout_s = self.timeout_s if timeout_s is None else check_seconds("timeout_s", timeout_s)
        value = _epoch("value", value)
        area = self._areas[me]
        base = self._slot(name, 0)
        pending = list(sources)

        def arrived() -> bool:
            pending[:] = [s for s in pending if load_acquire(area, base + s) < value]
            for s in pending:
                # An abort stamp >= value means the source gave up before raising this flag.
                # Re-read the flag after seeing the stamp: a source that finished its part
                # (raised the flag) before aborting is not a failure.
                if load_acquire(area, self._abort_at + s) >= value and load_acquire(area, base + s) < value:
                    raise_peer_report()  # the failing rank's own report, if it comes soon: it names the cause
                    raise PeerAborted(
                        f"rank {me} of group {self.group.name!r}: waiting for flag {name!r} >= {value} from rank "
                        f"{s}, but rank {s} aborted (it raised an error in the same step)")
            return not pending

        poll_until(arrived, timeout_s,
                   lambda waited: f"rank {me} of group {self.group.name!r}: timed out after {timeout_s:g} s waiting "
                                  f"for flag {name!r} from rank {pending[0]} to reach {value}; it is "
                                  f"{int(load_acquire(area, base + pending[0]))}",
                   error=WaitTimeout)

    def wait_consumed(self, timeout_s: float | None = None) -> None:
        """Wait until every peer has consumed the current epoch (finished reading my buffer).

        Call this before writing into your *own* peer buffer outside a collective (a
        zero-copy input produced in place): the collectives guard their own writes, but a
        write made before the call could otherwise clobber data a slower peer is still
        reading from the previous step.
        """
        self.wait("consumed", self.epoch, timeout_s=timeout_s)

    # ------------------------------------------------------------------ abort and metadata
    def abort(self, epoch: int | None = None) -> None:
        """Tell every peer that this rank gave up at ``epoch``: their waits on this rank for a
        value ``<= epoch`` that it never raised fail fast instead of timing out.

        Without ``epoch`` the abort is permanent (every later wait on this rank fails).  Call
        it *after* raising the flags you did finish (e.g. ``consumed``): a waiter re-reads the
        flag after seeing the stamp.
        """
        if self._pb.closed:
            return
        self._stamp_abort(self.group.rank, ABORT_FOREVER if epoch is None else _epoch("epoch", epoch, ABORT_FOREVER))

    def relay_abort(self, rank: int) -> None:
        """Pass on the news that ``rank`` gave up: copy its abort stamp, as this rank sees it,
        into every peer's area.

        Call it *before* this rank's own :meth:`abort` when it gives up *because* ``rank`` did.
        The failing rank stamps the peers' areas one after the other, so a third rank can find
        our stamp before the original one reaches its area, and blame us for the failure; with
        the original stamp relayed first (release order), whoever sees our stamp sees it too.
        """
        self._check_open()
        r = self._rank(rank, "rank")
        self._stamp_abort(r, self.abort_stamp(r))

    def _stamp_abort(self, rank: int, stamp: int) -> None:
        slot = self._abort_at + rank
        for r in range(self.group.size):
            if stamp > load_acquire(self._areas[r], slot):  # stamps only grow
                store_release(self._areas[r], slot, stamp)

    def abort_stamp(self, rank: int) -> int:
        """The epoch at which ``rank`` last gave up (0: never), read from this rank's own area,
        where every peer stamps its aborts."""
        self._check_open()
        r = self._rank(rank, "rank")
        return int(load_acquire(self._areas[self.group.rank], self._abort_at + r))

    def _meta_slice(self, bank) -> slice:
        if bank not in range(META_BANKS) or isinstance(bank, bool):
            raise ValueError(f"bank={bank!r} must be 0 or 1")
        start = self._meta_at + int(bank) * META_SLOTS
        return slice(start, start + META_SLOTS)

    def set_meta(self, values, bank: int = 0) -> None:
        """Publish up to 8 ints in this rank's own area (visible to a peer after it sees a later flag)."""
        self._check_open()
        if isinstance(values, (str, bytes)) or not all(is_int(v) for v in values):
            raise TypeError(f"values={values!r} must be a sequence of at most {META_SLOTS} ints")
        values = [int(v) for v in values]
        if len(values) > META_SLOTS:
            raise ValueError(f"set_meta takes at most {META_SLOTS} values, got {len(values)}")
        big = [v for v in values if not -2**63 <= v < 2**63]
        if big:
            raise ValueError(f"values={values!r}: {big[0]} does not fit the int64 a meta slot holds")
        # Plain stores: ordered before the next flag this rank raises by that flag's release store.
        padded = values + [0] * (META_SLOTS - len(values))
        self._areas[self.group.rank][self._meta_slice(bank)] = padded

    def meta(self, rank: int, bank: int = 0) -> tuple[int, ...]:
        """The 8 ints ``rank`` last published in ``bank`` (read after waiting for one of its flags)."""
        self._check_open()
        area = self._areas[self._rank(rank, "rank")]
        return tuple(area[self._meta_slice(bank)].tolist())

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run; the flags must not be used after that (most methods raise)."""
        return self._pb.closed

    def close(self) -> None:
        """Collective: release the flag memory (idempotent)."""
        self._areas = []
        self._pb.close()

    def __enter__(self) -> "PeerSignals":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            # This rank is leaving mid-protocol: tell peers now, so a peer waiting on one of
            # our flags fails fast and reaches close()'s barrier instead of timing out.
            self.abort()
        self.close()

    def __repr__(self) -> str:
        return f"<PeerSignals {list(self.names)} on group {self.group.name!r} epoch={self.epoch}>"


__all__ = ["PeerSignals", "DEFAULT_NAMES", "META_SLOTS", "META_BANKS", "flag_names_error"]
