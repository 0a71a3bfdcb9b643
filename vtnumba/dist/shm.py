"""POSIX shared-memory segments: the peer-memory transport of the ``cpu`` and ``cudasim`` targets.

Seed concept: on a GPU, ranks share device memory through CUDA IPC handles.  Without a GPU
the same idea is a file in ``/dev/shm`` (a tmpfs: RAM, not disk) that every rank maps
with ``mmap(MAP_SHARED)``; a store by one rank is a store into the page every other rank
sees.  The "handle" that travels between ranks is just the file name.

Lifecycle, chosen so that nothing is left in ``/dev/shm`` after a run, even after a crash:

1. ``ShmSegment.create`` makes the file with ``O_CREAT | O_EXCL`` (never reuse or truncate
   someone else's file), mode ``0600`` (only this user), under an unguessable name
   (``secrets.token_hex``: another user cannot pre-create it or guess it);
2. ``ftruncate`` sizes it (tmpfs pages read as zeros until written), ``mmap`` maps it and
   the descriptor is closed (the mapping keeps the memory alive);
3. peers ``ShmSegment.attach`` by name;
4. as soon as every peer has mapped it, the creator ``unlink``\\ s the name.  From then on
   the memory lives exactly as long as some process maps it and has no name anyone could
   leak: a rank that raises or is killed later leaves nothing behind.

Between 1 and 4 (a few milliseconds of setup) a name exists; an ``atexit`` hook unlinks any
name this process created and has not yet unlinked (a Python-level exception in that
window), and only a hard kill inside the window could leak a file.

Arrays handed out are ``np.frombuffer(mmap)``: zero-copy views.  In the simulator they are
wrapped as ``FakeCUDAArray`` by the caller, because the simulator copies plain numpy
kernel arguments in and back (which would hide and then clobber a peer's writes).
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import threading

import numpy as np

SHM_DIR = "/dev/shm"
NAME_PREFIX = "vtnumba-"

_linked: set[str] = set()  # paths this process created and has not unlinked yet
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


def _check_name(name: str) -> str:
    # Names come from peers; refuse anything that could point outside /dev/shm.
    if not isinstance(name, str) or not name.startswith(NAME_PREFIX) or "/" in name or len(name) > 200 \
            or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"shm segment name {name!r} is not a vtnumba segment name")
    return name


class ShmSegment:
    """One mapped ``/dev/shm`` file.  Use :meth:`create` or :meth:`attach`, never the constructor."""

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, owner: bool):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.nbytes = nbytes
        self.owner = owner
        self._mmap: mmap.mmap | None = mm
        self._array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self.linked = owner

    @classmethod
    def create(cls, nbytes: int, tag: str = "seg") -> "ShmSegment":
        """Create, size and map a fresh segment (mode 0600, unguessable name)."""
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes} must be > 0 for a shared-memory segment")
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"{SHM_DIR} does not exist: POSIX shared memory is unavailable on this system")
        name = f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        with _linked_lock:
            _linked.add(path)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_path(path)
            raise
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed any more
        return cls(name, nbytes, mm, owner=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> "ShmSegment":
        """Map a peer's segment by name; checks it has exactly ``nbytes``."""
        path = os.path.join(SHM_DIR, _check_name(name))
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(f"shm segment {name} has {size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, nbytes, mm, owner=False)

    @property
    def array(self) -> np.ndarray:
        """The whole segment as a flat, writable uint8 numpy array (zero-copy)."""
        if self._array is None:
            raise RuntimeError(f"shm segment {self.name} was closed")
        return self._array

    def unlink(self) -> None:
        """Remove the name (the creator calls this once every peer has mapped the segment)."""
        if self.owner and self.linked:
            self.linked = False
            _unlink_path(self.path)

    def close(self) -> None:
        """Unmap.  If a caller still holds a view, the mapping lives on until that view dies.

        ``mmap.close`` refuses while numpy views of it exist (``BufferError``); then we just
        drop our references and the memory is unmapped when the last view is collected.  The
        name is already unlinked, so nothing can leak into ``/dev/shm`` either way.
        """
        self.unlink()
        mm, self._mmap, self._array = self._mmap, None, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass


def _unlink_path(path: str) -> None:
    with _linked_lock:
        _linked.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def list_segments() -> list[str]:
    """Names of vtnumba segments currently in ``/dev/shm`` (for tests and diagnostics)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []


__all__ = ["ShmSegment", "SHM_DIR", "NAME_PREFIX", "list_segments"]
