"""Fixes to numba's CUDA simulator, applied when a :class:`~vtnumba.backend.cuda.CUDABackend` runs in it.

The simulator runs every thread of a block as a Python thread.  Three of its mechanisms
behave badly when 256 such threads share one interpreter; each fix below replaces one of
them and keeps what a kernel sees the same.

1. **Shared arrays** (:func:`make_shared_arrays_thread_safe`, a correctness fix).  A block's
   ``cuda.shared.array(...)`` is one numpy array per call site (file and line), made by the
   first thread that reaches the line: numba-cuda's ``FakeCUDAShared.array`` looks the call
   site up in a dict and, if it is missing, makes the array and stores it.  Between the
   lookup and the store another thread may do the same: then two threads of one block hold
   *different* "shared" arrays, a block reduction misses one thread's partial sum, and that
   thread reads a total out of uninitialised memory.  Rare (a thread switch must fall in that
   window, on the first call of each block), but real: vtnumba's peer reduce+norm test failed
   this way under load, and a loop of 32 threads meeting at a barrier before their first call
   gets two arrays in 9 to 10 blocks of 200 to 300 (measured on a 2-core machine).  The
   replacement does the lookup and the store as one ``dict.setdefault`` -- a single operation
   under the GIL -- so every thread of a block gets the array the first one stored.  It also
   finds the call site from the caller's frame directly (numba's version formats the whole
   stack, source lines included, on every call).

2. **Barriers** (:func:`make_barriers_event_driven`, a speed fix).  numba's ``BlockManager``
   releases a ``cuda.syncthreads()`` by *polling*: the launching thread loops over every
   thread of the block, again and again, until all of them are either waiting or finished.
   That loop never sleeps, so it takes the GIL from the block's own threads for as long as
   the block runs.  The replacement counts arrivals instead: the last thread to reach the
   barrier (or to finish, when the others are already waiting) wakes the rest, and the
   launching thread sleeps until the block is done or a thread has failed.  The rules are
   numba's: a finished thread no longer counts, and a thread's exception aborts the others at
   their next barrier and is raised by the launch.

3. **Device-function calls** (:func:`make_device_calls_lock_free`, a speed fix).  Inside a
   kernel, a ``@cuda.jit(device=True)`` function must see the simulator's fake ``cuda`` module
   in its module's globals.  numba swaps the globals on *every call*, counting the callers
   under two locks (one for all modules, one per module) and restoring the real module when
   the last one leaves.  With hundreds of threads calling small device functions (a 128-bit
   load, a tile product), a thread preempted while it holds a lock makes every other thread
   queue behind it.  The replacement swaps a module's globals the first time a kernel launch
   calls into it and restores them all when the launch ends; later calls only look the
   module up in a dict.  (What other host threads see during a launch is unchanged in
   kind: numba already swaps the kernel's own module for the whole launch.)

Measured on a 2-core machine, one launch of a 36 x 32 x 132 matmul, three runs each at
Python's default thread switch interval: the warp-tiled rung (two blocks of 256 threads,
8 barriers and ~60 device calls a thread) took 4.1-4.8 s with numba's mechanisms and
2.6-3.2 s with the fixes; the shared-memory rung (27 blocks of 256 threads) 9.1-10.3 s and
4.4-5.7 s.  A kernel without barriers or device calls (the naive rung) runs as before,
3.5-4.8 s: there the time is the kernel's own Python.  vtnumba's kernel tests
(``test_kernels_matmul``, ``_norm``, ``_peer``, ``_bench``) took 258 s before and 82 s after.

:func:`apply_simulator_fixes` applies all three.  Each fix is applied once per process, and
only to a simulator whose internals it recognises; otherwise it leaves numba alone and says
so by returning False.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import numpy as np

__all__ = ["apply_simulator_fixes", "make_barriers_event_driven", "make_device_calls_lock_free",
           "make_shared_arrays_thread_safe"]

_lock = threading.Lock()
_applied: set[str] = set()


def _apply_once(name: str, recognised, install) -> bool:
    """Run ``install()`` the first time, if ``recognised()``; True when the fix is in place."""
    with _lock:
        if name in _applied:
            return True
        if not recognised():
            return False
        install()
        _applied.add(name)
        return True


# --- 1. shared arrays ---------------------------------------------------------------------


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
    timing (fix 1 of the module docstring).  Idempotent; returns True when the fix is in
    place, False when this numba-cuda's simulator is not the one it was written for (left alone)."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    def recognised():
        probe = FakeCUDAShared(0)
        return all(hasattr(probe, a) for a in ("_allocations", "_dynshared", "_dynshared_size"))

    def install():
        FakeCUDAShared.array = _shared_array

    return _apply_once("shared arrays", recognised, install)


# --- 2. barriers --------------------------------------------------------------------------


def _event_driven_block_thread(BlockThread):
    """numba's ``BlockThread`` with a counting barrier (fix 2 of the module docstring)."""

    class EventDrivenBlockThread(BlockThread):
        def run(self):
            try:
                super().run()  # numba's run: the kernel, its exception kept in self.exception
            finally:
                self._manager.thread_finished(self)

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            wake = getattr(self, "_wake", None)
            if wake is None:  # this thread's own lock, held except while a barrier opens
                wake = self._wake = threading.Lock()
                wake.acquire()
            self._manager.arrive_and_wait(wake)
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    return EventDrivenBlockThread


def _event_driven_run(self, grid_point, *args):
    """``BlockManager.run`` without the polling loop: start the block's threads, then sleep
    until all have finished or one has failed, and raise that one's exception."""
    # Barrier state, guarded by one lock.  A waiting thread sleeps on a lock of its own,
    # which the thread that opens the barrier releases: each waiter wakes without queueing
    # for a lock all the others want too (what a shared threading.Condition would cost).
    self._barrier = threading.Lock()
    self._waiters = []
    self._live = 0
    self._failed = None
    self._done = threading.Event()

    def target():
        self._f(*args)

    points = list(np.ndindex(*self._block_dim))
    self._threads = [self._thread_class(target, self, grid_point, p, self._debug) for p in points]
    self._live = len(self._threads)  # before any starts: an early finisher must not end the block
    for t in self._threads:
        t.start()
    self._done.wait()
    if self._failed is not None:
        # As numba does: raise at once, without joining the others (a spinning thread would
        # never end); they were told to abort at their next barrier.
        exc, tb = self._failed.exception
        raise exc.with_traceback(tb)


def _release_locked(self) -> None:
    """Open the barrier (caller holds ``self._barrier``)."""
    waiters, self._waiters = self._waiters, []
    for wake in waiters:
        wake.release()


def _arrive_and_wait(self, wake) -> None:
    """Wait at the barrier; ``wake`` is the caller's own lock, held while it runs."""
    with self._barrier:
        if self._failed is not None:
            # The block has failed since this thread last checked its abort flag: nobody
            # will open the barrier again, so don't wait (the caller raises the abort).
            return
        if len(self._waiters) + 1 == self._live:  # the last one in opens it for everybody
            self._release_locked()
            return
        self._waiters.append(wake)
    wake.acquire()  # blocks until the opener releases it; then held again, for the next barrier


def _thread_finished(self, thread) -> None:
    with self._barrier:
        self._live -= 1
        if thread.exception is not None:
            if self._failed is None:
                self._failed = thread
                for t in self._threads:
                    t.abort = True
                self._release_locked()  # waiters wake, see the abort flag and raise
                self._done.set()
        elif self._live == 0:
            self._done.set()
        elif self._waiters and len(self._waiters) == self._live:
            # Everyone still running is at the barrier: a finished thread no longer counts
            # (numba's rule), so this exit is what opens it.
            self._release_locked()


def make_barriers_event_driven() -> bool:
    """Replace the simulator's polling barrier with a counting one (fix 2 of the module
    docstring).  Idempotent; True when in place, False when the simulator is not the one
    it was written for."""
    from numba.cuda.simulator import kernel

    def recognised():
        thread_methods = ("run", "syncthreads", "syncthreads_count", "syncthreads_and", "syncthreads_or")
        return (all(hasattr(kernel.BlockThread, m) for m in thread_methods)
                and hasattr(kernel.BlockManager, "run")
                and kernel.BlockManager.__init__.__code__.co_varnames[1:5] == ("f", "grid_dim", "block_dim", "debug"))

    def install():
        manager = kernel.BlockManager
        manager._thread_class = _event_driven_block_thread(kernel.BlockThread)
        manager.run = _event_driven_run
        manager._release_locked = _release_locked
        manager.arrive_and_wait = _arrive_and_wait
        manager.thread_finished = _thread_finished

    return _apply_once("barriers", recognised, install)


# --- 3. device-function calls -------------------------------------------------------------

# Modules whose globals this launch has swapped: id(globals) -> (globals, names swapped).
_swapped: dict[int, tuple[dict, list[str]]] = {}
_swap_lock = threading.Lock()


def _lock_free_call(original_call):
    from numba.cuda.simulator import kernel

    def __call__(self, *args):
        context = kernel._kernel_context  # the launch's fake cuda module; None outside a launch
        if context is None:
            return original_call(self, *args)
        fn_globals = self.fn.__globals__
        if id(fn_globals) not in _swapped:  # a dict lookup: atomic under the GIL
            with _swap_lock:
                if id(fn_globals) not in _swapped:
                    from numba import cuda

                    names = [name for name, value in fn_globals.items() if value is cuda]
                    for name in names:
                        fn_globals[name] = context
                    # Stored last: a thread that sees the entry may rely on the swap being done.
                    _swapped[id(fn_globals)] = (fn_globals, names)
        return self.fn(*args)

    return __call__


def _restoring_kernel_context(original_push):
    @contextmanager
    def push_kernel_context(fake_cuda_module):
        with original_push(fake_cuda_module):
            try:
                yield
            finally:
                # The launch is over (or failed): every module swapped for it gets the real
                # cuda back, so host code and the next launch see what they expect.
                from numba import cuda

                with _swap_lock:
                    for fn_globals, names in _swapped.values():
                        for name in names:
                            fn_globals[name] = cuda
                    _swapped.clear()

    return push_kernel_context


def make_device_calls_lock_free() -> bool:
    """Swap a device function's module globals once per launch instead of on every call
    (fix 3 of the module docstring).  Idempotent; True when in place, False when the
    simulator is not the one it was written for."""
    from numba.cuda.simulator import kernel

    def recognised():
        return (hasattr(kernel, "_kernel_context") and callable(getattr(kernel, "_push_kernel_context", None))
                and "_kernel_context" in kernel.FakeCUDAKernel.__call__.__code__.co_names
                and "_push_kernel_context" in kernel.FakeCUDAKernel.__call__.__code__.co_names)

    def install():
        kernel.FakeCUDAKernel.__call__ = _lock_free_call(kernel.FakeCUDAKernel.__call__)
        # FakeCUDAKernel.__call__ looks this name up in the module at every launch.
        kernel._push_kernel_context = _restoring_kernel_context(kernel._push_kernel_context)

    return _apply_once("device calls", recognised, install)


def apply_simulator_fixes() -> bool:
    """Apply the three fixes of the module docstring; True when all are in place."""
    results = [make_shared_arrays_thread_safe(), make_barriers_event_driven(), make_device_calls_lock_free()]
    return all(results)
