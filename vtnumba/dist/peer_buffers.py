"""PeerBuffers: symmetric memory -- one buffer per rank, every rank can read and write all of them.

Upstream concept: the P2P workspace of vLLM's ``CudaTPSPBackend``.  Every rank of a group allocates a buffer of the same
size, exports a handle to it as raw bytes, allgathers the handles and opens every peer's;
after that ``pb.peer(j)`` on any rank is rank ``j``'s memory, usable by kernels of this
process's target without a copy:

======== ========================== ==================================================================
target   transport                  arrays handed out
======== ========================== ==================================================================
cpu      shared memory (``shm.py``) numpy views of the mmap
cudasim  shared memory (``shm.py``) ``FakeCUDAArray`` over those views (zero-copy in the simulator)
cuda     CUDA IPC (``cuda_ipc.py``) numba device arrays on the opened IPC mappings
======== ========================== ==================================================================

Construction is collective and *agreed* at every step that can fail on one rank only
(the sizes, the export, the opening of peers): each step ends with an exchange of error
messages over the group's control communicator, so either every rank continues or every
rank raises the same exception -- no rank is ever left waiting for a peer that gave up.
Failures that mean "this machine cannot do peer memory" raise :class:`PeerAccessError`
(a RuntimeError); :meth:`PeerBuffers.try_create` turns that into ``None`` on every rank
so callers fall back to MPI collectives.  Bad input (sizes that differ across ranks) stays
a ValueError.

Teardown follows vLLM's TPSP: ``close()`` = synchronize, barrier (nobody uses any buffer any
more), unmap/close peers' memory, barrier (nobody maps my memory any more), free my own.

Test hooks (to force a one-rank failure): the constructor's ``_fail_on_rank=<group rank>``
and ``_fail_stage="export"|"open"``, or the environment variables
``VTNUMBA_FAIL_PEER_OPEN=<group rank>`` / ``VTNUMBA_FAIL_PEER_EXPORT=<group rank>``.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from vtnumba.backend.arrays import address_of, check_shape, is_int
from vtnumba.backend.base import Backend, check_nbytes
from vtnumba.dist.comm import DEFAULT, agree_errors, allgather_bytes, barrier, check_group, resolve_timeout
from vtnumba.dist.shm import ShmSegment


def _address_or_none(arr) -> int | None:
    """``arr``'s address (host or device), or None for something that is not an array."""
    try:
        return address_of(arr)
    except (TypeError, ValueError):
        return None


class PeerAccessError(RuntimeError):
    """Peer buffers cannot be set up for this group (raised identically on every rank)."""


class _OpenFailed(PeerAccessError):
    """A rank could not open a peer's buffer: the next transport mode may still work."""


#: What each transport means, for messages: which target a rank runs on, and how it shares memory.
_TRANSPORT_WORDS = {"shm": "cpu (shared memory)", "shm-sim": "cudasim (shared memory seen as device arrays)",
                    "cuda_ipc": "cuda (CUDA IPC)"}


def _transport_kind(backend: Backend) -> str:
    caps = backend.capabilities
    if caps.kernel_arrays == "numpy":
        return "shm"
    if caps.host_addressable:  # numba's simulator: "device" memory is host memory
        return "shm-sim"
    return "cuda_ipc"


def _env_rank(var: str) -> int | None:
    value = os.environ.get(var)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{var}={value!r} must be a group rank (an int)") from None


class PeerBuffers:
    """Symmetric peer memory of ``nbytes`` per rank over ``group`` (collective; see module docstring).

    ``backend`` defaults to :func:`vtnumba.default_backend`.  Index arrays by *group* rank.
    """

    def __init__(self, nbytes: int, group, backend: Backend | None = None, *,
                 timeout_s: float = DEFAULT, _fail_on_rank: int | None = None,
                 _fail_stage: str = "open"):
        check_group(group)
        if backend is None:
            from vtnumba.backend.default import default_backend

            backend = default_backend()
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a vtnumba Backend, got {type(backend).__name__}")
        if backend.closed:
            raise RuntimeError(f"backend {backend.name} on {backend.device} was closed; make a new backend")
        if _fail_stage not in ("export", "open"):
            raise ValueError(f"_fail_stage={_fail_stage!r} must be 'export' or 'open'")
        self.group = group
        self.backend = backend
        self.timeout_s = timeout_s = resolve_timeout(timeout_s)
        self.kind = _transport_kind(backend)
        self.nbytes = 0
        self._closed = True  # until construction completes
        self._local = None
        self._peers: list = []
        self._export = None       # ShmSegment or CudaIpcExport
        self._imports: list = []  # ShmSegment or CudaIpcImport, for peers
        self._queue = None
        self._view_cache: dict = {}
        self._local_address: int | None = None

        fail_export = _env_rank("VTNUMBA_FAIL_PEER_EXPORT")
        fail_open = _env_rank("VTNUMBA_FAIL_PEER_OPEN")
        if _fail_on_rank is not None:
            if _fail_stage == "export":
                fail_export = _fail_on_rank
            else:
                fail_open = _fail_on_rank

        # 1. Sizes: validated locally, then compared across ranks (same error everywhere).
        err = None
        try:
            nbytes = check_nbytes("nbytes", nbytes, allow_zero=False)
        except (TypeError, ValueError) as exc:
            err, nbytes = exc, -1
        agree_errors(err, group, context="PeerBuffers", timeout_s=timeout_s)
        # The transport goes along with the size: ranks on different targets (a rank whose
        # 'auto' found no usable GPU beside ranks on one) could not open each other's handles,
        # and would fail in ways that say less -- or wait for a retry their peers never make.
        mine = struct.pack("<q", nbytes) + self.kind.encode()
        everyone = [(struct.unpack("<q", b[:8])[0], b[8:].decode()) for b in allgather_bytes(mine, group, timeout_s)]
        kinds = [k for _, k in everyone]
        if len(set(kinds)) != 1:
            each = ", ".join(f"rank {r}: {_TRANSPORT_WORDS.get(k, k)}" for r, k in enumerate(kinds))
            raise ValueError(f"PeerBuffers: the ranks of group {group.name!r} run on different targets, whose memory "
                             f"cannot be shared ({each}); run every rank on the same target (vtnumba info says each "
                             "one's, and why)")
        sizes = [n for n, _ in everyone]
        if len(set(sizes)) != 1:
            raise ValueError(f"PeerBuffers(nbytes=...) must be the same on every rank of group {group.name!r}; got "
                             + ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes)))
        self.nbytes = nbytes

        # 2. Peer access is a property of the group, identical on every rank.
        if not group.peer_access:
            raise PeerAccessError(
                f"group {group.name!r} (world ranks {group.world_ranks}) spans more than one node, so its ranks "
                "cannot map each other's memory; use the MPI collectives (mpi_reduce_scatter / mpi_all_gather)")

        # 3-5. Export, exchange handles, open every peer's buffer.  Host memory is tried as
        #      anonymous segments first (no name that could leak, see dist.shm); if a rank
        #      cannot open a peer's /proc/<pid>/fd (a sandbox without a shared procfs), every
        #      rank learns it from the agreement and all retry with named /dev/shm segments.
        modes = ["ipc"] if self.kind == "cuda_ipc" else ["anonymous", "named"]
        for attempt, mode in enumerate(modes):
            try:
                self._setup(mode, nbytes, fail_export, fail_open)
                break
            except _OpenFailed as exc:  # identical on every rank (it comes out of an agreement)
                if attempt == len(modes) - 1:
                    raise PeerAccessError(str(exc)) from exc
        self._closed = False

    def _setup(self, mode: str, nbytes: int, fail_export, fail_open) -> None:
        group, timeout_s = self.group, self.timeout_s
        # Export my buffer.
        err, handle = None, b""
        try:
            if fail_export == group.rank:
                raise PeerAccessError(f"forced export failure on group rank {group.rank} (test hook)")
            handle = self._export_local(nbytes, named=mode == "named")
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            err = exc
        try:
            agree_errors(err, group, context="PeerBuffers export", exc_type=PeerAccessError, timeout_s=timeout_s)
        except BaseException:
            self._release_local()
            raise

        # Exchange handles (raw bytes) and open every peer's buffer.
        handles = allgather_bytes(handle, group, timeout_s)
        err = None
        try:
            if fail_open == group.rank:
                raise PeerAccessError(f"forced failure opening peer buffers on group rank {group.rank} (test hook)")
            self._open_peers(handles, nbytes)
        except Exception as exc:  # noqa: BLE001
            err = exc
        try:
            agree_errors(err, group, context="PeerBuffers open", exc_type=_OpenFailed, timeout_s=timeout_s)
        except BaseException as open_error:
            # Undo in the safe order: close peers' memory, wait until every rank did, free mine.
            # (An unmap that fails too must not keep this rank from the barrier, nor its memory
            # from being freed: the open's error is the one raised, and says so.)
            try:
                self._close_peers()
            except Exception as unmap_error:
                open_error.add_note(f"unmapping the peers' memory afterwards failed too: {unmap_error!r}")
            try:
                barrier(group, timeout_s)
            finally:
                self._release_local()
            raise

        # The agreement above completed on every rank, so every peer has mapped my segment:
        # nobody needs to open it again -- close its descriptor or remove its name.  From here
        # on a crash cannot leak anything.
        if isinstance(self._export, ShmSegment):
            self._export.unlink()

    # ------------------------------------------------------------------ construction helpers
    def _wrap(self, host: np.ndarray):
        if self.kind == "shm-sim":
            from vtnumba.backend.cuda import fake_device_array

            return fake_device_array(host)
        return host

    def _export_local(self, nbytes: int, *, named: bool) -> bytes:
        if self.kind == "cuda_ipc":
            from vtnumba.dist.cuda_ipc import CudaIpcExport

            try:
                self._export = CudaIpcExport(self.backend, nbytes)
            except Exception as exc:  # an out-of-memory error does not say how much was asked for
                raise PeerAccessError(f"could not allocate and export {nbytes} bytes of device memory for "
                                      f"PeerBuffers: {exc}") from exc
            self._local = self._export.array
            return self._export.handle_bytes
        self._export = ShmSegment.create(nbytes, tag=f"pb{self.group.rank}", named=named)
        self._local = self._wrap(self._export.array)
        return self._export.handle.encode()

    def _open_peers(self, handles: list[bytes], nbytes: int) -> None:
        peers = []
        for j, h in enumerate(handles):
            if j == self.group.rank:
                peers.append(self._local)
                continue
            if self.kind == "cuda_ipc":
                from vtnumba.dist.cuda_ipc import CudaIpcImport

                imp = CudaIpcImport(h, nbytes)
                self._imports.append(imp)
                peers.append(imp.array)
            else:
                seg = ShmSegment.attach(h.decode(), nbytes)
                self._imports.append(seg)
                peers.append(self._wrap(seg.array))
        self._peers = peers

    def _close_peers(self) -> None:
        """Unmap every peer's memory; if an unmap fails, the others are still unmapped, and the
        first error is raised after them."""
        self._peers = []
        self._view_cache = {}
        imports, self._imports = self._imports, []
        first_error = None
        for imp in imports:
            try:
                imp.close()
            except Exception as exc:  # (not BaseException: an interrupt stops the teardown here)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def _release_local(self) -> None:
        self._local = None
        self._local_address = None
        exp, self._export = self._export, None
        if exp is None:
            return
        if isinstance(exp, ShmSegment):
            exp.close()  # also unlinks if still linked
        else:
            exp.free()

    # ------------------------------------------------------------------ public API
    @classmethod
    def try_create(cls, nbytes: int, group, backend: Backend | None = None, *, why: list | None = None,
                   **kwargs) -> "PeerBuffers | None":
        """Like the constructor, but ``None`` on every rank when peer memory is unavailable.

        All ranks agree: if any rank cannot export or open, or the group spans nodes, every
        rank gets ``None`` (and falls back to MPI collectives).  Bad input still raises.
        ``why``, a list, receives the reason (the same on every rank), for a caller's message.
        """
        try:
            return cls(nbytes, group, backend, **kwargs)
        except PeerAccessError as exc:
            if why is not None:
                why.append(str(exc))
            return None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run; the buffers must not be used after that (most methods raise)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"PeerBuffers on group {self.group.name!r} is closed")

    @property
    def local(self):
        """This rank's buffer, a flat uint8 array of ``nbytes`` (the target's array type)."""
        self._check_open()
        return self._local

    def peer(self, rank: int):
        """Group rank ``rank``'s buffer as a flat uint8 array (``peer(self.group.rank)`` is ``local``)."""
        self._check_open()
        if not is_int(rank) or not 0 <= rank < self.group.size:
            raise ValueError(f"rank={rank!r} must be a group rank in 0..{self.group.size - 1} "
                             f"of group {self.group.name!r}")
        return self._peers[int(rank)]

    def views(self, dtype, shape, offset: int = 0) -> list:
        """One typed view per rank (index = group rank) of ``shape`` elements at byte ``offset``.

        The list is fresh on every call (callers may replace entries); the arrays of recent
        layouts are cached, because collectives ask for the same layout every step.
        """
        self._check_open()
        key = (dtype, shape if isinstance(shape, (int, tuple)) else tuple(shape), offset)
        try:
            cached = self._view_cache.get(key)
        except TypeError:  # an unhashable dtype spec: just build the views
            cached = None
        if cached is not None:
            return list(cached)
        made = self._make_views(dtype, shape, offset)
        try:
            if len(self._view_cache) >= 32:
                self._view_cache.clear()
            self._view_cache[key] = made
        except TypeError:
            pass
        return list(made)

    def _make_views(self, dtype, shape, offset: int) -> list:
        dtype = np.dtype(dtype)
        if dtype.hasobject or dtype.itemsize == 0:
            raise TypeError(f"dtype={dtype} cannot view shared memory; expected a numeric dtype such as float32")
        offset = check_nbytes("offset", offset)
        shape = check_shape("shape", shape)  # (2.7 is refused, not truncated to 2)
        if offset % dtype.itemsize:
            raise ValueError(f"offset={offset} is not a multiple of {dtype.name}'s itemsize {dtype.itemsize}")
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + need > self.nbytes:
            raise ValueError(f"views(shape={shape}, dtype={dtype.name}, offset={offset}) need {offset + need} bytes "
                             f"but the peer buffers have nbytes={self.nbytes}")
        return [p[offset:offset + need].view(dtype).reshape(shape) for p in self._peers]

    def is_local_view(self, arr, offset: int = 0) -> bool:
        """Does ``arr`` start exactly at byte ``offset`` of this rank's buffer?

        The collectives use it to skip staging copies when a producer already wrote its
        data into the peer buffer.
        """
        self._check_open()
        if self._local_address is None:  # once: the mapping never moves while open
            self._local_address = _address_or_none(self._local)
        a = _address_or_none(arr)
        return a is not None and self._local_address is not None and a == self._local_address + offset

    @property
    def queue(self):
        """A queue of ``backend`` owned by these buffers (created on first use, destroyed by close)."""
        self._check_open()
        if self._queue is None:
            self._queue = self.backend.create_queue(f"peer:{self.group.name}")
        return self._queue

    def close(self) -> None:
        """Collective teardown: synchronize, barrier, unmap peers, barrier, free.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue is not None:
                q, self._queue = self._queue, None
                self.backend.destroy_queue(q)  # waits for its work
            self.backend.synchronize()  # any other queue may still touch the buffers
        finally:
            try:
                if not getattr(self.group, "freed", False):
                    barrier(self.group, self.timeout_s)  # nobody reads or writes any buffer any more
                    try:
                        self._close_peers()
                    finally:
                        # Reached even when an unmap failed: the peers must not wait here for a
                        # rank that will never come (the error is raised after the barrier).
                        barrier(self.group, self.timeout_s)  # nobody maps my memory any more
                # else: destroy_distributed() already ran, so the ranks cannot coordinate any
                # more; releasing our own mappings is all that is left (the shm names are long
                # gone, so nothing leaks either way).
            finally:
                self._close_peers()
                self._release_local()

    def __enter__(self) -> "PeerBuffers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<PeerBuffers {self.nbytes} B x {self.group.size} ranks on group {self.group.name!r} "
                f"via {self.kind} ({state})>")


__all__ = ["PeerBuffers", "PeerAccessError"]
