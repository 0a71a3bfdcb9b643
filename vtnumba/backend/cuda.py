"""The CUDA backend on numba-cuda: a real GPU, or numba's CUDA simulator.

On a real GPU a :class:`Queue` wraps a CUDA stream, an :class:`Event` a CUDA event, and
``alloc`` returns device memory from numba (``cuMemAlloc``, 256-byte aligned).  Graph
capture uses cuda.bindings stream capture around numba launches (warm kernels first: a
first-call compilation inside capture would try to synchronise).

In the simulator (``VTNUMBA_TARGET=cudasim``) numba gives us kernels but not a runtime:
streams are ignored, events cannot be queried or timed, and only one kernel may run per
process at a time (a second thread's launch is mistaken for a device-function call).
This backend fills those gaps with *honest host semantics*: the simulator runs every
launch synchronously, so work is complete when it is submitted; an event is recorded
with the host clock at that moment (so ``query_event`` is True and ``elapsed_ms`` is the
real host time between the two records); each queue keeps its own identity; and a
process-wide lock serialises launches.  Device memory is host memory wrapped in the
simulator's ``FakeCUDAArray``, which kernels see *without* copying -- plain numpy
arguments would be copied in and back (see the shared notes), which breaks peer buffers.
"""

from __future__ import annotations

import threading

import numpy as np

from vtnumba import trace
from vtnumba.backend.base import Backend, Buffer, Event, Queue
from vtnumba.backend.cpu import _Mark, aligned_empty
from vtnumba.backend.device import Device, DeviceType
from vtnumba.target import current_target

# One kernel at a time per process in the simulator (see module docstring).
SIM_LAUNCH_LOCK = threading.RLock()


def _cuda():
    from numba import cuda

    return cuda


def simulator_active() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def fake_device_array(host: np.ndarray):
    """Wrap host memory as a simulator device array that kernels use in place (zero-copy)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(host)


def is_device_array(obj) -> bool:
    """Is ``obj`` a numba device array (real or simulated)?"""
    if simulator_active():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(obj, FakeCUDAArray)
    try:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, DeviceNDArray)


def sim_host_view(obj) -> np.ndarray:
    """The numpy array behind a simulator device array (or the array itself)."""
    if isinstance(obj, np.ndarray):
        return obj
    ary = getattr(obj, "_ary", None)
    if ary is None:
        raise TypeError(f"expected a numpy or simulator device array, got {type(obj).__name__}")
    return ary


def to_host_array(arr) -> np.ndarray:
    """A numpy array with ``arr``'s contents: itself (numpy), the simulator's host memory
    behind it (no copy), or a device-to-host copy (real GPU)."""
    if isinstance(arr, np.ndarray):
        return arr
    try:
        return sim_host_view(arr)
    except TypeError:
        return arr.copy_to_host()


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
    def __init__(self, backend, name, stream):
        super().__init__(backend, name)
        self.stream = stream


class _CUDAEvent(Event):
    def __init__(self, backend, blocking, native):
        super().__init__(backend, blocking)
        self.native = native  # a numba Event on a real GPU; None in the simulator
        self.mark = _Mark()
        self.mark.fire()


class CUDABackend(Backend):
    """A CUDA device through numba-cuda; see the module docstring for the simulator."""

    device_type = DeviceType.CUDA

    def __init__(self, device: Device | None = None):
        device = device or Device(DeviceType.CUDA, 0)
        if device.type is not DeviceType.CUDA:
            raise ValueError(f"device={device} must be a CUDA device for CUDABackend")
        super().__init__(device)
        cuda = _cuda()
        self.simulator = simulator_active()
        if not self.simulator:
            if not cuda.is_available():
                raise RuntimeError("CUDABackend: no usable CUDA GPU (use VTNUMBA_TARGET=cpu or cudasim)")
            cuda.select_device(device.index)
        self._queues_by_id: dict[int, _CUDAQueue] = {}

    @property
    def name(self) -> str:
        return "CUDABackend(simulator)" if self.simulator else "CUDABackend"

    def unified_memory(self) -> bool:
        # The simulator's "device" memory is host memory, but we keep copy semantics so code
        # written against it is correct on a GPU.
        return False

    def device_capability(self) -> tuple[int, int]:
        if self.simulator:
            return (0, 0)
        return tuple(_cuda().get_current_device().compute_capability)

    def supports_graph_capture(self) -> bool:
        return not self.simulator

    def supports_aux_stream(self) -> bool:
        return not self.simulator  # simulated launches are serialised

    def device_name(self) -> str:
        if self.simulator:
            return "numba CUDA simulator"
        name = _cuda().get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)

    # ---------------------------------------------------------------- memory
    def _alloc(self, nbytes: int) -> Buffer:
        if self.simulator:
            host = aligned_empty(nbytes)
            return Buffer(self, self.device, nbytes, fake_device_array(host), ptr=host.ctypes.data, owner=host)
        arr = _cuda().device_array(max(nbytes, 1), dtype=np.uint8)[:nbytes]
        ptr = arr.__cuda_array_interface__["data"][0] if nbytes else 0
        return Buffer(self, self.device, nbytes, arr, ptr=ptr)

    def _alloc_pinned(self, nbytes: int) -> Buffer:
        if self.simulator:
            host = aligned_empty(nbytes)
            return Buffer(self, self.device, nbytes, host, pinned=True, ptr=host.ctypes.data)
        host = _cuda().pinned_array(max(nbytes, 1), dtype=np.uint8)[:nbytes]
        return Buffer(self, self.device, nbytes, host, pinned=True, ptr=host.ctypes.data)

    def _free(self, buf: Buffer) -> None:
        # numba frees device memory when the last reference goes; its deallocations are
        # deferred until no stream can still use them, so dropping the array is safe.
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

        view = buf.array[offset:offset + nbytes]
        with trace.span("memset", "queue", f"cuda:{q.name}", bytes=nbytes):
            driver.device_memset(view, value, nbytes, stream=q.stream)

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
        with trace.span("copy", "queue", f"cuda:{q.name}", bytes=nbytes):
            if d_dev:
                d.copy_to_device(s, stream=q.stream)  # H2D or D2D
            elif s_dev:
                s.copy_to_host(d, stream=q.stream)  # D2H
            else:
                q.stream.synchronize()  # H2H must still respect queue order
                np.copyto(d, s)

    # ---------------------------------------------------------------- queues
    def _create_queue(self, name) -> Queue:
        q = _CUDAQueue(self, name, _cuda().stream())
        self._queues_by_id[q.id] = q
        return q

    def _destroy_queue(self, q) -> None:
        self._queues_by_id.pop(q.id, None)
        q.stream = None

    def _synchronize(self, q) -> None:
        if not self.simulator:
            with trace.span("synchronize", "host", "host", queue=q.name):
                q.stream.synchronize()

    def _synchronize_all(self) -> None:
        if not self.simulator:
            _cuda().synchronize()

    def _run_sim(self, q, name, fn, args) -> None:
        # The simulator runs launches synchronously; one at a time per process.
        with SIM_LAUNCH_LOCK, trace.span(name, "queue", f"cudasim:{q.name}", **args):
            fn()

    def _submit(self, q, fn, name, trace_args) -> None:
        if self.simulator:
            self._run_sim(q, name, lambda: fn(q.stream), trace_args)
            return
        rec = trace.RECORDER
        if rec is None:
            fn(q.stream)
            return
        # With tracing on, bracket the launch with events so the span is device time.
        start, end = _cuda().event(), _cuda().event()
        start.record(q.stream)
        fn(q.stream)
        end.record(q.stream)
        end.synchronize()
        t_end = trace.now_ns()
        ms = _cuda().event_elapsed_time(start, end)
        rec.add(name, "queue", f"cuda:{q.name}", t_end - int(ms * 1e6), t_end, trace_args)

    def _launch_host_func(self, q, fn, name) -> None:
        if self.simulator:
            self._run_sim(q, name, fn, {})
            return
        q.stream.add_callback(lambda stream, status, arg: fn(), None)

    # ---------------------------------------------------------------- events
    def _create_event(self, blocking) -> Event:
        native = None if self.simulator else _cuda().event(timing=True)
        return _CUDAEvent(self, blocking, native)

    def _destroy_event(self, e) -> None:
        e.native = None

    def _record_event(self, e, q) -> None:
        if self.simulator:
            mark = _Mark()
            mark.fire()  # everything submitted before is already done in the simulator
            e.mark = mark
            return
        e.native.record(q.stream)

    def _synchronize_event(self, e) -> None:
        if not self.simulator:
            e.native.synchronize()

    def _query_event(self, e) -> bool:
        return True if self.simulator else bool(e.native.query())

    def _queue_wait_event(self, q, e) -> None:
        if not self.simulator:
            e.native.wait(q.stream)

    def _elapsed_ms(self, start, end) -> float:
        if self.simulator:
            return (end.mark.time_ns - start.mark.time_ns) / 1e6
        end.native.synchronize()
        start.native.synchronize()
        return float(_cuda().event_elapsed_time(start.native, end.native))

    # ---------------------------------------------------------------- graphs (real GPU)
    def _begin_capture(self, q):
        from cuda.bindings import driver as cu

        (err,) = cu.cuStreamBeginCapture(q.stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        _check_cu(err, "cuStreamBeginCapture")
        return True

    def _end_capture(self, q, state):
        from cuda.bindings import driver as cu

        err, graph = cu.cuStreamEndCapture(q.stream.handle)
        _check_cu(err, "cuStreamEndCapture")
        err, exec_graph = cu.cuGraphInstantiate(graph, 0)
        _check_cu(err, "cuGraphInstantiate")
        return graph, exec_graph

    def _replay(self, q, native) -> None:
        from cuda.bindings import driver as cu

        with trace.span("graph_replay", "queue", f"cuda:{q.name}"):
            (err,) = cu.cuGraphLaunch(native[1], q.stream.handle)
        _check_cu(err, "cuGraphLaunch")

    def _destroy_graph(self, native) -> None:
        from cuda.bindings import driver as cu

        cu.cuGraphExecDestroy(native[1])
        cu.cuGraphDestroy(native[0])


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
