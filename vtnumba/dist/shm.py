"""Shared-memory segments: the peer-memory transport of the ``cpu`` and ``cudasim`` targets.

Upstream concept (vLLM's TPSP): on a GPU, ranks share device memory through CUDA IPC handles.  Without a GPU
the same idea is host memory that every rank maps with ``mmap(MAP_SHARED)``: a store by one
rank is a store into the page every other rank sees.  What travels between ranks is a
*handle* -- a short string saying how to open the creator's memory.

**No name, nothing to leak.**  A file in ``/dev/shm`` is the textbook way, but a name is what
leaks: a rank killed between creating the file and the last peer mapping it leaves it behind
for good.  So by default a segment has no name at all:

1. the creator makes it with ``memfd_create`` -- an anonymous file that exists only while some
   process holds a descriptor or a mapping of it -- sizes it (``ftruncate``; pages read as
   zeros until written) and maps it;
2. its handle is ``fd:<pid>:<fd>:<name>``: a peer opens ``/proc/<pid>/fd/<fd>``, the creator's
   own descriptor, which the kernel allows only to processes of the same user; it checks the
   descriptor really is that memfd (``readlink`` shows its name), maps it and closes its
   descriptor;
3. once every peer has mapped it (an agreement in :class:`~vtnumba.dist.PeerBuffers`) the
   creator closes its descriptor too (:meth:`ShmSegment.unlink`): from then on the memory
   lives exactly as long as some process maps it.

Whatever happens -- an exception, ``SIGKILL`` at any moment -- no file is ever left behind:
there is none.

**Named segments** (``named=True``) are the fallback where ``/proc/<pid>/fd`` cannot be
opened (a sandbox without a shared procfs): a ``/dev/shm/vtnumba-*`` file made with
``O_CREAT | O_EXCL`` (never reuse someone else's file), mode ``0600``, an unguessable name
(``secrets.token_hex``), opened by peers with ``O_NOFOLLOW`` (a symlink planted at the name
is refused) after checking it is this user's and mode ``0600``, and unlinked as soon as every
peer has mapped it -- with an ``atexit`` hook for a Python-level failure in between, and the
janitor process of :mod:`vtnumba.memory.shared_files` for a kill (nothing of ours runs then).

A segment dropped without :meth:`ShmSegment.close` (its last reference gone) gives back what
it still holds -- the creator's descriptor, which keeps anonymous memory alive, or a named
segment's file -- with a ``ResourceWarning``, as an unclosed file does; ``with
ShmSegment.create(...) as seg:`` closes it.

Arrays handed out are ``np.frombuffer(mmap)``: zero-copy views.  In the simulator they are
wrapped as ``FakeCUDAArray`` by the caller, because the simulator copies plain numpy
kernel arguments in and back (which would hide and then clobber a peer's writes).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import numpy as np

from vtnumba.memory.shared_files import (
    Leftovers,
    create_private_file,
    private_file_problem,
    release_when_dropped,
    unlink_private_file,
)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "vtnumba-"
_NAME = re.compile(r"vtnumba-[A-Za-z0-9_.-]{1,160}")
_TAG = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # what a creator may put into its segments' names

def _check_name(name: str) -> str:
    # Names come from peers; refuse anything that could point outside /dev/shm.
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"shm segment name {name!r} is not a vtnumba segment name")
    return name


def _describe_nbytes(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes} bytes ({nbytes / size:.3g} {unit})"
    return f"{nbytes} bytes"


def _map(fd: int, nbytes: int, what: str, *, reserve: bool = False) -> mmap.mmap:
    """Size a new segment and map it.  ``reserve``: allocate every page now (a file in
    /dev/shm, whose tmpfs may be small) so that a lack of room is this OSError, not a SIGBUS
    at the first page a peer writes that has no room."""
    try:
        os.ftruncate(fd, nbytes)
        if reserve:
            os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise OSError(exc.errno, f"could not allocate {_describe_nbytes(nbytes)} of shared memory for {what}: "
                                 f"{exc.strerror}") from exc


class ShmSegment:
    """One mapped shared-memory segment.  Use :meth:`create` or :meth:`attach`, never the constructor."""

    def __init__(self, name: str, handle: str, nbytes: int, mm: mmap.mmap, owner: bool, *,
                 fd: int | None = None, path: str | None = None):
        self.name = name
        self.handle = handle
        self.path = path          # the /dev/shm path of a named segment, else None
        self.nbytes = nbytes
        self.owner = owner
        # What dropping the segment without close() would keep until the process ends: the
        # anonymous creator's descriptor (until unlink()), a named creator's file.
        self._left = Leftovers()
        self._left.fd = fd
        self._left.path = path if owner else None
        release_when_dropped(self, self._left, f"shm segment {name}")
        self._mmap: mmap.mmap | None = mm
        self._array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self.linked = owner       # can a peer still open it (name or descriptor still there)?

    @classmethod
    def create(cls, nbytes: int, tag: str = "seg", *, named: bool = False) -> "ShmSegment":
        """Create, size and map a fresh segment: anonymous (default) or a named ``/dev/shm`` file."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise ValueError(f"nbytes={nbytes!r} must be a positive int for a shared-memory segment")
        nbytes = int(nbytes)
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise ValueError(f"tag={tag!r} must be a name of 1 to 64 letters, digits, '_', '.' and '-' (it goes "
                             "into the segment's name)")
        name = _check_name(f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(16)}")
        if not named:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            try:
                mm = _map(fd, nbytes, f"segment {name}")
            except BaseException:
                os.close(fd)
                raise
            return cls(name, f"fd:{os.getpid()}:{fd}:{name}", nbytes, mm, owner=True, fd=fd)
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"{SHM_DIR} does not exist: POSIX shared memory is unavailable on this system")
        path = os.path.join(SHM_DIR, name)
        fd = create_private_file(path)  # 0600, O_EXCL, O_NOFOLLOW; unlinked at exit if still there
        try:
            mm = _map(fd, nbytes, f"segment {path}", reserve=True)
        except BaseException:
            os.close(fd)
            unlink_private_file(path)
            raise
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed any more
        return cls(name, f"name:{name}", nbytes, mm, owner=True, path=path)

    @classmethod
    def attach(cls, handle: str, nbytes: int) -> "ShmSegment":
        """Map a peer's segment from its handle; checks it is a vtnumba segment of exactly ``nbytes``."""
        if not isinstance(handle, str):
            raise TypeError(f"handle must be a str, got {type(handle).__name__}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise TypeError(f"nbytes={nbytes!r} must be an int (the segment's size, as its creator made it)")
        nbytes = int(nbytes)
        kind, _, rest = handle.partition(":")
        try:
            if kind == "fd":
                fd, name, path = cls._open_descriptor(rest)
            elif kind == "name":
                name = _check_name(rest)
                path = os.path.join(SHM_DIR, name)
                fd = cls._open_named(path)
            else:
                raise ValueError(f"shm handle {handle!r} is not a vtnumba segment handle (expected fd:... or name:...)")
        except FileNotFoundError as exc:
            # (Same type, so callers catching OSError still do; the message names the handle.)
            raise FileNotFoundError(exc.errno, f"shm handle {handle!r}: the segment is gone -- its creator exited "
                                               "or closed it before this process mapped it", exc.filename) from None
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(f"shm segment {name} has {size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, handle, nbytes, mm, owner=False, path=path if kind == "name" else None)

    @staticmethod
    def _open_descriptor(rest: str) -> tuple[int, str, str]:
        try:
            pid_s, fd_s, name = rest.split(":", 2)
            pid, fd_num = int(pid_s), int(fd_s)
        except ValueError:
            raise ValueError(f"shm handle 'fd:{rest}' is malformed (expected fd:<pid>:<fd>:<name>)") from None
        _check_name(name)
        path = f"/proc/{pid}/fd/{fd_num}"
        # The descriptor number could have been reused by something else: it must be our memfd.
        target = os.readlink(path)
        if target not in (f"/memfd:{name}", f"/memfd:{name} (deleted)"):
            raise ValueError(f"{path} is {target!r}, not the shared-memory segment {name}")
        return os.open(path, os.O_RDWR), name, path

    @staticmethod
    def _open_named(path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a symlink planted at the name fails here
        problem = private_file_problem(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            raise PermissionError(f"{path} is not a vtnumba segment of this user: it {problem}")
        return fd

    @property
    def array(self) -> np.ndarray:
        """The whole segment as a flat, writable uint8 numpy array (zero-copy)."""
        if self._array is None:
            raise RuntimeError(f"shm segment {self.name} was closed")
        return self._array

    def unlink(self) -> None:
        """No peer may open the segment any more (the creator calls this once every peer has
        mapped it): an anonymous segment's descriptor is closed, a named one's file removed."""
        if not (self.owner and self.linked):
            return
        self.linked = False
        self._left.release()  # (closes the descriptor of an anonymous segment, removes a named one's file)

    def close(self) -> None:
        """Unmap.  If a caller still holds a view, the mapping lives on until that view dies.

        ``mmap.close`` refuses while numpy views of it exist (``BufferError``); then we just
        drop our references and the memory is unmapped when the last view is collected.
        Nothing can leak either way: :meth:`unlink` runs first.
        """
        self.unlink()
        mm, self._mmap, self._array = self._mmap, None, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def list_segments() -> list[str]:
    """Names of vtnumba files currently in ``/dev/shm`` (for tests and diagnostics; anonymous
    segments never appear: they have no name)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []


__all__ = ["ShmSegment", "SHM_DIR", "NAME_PREFIX", "list_segments"]
