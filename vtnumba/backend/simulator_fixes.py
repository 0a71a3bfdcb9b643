"""A fix to numba's CUDA simulator, applied when a :class:`~vtnumba.backend.cuda.CUDABackend` runs in it.

The simulator runs every thread of a block as a Python thread, and gives a block's
``cuda.shared.array(...)`` one numpy array per call site (file and line), made by the first
thread that reaches the line: numba-cuda's ``FakeCUDAShared.array`` looks the call site up
in a dict and, if it is missing, makes the array and stores it.  Between the lookup and the
store another thread may do the same: then two threads of one block hold *different*
"shared" arrays, a block reduction misses one thread's partial sum, and that thread reads a
total out of uninitialised memory.  Rare (a thread switch must fall in that window, on the
first call of each block), but real: vtnumba's peer reduce+norm test failed this way under
load, and a loop of 32 threads meeting at a barrier before their first call gets two
arrays in 9 to 10 blocks of 200 to 300 (measured on a 2-core machine).

:func:`make_shared_arrays_thread_safe` replaces the method with one that does the lookup and
the store as one ``dict.setdefault`` -- a single operation under the GIL -- so every thread
of a block gets the array the first one stored.  It also finds the call site from the
caller's frame directly (``numba``'s version formats the whole stack, source lines
included, on every call).  The replacement keeps the original's behaviour otherwise
(dynamic shared memory, the same key, the same aliasing of two calls on one line), and is
applied only to the simulator version whose internals it knows.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["make_shared_arrays_thread_safe"]

_lock = threading.Lock()
_applied = False


def _shared_array(self, shape, dtype, alignment=None):
    """``FakeCUDAShared.array`` with an atomic lookup-or-store (see the module docstring)."""
    from numba.cuda import types  # what numba-cuda's simulator itself uses
    from numba.cuda.np import numpy_support

    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:  # dynamic shared memory: one buffer for every such call, as in numba
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    caller = sys._getframe(1)
    site = (caller.f_code.co_filename, caller.f_lineno)
    array = self._allocations.get(site)
    if array is None:
        # Two threads may both get here; setdefault keeps the first array stored and hands
        # it to both (the loser's is dropped).
        array = self._allocations.setdefault(site, np.empty(shape, dtype))
    return array


def make_shared_arrays_thread_safe() -> bool:
    """Make the simulator's shared arrays one per block and call site, whatever the thread
    timing (see the module docstring).  Idempotent; returns True when the fix is in place,
    False when this numba-cuda's simulator is not the one it was written for (left alone)."""
    global _applied
    with _lock:
        if _applied:
            return True
        from numba.cuda.simulator.kernelapi import FakeCUDAShared

        probe = FakeCUDAShared(0)
        if not all(hasattr(probe, a) for a in ("_allocations", "_dynshared", "_dynshared_size")):
            return False
        FakeCUDAShared.array = _shared_array
        _applied = True
        return True
