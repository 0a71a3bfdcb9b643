"""CUDA IPC: the peer-memory transport of the ``cuda`` target (real GPUs only).

Upstream concept (vLLM's TPSP workspace): each rank ``cudaMalloc``\\ s its buffer, exports a 64-byte
``cudaIpcMemHandle_t`` for it, the handles are allgathered, and every rank opens every
peer's handle (``cuIpcOpenMemHandle``) to get a device pointer it can pass to kernels.  A
kernel on rank 0 then loads and stores rank 1's memory directly (over NVLink or PCIe, with
peer access enabled lazily by ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``).

Four rules from the CUDA documentation shape the code:

* only a ``cuMemAlloc`` *allocation* can be exported, and the handle names the whole
  allocation: a buffer that starts inside one travels as (handle, offset, size), and the
  importer opens the handle and adds the offset;
* a process cannot open its own handle, and can open a given handle only once;
* ``cudaMalloc`` may carve small allocations out of one larger block, and IPC then shares
  that whole block (the CUDA Programming Guide's IPC section recommends sharing only
  allocations of a 2 MiB-aligned size): so an export allocates a multiple of
  :data:`IPC_ALLOCATION_BYTES` -- its own block, never one with this process's other memory
  in it -- and uses the first ``nbytes`` of it.  The flag areas are a few dozen bytes;
  without the padding a peer would map whatever else shares their block;
* the exporter must keep the allocation alive until every importer has called
  ``cuIpcCloseMemHandle`` (freeing earlier is undefined behaviour) -- hence the two
  barriers in :meth:`PeerBuffers.close`: everyone closes peers' memory, *then* everyone
  frees their own.

Why not numba's ``get_ipc_handle`` + pickle: with cuda-bindings 13.5 ``CUipcMemHandle``
became opaque (only ``getPtr()``), and numba-cuda 0.30.4 still reads ``.reserved`` when
pickling, so ``pickle.dumps(IpcArrayHandle)`` and ``open_ipc_array`` raise AttributeError.
We copy the 64 raw bytes out of the handle with
``ctypes.string_at(handle.getPtr(), 64)`` and back into a fresh handle with
``ctypes.memmove`` -- a format that depends on no Python library's pickling -- and open it
with numba's own ``IpcHandle.open_array`` (``source_info=None`` selects the direct path;
the "staged" path numba uses for non-peer devices would silently open a *copy*, which is
useless for shared memory).

This module imports ``cuda.bindings`` and ``numba.cuda`` lazily; it is only used when the
process target is ``cuda``.  It cannot run without a GPU; its tests are marked ``cuda``.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from vtnumba.backend.arrays import cdiv

IPC_HANDLE_BYTES = 64
#: The granularity of an exported allocation (the CUDA Programming Guide: share only
#: allocations of a 2 MiB-aligned size, or a small one may share its block with others).
IPC_ALLOCATION_BYTES = 2 << 20
_WIRE = struct.Struct("<4s64sQQ")  # magic, raw handle, offset into the allocation, size
_MAGIC = b"CIPC"


def _check(err, what: str) -> None:
    from cuda.bindings import driver as cu

    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


def ipc_allocation_bytes(nbytes: int) -> int:
    """What an export of ``nbytes`` allocates: ``nbytes`` rounded up to a whole, non-zero number
    of :data:`IPC_ALLOCATION_BYTES` (so the allocation is a block of its own)."""
    return max(cdiv(nbytes, IPC_ALLOCATION_BYTES), 1) * IPC_ALLOCATION_BYTES


class CudaIpcExport:
    """This rank's buffer of ``nbytes``, allocated through the backend (padded to
    :func:`ipc_allocation_bytes`) and exported as raw handle bytes."""

    def __init__(self, backend, nbytes: int):
        from cuda.bindings import driver as cu

        self.backend = backend
        self.nbytes = int(nbytes)
        self.buffer = backend.alloc(ipc_allocation_bytes(nbytes))
        ptr = int(self.buffer.ptr)
        err, base, _size = cu.cuMemGetAddressRange(cu.CUdeviceptr(ptr))
        _check(err, "cuMemGetAddressRange")
        err, handle = cu.cuIpcGetMemHandle(base)
        _check(err, "cuIpcGetMemHandle")
        raw = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
        self.handle_bytes = _WIRE.pack(_MAGIC, raw, ptr - int(base), nbytes)

    @property
    def array(self):
        """This rank's ``nbytes`` as a device ``uint8`` array (what its own kernels use); valid until :meth:`free`."""
        return self.buffer.array[:self.nbytes]

    def free(self) -> None:
        """Free the exported buffer (idempotent).

        Call it only after every peer has closed its import of it (see the module docstring).
        """
        if self.buffer is not None and not self.buffer.freed:
            self.backend.free(self.buffer)
        self.buffer = None


class CudaIpcImport:
    """A peer's buffer opened from its handle bytes: ``array`` is a device uint8 array of ``nbytes``."""

    def __init__(self, handle_bytes: bytes, nbytes: int):
        from cuda.bindings import driver as cu
        from numba.cuda.cudadrv.driver import IpcHandle

        from vtnumba.backend.cuda import current_context

        if len(handle_bytes) != _WIRE.size:
            raise ValueError(f"CUDA IPC handle message has {len(handle_bytes)} bytes, expected {_WIRE.size}")
        magic, raw, offset, size = _WIRE.unpack(handle_bytes)
        if magic != _MAGIC:
            raise ValueError(f"not a vtnumba CUDA IPC handle (magic {magic!r})")
        if size != nbytes:
            raise ValueError(f"peer buffer has {size} bytes, expected {nbytes}")
        handle = cu.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
        self._ipc = IpcHandle(None, handle, size, source_info=None, offset=offset)
        # open_array -> open_direct -> cuIpcOpenMemHandle(LAZY_ENABLE_PEER_ACCESS), then a view at offset
        self.array = self._ipc.open_array(current_context(), shape=(size,), dtype=np.dtype(np.uint8))

    def close(self) -> None:
        """Unmap the peer's buffer (``cuIpcCloseMemHandle``) and drop ``array``; idempotent."""
        if self._ipc is not None:
            from vtnumba.backend.cuda import current_context

            self.array = None  # drop the view before the mapping goes away
            ipc, self._ipc = self._ipc, None
            # cuIpcCloseMemHandle needs this process's context current on the calling thread,
            # which a teardown on a thread that never touched the GPU does not have.
            current_context()
            ipc.close()


__all__ = ["CudaIpcExport", "CudaIpcImport", "IPC_ALLOCATION_BYTES", "IPC_HANDLE_BYTES", "ipc_allocation_bytes"]
