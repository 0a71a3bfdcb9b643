"""Waiting for something another thread, process or device will do -- with a deadline, always.

Every wait in vtnumba on another rank, process or device is a poll: "is the MPI request
done?", "has the peer raised its flag?", "has the GPU passed this event?".  Polling (instead
of a blocking call) is what lets a wait *end*: after ``timeout_s`` it raises an error that
names what it waited for, so one rank that crashed or hangs can never leave the others
waiting forever.  (The cpu backend's waits for its own queue threads -- an event, a queue
drain -- block on a ``threading`` primitive instead: that work is local and ends by itself,
and any wait *it* makes on a peer is one of these polls.)

How a waiter spends the time between two polls matters as much as the deadline:

1. **spin** for the first :data:`PURE_SPIN_S` -- a peer on the same node usually answers
   within microseconds, and giving up the core costs more than that on a busy machine;
2. **spin, yielding now and then** until :data:`SPIN_S` -- if ranks outnumber cores, the
   rank we wait for may need *this* core to make progress;
3. **sleep** in short naps (at most 1 ms, growing with the wait) -- a long wait must not
   burn a core at all.

:func:`poll_until` is that loop; everything that waits uses it (the MPI waits of
:mod:`vtnumba.dist.comm`, the peer flags of :mod:`vtnumba.dist.signals`, the encoder-cache
channel, the host side of :meth:`vtnumba.backend.Backend.wait_value32`).

A wait can also end *early* because something elsewhere went wrong: a *watch*
(:func:`add_watch`) is called every few milliseconds of every wait on the main thread and
may raise -- :mod:`vtnumba.dist.failures` uses one so that a rank that failed tells every
other rank within milliseconds, wherever they are waiting, instead of after their timeouts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

SPIN_S = 0.005        # poll this long before sleeping: peers on one node answer in microseconds
PURE_SPIN_S = 0.0002  # ... of which this long without ever yielding the core
MAX_NAP_S = 0.001     # the longest sleep between two polls


WATCH_EVERY_S = 0.002  # how often a long wait asks the watches (cheap: an MPI iprobe)

_watches: list[Callable[[], None]] = []


def add_watch(fn: Callable[[], None]) -> None:
    """Call ``fn()`` now and then during every wait on the main thread; it may raise to end the wait."""
    if fn not in _watches:
        _watches.append(fn)


def remove_watch(fn: Callable[[], None]) -> None:
    """Stop calling ``fn`` (a no-op if it was not added)."""
    if fn in _watches:
        _watches.remove(fn)


def _run_watches() -> None:
    if threading.current_thread() is threading.main_thread():
        for fn in list(_watches):
            fn()


class WaitTimeout(RuntimeError):
    """A poll did not succeed before its deadline (the message says what was awaited)."""


def backoff(polls: int, waited: float) -> None:
    """Spend the time between poll number ``polls`` and the next, ``waited`` seconds into the wait."""
    if waited < PURE_SPIN_S:
        return
    if waited < SPIN_S:
        if polls % 64 == 0:
            os.sched_yield()
    else:
        time.sleep(min(MAX_NAP_S, waited / 100))


def poll_until(done: Callable[[], bool], timeout_s: float, describe: Callable[[float], str],
               *, error: type[Exception] = WaitTimeout) -> float:
    """Call ``done()`` until it returns True; return the seconds waited.

    After ``timeout_s`` seconds raise ``error(describe(waited))``: ``describe`` builds the
    message lazily, so it can report the state *at the time of the failure* (e.g. the value
    a flag has now).  ``done`` may itself raise to end the wait early (a peer reported a
    failure): that exception propagates unchanged.
    """
    if done():
        return 0.0
    start = time.perf_counter()
    polls = 0
    next_watch = WATCH_EVERY_S
    while True:
        polls += 1
        waited = time.perf_counter() - start
        if waited > timeout_s:
            raise error(describe(waited))
        if _watches and waited >= next_watch:
            next_watch = waited + WATCH_EVERY_S
            _run_watches()
        backoff(polls, waited)
        if done():
            return time.perf_counter() - start


__all__ = ["SPIN_S", "PURE_SPIN_S", "MAX_NAP_S", "WATCH_EVERY_S", "WaitTimeout", "backoff", "poll_until", "add_watch",
           "remove_watch"]
