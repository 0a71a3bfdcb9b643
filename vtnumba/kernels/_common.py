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

from collections.abc import Callable
from typing import Any

from vtnumba.backend.arrays import (  # noqa: F401  (re-exported: the kernels' shared vocabulary)
    DEVICE,
    HOST,
    array_kind,
    cdiv,
    check_array,
    check_eps,
    common_kind,
    empty,
    is_c_contiguous,
)

#: How the host references are compiled.  ``nogil`` lets a threaded queue run them beside
#: other work.  The fast-math flags allow what vectorising a float32 sum needs -- reassociation
#: (SIMD lanes keep separate partial sums), contraction into FMAs, reciprocal approximations,
#: ignoring the sign of zero -- but *not* "no NaNs / no infinities": a NaN in a row must come
#: out as NaN, as on a GPU, not be optimised into anything else.  ``error_model="numpy"`` makes
#: a division by zero an IEEE infinity or NaN instead of a Python ZeroDivisionError raised
#: from inside a queued kernel.
HOST_JIT = dict(nogil=True, fastmath={"reassoc", "contract", "arcp", "nsz"}, error_model="numpy", cache=True)


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
        launch_fn: Callable[[Any], None], *, uses=(), **trace_args) -> None:
    """Run ``host_fn()`` (host arrays) or ``launch_fn(stream)`` (device arrays) in queue order.

    See the module docstring for the three cases (queue / no queue / simulator).
    """
    if queue is not None:
        backend = _resolve_backend(kind, queue, backend)
        # ``uses``: the arrays the work touches, for the hazard checker (see Backend.submit).
        if kind == HOST:
            backend.submit(queue, lambda _stream: host_fn(), name=name, uses=uses, **trace_args)
        else:
            backend.submit(queue, launch_fn, name=name, uses=uses, **trace_args)
        return
    if kind == HOST:
        host_fn()
        return
    from numba import cuda

    from vtnumba.backend.arrays import simulator_active
    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK

    if simulator_active():
        with SIM_LAUNCH_LOCK:
            launch_fn(cuda.default_stream())
        return
    stream = cuda.default_stream()
    launch_fn(stream)
    stream.synchronize()  # no queue means a synchronous call: the result is ready on return

