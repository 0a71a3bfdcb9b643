"""vtnumba: an inference-engine runtime you can read, run, step through and measure.

Three parts, one code base, three targets (``cpu``, ``cudasim``, ``cuda``):

1. the device runtime (:mod:`vtnumba.backend`, :mod:`vtnumba.memory`);
2. TPSP, the fused tensor-parallel matmul / reduce-scatter / norm / all-gather
   (:mod:`vtnumba.tpsp`, over :mod:`vtnumba.dist` and :mod:`vtnumba.kernels`);
3. the encoder-cache connector (:mod:`vtnumba.ec`).

Importing vtnumba never imports ``numba.cuda``: the target (and with it numba's simulator
switch) is chosen first -- see :mod:`vtnumba.target`.
"""

from vtnumba._threads import share_cores_between_local_ranks

share_cores_between_local_ranks()  # must run before numpy (imported below) loads BLAS

from vtnumba.backend import (  # noqa: E402
    CPU,
    Backend,
    Buffer,
    CPUBackend,
    Device,
    DeviceResourceOps,
    DeviceType,
    DType,
    Event,
    GraphHandle,
    Queue,
    alloc,
    create_queue,
    default_backend,
    default_device,
    destroy_queue,
    free,
    get_backend,
    register_backend,
    try_get_backend,
)
from vtnumba.target import current_target, select_target  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    # CUDABackend imports numba.cuda, so it is loaded only when asked for.
    if name == "CUDABackend":
        from vtnumba.backend.cuda import CUDABackend

        return CUDABackend
    raise AttributeError(f"module 'vtnumba' has no attribute {name!r}")


__all__ = [
    "CPU", "Backend", "Buffer", "CPUBackend", "CUDABackend", "Device", "DeviceResourceOps", "DeviceType", "DType",
    "Event", "GraphHandle", "Queue", "alloc", "create_queue", "default_backend", "default_device",
    "destroy_queue", "free", "get_backend", "register_backend", "try_get_backend", "current_target",
    "select_target", "__version__",
]
