"""Acquire/release loads and stores on host memory shared between processes or threads.

Why this module exists
----------------------
Signalling between ranks (and between a host thread and a queue's worker thread) is
"write the data, then raise a flag; the other side sees the flag, then reads the data".
That is only correct if the *flag store* cannot become visible before the *data stores*,
and the reader's *data loads* cannot be satisfied before its *flag load*.

* On x86-64 (TSO) the hardware already keeps stores in order and loads in order, so plain
  numpy writes followed by a plain flag write would work -- but only by accident of the
  architecture.
* On AArch64 (and POWER) stores and loads can be reordered; a plain flag write can overtake
  the data.  C11 fixes this with a *release* store (everything before it is visible first)
  and an *acquire* load (nothing after it is performed before it).

Python has no memory-ordering primitives: ``threading`` locks order threads of one process,
not two processes that share an mmap; ``ctypes`` cannot express an atomic store.  numba is
already a dependency, so we emit the exact LLVM instructions ourselves: ``store atomic ...
release`` and ``load atomic ... acquire`` on an aligned integer word.  On x86 they compile
to a plain ``mov`` (free); on Arm to ``stlr``/``ldar``.  An aligned 4- or 8-byte access is
also single-copy atomic, so a reader never sees half a counter.

Two word sizes are supported: 64-bit words (``int64``/``uint64``, the host-side epoch flags
of :class:`vtnumba.dist.PeerSignals`) and 32-bit words (``int32``/``uint32``, the flags that
queues raise and wait for, :meth:`vtnumba.backend.Backend.write_value32` -- 32 bits because
that is what a GPU's stream memory operations write).

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

from vtnumba.backend.arrays import is_int

#: The element types whose words can be loaded and stored atomically here.
WORD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64), np.dtype(np.uint64))
_WORD_TYPES = (types.int32, types.uint32, types.int64, types.uint64)


def _element_pointer(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)


def _is_word_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in _WORD_TYPES


@intrinsic
def _load_acquire_intrinsic(typingctx, arr, idx):
    if not _is_word_array(arr):
        return None
    sig = arr.dtype(arr, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, ordering="acquire", align=signature.args[0].dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def _store_release_intrinsic(typingctx, arr, idx, value):
    if not _is_word_array(arr):
        return None
    sig = types.void(arr, types.intp, arr.dtype)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], args[1])
        builder.store_atomic(args[2], ptr, ordering="release", align=arrty.dtype.bitwidth // 8)
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


_I32, _U32, _I64, _U64 = WORD_DTYPES


def _check(arr, idx) -> None:
    if type(arr) is np.ndarray and type(idx) is int:
        dt = arr.dtype
        # The usual call -- a flag word of a numpy array, a Python int index -- decided by
        # identity (numpy hands out one dtype object per builtin type) and a few reads: it
        # runs at every flag poll and store.  Anything else goes through the checks below.
        if ((dt is _U32 or dt is _I64 or dt is _U64 or dt is _I32) and arr.ndim == 1 and 0 <= idx < arr.shape[0]
                and arr.strides[0] == dt.itemsize and arr.flags.aligned and dt.alignment == dt.itemsize):
            return
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype not in WORD_DTYPES:
        raise TypeError(f"flags must be a 1-D numpy array of int32/uint32/int64/uint64 words, got "
                        f"{type(arr).__name__} {getattr(arr, 'dtype', None)} ndim={getattr(arr, 'ndim', None)}")
    if not is_int(idx) or not 0 <= idx < arr.shape[0]:
        raise IndexError(f"flag index {idx!r} is out of range for {arr.shape[0]} flags")
    # numpy's ALIGNED flag says the address is a multiple of the word's alignment (its size,
    # for these words) without ``arr.ctypes.data``, a microsecond at every flag poll; only an
    # array the flag does not vouch for has its address read.
    size = arr.dtype.itemsize
    vouched = arr.flags.aligned and arr.dtype.alignment == size
    if arr.strides[0] != size or (not vouched and arr.ctypes.data % size):
        raise ValueError(f"flags must be contiguous and {arr.dtype.itemsize}-byte aligned for atomic access")


def load_acquire(arr: np.ndarray, idx: int) -> int:
    """Read ``arr[idx]`` with acquire ordering (later reads cannot move before it)."""
    _check(arr, idx)
    return int(_load_acquire(arr, int(idx)))


def store_release(arr: np.ndarray, idx: int, value: int) -> None:
    """Write ``arr[idx] = value`` with release ordering (earlier writes become visible first)."""
    _check(arr, idx)
    _store_release(arr, int(idx), arr.dtype.type(value))


def fence() -> None:
    """A full (sequentially consistent) memory fence."""
    _fence()


__all__ = ["WORD_DTYPES", "load_acquire", "store_release", "fence"]
