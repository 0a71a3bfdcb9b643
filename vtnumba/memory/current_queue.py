"""The thread's "current queue": a stream for code that is not handed one.

Most vtnumba code passes queues explicitly.  Some code cannot: numba's external memory
manager interface calls ``memalloc(size)`` with *no* stream (NBEP 7; docs/concepts/memory.rst), so
a stream-ordered allocator behind it has to learn the stream some other way.  The usual
answer (PyTorch's "current stream") is a thread-local that the runtime sets around the
work it submits::

    with using_queue(q):
        d = numba.cuda.device_array(n)     # allocated from q's pool

Thread-local because two host threads driving two queues must not see each other's
choice; a stack because scopes nest.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from vtnumba.backend.base import Queue

_tls = threading.local()


def current_queue() -> Queue | None:
    """The innermost queue set by :func:`using_queue` on this thread, or ``None``."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def using_queue(queue: Queue):
    """Make ``queue`` this thread's current queue for the duration of the ``with`` block."""
    if not isinstance(queue, Queue):
        raise TypeError(f"using_queue(queue={queue!r}) needs a Queue, got {type(queue).__name__}")
    if queue.destroyed:
        raise RuntimeError(f"using_queue(queue={queue.name}) got a destroyed queue")
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(queue)
    try:
        yield queue
    finally:
        stack.pop()
