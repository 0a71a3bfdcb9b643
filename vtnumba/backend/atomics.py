"""Acquire/release loads and stores on host memory shared between processes.

Why this module exists
----------------------
Peer signalling is "write the data, then raise a flag; the peer sees the flag, then reads
the data".  That is only correct if the *flag store* cannot become visible before the *data
stores*, and the peer's *data loads* cannot be satisfied before its *flag load*.

* On x86-64 (TSO) the hardware already keeps stores in order and loads in order, so plain
  numpy writes followed by a plain flag write would work -- but only by accident of the
  architecture.
* On AArch64 (and POWER) stores and loads can be reordered; a plain flag write can overtake
  the data.  C11 fixes this with a *release* store (everything before it is visible first)
  and an *acquire* load (nothing after it is performed before it).

Python has no memory-ordering primitives: ``threading`` locks order threads of one process,
not two processes that share an mmap; ``ctypes`` cannot express an atomic store.  numba is
already a dependency, so we emit the exact LLVM instructions ourselves: ``store atomic ...
release`` and ``load atomic ... acquire`` on an aligned int64.  On x86 they compile to a
plain ``mov`` (free); on Arm to ``stlr``/``ldar``.  An aligned 8-byte access is also
single-copy atomic, so a reader never sees half a counter.

Stores made by numpy (C code called from Python) on the same thread *before* the release
store are ordered by it: the release covers every earlier memory operation of the thread,
not just the ones in this module.  Work done on another thread (a threaded CPU queue) is
ordered first by the queue's own synchronisation (a mutex/condition), then by the release.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic


def _element_pointer(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)


@intrinsic
def _load_acquire_intrinsic(typingctx, arr, idx):
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, ordering="acquire", align=8)

    return sig, codegen


@intrinsic
def _store_release_intrinsic(typingctx, arr, idx, value):
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None
    sig = types.void(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(val, ptr, ordering="release", align=8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fence_intrinsic(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _load_acquire(arr, idx):
    return _load_acquire_intrinsic(arr, idx)


@njit(cache=True, nogil=True)
def _store_release(arr, idx, value):
    _store_release_intrinsic(arr, idx, value)


@njit(cache=True, nogil=True)
def _fence():
    _fence_intrinsic()


def _check(arr: np.ndarray, idx: int) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.ndim != 1:
        raise TypeError(f"flags must be a 1-D int64 numpy array, got {type(arr).__name__} "
                        f"{getattr(arr, 'dtype', None)} ndim={getattr(arr, 'ndim', None)}")
    if not 0 <= idx < arr.shape[0]:
        raise IndexError(f"flag index {idx} is out of range for {arr.shape[0]} flags")
    if arr.ctypes.data % 8:
        raise ValueError("flags must be 8-byte aligned for atomic access")


def load_acquire(arr: np.ndarray, idx: int) -> int:
    """Read ``arr[idx]`` with acquire ordering (later reads cannot move before it)."""
    _check(arr, idx)
    return int(_load_acquire(arr, idx))


def store_release(arr: np.ndarray, idx: int, value: int) -> None:
    """Write ``arr[idx] = value`` with release ordering (earlier writes become visible first)."""
    _check(arr, idx)
    _store_release(arr, idx, int(value))


def fence() -> None:
    """A full (sequentially consistent) memory fence."""
    _fence()


__all__ = ["load_acquire", "store_release", "fence"]
