"""Fixes to numba's CUDA simulator, applied when a :class:`~vtnumba.backend.cuda.CUDABackend` runs in it.

The simulator runs every thread of a block as a Python thread.  Four of its mechanisms
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

3. **Threads** (:func:`make_block_threads_reusable`, a speed fix).  numba starts a new Python
   thread for every GPU thread of every block, and starting one costs more than most kernels'
   work: 430 us a thread (start and join) on a 2-core machine, against 40-55 us to wake a
   waiting one.  The replacement keeps the threads of finished blocks in a pool, each
   waiting on a lock of its own, and binds the next block's GPU threads to them (block and
   thread index, the fields numba's ``BlockThread`` has); new threads are started only when
   the pool has too few (a bigger block, or threads of a failed block still running).  A
   forked child starts with an empty pool; debug launches keep numba's fresh threads.

4. **Device-function calls** (:func:`make_device_calls_lock_free`, a speed fix).  Inside a
   kernel, a ``@cuda.jit(device=True)`` function must see the simulator's fake ``cuda`` module
   in its module's globals.  numba swaps the globals on *every call*, counting the callers
   under two locks (one for all modules, one per module) and restoring the real module when
   the last one leaves.  With hundreds of threads calling small device functions (a 128-bit
   load, a tile product), a thread preempted while it holds a lock makes every other thread
   queue behind it.  The replacement swaps a module's globals the first time a kernel launch
   calls into it and restores them all when the launch ends; later calls only look the
   module up in a dict.  (What other host threads see during a launch is unchanged in
   kind: numba already swaps the kernel's own module for the whole launch.)

Measured on a 2-core machine, three runs each, alternating with numba's own mechanisms, at
Python's default thread switch interval.  One launch of a 36 x 32 x 132 matmul: the
warp-tiled rung (two blocks of 256 threads, 8 barriers and ~60 device calls a thread)
4.3-4.8 s with numba's mechanisms, 2.5-3.3 s with the fixes; the shared-memory rung (27
blocks of 256 threads) 10.4-10.6 s and 3.0-3.4 s; the naive rung (no barriers) 3.3-5.7 s
and 2.2-2.8 s.  A kernel that only stores its index, 27 blocks of 256: 2,100-3,900 GPU
threads a second before, 9,200-13,900 after; with one barrier, 920-1,560 and 7,100-7,700.
vtnumba's serial test stage went from 617 s to 398 s.

:func:`apply_simulator_fixes` applies all four.  Each fix is applied once per process, and
only to a simulator whose internals it recognises; otherwise it leaves numba alone and says
so by returning False.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import numpy as np

__all__ = ["apply_simulator_fixes", "make_barriers_event_driven", "make_block_threads_reusable",
           "make_device_calls_lock_free", "make_shared_arrays_thread_safe", "GPU_THREAD_END_HOOKS"]

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
    """numba's ``BlockThread`` with a counting barrier (fix 2 of the module docstring): a
    new thread for one simulated GPU thread, ``go()`` starts it."""

    class EventDrivenBlockThread(BlockThread):
        def run(self):
            try:
                super().run()  # numba's run: the kernel, its exception kept in self.exception
            finally:
                self._manager.thread_finished(self)

        go = BlockThread.start

        def retire(self):
            """Called by the block, under its lock, when this thread has finished."""

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


def _new_threads(self, target, grid_point, points):
    """One new thread per simulated GPU thread of the block (numba's way)."""
    return [self._thread_class(target, self, grid_point, p, self._debug) for p in points]


def _event_driven_run(self, grid_point, *args):
    """``BlockManager.run`` without the polling loop: start the block's threads, then sleep
    until all have finished or one has failed, and raise that one's exception."""
    # Barrier state, guarded by one lock.  A waiting thread sleeps on a lock of its own,
    # which the thread that opens the barrier releases: each waiter wakes without queueing
    # for a lock all the others want too (what a shared threading.Condition would cost).
    self._barrier = threading.Lock()
    self._waiters = []
    self._failure = None  # (exception, traceback) of the first thread that failed
    self._done = threading.Event()

    def target():
        self._f(*args)

    points = list(np.ndindex(*self._block_dim))
    self._live = len(points)  # before any starts: an early finisher must not end the block
    self._threads = self.threads_for(target, grid_point, points)
    for t in self._threads:
        t.go()
    self._done.wait()
    if self._failure is not None:
        # As numba does: raise at once, without joining the others (a spinning thread would
        # never end); they were told to abort at their next barrier.
        exc, tb = self._failure
        raise exc.with_traceback(tb)


def _release_locked(self) -> None:
    """Open the barrier (caller holds ``self._barrier``)."""
    waiters, self._waiters = self._waiters, []
    for wake in waiters:
        wake.release()


def _arrive_and_wait(self, wake) -> None:
    """Wait at the barrier; ``wake`` is the caller's own lock, held while it runs."""
    with self._barrier:
        if self._failure is not None:
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
        failure = thread.exception
        # Before `done` is set: a launcher woken by it finds a reusable thread back in its
        # pool (fix 3), and the thread's fields may be rebound from then on.
        thread.retire()
        if failure is not None:
            if self._failure is None:
                self._failure = failure
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
        manager.threads_for = _new_threads
        manager.run = _event_driven_run
        manager._release_locked = _release_locked
        manager.arrive_and_wait = _arrive_and_wait
        manager.thread_finished = _thread_finished

    return _apply_once("barriers", recognised, install)


# --- 3. reused threads --------------------------------------------------------------------


class _ThreadPool:
    """Idle simulator threads, each waiting on a lock of its own for its next GPU thread."""

    def __init__(self, thread_class):
        self._thread_class = thread_class
        self._start_afresh()
        os.register_at_fork(after_in_child=self._start_afresh)

    def _start_afresh(self) -> None:
        # Also what a forked child does: it has none of these threads, only their objects,
        # and the lock may have been held by a thread that is not there.
        self._idle = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list:
        with self._lock:
            taken = self._idle[-n:] if n else []
            del self._idle[len(self._idle) - len(taken):]
        # Threads still busy elsewhere (a failed block's, which run on to their next
        # barrier) are not here: new ones stand in for them.
        while len(taken) < n:
            thread = self._thread_class(self)
            thread.start()
            taken.append(thread)
        return taken

    def give_back(self, thread) -> None:
        with self._lock:
            self._idle.append(thread)


#: Called, without arguments, on a reused thread each time a GPU thread it ran has ended: where
#: per-thread state kept in ``threading.local`` (as a GPU thread's registers would be) is
#: finished off before the same Python thread becomes another GPU thread.
GPU_THREAD_END_HOOKS: list = []


def _reusable_block_thread(EventDrivenBlockThread, BlockThread, Dim3):
    """A simulator thread that runs one GPU thread after another (fix 3 of the module docstring):
    fix 2's thread class, made to wait for its next binding instead of ending."""

    class ReusableBlockThread(EventDrivenBlockThread):
        def __init__(self, pool):
            threading.Thread.__init__(self, daemon=True)  # its GPU thread comes with bind()
            self._pool = pool
            self._go = threading.Lock()
            self._go.acquire()

        def bind(self, manager, target, block_idx, thread_idx):
            """Make this the GPU thread ``thread_idx`` of block ``block_idx`` -- the fields
            numba's BlockThread.__init__ sets -- ready for go()."""
            bx, by, _ = manager._block_dim
            self._manager = manager
            self._target, self._args, self._kwargs = target, (), {}  # what Thread.run calls
            self.blockIdx, self.threadIdx = Dim3(*block_idx), Dim3(*thread_idx)
            self.thread_id = thread_idx[0] + bx * (thread_idx[1] + by * thread_idx[2])
            self.abort, self.exception, self.debug = False, None, False

        def go(self):
            self._go.release()

        def retire(self):
            self.exception = None  # the block has taken it; drop the traceback's frames
            if self._pool is not None:
                self._pool.give_back(self)

        def run(self):
            while True:
                self._go.acquire()
                manager = self._manager
                try:
                    # numba's BlockThread.run: the GPU thread, its exception kept in
                    # self.exception (Thread.run drops _target afterwards).
                    BlockThread.run(self)
                    for hook in GPU_THREAD_END_HOOKS:  # before this Python thread is another GPU thread
                        hook()
                except BaseException:
                    self._pool = None  # numba's threads die of these: not reused either
                    raise
                finally:
                    # Nothing of this launch stays reachable from an idle thread; and once
                    # thread_finished has put it back in the pool it may be rebound at once.
                    self._manager = None
                    manager.thread_finished(self)

    return ReusableBlockThread


_pool: _ThreadPool | None = None


def _pooled_threads(self, target, grid_point, points):
    """The block's GPU threads on idle simulator threads (new ones where there are too few)."""
    if self._debug:  # numba's debug threads set numpy error state for their lifetime
        return _new_threads(self, target, grid_point, points)
    threads = _pool.take(len(points))
    for thread, point in zip(threads, points):
        thread.bind(self, target, grid_point, point)
    return threads


def make_block_threads_reusable() -> bool:
    """Run a block's GPU threads on simulator threads kept from earlier blocks instead of new
    ones (fix 3 of the module docstring); needs fix 2, applied first.  Idempotent; True when
    in place, False when the simulator is not the one it was written for."""
    from numba.cuda.simulator import kernel
    from numba.cuda.simulator.kernelapi import Dim3

    make_barriers_event_driven()

    def recognised():
        # Needs the counting barrier; bind() sets what threading.Thread.run reads.
        return "barriers" in _applied and {"_target", "_args", "_kwargs"} <= set(threading.Thread.run.__code__.co_names)

    def install():
        global _pool
        _pool = _ThreadPool(_reusable_block_thread(kernel.BlockManager._thread_class, kernel.BlockThread, Dim3))
        kernel.BlockManager.threads_for = _pooled_threads

    return _apply_once("reused threads", recognised, install)


# --- 4. device-function calls -------------------------------------------------------------

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
    (fix 4 of the module docstring).  Idempotent; True when in place, False when the
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
    """Apply the four fixes of the module docstring; True when all are in place."""
    results = [make_shared_arrays_thread_safe(), make_barriers_event_driven(), make_block_threads_reusable(),
               make_device_calls_lock_free()]
    return all(results)
