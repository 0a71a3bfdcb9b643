"""The shared region: a block-structured file in ``/dev/shm`` that producer and consumer both map.

Seed: ``ECSharedRegion`` and ``create_ec_shared_region`` in vLLM's CPU encoder-cache
connector.  An encoder process (producer) writes encoder outputs into the region; a
prefill process (consumer) on the same machine reads them back.  Both map the *same*
file, so a write by one is a read by the other with no copy in between.

Layout: ``/dev/shm/vtnumba_ec_<engine_id>.mmap``, mode 0600, mapped ``MAP_SHARED``::

    [ header: 4096 bytes ][ block 0 ][ block 1 ] ... [ block num_blocks-1 ]

One block holds one token's embedding row: ``block_size_bytes = hidden_size * itemsize``,
``num_blocks = region_bytes // block_size_bytes``.  :attr:`ECSharedRegion.blocks` is the
``int8`` view ``[num_blocks, block_size_bytes]``.  The header (the seed has none; this is
our addition) records dtype, hidden size and block count, so a consumer configured
differently from its producer fails at open time with a clear message instead of
reinterpreting the wrong bytes.  The blocks start one page in, so they stay page-aligned.

Lifecycle:

* the *creator* opens with ``O_CREAT | O_EXCL`` (a second creator for the same engine id
  is refused), sizes the file, pre-faults every page (``MADV_POPULATE_WRITE``, so the
  first real copy does not pay for page faults), and writes the header's magic *last*:
  an opener that sees the magic sees a complete header;
* others open the existing file, wait (up to ``open_timeout_s``) for the magic, validate,
  and pre-fault their own mapping too (page tables are per process; the seed does not);
* :meth:`~ECSharedRegion.pin_memory` page-locks the mapping for the GPU (``cuMemHostRegister``)
  where there is one -- each process registers its own mapping; elsewhere it says why not;
* :meth:`~ECSharedRegion.cleanup`: the creator unlinks the name, everyone unmaps.  Because
  a mapping outlives its name, the creator may also :meth:`~ECSharedRegion.unlink` early,
  once every process has mapped the region -- then even a killed process leaves nothing
  behind in ``/dev/shm``.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtnumba.backend.address_ranges import register, unregister

__all__ = ["ECRegionConfig", "ECSharedRegion", "ECRegionError", "create_ec_shared_region", "region_path",
           "HEADER_BYTES"]

HEADER_BYTES = 4096
_MAGIC = b"VTNUMBA-EC-v1\x00\x00\x00"  # 16 bytes, written last
# magic(16s) version(I) itemsize(I) hidden_size(Q) num_blocks(Q) block_size_bytes(Q) creator_pid(Q) dtype(32s)
_HEADER = struct.Struct("<16sIIQQQQ32s")
_VERSION = 1
_ENGINE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


class ECRegionError(RuntimeError):
    """The region cannot be created or opened (already exists, missing, incomplete)."""


def region_path(engine_id: str) -> str:
    """The ``/dev/shm`` path of an engine's region."""
    _check_engine_id(engine_id)
    return f"/dev/shm/vtnumba_ec_{engine_id}.mmap"


def _check_engine_id(engine_id) -> str:
    if not isinstance(engine_id, str) or not _ENGINE_ID.match(engine_id):
        raise ValueError(f"engine_id={engine_id!r} must be 1-128 characters of [A-Za-z0-9_.-] "
                         "(it becomes part of a file name in /dev/shm)")
    return engine_id


def _numpy_dtype(dtype) -> np.dtype:
    from vtnumba.backend.dtype import DType

    if isinstance(dtype, DType):
        return dtype.to_numpy()
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        raise TypeError(f"dtype={dtype!r}: numpy has no bfloat16, so the host cannot reinterpret the region's "
                        "bytes as it; store bfloat16 embeddings as float16 or float32")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype={dtype!r} is not a numpy dtype; expected e.g. 'float16' or 'float32'") from None
    if dt.hasobject or dt.itemsize == 0:
        raise TypeError(f"dtype={dt} cannot live in shared memory; expected a fixed-size numeric dtype")
    return dt


@dataclass(frozen=True)
class ECRegionConfig:
    """What both sides must agree on.  ``region_bytes=None`` on an opener adopts the creator's."""

    engine_id: str
    hidden_size: int
    dtype: Any = "float32"
    region_bytes: int | None = None
    create: bool = False
    open_timeout_s: float = 0.0  # openers: how long to wait for the creator's file and header

    def __post_init__(self) -> None:
        _check_engine_id(self.engine_id)
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, (int, np.integer)) \
                or self.hidden_size <= 0:
            raise ValueError(f"hidden_size={self.hidden_size!r} must be a positive int")
        object.__setattr__(self, "dtype", _numpy_dtype(self.dtype))
        if self.region_bytes is None:
            if self.create:
                raise ValueError("region_bytes=None: the creator must say how large the region is")
        elif isinstance(self.region_bytes, bool) or not isinstance(self.region_bytes, (int, np.integer)) \
                or self.region_bytes < 0:
            raise ValueError(f"region_bytes={self.region_bytes!r} must be a non-negative int")
        if self.open_timeout_s < 0:
            raise ValueError(f"open_timeout_s={self.open_timeout_s} must be >= 0")

    @property
    def block_size_bytes(self) -> int:
        return int(self.hidden_size) * self.dtype.itemsize

    @property
    def num_blocks(self) -> int | None:
        return None if self.region_bytes is None else int(self.region_bytes) // self.block_size_bytes


class ECSharedRegion:
    """A mapped region; use :func:`create_ec_shared_region` to make one (see module docstring)."""

    def __init__(self, config: ECRegionConfig):
        self.config = config
        self.engine_id = config.engine_id
        self.path = region_path(config.engine_id)
        self.dtype = config.dtype
        self.hidden_size = int(config.hidden_size)
        self.block_size_bytes = config.block_size_bytes
        self.is_creator = False
        self.is_pinned = False
        self.pin_status = "not requested"
        self._unlinked = False
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        self._base: np.ndarray | None = None
        self.blocks: np.ndarray | None = None
        self._range: int | None = None
        try:
            if config.create:
                self._create(config)
            else:
                self._open(config)
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
        try:
            self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise ECRegionError(
                f"engine_id={config.engine_id!r}: {self.path} already exists -- another creator owns this "
                "region (open it with create=False), or a crashed run left it behind (remove the file)") from None
        self.is_creator = True
        os.fchmod(self._fd, 0o600)  # exact mode, whatever the umask
        self.num_blocks = num_blocks
        total = HEADER_BYTES + num_blocks * self.block_size_bytes
        os.ftruncate(self._fd, total)
        self._map(total)
        # Pre-fault every page now, so the first save does not pay a page fault per 4 KiB.
        if not self._prefault():
            self._base[:] = 0  # older kernels: touch the pages ourselves (the file is new: zeros)
        # Header fields first, magic last: an opener that sees the magic sees all of it.
        self._mmap[:_HEADER.size] = _HEADER.pack(b"\x00" * 16, _VERSION, self.dtype.itemsize, self.hidden_size,
                                                 num_blocks, self.block_size_bytes, os.getpid(),
                                                 self.dtype.str.encode())
        self._mmap[:16] = _MAGIC

    def _open(self, config: ECRegionConfig) -> None:
        deadline = time.monotonic() + config.open_timeout_s
        while True:
            try:
                self._fd = os.open(self.path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise ECRegionError(
                        f"engine_id={config.engine_id!r}: {self.path} does not exist (waited "
                        f"{config.open_timeout_s:g} s); the creator (create=True) must create it first") from None
                time.sleep(0.005)
        while True:
            size = os.fstat(self._fd).st_size
            if size >= HEADER_BYTES:
                header = os.pread(self._fd, _HEADER.size, 0)
                if header[:16] == _MAGIC:
                    break
            if time.monotonic() >= deadline:
                raise ECRegionError(f"{self.path} has no complete header (size {size} bytes, waited "
                                    f"{config.open_timeout_s:g} s); its creator has not finished creating it")
            time.sleep(0.005)
        _, version, itemsize, hidden, num_blocks, block_size, pid, dtype_str = _HEADER.unpack(header)
        their_dtype = np.dtype(dtype_str.rstrip(b"\x00").decode())
        if version != _VERSION:
            raise ECRegionError(f"{self.path} has header version {version}; this vtnumba reads version {_VERSION}")
        if itemsize != their_dtype.itemsize or block_size != hidden * itemsize:
            raise ECRegionError(f"{self.path} has an inconsistent header (itemsize {itemsize}, block {block_size} B "
                                f"for hidden_size {hidden}); it was not written by vtnumba's ECSharedRegion")
        if their_dtype != self.dtype or hidden != self.hidden_size:
            raise ValueError(
                f"engine_id={config.engine_id!r}: this side expects dtype={self.dtype.name}, "
                f"hidden_size={self.hidden_size} but the producer (pid {pid}) created the region with "
                f"dtype={their_dtype.name}, hidden_size={hidden}; both sides must use the same model config")
        if config.num_blocks is not None and config.num_blocks != num_blocks:
            raise ValueError(
                f"engine_id={config.engine_id!r}: region_bytes={config.region_bytes} gives {config.num_blocks} "
                f"blocks but the producer's region has {num_blocks}; pass region_bytes=None to adopt it")
        self.num_blocks = int(num_blocks)
        total = HEADER_BYTES + self.num_blocks * self.block_size_bytes
        if os.fstat(self._fd).st_size < total:
            raise ECRegionError(f"{self.path} is {os.fstat(self._fd).st_size} bytes; its header promises {total}")
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
        # The blocks are live memory for batched copies (which check every address they touch).
        self._range = register(self.blocks.ctypes.data, self.blocks.nbytes, f"encoder-cache region {self.path}")

    # ------------------------------------------------------------------ properties
    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_size_bytes

    @property
    def base_ptr(self) -> int:
        """Address of block 0 in *this* process (each process maps the file elsewhere)."""
        if self.blocks is None:
            raise RuntimeError(f"region {self.path} was cleaned up")
        return int(self.blocks.ctypes.data)

    @property
    def closed(self) -> bool:
        return self.blocks is None

    def check_block_ids(self, block_ids, what: str = "block_ids") -> np.ndarray:
        """Return ``block_ids`` as an int64 array; ValueError if any lies outside ``0 .. num_blocks-1``."""
        try:
            ids = np.asarray(block_ids, dtype=np.int64)
        except (TypeError, ValueError):
            raise TypeError(f"{what}={block_ids!r} must be a sequence of int block ids") from None
        if ids.ndim != 1:
            raise ValueError(f"{what} must be a flat sequence of block ids, got shape={ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise ValueError(f"{what} contains block id {bad}, outside the region's 0..{self.num_blocks - 1}")
        return ids

    # ------------------------------------------------------------------ GPU registration
    def pin_memory(self, backend=None) -> bool:
        """Page-lock the mapping for fast DMA where a real GPU is in use; return whether it is.

        Each process registers its own mapping (same physical pages, different virtual
        addresses), once.  On the cpu target and in the simulator there is nothing to
        register: returns False and :attr:`pin_status` says so.
        """
        if self.closed:
            raise RuntimeError(f"pin_memory on region {self.path} after cleanup")
        if self.is_pinned:
            return True
        from vtnumba.backend.device import DeviceType

        if backend is None:
            from vtnumba.target import current_target

            on_gpu = current_target().name == "cuda"
        else:
            on_gpu = backend.device_type is DeviceType.CUDA and not getattr(backend, "simulator", False)
        if not on_gpu:
            self.pin_status = "no-op: no real GPU in use (cpu target or simulator), host memory needs no registration"
            return False
        from cuda.bindings import driver as cu
        from numba import cuda

        cuda.current_context()  # registration needs a current context
        (err,) = cu.cuMemHostRegister(int(self._base.ctypes.data), int(self._base.nbytes), 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            # Still correct without it, only slower (pageable DMA through a bounce buffer).
            self.pin_status = f"cuMemHostRegister failed ({err}); transfers use pageable memory"
            warnings.warn(f"ECSharedRegion.pin_memory: {self.pin_status}", RuntimeWarning, stacklevel=2)
            return False
        self.is_pinned = True
        self.pin_status = f"registered {self._base.nbytes} bytes with cuMemHostRegister"
        return True

    # ------------------------------------------------------------------ teardown
    def unlink(self) -> bool:
        """Creator only: remove the name from /dev/shm now (mappings stay valid).  Idempotent."""
        if not self.is_creator or self._unlinked:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._unlinked = True
        return True

    def _close_mapping(self) -> None:
        if self._range is not None:
            unregister(self._range)
            self._range = None
        if self.is_pinned and self._base is not None:
            from cuda.bindings import driver as cu

            cu.cuMemHostUnregister(int(self._base.ctypes.data))
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
                warnings.warn(f"ECSharedRegion.cleanup: views of {self.path} are still alive; the mapping is "
                              "released when they are garbage-collected", ResourceWarning, stacklevel=3)
            self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def cleanup(self) -> None:
        """The creator unlinks the file; every process unmaps.  Safe to call twice."""
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
        return f"<ECSharedRegion {self.path} ({role}, {state}, {self.dtype.name} x {self.hidden_size})>"


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
