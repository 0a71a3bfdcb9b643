"""Plumbing shared by every kernel entry point: where the arrays live, argument checks, launching.

Each public kernel function (``matmul``, ``fused_add_rms_norm``, ``peer_reduce_norm`` ...)
follows the same three steps, and this module holds the shared part of each:

1. **Where do the arrays live?**  numpy arrays run the host reference (the ``cpu``
   target); numba device arrays (a real ``DeviceNDArray``, or the simulator's
   ``FakeCUDAArray``) run the ``@cuda.jit`` kernel.  Mixing the two in one call is an
   error: a numpy array handed to a kernel would be *copied* in and back, which silently
   breaks peer buffers and stream ordering.
2. **Are the arguments what the kernel expects?**  Shapes, dtypes and C-contiguity are
   checked at the public boundary, with messages that name the argument, the value and
   what was expected -- a kernel would otherwise index out of bounds or compute garbage.
3. **Run it in queue order.**  With a ``queue`` the work goes through
   ``backend.submit(queue, fn)`` -- on cpu ``fn`` is the host reference itself (run on the
   queue's worker thread in threaded mode, so queue order and events stay meaningful); on
   cuda ``fn`` launches the kernel into the queue's stream.  Without a queue the call is
   synchronous: the host reference runs inline, a kernel runs on the default stream and is
   waited for (in the simulator under the process-wide launch lock, because the simulator
   can run only one kernel per process at a time).

Nothing here imports ``numba.cuda`` unless a device array is actually seen, so the cpu
target never pays for (or is locked out of the simulator by) that import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

HOST = "host"
DEVICE = "device"


def _looks_like_numba_cuda(obj) -> bool:
    # A cheap test before importing numba.cuda: device arrays come from numba.cuda modules.
    return type(obj).__module__.startswith("numba.cuda")


def array_kind(name: str, arr) -> str:
    """``"host"`` for a numpy array, ``"device"`` for a numba device array; TypeError otherwise."""
    if isinstance(arr, np.ndarray):
        return HOST
    if _looks_like_numba_cuda(arr):
        from vtnumba.backend.cuda import is_device_array

        if is_device_array(arr):
            return DEVICE
    raise TypeError(f"{name} must be a numpy array (cpu) or a numba device array (cuda/cudasim), "
                    f"got {type(arr).__module__}.{type(arr).__name__}")


def common_kind(arrays: dict[str, Any]) -> str:
    """The one kind shared by all non-None arrays in ``arrays`` (name -> array)."""
    kinds = {name: array_kind(name, arr) for name, arr in arrays.items() if arr is not None}
    if not kinds:
        raise ValueError("no arrays given")
    if len(set(kinds.values())) > 1:
        hosts = [n for n, k in kinds.items() if k == HOST]
        devs = [n for n, k in kinds.items() if k == DEVICE]
        raise TypeError(f"arrays must all be numpy arrays or all device arrays; got numpy for "
                        f"{', '.join(hosts)} and device arrays for {', '.join(devs)}")
    return next(iter(kinds.values()))


def is_c_contiguous(arr) -> bool:
    flags = getattr(arr, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            pass
    fn = getattr(arr, "is_c_contiguous", None)
    return bool(fn()) if fn is not None else False


def check_array(name: str, arr, *, ndim: int, dtypes: Iterable, shape: tuple | None = None,
                contiguous: bool = True) -> None:
    """Validate one array argument; ``shape`` entries of None are free."""
    dtypes = tuple(np.dtype(d) for d in dtypes)
    if getattr(arr, "ndim", None) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got ndim={getattr(arr, 'ndim', None)} "
                         f"(shape {getattr(arr, 'shape', None)})")
    if np.dtype(arr.dtype) not in dtypes:
        names = " or ".join(d.name for d in dtypes)
        raise TypeError(f"{name} has dtype {np.dtype(arr.dtype).name}; expected {names}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(arr.shape, shape, strict=True)):
            if want is not None and got != want:
                raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected "
                                 f"{tuple('?' if s is None else s for s in shape)} (axis {axis} is {got}, "
                                 f"not {want})")
    if contiguous and not is_c_contiguous(arr):
        raise ValueError(f"{name} (shape {tuple(arr.shape)}) must be C-contiguous; pass a contiguous copy")


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps={eps!r} must be a float")
    eps = float(eps)
    if not eps > 0 or not np.isfinite(eps):
        raise ValueError(f"eps={eps} must be a positive finite float (it keeps rsqrt finite)")
    return eps


def empty(kind: str, shape: tuple, dtype) -> Any:
    """A fresh uninitialised array of the given kind (used when the caller passes no ``out``)."""
    if kind == HOST:
        return np.empty(shape, dtype=dtype)
    from numba import cuda

    return cuda.device_array(shape, dtype=dtype)


def _resolve_backend(kind: str, queue, backend):
    from vtnumba.backend.base import Queue
    from vtnumba.backend.device import DeviceType

    if not isinstance(queue, Queue):
        raise TypeError(f"queue must be a vtnumba Queue or None, got {type(queue).__name__}")
    if backend is None:
        backend = queue.backend
    elif queue.backend is not backend:
        raise ValueError(f"queue={queue.name} belongs to {queue.backend.name}, not to backend={backend.name}")
    want = DeviceType.CPU if kind == HOST else DeviceType.CUDA
    if backend.device_type is not want:
        what = "numpy arrays need a cpu backend queue" if kind == HOST else \
            "device arrays need a cuda backend queue"
        raise TypeError(f"queue={queue.name} is on {backend.name}, but {what}")
    return backend


def run(kind: str, name: str, queue, backend, host_fn: Callable[[], None],
        launch_fn: Callable[[Any], None], **trace_args) -> None:
    """Run ``host_fn()`` (host arrays) or ``launch_fn(stream)`` (device arrays) in queue order.

    See the module docstring for the three cases (queue / no queue / simulator).
    """
    if queue is not None:
        backend = _resolve_backend(kind, queue, backend)
        if kind == HOST:
            backend.submit(queue, lambda _stream: host_fn(), name=name, **trace_args)
        else:
            backend.submit(queue, launch_fn, name=name, **trace_args)
        return
    if kind == HOST:
        host_fn()
        return
    from numba import cuda

    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK, simulator_active

    if simulator_active():
        with SIM_LAUNCH_LOCK:
            launch_fn(cuda.default_stream())
        return
    stream = cuda.default_stream()
    launch_fn(stream)
    stream.synchronize()  # no queue means a synchronous call: the result is ready on return


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
