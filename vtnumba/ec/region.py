"""The shared region: a block-structured piece of shared memory that producer and consumer both map.

Upstream: ``ECSharedRegion`` and ``create_ec_shared_region`` in vLLM's CPU encoder-cache
connector.  An encoder process (producer) writes encoder outputs into the region; a
prefill process (consumer) on the same machine reads them back.  Both map the *same*
memory, so a write by one is a read by the other with no copy in between.

Layout, mapped ``MAP_SHARED``::

    [ header: 4096 bytes ][ block 0 ][ block 1 ] ... [ block num_blocks-1 ]

One block holds one token's embedding row: ``block_size_bytes = hidden_size * itemsize``,
``num_blocks = region_bytes // block_size_bytes``.  :attr:`ECSharedRegion.blocks` is the
``int8`` view ``[num_blocks, block_size_bytes]``.  The header (vLLM's has none; this is
our addition) records dtype, hidden size and block count, so a consumer configured
differently from its producer fails at open time with a clear message instead of
reinterpreting the wrong bytes.  The blocks start one page in, so they stay page-aligned.

Two ways to share the memory
----------------------------

* **named** (vLLM's): a file ``/dev/shm/vtnumba_ec_<engine_id>.mmap`` that any process
  of the same user can open by engine id -- the way to go when producer and consumer are
  not MPI peers and only agree on a name.  The price: between the creator's ``open`` and
  its :meth:`~ECSharedRegion.unlink` a name exists, and a creator that dies in that window
  must not leave it behind: an ``atexit`` hook unlinks it after an *exception*, and a
  janitor process (one that outlives the creator, in a session of its own, see
  :mod:`vtnumba.memory.shared_files`) moments after a *kill* -- ``SIGKILL``, or the
  ``SIGTERM`` that ``timeout`` and ``mpiexec`` send, under which no exit hook runs.
* **anonymous** (``anonymous=True``, what the endpoints use): the creator makes the memory
  with ``memfd_create`` -- shared memory that never has a name in ``/dev/shm`` at all, so
  no crash at any moment can leave a file behind.  Openers reach it through the creator's
  descriptor, ``/proc/<creator pid>/fd/<fd>``, described by an :class:`ECRegionHandle` the
  creator sends them (over MPI in the demos).  The kernel lets only processes of the same
  user open another process's descriptors, and the handle carries the file's inode, which
  the opener checks, so a recycled pid or descriptor number cannot hand it someone
  else's memory.  The memory lives as long as any process maps it or holds the descriptor.

Lifecycle:

* the *creator* makes the memory (named: ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, so a
  second creator -- or a symlink planted under the name -- is refused), sizes it,
  pre-faults every page (``MADV_POPULATE_WRITE``, so the first real copy does not pay for
  page faults), and writes the header's magic *last*: an opener that sees the magic sees a
  complete header;
* others open it (named: ``O_NOFOLLOW`` and, up to ``open_timeout_s``, waiting for the file
  and its magic; anonymous: through the handle), check that it is a regular file owned by
  this user with mode 0600, validate the header, and pre-fault their own mapping too (page
  tables are per process; vLLM's openers do not);
* :meth:`~ECSharedRegion.pin_memory` page-locks the mapping for the GPU (``cuMemHostRegister``)
  where there is one -- each process registers its own mapping; elsewhere it says why not;
* :meth:`~ECSharedRegion.unlink` (creator, once every process has mapped the region): from
  then on nobody else can open it -- a named region loses its name, an anonymous one its
  creator's descriptor.  The mappings stay valid;
* :meth:`~ECSharedRegion.cleanup`: the creator unlinks, everyone unmaps.  A region dropped
  without it (the last reference gone) is unmapped by ``mmap``, and its descriptor -- which
  keeps an anonymous creator's memory alive -- and a named creator's file would stay until
  the process ends: they are given back then, with a ``ResourceWarning``, as an unclosed
  file does (:func:`vtnumba.memory.shared_files.release_when_dropped`).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtnumba.backend.address_ranges import register, unregister
from vtnumba.backend.arrays import check_int, dtype_labels, is_int, numeric_dtype
from vtnumba.memory.shared_files import (
    Leftovers,
    create_private_file,
    private_file_problem,
    release_when_dropped,
    unlink_private_file,
)

__all__ = ["ECRegionConfig", "ECRegionHandle", "ECSharedRegion", "ECRegionError", "create_ec_shared_region",
           "open_ec_shared_region", "region_path", "HEADER_BYTES", "block_id_array"]

HEADER_BYTES = 4096
_MAGIC = b"VTNUMBA-EC-v1\x00\x00\x00"  # 16 bytes, written last
# magic(16s) version(I) itemsize(I) hidden_size(Q) num_blocks(Q) block_size_bytes(Q) creator_pid(Q) dtype(32s)
_HEADER = struct.Struct("<16sIIQQQQ32s")
_VERSION = 1
# fullmatch, not match with "$": "$" also matches before a trailing newline, and a newline
# must never reach a file name.
_ENGINE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14

class ECRegionError(RuntimeError):
    """The region cannot be created or opened (already exists, missing, incomplete, not ours)."""


def region_path(engine_id: str) -> str:
    """The ``/dev/shm`` path of an engine's *named* region."""
    _check_engine_id(engine_id)
    return f"/dev/shm/vtnumba_ec_{engine_id}.mmap"


def _check_engine_id(engine_id) -> str:
    if not isinstance(engine_id, str) or not _ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"engine_id={engine_id!r} must be 1-128 characters of [A-Za-z0-9_.-] "
                         "(it becomes part of a file name)")
    return engine_id


def _numpy_dtype(dtype) -> np.dtype:
    from vtnumba.backend.dtype import DType

    if isinstance(dtype, DType):
        return dtype.to_numpy()
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        raise TypeError(f"dtype={dtype!r}: numpy has no bfloat16, so the host cannot reinterpret the region's "
                        "bytes as it; store bfloat16 embeddings as float16 or float32")
    return numeric_dtype("dtype", dtype, use="hold embeddings")


@dataclass(frozen=True)
class ECRegionHandle:
    """What another process needs to open an anonymous region: small, picklable, sent over MPI.

    ``pid``/``fd`` name the creator's descriptor (``/proc/<pid>/fd/<fd>``); ``dev``/``ino``
    identify the memory itself, so an opener can tell that the descriptor it reached is
    the one the creator meant (pids and descriptor numbers are reused).
    """

    engine_id: str  #: the region's engine id (its memfd is labelled ``vtnumba_ec_<engine_id>``)
    pid: int        #: the creator's process id
    fd: int         #: the creator's descriptor of the region
    dev: int        #: device number of the region's inode
    ino: int        #: inode number of the region

    @property
    def proc_path(self) -> str:
        """``/proc/<pid>/fd/<fd>``: the path an opener opens."""
        return f"/proc/{self.pid}/fd/{self.fd}"


@dataclass(frozen=True)
class ECRegionConfig:
    """What both sides must agree on.

    ``create=True`` makes the region (named by default, ``anonymous=True`` for one that never
    has a name); an opener either names the engine (a named region) or passes the
    creator's ``handle``.  ``region_bytes=None`` on an opener adopts the creator's size.
    """

    engine_id: str               #: names the region (its file, or its memfd's label)
    hidden_size: int             #: elements per row; one block holds one row
    dtype: Any = "float32"       #: the rows' dtype
    region_bytes: int | None = None  #: the creator's size; None on an opener adopts it
    create: bool = False         #: make the region (True) or open it (False)
    open_timeout_s: float = 0.0  #: named openers: how long to wait for the creator's file and header
    anonymous: bool = False      #: creators: memfd_create instead of a file in /dev/shm
    handle: ECRegionHandle | None = None  #: openers of an anonymous (or any) region: the creator's descriptor

    def __post_init__(self) -> None:
        _check_engine_id(self.engine_id)
        for flag in ("create", "anonymous"):  # ("no" is a true string: it would create a region)
            value = getattr(self, flag)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{flag}={value!r} must be True or False")
            object.__setattr__(self, flag, bool(value))
        check_int("hidden_size", self.hidden_size, min_value=1)
        object.__setattr__(self, "dtype", _numpy_dtype(self.dtype))
        if self.region_bytes is None:
            if self.create:
                raise ValueError("region_bytes=None: the creator must say how large the region is")
        else:
            check_int("region_bytes", self.region_bytes, min_value=0, max_value=MAX_REGION_BYTES)
        if isinstance(self.open_timeout_s, bool) or not isinstance(self.open_timeout_s, (int, float)) \
                or not 0 <= self.open_timeout_s < float("inf"):
            raise ValueError(f"open_timeout_s={self.open_timeout_s!r} must be a finite number of seconds >= 0")
        if self.handle is not None:
            if self.create:
                raise ValueError("handle= is for openers; a creator (create=True) makes its own region")
            if not isinstance(self.handle, ECRegionHandle):
                raise TypeError(f"handle must be an ECRegionHandle, got {type(self.handle).__name__}")
            if self.handle.engine_id != self.engine_id:
                raise ValueError(f"handle is for engine_id={self.handle.engine_id!r}, not {self.engine_id!r}")
        if self.anonymous and not self.create:
            raise ValueError("anonymous=True is for the creator; an opener of an anonymous region passes handle=")

    @property
    def block_size_bytes(self) -> int:
        """Bytes per block: one row of ``hidden_size`` x ``dtype``."""
        return int(self.hidden_size) * self.dtype.itemsize

    @property
    def num_blocks(self) -> int | None:
        """Blocks that fit in ``region_bytes`` (None when an opener adopts the creator's size)."""
        return None if self.region_bytes is None else int(self.region_bytes) // self.block_size_bytes


#: More than any machine's memory: region_bytes past it is refused where it is given.
MAX_REGION_BYTES = 1 << 60


def available_memory_bytes() -> int | None:
    """Memory the kernel could still give out (``MemAvailable`` + ``SwapFree`` of
    ``/proc/meminfo``), or None where that file is not there to read."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return None


def check_fits_in_memory(nbytes: float, what: str) -> None:
    """ValueError ``"WHAT: more than this machine has free ..."`` when ``nbytes`` exceed
    :func:`available_memory_bytes` -- a command line's check of a region size before anything
    is made (an anonymous region that large would be ended by the OOM killer, not refused)."""
    room = available_memory_bytes()
    if room is not None and nbytes > room:
        raise ValueError(f"{what}: more than this machine has free ({room / 2**20:.0f} MiB of memory and swap)")


def block_id_array(block_ids, what: str = "block_ids") -> np.ndarray:
    """``block_ids`` as a 1-D C-contiguous int64 array; TypeError unless they are a sequence
    of whole numbers (a ragged nested list is not), ValueError for a scalar, a regular
    multi-dimensional one or an id beyond int64.  (Not their range: see
    :meth:`ECSharedRegion.check_block_ids`.)"""
    try:
        raw = np.asarray(block_ids)
    except (TypeError, ValueError):
        raise TypeError(f"{what}={block_ids!r} must be a sequence of int block ids") from None
    if raw.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of block ids, got shape={raw.shape}")
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)  # np.asarray([]) is float64: an empty list is fine
    # Integer dtypes only: converting 1.7 to int64 would silently copy block 1.
    if raw.dtype.kind not in "iu" and not (raw.dtype == object and all(is_int(v) for v in raw)):
        raise TypeError(f"{what}={block_ids!r} must be whole-number int block ids, got dtype {raw.dtype}")
    # Ids past int64 (Python ints as dtype object, or uint64's top half) cannot be any region's
    # block: named here -- the conversion below was a bare OverflowError, or wrapped to negatives.
    kind = raw.dtype.kind
    if kind == "O" or (kind == "u" and raw.dtype.itemsize == 8):  # (signed ints, the usual case: nothing to do)
        beyond = [v for v in raw.tolist() if not _INT64_MIN <= v <= _INT64_MAX] if kind == "O" else \
            raw[raw > _INT64_MAX].tolist()
        if beyond:
            raise ValueError(f"{what} holds block id {beyond[0]}, outside any region's block ids (int64)")
    return np.ascontiguousarray(raw, dtype=np.int64)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_ownership(fd: int, what: str) -> os.stat_result:
    """Refuse memory that is not a regular file of this user with mode 0600.

    Anything else was not made by a vtnumba creator of this user: mapping it would let
    another user's process read (or write) our embeddings, or hand us theirs.
    """
    st = os.fstat(fd)
    problem = private_file_problem(st)
    if problem is not None:
        raise ECRegionError(f"{what} {problem}; refusing to map it")
    return st


class ECSharedRegion:
    """A mapped region; use :func:`create_ec_shared_region` to make or open one (see module docstring)."""

    def __init__(self, config: ECRegionConfig):
        self.config = config
        self.engine_id = config.engine_id
        self.anonymous = bool(config.anonymous or config.handle is not None)
        # Named regions have a path in /dev/shm; anonymous ones have none (that is the point).
        self.path: str | None = None if self.anonymous else region_path(config.engine_id)  #: None if anonymous
        self.dtype = config.dtype
        self.hidden_size = int(config.hidden_size)
        self.block_size_bytes = config.block_size_bytes
        self.is_creator = False
        self.is_pinned = False
        self.pin_status = "not requested"
        self._unpin: weakref.finalize | None = None  # undoes the registration (see pin_memory)
        self._unlinked = False
        # The workers copying to and from this mapping (ECWorker adds itself): cleanup lets
        # their copies in flight finish before it unmaps -- a threaded queue or a GPU's copy
        # engine still writing an unmapped page would crash the process.
        self._workers: weakref.WeakSet = weakref.WeakSet()
        # The descriptor, and a named creator's file: what dropping the region without
        # cleanup() would keep until the process ends (self._fd is the descriptor held there).
        self._left = Leftovers()
        self._mmap: mmap.mmap | None = None
        self._base: np.ndarray | None = None
        self.blocks: np.ndarray | None = None  #: the ``int8`` view ``[num_blocks, block_size_bytes]``
        self._base_ptr = 0
        self._range: weakref.finalize | None = None  # the blocks' live-range registration
        self.label = self.path or f"anonymous region vtnumba_ec_{config.engine_id}"
        release_when_dropped(self, self._left, self.label)
        try:
            if config.create:
                self._create(config)
            elif config.handle is not None:
                self._open_handle(config)
            else:
                self._open_named(config)
        except BaseException:
            # A half-made region must not leave its name behind.
            if self.is_creator:
                self.unlink()
            self._close_mapping()
            raise

    # ------------------------------------------------------------------ create / open
    def _create(self, config: ECRegionConfig) -> None:
        num_blocks = config.num_blocks
        if num_blocks < 1:
            raise ValueError(
                f"region_bytes={config.region_bytes} is smaller than one block: a block holds one row of "
                f"hidden_size={config.hidden_size} x {config.dtype.name} = {config.block_size_bytes} bytes; "
                f"expected region_bytes >= {config.block_size_bytes}")
        if self.anonymous:
            # No name anywhere: the memory is reachable only through this descriptor (and
            # the mappings made from it).  CLOEXEC: a child we exec must not inherit it.
            self._fd = os.memfd_create(f"vtnumba_ec_{config.engine_id}", os.MFD_CLOEXEC)
            self.is_creator = True
        else:
            try:
                # O_NOFOLLOW inside: a symlink planted under our name must not redirect the
                # create; the file is unlinked at exit if this process has not done it before.
                self._fd = create_private_file(self.path)
                self._left.path = self.path
            except FileExistsError:
                raise ECRegionError(
                    f"engine_id={config.engine_id!r}: {self.path} already exists -- another creator owns this "
                    "region (open it with create=False), or a killed run left it behind (remove the file)") from None
            self.is_creator = True
        os.fchmod(self._fd, 0o600)  # exact mode, whatever the umask (memfd starts at 0777)
        self.num_blocks = num_blocks
        total = HEADER_BYTES + num_blocks * self.block_size_bytes
        if self.anonymous:
            # A file in /dev/shm has a size limit (its tmpfs), so posix_fallocate below fails
            # cleanly there.  memfd memory has none: fallocate would take pages until the
            # kernel's OOM killer ends some process -- maybe this one, maybe another.
            room = available_memory_bytes()
            if room is not None and total > room:
                raise ECRegionError(f"region_bytes={config.region_bytes}: {total} bytes of shared memory for "
                                    f"{self.label} is more than this machine has free ({room} bytes of memory "
                                    "and swap); choose a smaller region")
        os.ftruncate(self._fd, total)
        try:
            # Reserve the memory now: a file in a full /dev/shm (a container's is often 64 MB)
            # would otherwise be mapped fine and then kill the process with SIGBUS at the
            # first page that has no room -- in the touch below, or in some later save.
            os.posix_fallocate(self._fd, 0, total)
        except OSError as exc:
            room = (f"{os.path.dirname(self.path)} has less room than that (a container's is often 64 MB: "
                    "docker run --shm-size), or create the region with anonymous=True") if self.path else \
                "this machine has less free memory than that"
            raise ECRegionError(f"region_bytes={config.region_bytes}: could not reserve {total} bytes of shared "
                                f"memory for {self.label}: {exc.strerror}; {room}") from None
        self._map(total)
        # Pre-fault every page now, so the first save does not pay a page fault per 4 KiB.
        if not self._prefault():
            self._base[:] = 0  # older kernels: touch the pages ourselves (the memory is new: zeros)
        # Header fields first, magic last: an opener that sees the magic sees all of it.
        self._mmap[:_HEADER.size] = _HEADER.pack(b"\x00" * 16, _VERSION, self.dtype.itemsize, self.hidden_size,
                                                 num_blocks, self.block_size_bytes, os.getpid(),
                                                 self.dtype.str.encode())
        self._mmap[:16] = _MAGIC

    def _open_named(self, config: ECRegionConfig) -> None:
        deadline = time.monotonic() + config.open_timeout_s
        while True:
            try:
                # O_NOFOLLOW: refuse a symlink under the region's name (it could point anywhere).
                self._fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise ECRegionError(
                        f"engine_id={config.engine_id!r}: {self.path} does not exist (waited "
                        f"{config.open_timeout_s:g} s); the creator (create=True) must create it first") from None
                time.sleep(0.005)
            except OSError as exc:
                raise ECRegionError(f"cannot open {self.path}: {exc.strerror} (a symlink is refused)") from None
        _check_ownership(self._fd, self.path)
        header = self._wait_for_header(deadline, config.open_timeout_s)
        self._adopt(config, header)

    def _open_handle(self, config: ECRegionConfig) -> None:
        h = config.handle
        what = f"{h.proc_path} (the creator's descriptor of region {config.engine_id!r})"
        try:
            # /proc/<pid>/fd/<n> is a "magic link" to the creator's open file, so O_NOFOLLOW
            # cannot apply here; the fstat checks below (same inode as announced, our user,
            # mode 0600) take its place.  The kernel allows it only within the same user.
            self._fd = os.open(h.proc_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ECRegionError(f"{what} does not exist: the creator (pid {h.pid}) exited or already stopped "
                                "sharing the region (it does once every consumer has mapped it)") from None
        except PermissionError:
            raise ECRegionError(f"{what}: permission denied -- only processes of the creator's user may open "
                                "its descriptors") from None
        st = _check_ownership(self._fd, what)
        if (st.st_dev, st.st_ino) != (h.dev, h.ino):
            raise ECRegionError(f"{what} is not the region the creator announced (inode {st.st_dev}:{st.st_ino}, "
                                f"expected {h.dev}:{h.ino}); the creator's pid or descriptor was reused")
        self.label = f"anonymous region vtnumba_ec_{config.engine_id} (creator pid {h.pid})"
        self._adopt(config, self._wait_for_header(time.monotonic(), 0.0))

    def _wait_for_header(self, deadline: float, waited_s: float) -> bytes:
        while True:
            size = os.fstat(self._fd).st_size
            if size >= HEADER_BYTES:
                header = os.pread(self._fd, _HEADER.size, 0)
                if header[:16] == _MAGIC:
                    return header
            if time.monotonic() >= deadline:
                raise ECRegionError(f"{self.label} has no complete header (size {size} bytes, waited "
                                    f"{waited_s:g} s); its creator has not finished creating it")
            time.sleep(0.005)

    def _adopt(self, config: ECRegionConfig, header: bytes) -> None:
        """Validate the creator's header against this side's config, then map."""
        _, version, itemsize, hidden, num_blocks, block_size, pid, dtype_str = _HEADER.unpack(header)
        if version != _VERSION:
            raise ECRegionError(f"{self.label} has header version {version}; this vtnumba reads version {_VERSION}")
        try:
            their_dtype = np.dtype(dtype_str.rstrip(b"\x00").decode())
        except (TypeError, UnicodeDecodeError):
            raise ECRegionError(f"{self.label} has an unreadable dtype in its header; it was not written by "
                                "vtnumba's ECSharedRegion") from None
        if itemsize != their_dtype.itemsize or block_size != hidden * itemsize:
            raise ECRegionError(f"{self.label} has an inconsistent header (itemsize {itemsize}, block {block_size} B "
                                f"for hidden_size {hidden}); it was not written by vtnumba's ECSharedRegion")
        if their_dtype != self.dtype or hidden != self.hidden_size:
            ours, theirs = dtype_labels(self.dtype, their_dtype)  # ('>f4' and '<f4' are both 'float32')
            raise ValueError(
                f"engine_id={config.engine_id!r}: this side expects dtype={ours}, "
                f"hidden_size={self.hidden_size} but the producer (pid {pid}) created the region with "
                f"dtype={theirs}, hidden_size={hidden}; both sides must use the same model config")
        if config.num_blocks is not None and config.num_blocks != num_blocks:
            raise ValueError(
                f"engine_id={config.engine_id!r}: region_bytes={config.region_bytes} gives {config.num_blocks} "
                f"blocks but the producer's region has {num_blocks}; pass region_bytes=None to adopt it")
        self.num_blocks = int(num_blocks)
        total = HEADER_BYTES + self.num_blocks * self.block_size_bytes
        if os.fstat(self._fd).st_size < total:
            raise ECRegionError(f"{self.label} is {os.fstat(self._fd).st_size} bytes; its header promises {total}")
        self._map(total)
        # Our page tables are our own: map the (already allocated) pages in now too, so the
        # first load is not slowed by a minor fault per page.  Populating does not change data.
        self._prefault()

    def _prefault(self) -> bool:
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, 0, len(self._mmap))
            return True
        except (OSError, ValueError, AttributeError):
            return False

    def _map(self, total: int) -> None:
        self._mmap = mmap.mmap(self._fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._base = np.frombuffer(self._mmap, dtype=np.int8)
        self.blocks = self._base[HEADER_BYTES:].reshape(self.num_blocks, self.block_size_bytes)
        # The address is asked for on every transfer; reading it through numpy's ctypes
        # helper costs a microsecond or so each time, and it never changes while mapped.
        self._base_ptr = int(self.blocks.ctypes.data)
        # The blocks are live memory for batched copies (which check every address they touch)
        # -- for as long as the mapping exists: a region dropped without cleanup() is unmapped
        # when the last view of it goes, and its range must go with it, or the copy engine
        # would pass an address that no longer maps to anything.
        token = register(self.blocks.ctypes.data, self.blocks.nbytes, f"encoder-cache {self.label}")
        self._range = weakref.finalize(self._mmap, unregister, token)

    # ------------------------------------------------------------------ properties
    @property
    def total_bytes(self) -> int:
        """Bytes in all blocks (the header not counted)."""
        return self.num_blocks * self.block_size_bytes

    @property
    def base_ptr(self) -> int:
        """Address of block 0 in *this* process (each process maps the memory elsewhere)."""
        if self.blocks is None:
            raise RuntimeError(f"{self.label} was cleaned up")
        return self._base_ptr

    @property
    def closed(self) -> bool:
        """Has this process unmapped the region (:meth:`cleanup`)?"""
        return self.blocks is None

    @property
    def handle(self) -> ECRegionHandle:
        """Creator only, until :meth:`unlink`: what another process of this user needs to open the region."""
        if not self.is_creator:
            raise RuntimeError(f"{self.label}: only the creator can hand out the region's handle")
        if self._unlinked or self._fd is None:
            raise RuntimeError(f"{self.label} is no longer shared (unlink() was called); nobody else can open it")
        st = os.fstat(self._fd)
        return ECRegionHandle(self.engine_id, os.getpid(), self._fd, st.st_dev, st.st_ino)

    def check_block_ids(self, block_ids, what: str = "block_ids") -> np.ndarray:
        """Return ``block_ids`` as an int64 array; refuse ids that are not whole numbers (TypeError)
        or lie outside ``0 .. num_blocks-1`` (ValueError)."""
        ids = block_id_array(block_ids, what)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise ValueError(f"{what} contains block id {bad}, outside the region's 0..{self.num_blocks - 1}")
        return ids

    # ------------------------------------------------------------------ GPU registration
    def pin_memory(self, backend=None) -> bool:
        """Page-lock the mapping for fast DMA where a real GPU is in use; return whether it is.

        Each process registers its own mapping (same physical pages, different virtual
        addresses), once.  Where the backend's memory is host memory already (the cpu
        target, the simulator) there is nothing to register: returns False and
        :attr:`pin_status` says so.
        """
        if self.closed:
            raise RuntimeError(f"pin_memory on {self.label} after cleanup")
        if self.is_pinned:
            return True
        if backend is None:
            from vtnumba.backend.default import default_backend

            backend = default_backend()
        if getattr(backend, "capabilities", None) is None:  # (what it asks of a Backend, so stand-ins work)
            raise TypeError(f"backend must be a vtnumba Backend or None, got {type(backend).__name__}")
        if backend.capabilities.host_addressable:
            self.pin_status = "no-op: no real GPU in use (cpu target or simulator), host memory needs no registration"
            return False
        from cuda.bindings import driver as cu

        from vtnumba.backend.cuda import current_context

        current_context()  # registration needs a current context (this process's GPU's)
        # PORTABLE: pinned for every context of this process, not only the current one (a
        # queue or a library may run in another).  The whole mapping, header included: it is
        # page-aligned (mmap), as registration wants.
        (err,) = cu.cuMemHostRegister(int(self._base.ctypes.data), int(self._base.nbytes),
                                      cu.CU_MEMHOSTREGISTER_PORTABLE)
        if err != cu.CUresult.CUDA_SUCCESS:
            # Still correct without it, only slower (pageable DMA through a bounce buffer).
            self.pin_status = f"cuMemHostRegister failed ({err}); transfers use pageable memory"
            warnings.warn(f"ECSharedRegion.pin_memory: {self.pin_status}", RuntimeWarning, stacklevel=2)
            return False
        self.is_pinned = True
        self.pin_status = f"registered {self._base.nbytes} bytes with cuMemHostRegister"
        # Registered pages must be unregistered before they are unmapped: a region dropped
        # without cleanup() would otherwise be unmapped (the mmap's deallocation) with the
        # driver still tracking the range -- a later mapping at that address would fail to
        # register, or worse.  The finalizer holds the mmap until it has run, so it always
        # runs first.  (Not at interpreter exit: the process's pages go with it anyway.)
        self._unpin = weakref.finalize(self, _unregister_pages, int(self._base.ctypes.data), self.label,
                                       self._mmap)
        self._unpin.atexit = False
        return True

    # ------------------------------------------------------------------ teardown
    def unlink(self) -> bool:
        """Creator only: from now on no other process can open the region (mappings stay valid).

        Named: the file's name is removed from /dev/shm.  Anonymous: the creator closes its
        descriptor, the only way in (``/proc/<pid>/fd/<fd>`` stops existing).  Idempotent;
        returns whether this call did it.
        """
        if not self.is_creator or self._unlinked:
            return False
        self._unlinked = True
        # (Each is taken out of the leftovers before it is closed or removed: an interrupt in
        # between then leaves it open, never a closed number that a later release -- the
        # finalizer's, another cleanup -- would close again, as someone else's by then.)
        if self.anonymous:
            fd, self._left.fd = self._left.fd, None
            if fd is not None:
                os.close(fd)
            return True
        self._left.path = None
        unlink_private_file(self.path)
        return True

    @property
    def _fd(self) -> int | None:
        return self._left.fd

    @_fd.setter
    def _fd(self, fd: int | None) -> None:
        self._left.fd = fd

    def _close_mapping(self) -> None:
        # Copies still in flight read or write the mapping: wait for them first.  A wait that
        # fails (a dead CUDA context, a queue's own error) has nothing left running behind it,
        # and if it stopped the teardown, every later cleanup would fail the same way and the
        # descriptor, the mapping and the locked pages would stay until the process exits:
        # the teardown goes on, and the first such error is raised at the end.
        failure = None
        for worker in list(self._workers):
            if not worker.backend.closed:  # (close() already drained every queue)
                try:
                    worker.wait()
                except Exception as exc:  # noqa: BLE001 - re-raised below, after the teardown
                    failure = failure or exc
        if self._range is not None:
            self._range()  # (unregisters now; a finalizer called by hand is detached)
            self._range = None
        if self._unpin is not None:
            self._unpin()  # (runs once: a finalizer called by hand is detached)
            self._unpin = None
            self.is_pinned = False
        self.blocks = None
        self._base = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # Someone still holds a numpy view of the blocks.  Unmapping now would leave
                # it pointing at nothing; instead the mapping is released when the last view
                # is garbage-collected (the mmap object is its base).
                warnings.warn(f"ECSharedRegion.cleanup: views of {self.label} are still alive; the mapping is "
                              "released when they are garbage-collected", ResourceWarning, stacklevel=3)
            self._mmap = None
        fd, self._left.fd = self._left.fd, None  # (out first: see unlink)
        if fd is not None:
            os.close(fd)
        if failure is not None:
            raise failure

    def cleanup(self) -> None:
        """The creator unlinks; every process unmaps -- once the copies its workers still have
        in flight have finished.  Safe to call twice."""
        # Unlink first: the name is what leaks, the mapping dies with the process anyway.
        if self.is_creator:
            self.unlink()
        self._close_mapping()

    close = cleanup

    def __enter__(self) -> "ECSharedRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        role = "creator" if self.is_creator else "opener"
        state = "closed" if self.closed else f"{self.num_blocks} x {self.block_size_bytes} B"
        return f"<ECSharedRegion {self.label} ({role}, {state}, {self.dtype.name} x {self.hidden_size})>"


def _unregister_pages(address: int, label: str, _mapping) -> None:
    """Undo :meth:`ECSharedRegion.pin_memory`'s ``cuMemHostRegister`` (``_mapping``: the mmap,
    kept alive by this call's arguments until the pages are unregistered)."""
    from cuda.bindings import driver as cu

    from vtnumba.backend.cuda import current_context

    current_context()  # cleanup may run on a thread that never touched the GPU
    (err,) = cu.cuMemHostUnregister(address)
    if err != cu.CUresult.CUDA_SUCCESS:
        # The pages stay locked until the process exits, and a later mapping at the same
        # address could not be registered: worth saying, not worth failing the cleanup.
        warnings.warn(f"{label}: cuMemHostUnregister failed ({err})", RuntimeWarning, stacklevel=2)


def create_ec_shared_region(config: ECRegionConfig | Mapping[str, Any] | None = None, **kwargs) -> ECSharedRegion:
    """Create (``create=True``) or open the region described by ``config``.

    ``config`` is an :class:`ECRegionConfig`, a mapping with its fields, or omitted in
    favour of keyword arguments: ``create_ec_shared_region(engine_id="e0", hidden_size=64,
    dtype="float16", region_bytes=1 << 20, create=True)``.
    """
    if config is None:
        config = ECRegionConfig(**kwargs)
    elif isinstance(config, Mapping):
        config = ECRegionConfig(**{**config, **kwargs})
    elif not isinstance(config, ECRegionConfig):
        raise TypeError(f"config must be an ECRegionConfig or a mapping, got {type(config).__name__}")
    elif kwargs:
        raise TypeError("pass either config or keyword arguments, not both")
    return ECSharedRegion(config)


def open_ec_shared_region(handle: ECRegionHandle, *, hidden_size: int, dtype="float32",
                          region_bytes: int | None = None) -> ECSharedRegion:
    """Open the region behind a creator's :attr:`~ECSharedRegion.handle` (this side's model config
    is checked against the creator's header)."""
    if not isinstance(handle, ECRegionHandle):
        raise TypeError(f"handle must be an ECRegionHandle, got {type(handle).__name__}")
    return ECSharedRegion(ECRegionConfig(engine_id=handle.engine_id, hidden_size=hidden_size, dtype=dtype,
                                         region_bytes=region_bytes, handle=handle))
