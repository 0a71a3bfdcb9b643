"""``SingleCaller``: one thread at a time in an object whose calls share scratch memory.

Some objects own memory that every call writes -- a model's step arena (its activations), a
TPSP handle's workspace and flags.  Two threads calling one of them at once would write each
other's scratch and return wrong numbers *without any error*: the worst kind of bug to meet
while learning.  A lock would serialise them, but where the calls are collective (every rank
of a group must make them in the same order) a lock would only trade the wrong numbers for a
hang.  So the second thread is refused, at once, with an error that says why::

    self._caller = SingleCaller("MiniLMEncoder", "its forwards share one step arena")
    ...
    with self._caller:          # RuntimeError here if another thread is inside
        ...

The thread already inside may enter again (an ``encode`` that calls ``tokenize``).  This is
the same contract as a CUDA stream's: ordered work from one owner, not a thread-safe service.
"""

from __future__ import annotations

import threading


class SingleCaller:
    """A guard: entered by one thread at a time (re-entrant for that thread); see the module docstring."""

    def __init__(self, what: str, why: str):
        self.what = what
        self.why = why
        self._lock = threading.RLock()

    def __enter__(self) -> "SingleCaller":
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{self.what} is already running a call on another thread: {self.why}, so it serves "
                               "one thread at a time -- give each thread its own, or call it from one thread")
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


__all__ = ["SingleCaller"]
