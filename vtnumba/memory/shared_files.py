"""Private shared-memory files: made safely, checked when opened, never left behind.

Both users of shared memory between processes -- the peer segments of :mod:`vtnumba.dist.shm`
and the encoder-cache region of :mod:`vtnumba.ec.region` -- make their memory the same way
when it needs a name in ``/dev/shm`` (where ``/proc/<pid>/fd`` cannot be opened, or a
consumer must find it by name), and this module is that one way:

* :func:`create_private_file` -- ``O_CREAT | O_EXCL`` (never reuse someone else's file),
  ``O_NOFOLLOW`` (a symlink planted at the name cannot redirect the create), ``O_CLOEXEC``,
  mode exactly ``0600`` whatever the umask; and the path is remembered, so that an
  uncaught exception or a plain exit unlinks it (an ``atexit`` hook);
* :func:`private_file_problem` -- what is wrong with a file someone else made, or None: it
  must be a regular file of this user with mode ``0600``; anything else was not made by a
  vtnumba creator of this user, and mapping it would let another user's process read or
  write our memory;
* :func:`unlink_private_file` -- remove the name (once every peer has mapped it) and forget it.

Only a hard kill (``SIGKILL``) between the create and the unlink can leak a file; that is why
both users prefer anonymous memory (``memfd_create``) and keep the window of a name short.
This module imports no MPI: the encoder cache, whose processes may not use MPI, needs it too.
"""

from __future__ import annotations

import atexit
import os
import stat
import threading

__all__ = ["create_private_file", "private_file_problem", "unlink_private_file"]

_linked: set[str] = set()  # files this process created and has not unlinked yet
_linked_lock = threading.Lock()


def _unlink_leftovers() -> None:
    with _linked_lock:
        paths = list(_linked)
        _linked.clear()
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


atexit.register(_unlink_leftovers)


def create_private_file(path: str) -> int:
    """Create ``path`` (which must not exist: FileExistsError) with mode ``0600``; return its
    descriptor.  The file is unlinked at exit unless :func:`unlink_private_file` ran first."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with _linked_lock:
        _linked.add(path)
    try:
        os.fchmod(fd, 0o600)  # exactly, whatever the umask
    except BaseException:
        os.close(fd)
        unlink_private_file(path)
        raise
    return fd


def private_file_problem(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` (``os.fstat`` of an opened descriptor) must not be mapped,
    or None when it is a regular file of this user with mode ``0600``."""
    if not stat.S_ISREG(st.st_mode):
        return f"is not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"has mode {oct(stat.S_IMODE(st.st_mode))}, expected 0o600 (only this user may read or write it)"
    return None


def unlink_private_file(path: str) -> None:
    """Remove ``path``'s name (mappings stay valid) and stop tracking it; a missing file is fine."""
    with _linked_lock:
        _linked.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
