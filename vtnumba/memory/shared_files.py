"""Private shared-memory files: made safely, checked when opened, never left behind.

Both users of shared memory between processes -- the peer segments of :mod:`vtnumba.dist.shm`
and the encoder-cache region of :mod:`vtnumba.ec.region` -- make their memory the same way
when it needs a name in ``/dev/shm`` (where ``/proc/<pid>/fd`` cannot be opened, or a
consumer must find it by name), and this module is that one way:

* :func:`create_private_file` -- ``O_CREAT | O_EXCL`` (never reuse someone else's file),
  ``O_NOFOLLOW`` (a symlink planted at the name cannot redirect the create), ``O_CLOEXEC``,
  mode exactly ``0600`` whatever the umask; and the path is remembered, so that an
  uncaught exception or a plain exit unlinks it (an ``atexit`` hook), and a *janitor*
  process unlinks it if this process is killed (below);
* :func:`private_file_problem` -- what is wrong with a file someone else made, or None: it
  must be a regular file of this user with mode ``0600``; anything else was not made by a
  vtnumba creator of this user, and mapping it would let another user's process read or
  write our memory;
* :func:`unlink_private_file` -- remove the name (once every peer has mapped it) and forget it;
* :class:`Leftovers` and :func:`release_when_dropped` -- what a segment or region dropped
  without ``close()`` would keep until the process ends (its descriptor, which keeps an
  anonymous creator's memory alive, and a named creator's file) is given back when it is
  garbage-collected, with a ``ResourceWarning``, as an unclosed file does.

**Killed processes.**  ``atexit`` runs on a normal exit and after an uncaught exception, but
not when a signal kills the process: ``SIGKILL``, and ``SIGTERM`` or ``SIGHUP`` under their
default action -- what ``timeout`` sends, and what ``mpiexec`` does to the ranks left when
one aborts.  A Python signal handler would not close that gap (it runs only between
bytecodes: a process blocked in C would stop dying of ``SIGTERM``, and nothing catches
``SIGKILL``).  What does is a process that outlives ours.  The first named file starts a
*janitor*: a few lines of Python in a session of its own (so the signals a terminal, a
``timeout`` or ``mpiexec`` send to our process group do not reach it), reading from a pipe
"created path P (device, inode)" and "unlinked P".  When the pipe closes -- every process
holding its write end has ended, however it ended -- the janitor unlinks each file still
listed, if the name still leads to the inode we made (never someone else's file that took
the name since), and exits.  Python's own ``multiprocessing`` resource tracker does the same
for ``shared_memory``, but inside our process group, where ``mpiexec``'s kill takes it too.
A janitor that died is noticed at this process's next create or unlink (its pipe is
broken) and replaced, and the new one is told every file still listed, not just the next.
So only a kill in the microseconds between the create and the message, or a kill of the
janitor and then of this process before it creates or unlinks another file, can leak a file;
that is why both users prefer anonymous memory (``memfd_create``) and keep the window of a
name short.  A forked child forgets its parent's files (it did not make them: its exit and
its own janitor leave them to the parent's), and lets go of its copy of the parent's janitor
pipe, so the parent's death alone sets that janitor to work.
This module imports no MPI: the encoder cache, whose processes may not use MPI, needs it too.
"""

from __future__ import annotations

import atexit
import os
import stat
import subprocess
import sys
import threading
import warnings
import weakref

__all__ = ["Leftovers", "create_private_file", "private_file_problem", "release_when_dropped",
           "unlink_private_file"]

# The files this process created and has not unlinked yet, each with its (device, inode):
# what a janitor that replaces one that died must be told again.
_linked: dict[str, tuple[int, int]] = {}
_linked_lock = threading.Lock()

# The janitor's whole program (run with ``python -I``: no site, no environment, nothing of
# ours to import).  Lines are "+<device> <inode> <path>" and "-<path>"; at end of input it
# removes what is left, checking the inode first.
_JANITOR = r"""
import os, sys
made = {}
for line in sys.stdin.buffer:
    line = line.rstrip(b"\n")
    if line[:1] == b"+":
        dev, ino, path = line[1:].split(b" ", 2)
        made[path] = (int(dev), int(ino))
    else:
        made.pop(line[1:], None)
for path, (dev, ino) in made.items():
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except OSError:
        pass
"""
_janitor: subprocess.Popen | None = None
_janitor_pid = 0  # the process that started it (a forked child starts its own)


def _created_line(path: str, dev: int, ino: int) -> bytes:
    return b"+%d %d %s" % (dev, ino, os.fsencode(path))


def _tell_janitor(message: bytes) -> None:
    """Send one line to the janitor, starting it first if this process has none.  Best effort:
    without a janitor (no fork allowed, say) the atexit hook still covers exits and exceptions.
    (Called with ``_linked_lock`` held, so no file is created or unlinked meanwhile.)"""
    global _janitor, _janitor_pid
    for _ in range(2):  # a janitor that died (or was told to finish) is replaced once
        try:
            if _janitor is None or _janitor_pid != os.getpid():
                _janitor = subprocess.Popen(
                    [sys.executable, "-I", "-c", _JANITOR], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
                _janitor_pid = os.getpid()
                # A new janitor knows nothing yet: tell it every file still listed -- those the
                # one it replaces was told of died with it (message's own file may be among
                # them: the janitor takes a repeated line as one).
                lines = b"".join(_created_line(p, *ids) + b"\n" for p, ids in _linked.items() if "\n" not in p)
                if lines:
                    _janitor.stdin.write(lines)
            _janitor.stdin.write(message + b"\n")
            _janitor.stdin.flush()
            return
        except (OSError, ValueError):
            _janitor = None


_inherited_janitors: list = []  # a forked child's copies of its parent's janitor (see below)


def _forget_parents_files() -> None:
    # A forked child did not create its parent's files: its exit, and its janitor, must not
    # remove them (the parent's own janitor and atexit hook still cover them).
    global _linked_lock, _janitor
    _linked_lock = threading.Lock()  # (a thread of the parent may have held it at the fork)
    _linked.clear()
    if _janitor is not None:
        # The parent's janitor acts when every holder of its pipe's write end has ended, and
        # this child holds a copy: a parent killed while the child lives would leave its files
        # until the child ends.  So that descriptor is pointed at /dev/null -- not closed: the
        # file object still owns its number and would close it again later, perhaps as someone
        # else's -- and the object is kept, unused, so nothing of it runs here.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, _janitor.stdin.fileno(), inheritable=False)
            finally:
                os.close(devnull)
        except (OSError, ValueError):
            pass
        _inherited_janitors.append(_janitor)
        _janitor = None


os.register_at_fork(after_in_child=_forget_parents_files)


def _unlink_leftovers() -> None:
    global _janitor
    with _linked_lock:
        # The janitor is taken out first: the unlinks below need not tell it (it is told to
        # finish right after), and one that died is not replaced just to be stopped.  (Killed
        # during the loop, this process still leaves the files to it: it was never told they
        # went, and it checks each name before removing it.)
        janitor, _janitor = (_janitor, None) if _janitor_pid == os.getpid() else (None, _janitor)
        paths = list(_linked)
    for path in paths:
        unlink_private_file(path)
    if janitor is not None:
        try:
            janitor.stdin.close()  # nothing is left for it: it exits now
            janitor.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


atexit.register(_unlink_leftovers)


def create_private_file(path: str) -> int:
    """Create ``path`` (which must not exist: FileExistsError) with mode ``0600``; return its
    descriptor.  The file is unlinked at exit unless :func:`unlink_private_file` ran first."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    with _linked_lock:
        _strike_off_dropped()  # (first: a name a finalizer removed may be this very path)
        _linked[path] = (st.st_dev, st.st_ino)
        if "\n" not in path:  # (a line per message; vtnumba's names never hold one)
            _tell_janitor(_created_line(path, st.st_dev, st.st_ino))
        _strike_off_dropped()  # (and last: a finalizer may have run meanwhile, inside this very call)
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
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with _linked_lock:  # (after the unlink: a kill in between still leaves the janitor to do it)
        _strike_off_dropped()
        _forget(path)
        _strike_off_dropped()


def _forget(path: str, made: tuple[int, int] | None = None) -> None:
    """Stop tracking ``path`` (only if it is still the file ``made``, when given); called with
    ``_linked_lock`` held."""
    if path in _linked and (made is None or _linked[path] == made):
        del _linked[path]
        if _janitor is not None and "\n" not in path:
            _tell_janitor(b"-" + os.fsencode(path))


#: Files a dropped owner's finalizer removed while ``_linked_lock`` was held, as (path, (dev,
#: inode)): struck off ``_linked`` by the lock's next holder (see _unlink_dropped).
_dropped: list[tuple[str, tuple[int, int]]] = []


def _strike_off_dropped() -> None:
    """Called with ``_linked_lock`` held.  (A finalizer may append while this runs: it is seen.)"""
    while _dropped:
        _forget(*_dropped.pop())


def _unlink_dropped(path: str) -> bool:
    """:func:`unlink_private_file` for a finalizer; whether the file was removed.

    Garbage collection -- and with it a finalizer -- can run inside any allocation, this
    module's own code included while it holds ``_linked_lock``, a plain lock: waiting for it
    there would wait forever.  So the name goes at once, if it is still the file this process
    made (a forked child's list is empty: its parent's files are not its own to remove), and
    the bookkeeping under the lock is done now if the lock is free, else by its next holder."""
    made = _linked.get(path)
    if made is None:
        return False
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != made:
            return False
        os.unlink(path)
    except OSError:
        return False
    if _linked_lock.acquire(blocking=False):
        try:
            _forget(path, made)
        finally:
            _linked_lock.release()
    else:
        _dropped.append((path, made))
    return True


class Leftovers:
    """What an owner of shared memory holds that garbage-collecting it would not give back: a
    descriptor (an anonymous creator's keeps the memory alive, and every one is a slot of the
    process's table) and, for a named creator, the file's name.  The owner keeps ``fd`` and
    ``path`` current as it closes and unlinks them (the mapping itself is unmapped by
    ``mmap`` when collected)."""

    __slots__ = ("fd", "path")

    def __init__(self) -> None:
        self.fd: int | None = None  #: the descriptor still open (None once closed)
        self.path: str | None = None  #: a named creator's file still linked (None once removed, or anonymous)

    def release(self, *, dropped: bool = False) -> list[str]:
        """Close the descriptor and unlink the name still held (``dropped``: from a finalizer,
        see :func:`_unlink_dropped`); returns what was done."""
        # (Taken out of the fields before they are closed: an interrupt between the two then
        # leaves a descriptor open, never a number that a later release would close again.)
        fd, path, self.fd, self.path = self.fd, self.path, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        removed = False
        if path is not None:
            if dropped:
                removed = _unlink_dropped(path)
            else:
                unlink_private_file(path)
                removed = True
        released = ["closed its descriptor"] if fd is not None else []
        return released + (["removed its file"] if removed else [])


def _release_dropped(leftovers: Leftovers, what: str) -> None:
    released = leftovers.release(dropped=True)
    if released:
        warnings.warn(f"{what} was garbage-collected without close(), so vtnumba {' and '.join(released)} now; call "
                      "close() (or use a with block) when done with it", ResourceWarning, stacklevel=2)


def release_when_dropped(owner, leftovers: Leftovers, what: str) -> weakref.finalize:
    """Give ``leftovers`` back when ``owner`` is garbage-collected without having done it, and say
    so (``ResourceWarning``, named by ``what``).  Not at exit: the process's end closes its
    descriptors, and the exit hook above removes the names."""
    finalizer = weakref.finalize(owner, _release_dropped, leftovers, what)
    finalizer.atexit = False
    return finalizer
