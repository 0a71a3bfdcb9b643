"""The CUDA backend on numba-cuda: a real GPU, or numba's CUDA simulator.

On a real GPU a :class:`Queue` wraps a CUDA stream, an :class:`Event` a CUDA event, and
``alloc`` returns device memory from numba (``cuMemAlloc``, 256-byte aligned).  Graph
capture uses cuda.bindings stream capture around numba launches (warm kernels first: a
first-call compilation inside capture would try to synchronise).

Three choices matter on a real GPU:

* **Queues are non-blocking streams** (``CU_STREAM_NON_BLOCKING``, made with cuda.bindings
  and handed to numba as an external stream).  A stream created by ``cuda.stream()`` is a
  *blocking* one: it synchronises with the legacy default stream, so one queue stuck on a
  flag that a failed peer will never raise would freeze every later default-stream
  operation of the process -- including the copy that would report the error.  A
  destroyed queue's stream is kept, idle, for the next queue: streams are tied to a few
  hardware work queues as they are created, and one stream too many would share a
  hardware queue with a stream a flag wait may hold up.
* **Flags in queue order are stream memory operations** (``cuStreamWriteValue32`` /
  ``cuStreamWaitValue32``): the GPU orders work across processes without a host thread on
  the critical path.  Where the driver refuses them, one-thread kernels do the same
  (:mod:`vtnumba.backend.cuda_flags`).  Neither can time out on the GPU, so the host keeps
  each wait's deadline: synchronizing a queue with pending flag waits polls the stream
  instead of blocking in the driver.
* **Host functions go through** ``cuLaunchHostFunc`` **of cuda.bindings**, not numba's
  ``Stream.add_callback`` (broken with cuda-bindings in numba-cuda 0.30: it reads
  ``handle.value``).  The Python callable is kept alive until the driver has called it,
  and an exception it raises is kept and raised by the queue's next ``synchronize``.

In the simulator (``VTNUMBA_TARGET=cudasim``) numba gives us kernels but not a runtime:
streams are ignored, events cannot be queried or timed, and only one kernel may run per
process at a time (a second thread's launch is mistaken for a device-function call).
This backend fills those gaps with *honest host semantics*: the simulator runs every
launch synchronously, so work is complete when it is submitted; an event is recorded
with the host clock at that moment (so ``query_event`` is True and ``elapsed_ms`` is the
real host time between the two records); each queue keeps its own identity; and a
process-wide lock serialises launches.  Device memory is host memory wrapped in the
simulator's ``FakeCUDAArray``, which kernels see *without* copying -- plain numpy
arguments would be copied in and back (docs/troubleshooting.rst), which breaks peer buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
import warnings

import numpy as np

from vtnumba import trace
from vtnumba.backend.arrays import (
    address_of,
    host_view,
    is_device_array,
    is_gpu_array,
    simulator_active,
    wrap_host_memory,
)
from vtnumba.backend.atomics import store_release
from vtnumba.backend.base import QUEUE_PRIORITIES, Backend, Buffer, Capabilities, Event, EventMark, Queue
from vtnumba.backend.cpu import aligned_empty, wait_flag_word
from vtnumba.backend.device import Device, DeviceType, as_device
from vtnumba.backend.device_choice import process_cuda_device
from vtnumba.target import ask_for_cuda_connections, current_target

# One kernel at a time per process in the simulator (see module docstring).
SIM_LAUNCH_LOCK = threading.RLock()


def _cuda():
    from numba import cuda

    return cuda


def _gpu():
    """``numba.cuda`` with this process's GPU current on the calling thread: numba's calls make
    device 0's context current on a thread that has none (see :func:`current_context`), so
    every numba call of the real-GPU paths goes through here -- an allocation, an event or a
    ``defer_cleanup`` made first thing on a new thread would otherwise land on GPU 0, and a
    driver call numba makes without asking (a copy, a memset) would find no context at all."""
    if not getattr(_thread_context, "ready", False):
        current_context()
    return _cuda()


#: The GPU this process's CUDA backends run on (the first real one made chooses it); None before.
_process_device_index: int | None = None
#: ``.ready``: current_context() has made sure of this thread's context (numba keeps it current).
_thread_context = threading.local()


def current_context():
    """numba's context of this process's GPU, made current on the calling thread if none is.

    Asked on a thread that has no current context, ``cuda.current_context()`` makes *device
    0's* current -- the wrong GPU for a rank that runs on another one
    (:mod:`vtnumba.backend.device_choice`), e.g. for a cleanup that runs on a thread which
    never touched the GPU.  Every "a context must be current here" of vtnumba asks here --
    batched copies among them, so after a thread's first call it costs one attribute lookup
    more than numba's own.
    """
    cuda = _cuda()
    if getattr(_thread_context, "ready", False) or simulator_active():
        return cuda.current_context()  # (the simulator has one device and no driver to ask)
    from cuda.bindings import driver as cu

    global _process_device_index
    err, ctx = cu.cuCtxGetCurrent()  # (an error: the driver is not initialized yet in this process)
    if err != cu.CUresult.CUDA_SUCCESS or int(ctx) == 0:
        if _process_device_index is None:
            _process_device_index = process_cuda_device().index  # (a later CUDABackend must agree)
        cuda.select_device(_process_device_index)
    context = cuda.current_context()
    _thread_context.ready = True
    return context


def fake_device_array(host: np.ndarray):
    """Simulator only: host memory as a device array kernels use in place (see :func:`wrap_host_memory`)."""
    return wrap_host_memory(host)


def sim_host_view(obj) -> np.ndarray:
    """The numpy array behind a simulator device array (or the array itself)."""
    view = host_view(obj)
    if view is None:
        raise TypeError(f"expected a numpy or simulator device array, got {type(obj).__name__}")
    return view


def to_host_array(arr) -> np.ndarray:
    """A numpy array with ``arr``'s contents (see :func:`vtnumba.backend.arrays.to_host`)."""
    from vtnumba.backend.arrays import to_host

    return to_host(arr)


def _flat_bytes(obj, name: str):
    """A flat uint8 view of a Buffer, host array or device array, without copying."""
    if isinstance(obj, Buffer):
        return obj.array
    if not getattr(obj, "flags", {"C_CONTIGUOUS": True})["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous")
    if obj.nbytes == 0:
        return obj.reshape(-1).view(np.uint8)[:0] if isinstance(obj, np.ndarray) else obj
    return obj.reshape(obj.size).view(np.uint8)


class _CUDAQueue(Queue):
    def __init__(self, backend, name, stream, handle=None):
        super().__init__(backend, name)
        self.stream = stream   # what numba launches and copies take
        self.handle = handle   # the cuda.bindings CUstream we created (real GPU), destroyed with the queue
        self.error: BaseException | None = None  # raised by a host function; re-raised by synchronize
        #: Real GPU: the flag waits queued here and not yet seen passed, as
        #: ``(flags, index, value, deadline)`` -- what synchronize watches (see _wait_out_flag_waits).
        #: Only ever appended to, or replaced by a new list: events keep (list, length) views of it.
        self.flag_waits: list[tuple] = []


# Host functions queued with cuLaunchHostFunc, by key, until the driver has called them.  The
# driver gets one C function for all of them -- the trampoline below, alive for the whole
# process -- and the key as its userData: no per-call C thunk exists, so none can be freed
# while the driver still holds (or is running) it.
_pending_host_funcs: dict[int, object] = {}
_host_func_ids = itertools.count(1)
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_HOST_FN
def _host_func_trampoline(user_data) -> None:
    # Runs on a driver thread.  Nothing may escape into C: the callables catch their own errors.
    call = _pending_host_funcs.pop(user_data or 0, None)
    if call is not None:
        call()


_HOST_FN_ADDRESS = ctypes.cast(_host_func_trampoline, ctypes.c_void_p).value


class _CUDAEvent(Event):
    def __init__(self, backend, blocking, timing, native):
        super().__init__(backend, blocking, timing)
        self.native = native  # a numba Event on a real GPU; None in the simulator
        # Real GPU: its queue's flag-wait list and that list's length when it was recorded (the
        # waits it fires after) -- kept, not copied: recording events is on the hot path.
        self.flag_waits: tuple = ([], 0)
        self.mark = EventMark()
        self.mark.fire()


class CUDABackend(Backend):
    """A CUDA device through numba-cuda; see the module docstring for the simulator."""

    #: Always :attr:`DeviceType.CUDA <vtnumba.backend.device.DeviceType.CUDA>`, the simulator included.
    device_type = DeviceType.CUDA

    def __init__(self, device: Device | str | None = None):
        if device is None:
            # The simulator has one device; only a real GPU asks which one is this process's
            # (asking there would also fix the process's target as a side effect).
            device = Device(DeviceType.CUDA, process_cuda_device().index if not simulator_active() else 0)
        device = as_device(device)  # ("cuda:1" too, as the registry's functions take it)
        if device.type is not DeviceType.CUDA:
            raise ValueError(f"device={device} must be a CUDA device for CUDABackend")
        super().__init__(device)
        self.simulator = simulator_active()
        if self.simulator:
            if device.index != 0:
                # (A program that ran here on "cuda:3" would fail on a one-GPU machine: say so here.)
                raise ValueError(f"device={device}: numba's CUDA simulator has one device, cuda:0")
            from vtnumba.backend.simulator_fixes import apply_simulator_fixes

            apply_simulator_fixes()  # shared arrays, barriers, threads, device calls: see simulator_fixes
        else:
            from vtnumba.backend.cuda_stack import check_cuda_stack

            check_cuda_stack()  # refuse numba's deprecated numba.cuda before it fails obscurely later
            # As many hardware work queues as the GPU has (vtnumba.target.CUDA_CONNECTIONS says
            # why); read when the process's context is made, so only if none exists yet.
            ask_for_cuda_connections()
            cuda = _cuda()
            if not cuda.is_available():
                raise RuntimeError("CUDABackend: no usable CUDA GPU (use VTNUMBA_TARGET=cpu or cudasim)")
            global _process_device_index
            if _process_device_index not in (None, device.index):
                # numba keeps one current context per thread: a second GPU's backend would move
                # every later launch and allocation of this thread (and the first backend's) there.
                raise ValueError(f"device={device}: this process already runs on cuda:{_process_device_index}; "
                                 "vtnumba drives one GPU per process (see vtnumba.backend.device_choice)")
            cuda.select_device(device.index)
            _process_device_index = device.index
        self._queues_by_id: dict[int, _CUDAQueue] = {}
        self._memops_ok = True  # stream memory operations; False once the driver refused one
        self._flag_readback = None  # a pinned word that _read_flag_word copies a flag word into
        # One reader of that word at a time: two threads past their deadlines at once (or one
        # asking QueueFlags.missing) would each read the other's copy -- a wait taken for
        # arrived would never be released, and its queue never drain.
        self._readback_lock = threading.Lock()
        #: Streams of destroyed queues, idle, for the next queues of the same priority.
        self._idle_streams: dict[str, list] = {p: [] for p in QUEUE_PRIORITIES}
        #: Streams this backend has created (a real GPU's; recycled ones count once).
        self.streams_created = 0
        self._trace_origin_pair = None  # (event, host ns): see _trace_origin

    @property
    def name(self) -> str:
        """``"CUDABackend"`` on a real GPU, ``"CUDABackend(simulator)"`` in numba's CUDA simulator."""
        return "CUDABackend(simulator)" if self.simulator else "CUDABackend"

    @property
    def capabilities(self) -> Capabilities:
        # The simulator's "device" memory is host memory (host-addressable), but we keep copy
        # semantics (unified_memory=False) so code written against it is correct on a GPU.
        # Simulated launches run synchronously, one at a time: no async queues, no overlap.
        sim = self.simulator
        return Capabilities(host_addressable=sim, simulator=sim, kernel_arrays="device", async_queues=not sim,
                            aux_stream=not sim, graph_capture=not sim, unified_memory=False)

    def device_capability(self) -> tuple[int, int]:
        """The current GPU's (major, minor) compute capability; (0, 0) in the simulator."""
        if self.simulator:
            return (0, 0)
        return tuple(current_context().device.compute_capability)

    def device_name(self) -> str:
        """The GPU's name as the driver reports it, or ``"numba CUDA simulator"``."""
        if self.simulator:
            return "numba CUDA simulator"
        name = current_context().device.name
        return name.decode() if isinstance(name, bytes) else str(name)

    # ---------------------------------------------------------------- arrays
    def _asarray(self, host: np.ndarray):
        if self.simulator:
            return wrap_host_memory(host.copy())
        arr = _gpu().to_device(host)
        # The copy went through the legacy default stream, which vtnumba's (non-blocking)
        # queues do not wait for: finish it here, so "synchronous" really means done.
        _gpu().default_stream().synchronize()
        return arr

    def _empty(self, shape, dtype):
        if self.simulator:
            return wrap_host_memory(np.empty(shape, dtype=dtype))
        return _gpu().device_array(shape, dtype=dtype)

    def _to_host(self, arr) -> np.ndarray:
        if not is_device_array(arr):
            raise TypeError(f"{self.name} cannot read {type(arr).__module__}.{type(arr).__name__} on the host")
        if not self.simulator:
            _gpu()
        return arr.copy_to_host()

    # ---------------------------------------------------------------- memory
    def _alloc(self, nbytes: int) -> Buffer:
        if self.simulator:
            host = aligned_empty(nbytes)
            return Buffer(self, self.device, nbytes, wrap_host_memory(host), ptr=host.ctypes.data, owner=host)
        arr = _gpu().device_array(max(nbytes, 1), dtype=np.uint8)[:nbytes]
        ptr = arr.__cuda_array_interface__["data"][0] if nbytes else 0
        return Buffer(self, self.device, nbytes, arr, ptr=ptr)

    def _alloc_pinned(self, nbytes: int) -> Buffer:
        if self.simulator:
            host = aligned_empty(nbytes)
            return Buffer(self, self.device, nbytes, host, pinned=True, ptr=host.ctypes.data)
        host = _gpu().pinned_array(max(nbytes, 1), dtype=np.uint8)[:nbytes]
        return Buffer(self, self.device, nbytes, host, pinned=True, ptr=host.ctypes.data)

    def _free(self, buf: Buffer) -> None:
        # numba frees device memory when the last reference goes -- batched: it queues the
        # frees and runs them by count and size, not by stream.  What makes dropping the array
        # safe is cuMemFree itself, which synchronizes the device first (a free in the middle
        # of a step also waits for every stream: see defer_frees).  With vtnumba's memory
        # manager installed, the plugin keeps that rule for blocks of the default pool by
        # waiting for every live queue (vtnumba.memory.numba_emm).
        buf._array = None
        buf._owner = None

    def _memset(self, q, buf, value, nbytes, offset) -> None:
        if nbytes == 0:
            return
        if self.simulator:
            view = sim_host_view(buf.array)[offset:offset + nbytes]
            self._run_sim(q, "memset", lambda: view.fill(value), {"bytes": nbytes})
            return
        from numba.cuda.cudadrv import driver

        _gpu()  # (numba's memset calls the driver directly: this thread needs the context current)
        view = buf.array[offset:offset + nbytes]
        self._traced(q, "memset", {"bytes": nbytes}, lambda: driver.device_memset(view, value, nbytes, stream=q.stream))

    def _copy(self, q, dst, src, nbytes, dst_offset, src_offset) -> None:
        if nbytes == 0:
            return
        d = _flat_bytes(dst, "dst")[dst_offset:dst_offset + nbytes]
        s = _flat_bytes(src, "src")[src_offset:src_offset + nbytes]
        if self.simulator:
            dh, sh = sim_host_view(d), sim_host_view(s)
            self._run_sim(q, "copy", lambda: np.copyto(dh, sh), {"bytes": nbytes})
            return
        d_dev, s_dev = is_device_array(d), is_device_array(s)
        if q.id in self._capturing:
            self._refuse_host_copy_in_capture(q, d, s, d_dev, s_dev)
        _gpu()  # (numba's copies call the driver directly: this thread needs the context current)
        if not d_dev and not s_dev:
            self._synchronize(q)  # H2H must still respect queue order (flag waits under their deadlines)
            with trace.span("copy", "queue", f"cuda:{q.name}", bytes=nbytes):  # (the host's copy: a host span)
                np.copyto(d, s)
            return
        if d_dev != s_dev and q.flag_waits and not _page_locked(s if d_dev else d):
            # With pageable host memory the driver stages the copy and may return only once
            # it has run: behind a flag wait, a wait without a deadline.  Drain the queue
            # first, under the waits' deadlines.
            self._synchronize(q)
        if d_dev:
            self._traced(q, "copy", {"bytes": nbytes}, lambda: d.copy_to_device(s, stream=q.stream))  # H2D or D2D
        else:
            self._traced(q, "copy", {"bytes": nbytes}, lambda: s.copy_to_host(d, stream=q.stream))  # D2H

    @staticmethod
    def _refuse_host_copy_in_capture(q, d, s, d_dev: bool, s_dev: bool) -> None:
        """A copy a graph cannot hold, on a capturing queue: refused before anything reaches the driver.

        A host-to-host copy is numpy's, run by this thread -- there is nothing to capture, and
        keeping queue order would mean synchronizing a capturing stream, an error that also
        invalidates the capture.  A copy between the device and *pageable* host memory is
        staged by the driver through a bounce buffer on the calling thread; capture refuses it
        the same way.  Pinned host memory is captured like any device copy."""
        if not d_dev and not s_dev:
            raise RuntimeError(f"copy on {q} while it is capturing a graph: both sides are host memory, so the "
                               "copy runs on the host and cannot be captured; copy outside the capture")
        host = s if d_dev else d
        if d_dev != s_dev and not _page_locked(host):
            raise RuntimeError(f"copy on {q} while it is capturing a graph: its host side is pageable memory, which "
                               "a graph cannot copy; use pinned memory (backend.alloc_pinned) for copies you capture")

    # ---------------------------------------------------------------- queues
    # Streams are recycled.  The GPU runs streams on a few hardware work queues
    # (CUDA_DEVICE_MAX_CONNECTIONS, 32 at most), and a stream is tied to one when it is
    # created, in turn: the 33rd stream shares a queue with the first.  A stream held by a flag
    # wait holds up everything behind it on its hardware queue -- a release queued on a stream
    # that shares it would never run.  Queues come and go freely (a timing gate, a batched copy
    # without a queue), so a destroyed queue's stream, idle, is kept for the next queue: a
    # process then has no more streams than it ever had queues at once.
    def _create_queue(self, name, priority) -> Queue:
        if self.simulator:
            q = _CUDAQueue(self, name, _cuda().stream())  # (one launch at a time: priorities mean nothing)
        else:
            with self._lock:
                idle = self._idle_streams[priority]
                handle = idle.pop() if idle else None
            if handle is None:
                handle = self._new_stream(priority)
            q = _CUDAQueue(self, name, _gpu().external_stream(int(handle)), handle)
        self._queues_by_id[q.id] = q
        return q

    def _new_stream(self, priority: str):
        """A non-blocking stream (see the module docstring) of the given priority, to be wrapped
        for numba's launches."""
        from cuda.bindings import driver as cu

        current_context()  # stream creation needs a current context
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        if priority == "high":
            # Lower numbers are higher priorities; the range is the device's (e.g. 0 .. -5).
            err, _least, greatest = cu.cuCtxGetStreamPriorityRange()
            _check_cu(err, "cuCtxGetStreamPriorityRange")
            err, handle = cu.cuStreamCreateWithPriority(flags, greatest)
            _check_cu(err, f"cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING, {greatest})")
        else:
            err, handle = cu.cuStreamCreate(flags)
            _check_cu(err, "cuStreamCreate(CU_STREAM_NON_BLOCKING)")
        self.streams_created += 1
        return handle

    def _destroy_queue(self, q) -> None:
        self._queues_by_id.pop(q.id, None)
        handle, q.handle, q.stream = q.handle, None, None
        if handle is not None and int(handle) != 0:  # 0: the legacy default stream, not ours to destroy
            # Kept for the next queue of its priority only if its work really is done
            # (destroy_queue synchronized first, but a flag wait released at its deadline may
            # still be draining) and the backend is open.
            try:
                idle = _stream_done(handle, f"queue {q.name}")
            except RuntimeError:
                idle = False  # (an error of its own: the stream is not one to hand on)
            if not self.closed and idle:
                with self._lock:
                    self._idle_streams[q.priority].append(handle)
                return
            self._destroy_stream(handle)

    @staticmethod
    def _destroy_stream(handle) -> None:
        from cuda.bindings import driver as cu

        (err,) = cu.cuStreamDestroy(handle)  # (work still queued on it finishes first, in the driver)
        if err != cu.CUresult.CUDA_SUCCESS:
            # Teardown goes on: after a fatal GPU error (an illegal address) every destroy
            # fails the same way, and raising here -- in close()'s or destroy_queue's cleanup
            # -- would leave the other streams and hide the error that mattered.  The stream
            # goes with the context.
            warnings.warn(f"cuStreamDestroy failed ({err.name}); the stream is released with the CUDA context",
                          RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """:meth:`Backend.close`, then destroy the idle streams kept for reuse."""
        try:
            super().close()
        finally:  # (closed even when queued work failed, see Backend.close)
            with self._lock:
                idle, self._idle_streams = self._idle_streams, {p: [] for p in QUEUE_PRIORITIES}
            for handle in (h for handles in idle.values() for h in handles):
                self._destroy_stream(handle)

    def _synchronize(self, q) -> None:
        if not self.simulator:
            with trace.span("synchronize", "host", "host", queue=q.name):
                if q.flag_waits:
                    self._wait_out_flag_waits(lambda: self._stream_idle(q), q.flag_waits, f"queue {q.name}")
                    q.flag_waits = []
                q.stream.synchronize()
            _settle_trace()
        self._raise_queue_error(q)

    def _synchronize_all(self) -> None:
        if not self.simulator:
            # Queues held by a flag wait first, each under its deadlines: a context-wide
            # synchronize would block on them for good.
            timed_out = None
            for q in list(self._queues_by_id.values()):
                if q.stream is not None and q.flag_waits:
                    try:
                        self._synchronize(q)
                    except RuntimeError as exc:
                        timed_out = timed_out or exc
            # The legacy default stream (numba's launches without a queue), not the whole
            # context: cuCtxSynchronize would also wait for other backends' streams, whose
            # flag waits nobody polls here.
            _gpu().default_stream().synchronize()
            for q in list(self._queues_by_id.values()):  # non-blocking streams: each on its own
                if q.stream is not None:
                    q.stream.synchronize()
            _settle_trace()
            if timed_out is not None:
                raise timed_out
        for q in list(self._queues_by_id.values()):
            self._raise_queue_error(q)

    # ---------------------------------------------------------------- flag waits with a deadline
    # A stream's wait (cuStreamWaitValue32, or the wait kernel) is done by the GPU and has no
    # timeout: a host that called cuStreamSynchronize on it would block for as long as the
    # flag stays short -- forever, if the peer that should raise it died.  So while a queue
    # has flag waits that are not known to have passed, synchronizing it *polls* the stream
    # and keeps each wait's deadline (wait_value32's timeout_s) on the host.  A wait past its
    # deadline is released the only way a GPU wait can end -- by storing the awaited value
    # into the word, from a queue of its own (Backend.release_flag_word) -- and the
    # synchronize raises an error naming the word.  (The work queued behind the wait then
    # runs on whatever the flag guarded: the error says the results are not to be used.
    # vtnumba.dist.queue_flags releases its peers' waits the same way when a call fails.)
    def _stream_idle(self, q) -> bool:
        return _stream_done(q.handle, f"queue {q.name}")

    def _query_queue(self, q) -> bool:
        if self.simulator:
            return True  # launches and copies are synchronous there
        try:
            return self._stream_idle(q)
        except RuntimeError:
            return True  # a failed stream has stopped: synchronize reports why

    def defer_frees(self):
        """numba's ``defer_cleanup`` on a real GPU (see :meth:`Backend.defer_frees`)."""
        return contextlib.nullcontext() if self.simulator else _gpu().defer_cleanup()

    def flush_frees(self) -> None:
        """Run numba's queued frees now, on a real GPU (see :meth:`Backend.flush_frees`)."""
        if not self.simulator:
            current_context().deallocations.clear()  # (does nothing inside defer_frees)

    def _read_flag_word(self, flags, index: int, timeout_s: float = 10.0) -> int:
        """The word's value now, read past a stuck stream: a copy on the side queue into a
        pinned word, waited for by polling (see :meth:`Backend.read_flag_word`)."""
        from cuda.bindings import driver as cu

        with self.defer_frees():  # (the stream may be stuck: no free may wait for it)
            q = self._prepare_flag_rescue()
            with self._readback_lock:
                word = self._flag_readback
                (err,) = cu.cuMemcpyDtoHAsync(word.ctypes.data, address_of(flags) + 4 * index, 4, q.handle)
                _check_cu(err, "cuMemcpyDtoHAsync(flag word)")
                self._finish_side_queue(q, timeout_s, f"reading flag word {index}")
                return int(word[0])

    def _prepare_flag_rescue(self) -> Queue:
        """Make what a stuck stream's rescue needs -- the side queue (returned) and the pinned
        word flag words are read into -- before the first wait is queued: page-locking host
        memory (cuMemHostAlloc) may wait for the whole device, which a stuck stream never lets
        finish."""
        q = self._flag_side_queue()
        with self._lock:
            if self._flag_readback is None:
                self._flag_readback = _gpu().pinned_array(1, np.uint32)
        return q

    def _wait_out_flag_waits(self, done, waits: list, who: str) -> None:
        """Poll ``done()`` until it is True; release (and report) every wait of ``waits`` whose
        deadline passes with its word short of its value.  RuntimeError once done, if any was."""
        from vtnumba.backend.cpu import flag_reached
        from vtnumba.backend.polling import backoff

        released: list[str] = []
        pending = list(waits)
        start = time.perf_counter()
        polls = 0
        # While a wait may be stuck, a free of device memory would wait for it -- and then
        # this loop could never release it (see Backend.defer_frees).
        with self.defer_frees():
            while not done():
                polls += 1
                now = time.monotonic()
                for w in [w for w in pending if now >= w[3]]:
                    flags, index, value, deadline = w
                    pending.remove(w)
                    seen = self._read_flag_word(flags, index)
                    if flag_reached(seen, value):
                        continue  # it arrived: the stream is busy with later work, not stuck
                    self.release_flag_word(flags, index, value)
                    released.append(f"flag word {index} to reach {value}; it is {seen}")
                backoff(polls, time.perf_counter() - start)
        if released:
            raise RuntimeError(f"{who}: timed out waiting for " + ", and for ".join(released) +
                               " -- a GPU stream's wait cannot be cancelled, so the backend stored the awaited "
                               "value into the word to let the queue drain: the work queued after the wait ran "
                               "without its input, do not use its results")

    def order_after_default_stream(self, q) -> None:
        """Make later work on ``q`` wait for what is queued on the legacy default stream now.

        vtnumba's queues are non-blocking streams, which the default stream does not order;
        an operation that reads arrays a caller produced with default-stream launches or
        copies calls this first.  (A no-op in the simulator: everything there is synchronous.)
        """
        self._check_queue(q)
        if self.simulator:
            return
        cuda = _gpu()
        ev = cuda.event(timing=False)
        ev.record(cuda.default_stream())
        ev.wait(q.stream)

    def order_default_stream_after(self, q) -> None:
        """Make later work on the legacy default stream wait for what is queued on ``q`` now
        (numba's own launches, and its synchronous copies such as ``copy_to_host``, go there).
        (A no-op in the simulator.)"""
        self._check_queue(q)
        if self.simulator:
            return
        cuda = _gpu()
        ev = cuda.event(timing=False)
        ev.record(q.stream)
        ev.wait(cuda.default_stream())

    @staticmethod
    def _raise_queue_error(q) -> None:
        if q.error is not None:
            err, q.error = q.error, None
            raise RuntimeError(f"a host function on queue {q.name} failed: {err!r}") from err

    def _run_sim(self, q, name, fn, args) -> None:
        # The simulator runs launches synchronously; one at a time per process.
        with SIM_LAUNCH_LOCK, trace.span(name, "queue", f"cudasim:{q.name}", **args):
            fn()

    def _submit(self, q, fn, name, trace_args) -> None:
        if self.simulator:
            self._run_sim(q, name, lambda: fn(q.stream), trace_args)
        elif trace.RECORDER is None:
            fn(q.stream)
        else:
            self._traced(q, name, trace_args, lambda: fn(q.stream))

    def _traced(self, q, name, trace_args, launch) -> None:
        """Call ``launch()``, which queues work on ``q``, and draw that work in the trace as the
        GPU ran it: between CUDA events recorded before and after it on ``q``.

        The events are read later, once they have fired (at the queue's next synchronize, or
        when the trace is written).  Waiting for them here would serialise every traced GPU call
        -- and block for good on a queue held by a flag wait, or by an event behind a host
        function that this very thread releases after the launch (the runtime tour's gate).
        So the queue's track shows device time: its spans never overlap (a stream runs its work
        in order), and a span starts when the GPU got to it, not when the host queued it.
        """
        rec = trace.RECORDER
        if rec is None:
            launch()
            return
        if q.id in self._capturing:
            # Recorded into a graph, not run: there is no device time to read (each replay has
            # its own), so the span is the host's launch, and says so.
            t0 = trace.now_ns()
            launch()
            rec.add(name, "queue", f"cuda:{q.name}", t0, trace.now_ns(),
                    dict(trace_args or {}, timing="host launch (capturing a graph)"))
            return
        origin = self._trace_origin()
        launch_ns = trace.now_ns()
        start, end = _timing_event(), _timing_event()
        _record_on(start, q.handle)
        launch()
        _record_on(end, q.handle)
        rec.defer(_DeviceSpan(rec, name, f"cuda:{q.name}", trace_args, origin, start, end, launch_ns).settle)

    def _trace_origin(self) -> tuple:
        """``(event, host_ns)``: a CUDA event that fired at a known ``perf_counter_ns`` time -- what
        turns a launch's event times into the trace's clock.  Taken on a stream of its own (the
        queues may be held) and renewed every 10 s, as the GPU's and the host's clocks drift
        apart (by parts per million).  (An old origin stays: spans still waiting may use it --
        one small event per 10 s of tracing.)"""
        origin = self._trace_origin_pair
        if origin is not None and trace.now_ns() - origin[1] < 10_000_000_000:
            return origin
        from cuda.bindings import driver as cu

        current_context()
        err, handle = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        _check_cu(err, "cuStreamCreate(CU_STREAM_NON_BLOCKING)")
        try:
            event = _timing_event()
            before = trace.now_ns()
            _record_on(event, handle)
            (err,) = cu.cuEventSynchronize(event)  # an empty stream: it fires at once, between the readings
            _check_cu(err, "cuEventSynchronize(the trace's origin)")
            after = trace.now_ns()
        finally:
            self._destroy_stream(handle)
        self._trace_origin_pair = (event, (before + after) // 2)
        return self._trace_origin_pair

    def _launch_host_func(self, q, fn, name) -> None:
        if self.simulator:
            self._run_sim(q, name, fn, {})
            return
        from cuda.bindings import driver as cu

        if q.id in self._capturing:
            # Captured, the host function would become a graph node that every replay calls --
            # but each key is called (and forgotten) once.
            raise RuntimeError(f"launch_host_func on {q} while it is capturing a graph: host functions "
                               "cannot be captured here; queue them outside the capture")
        key = next(_host_func_ids)
        # Taken here, where a context is current: on the driver's thread asking numba for it
        # would itself be a CUDA call.
        context = current_context()

        def call() -> None:
            # Runs on a driver thread once the stream gets here.  It must not call CUDA, and
            # an exception must not escape into C: keep it for the queue's next synchronize.
            # Any Python may drop the last reference to a device array, and numba may then
            # flush its pending frees -- cuMemFree, from inside a host function, where CUDA
            # calls are not allowed: the frees wait until the function has returned.
            try:
                with context.defer_cleanup():
                    fn()
            except BaseException as exc:  # noqa: BLE001
                if q.error is None:
                    q.error = exc

        _pending_host_funcs[key] = call
        (err,) = cu.cuLaunchHostFunc(q.handle, cu.CUhostFn(_HOST_FN_ADDRESS), key)
        if err != cu.CUresult.CUDA_SUCCESS:
            _pending_host_funcs.pop(key, None)
            _check_cu(err, "cuLaunchHostFunc")

    # ---------------------------------------------------------------- flags in queue order
    def _check_flag(self, flags, index, value, *, store: bool = True) -> tuple[int, int]:
        # On a GPU the word's address goes to the driver (or a kernel) as a *device* pointer: a
        # numpy or simulator array's host address there is invalid -- at best an error, at worst
        # an illegal access that kills the process's CUDA context.
        if not (is_device_array(flags) if self.simulator else is_gpu_array(flags)):
            # (The simulator refuses a numpy array too: a program that passed one there would
            # fail on a GPU.)
            raise TypeError(f"flags must be GPU memory (a numba device array: backend.empty, a Buffer's view, "
                            f"peer memory) on {self.name}, got {type(flags).__module__}.{type(flags).__name__}")
        return super()._check_flag(flags, index, value, store=store)

    def _write_value32(self, q, flags, index, value) -> None:
        if self.simulator:
            # Launches are synchronous here: everything before is done, so store now (release).
            word = host_view(flags)
            self._run_sim(q, "write_value32", lambda: store_release(word, index, value), {"value": value})
            return
        from cuda.bindings import driver as cu

        if self._memops_ok:
            (err,) = cu.cuStreamWriteValue32(q.handle, cu.CUdeviceptr(address_of(flags) + 4 * index), value,
                                             cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
            if self._memop_done(err, "cuStreamWriteValue32"):
                return
        from vtnumba.backend.cuda_flags import launch_write_flag

        launch_write_flag(flags, index, value, q.stream)

    def _wait_value32(self, q, flags, index, value, timeout_s) -> None:
        if self.simulator:
            # Nothing runs concurrently in the simulator: wait here, on the host, with a deadline
            # (outside the launch lock, so this process's other threads can still launch).
            wait_flag_word(host_view(flags), index, value, timeout_s, f"queue {q.name}")
            return
        from cuda.bindings import driver as cu

        if self._flag_readback is None:
            self._prepare_flag_rescue()
        # Kept for synchronize, which polls instead of blocking while waits are pending.  (A
        # queue that is never synchronized forgets the ones an idle stream has passed.)
        if len(q.flag_waits) >= 256 and self._stream_idle(q):
            q.flag_waits = []
        q.flag_waits.append((flags, index, value, time.monotonic() + timeout_s))
        if self._memops_ok:
            (err,) = cu.cuStreamWaitValue32(q.handle, cu.CUdeviceptr(address_of(flags) + 4 * index), value,
                                            cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            if self._memop_done(err, "cuStreamWaitValue32"):
                return
        from vtnumba.backend.cuda_flags import launch_wait_flag

        launch_wait_flag(flags, index, value, q.stream)

    def _memop_done(self, err, what: str) -> bool:
        """True if a stream memory operation was queued; False (for good) if the driver refuses
        them, so the caller falls back to the flag kernels; other errors raise."""
        from cuda.bindings import driver as cu

        if err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED:
            from vtnumba.backend.cuda_flags import load_flag_kernels

            self._memops_ok = False
            load_flag_kernels()  # before a stream waits on one (see load_flag_kernels)
            return False
        _check_cu(err, what)
        return True

    # ---------------------------------------------------------------- events
    def _create_event(self, blocking, timing) -> Event:
        native = None if self.simulator else _gpu().event(timing=timing)
        return _CUDAEvent(self, blocking, timing, native)

    def _destroy_event(self, e) -> None:
        e.native = None

    def _record_event(self, e, q) -> None:
        if self.simulator:
            mark = EventMark()
            mark.fire()  # everything submitted before is already done in the simulator
            e.mark = mark
            return
        e.native.record(q.stream)
        e.flag_waits = (q.flag_waits, len(q.flag_waits))  # the event fires only after these waits passed

    def _synchronize_event(self, e) -> None:
        if not self.simulator:
            waits, count = e.flag_waits
            if count:
                self._wait_out_flag_waits(lambda: _event_done(e.native.handle, "an event"), waits[:count], "an event")
                e.flag_waits = ([], 0)
            e.native.synchronize()

    def _query_event(self, e) -> bool:
        return True if self.simulator else _event_done(e.native.handle, "query_event")

    def _queue_wait_event(self, q, e) -> None:
        if not self.simulator:
            e.native.wait(q.stream)
            # q now also waits for the flag waits the event fires after: a synchronize of q
            # must keep their deadlines too, not block in the driver.
            waits, count = e.flag_waits
            known = {id(w) for w in q.flag_waits}
            q.flag_waits.extend(w for w in waits[:count] if id(w) not in known)

    def _elapsed_ms(self, start, end) -> float:
        if self.simulator:
            return (end.mark.time_ns - start.mark.time_ns) / 1e6
        self._synchronize_event(end)
        self._synchronize_event(start)
        return float(_gpu().event_elapsed_time(start.native, end.native))

    # ---------------------------------------------------------------- graphs (real GPU)
    def _begin_capture(self, q):
        """Start capturing ``q``; the state returned is numba's deferred-free guard, held until
        the capture ends or is discarded."""
        from cuda.bindings import driver as cu

        # numba frees device memory lazily, in batches, from whichever call happens to push
        # its list of pending frees over a limit.  A cuMemFree is not allowed while this thread
        # captures: it would invalidate the capture.  So frees wait until the capture is over.
        no_frees = self.defer_frees()
        if self._flag_readback is None:
            self._prepare_flag_rescue()  # (a flag wait captured first would page-lock inside the capture)
        no_frees.__enter__()
        (err,) = cu.cuStreamBeginCapture(q.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        if err != cu.CUresult.CUDA_SUCCESS:
            no_frees.__exit__(None, None, None)
            _check_cu(err, "cuStreamBeginCapture")
        return no_frees

    def _end_capture(self, q, state):
        from cuda.bindings import driver as cu

        try:
            err, graph = cu.cuStreamEndCapture(q.handle)
        finally:
            state.__exit__(None, None, None)  # the frees held back during the capture may run now
        _check_cu(err, "cuStreamEndCapture")
        err, exec_graph = cu.cuGraphInstantiate(graph, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            cu.cuGraphDestroy(graph)  # the raise below drops the only reference to it
            _check_cu(err, "cuGraphInstantiate")
        return graph, exec_graph

    def _discard_capture(self, q, state) -> None:
        from cuda.bindings import driver as cu

        # Ending the capture takes the stream out of capture mode even if the capture broke;
        # the graph it returns (None when it broke) has no other owner.
        try:
            err, graph = cu.cuStreamEndCapture(q.handle)
        finally:
            state.__exit__(None, None, None)
        if err == cu.CUresult.CUDA_SUCCESS and graph is not None and int(graph):
            cu.cuGraphDestroy(graph)

    def _replay(self, q, native) -> None:
        from cuda.bindings import driver as cu

        errors = []
        self._traced(q, "graph_replay", {}, lambda: errors.extend(cu.cuGraphLaunch(native[1], q.handle)))
        _check_cu(errors[0], "cuGraphLaunch")

    def _destroy_graph(self, native) -> None:
        from cuda.bindings import driver as cu

        cu.cuGraphExecDestroy(native[1])
        cu.cuGraphDestroy(native[0])


def _stream_done(handle, what: str) -> bool:
    """Has the stream ``handle`` finished all its work?  (``cuStreamQuery``; RuntimeError on
    an error other than "not ready", naming ``what``.)"""
    from cuda.bindings import driver as cu

    (err,) = cu.cuStreamQuery(handle)
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    _check_cu(err, f"cuStreamQuery({what})")
    return True


class _DeviceSpan:
    """One traced GPU launch between two CUDA events, added to the trace once both have fired.

    Its times are the events' offsets from the backend's origin event (see
    ``CUDABackend._trace_origin``), on the host's clock.  A launch still unfinished when the
    trace is written (``final``) is drawn at its launch time and says so.  The events are the
    driver's own (cuda.bindings), not numba's: numba destroys its events from its exit hooks,
    which can run before the trace is written at exit.  Settled, the span destroys them.
    """

    __slots__ = ("rec", "name", "track", "args", "origin", "start", "end", "launch_ns")

    def __init__(self, rec, name, track, args, origin, start, end, launch_ns):
        self.rec, self.name, self.track, self.args = rec, name, track, args
        self.origin, self.start, self.end, self.launch_ns = origin, start, end, launch_ns

    def settle(self, final: bool) -> bool:
        times = None
        try:
            if _event_done(self.end, "a traced launch's end event"):
                origin_event, origin_ns = self.origin
                t0 = origin_ns + round(_elapsed_ms(origin_event, self.start) * 1e6)
                # (The duration from the launch's own two events: an offset from an origin
                # seconds old is a float32 of milliseconds, good to about a microsecond.)
                times = t0, t0 + round(_elapsed_ms(self.start, self.end) * 1e6)
        except Exception:  # noqa: BLE001 (the context is gone -- after a fatal GPU error): as if unfinished
            pass
        if times is None and not final:
            return False
        if times is not None:
            self.rec.add(self.name, "queue", self.track, *times, self.args)
        else:
            self.rec.add(self.name, "queue", self.track, self.launch_ns, self.launch_ns,
                         dict(self.args or {}, timing="host launch (not finished when the trace was written)"))
        for event in (self.start, self.end):
            _destroy_timing_event(event)
        return True


def _timing_event():
    """A new timing CUDA event, the driver's (see _DeviceSpan)."""
    from cuda.bindings import driver as cu

    err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT)
    _check_cu(err, "cuEventCreate")
    return event


def _record_on(event, stream_handle) -> None:
    from cuda.bindings import driver as cu

    (err,) = cu.cuEventRecord(event, stream_handle)
    _check_cu(err, "cuEventRecord")


def _elapsed_ms(first, second) -> float:
    """Milliseconds from CUDA event ``first`` to ``second`` (both fired)."""
    from cuda.bindings import driver as cu

    err, ms = cu.cuEventElapsedTime(first, second)
    _check_cu(err, "cuEventElapsedTime")
    return ms


def _destroy_timing_event(event) -> None:
    from cuda.bindings import driver as cu

    cu.cuEventDestroy(event)  # (an error here -- the context gone -- leaves nothing to release)


def _settle_trace() -> None:
    """Add the traced launches whose events have fired (after a synchronize, usually all of them)."""
    rec = trace.RECORDER
    if rec is not None:
        rec.settle()


def _event_done(handle, what: str) -> bool:
    """Has the event ``handle`` fired?  (``cuEventQuery`` straight from cuda.bindings: numba's
    ``Event.query`` answers the same, but logs an ERROR record -- and builds an exception --
    for every "not ready", and the deadline loops poll unfinished events thousands of times.)"""
    from cuda.bindings import driver as cu

    (err,) = cu.cuEventQuery(handle)
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    _check_cu(err, f"cuEventQuery({what})")
    return True


def _page_locked(host_array) -> bool:
    """Is ``host_array``'s memory page-locked (allocated pinned, or registered) for CUDA?  Copies
    between the device and pageable memory are staged by the driver and block the caller."""
    from cuda.bindings import driver as cu

    err, _ = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                      host_array.ctypes.data)
    return err == cu.CUresult.CUDA_SUCCESS


def _check_cu(err, what: str) -> None:
    from cuda.bindings import driver as cu

    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


def cuda_backend_for_target() -> CUDABackend:
    """A CUDABackend matching the process target (cuda or cudasim)."""
    t = current_target()
    if not t.uses_cuda_kernels:
        raise RuntimeError(f"the process target is {t.name!r}; CUDABackend needs 'cuda' or 'cudasim'")
    return CUDABackend()
