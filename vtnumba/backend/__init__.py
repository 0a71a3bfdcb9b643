"""The device runtime: devices, dtypes, arrays, the Backend seam, the CPU and CUDA backends, the registry.

Reading order (one concept per module):

* :mod:`~vtnumba.backend.device` / :mod:`~vtnumba.backend.dtype` -- where memory lives, what it holds;
* :mod:`~vtnumba.backend.arrays`   -- the array kinds of the three targets and the argument checks
  every layer uses (where the package looks inside numba's arrays);
* :mod:`~vtnumba.backend.base`     -- the Backend seam (vllm.cpp: ``vt/backend.h``), Buffer, Queue,
  Event, and :class:`Capabilities`;
* :mod:`~vtnumba.backend.atomics` / :mod:`~vtnumba.backend.polling` -- acquire/release flag words
  and waiting with a deadline;
* :mod:`~vtnumba.backend.cpu`      -- host memory, synchronous or threaded queues;
* :mod:`~vtnumba.backend.cuda`     -- numba-cuda on a GPU or in the simulator
  (:mod:`~vtnumba.backend.cuda_flags`, :mod:`~vtnumba.backend.cuda_stack`);
* :mod:`~vtnumba.backend.registry` / :mod:`~vtnumba.backend.default` -- which backend serves which device;
  :mod:`~vtnumba.backend.device_choice` -- which GPU this process uses.
"""

from vtnumba.backend.arrays import check_nbytes
from vtnumba.backend.base import (
    FLAG_MAX,
    Backend,
    Buffer,
    Capabilities,
    Event,
    GraphHandle,
    Queue,
    add_use_observer,
    remove_use_observer,
)
from vtnumba.backend.cpu import CPUBackend
from vtnumba.backend.default import default_backend, default_cuda_device, default_device
from vtnumba.backend.device import CPU, MAX_DEVICES_PER_TYPE, Device, DeviceType, as_device
from vtnumba.backend.dtype import DType, as_dtype, check_dtype_supported, supported_dtypes
from vtnumba.backend.registry import (
    DeviceResourceOps,
    alloc,
    create_queue,
    destroy_queue,
    free,
    get_backend,
    register_backend,
    registered_devices,
    try_get_backend,
    unregister_backend,
)

__all__ = [
    "Backend", "Buffer", "Capabilities", "FLAG_MAX", "Event", "add_use_observer", "remove_use_observer", "GraphHandle", "Queue", "check_nbytes", "CPUBackend", "CPU",
    "MAX_DEVICES_PER_TYPE", "Device", "DeviceType", "as_device", "DType", "as_dtype", "check_dtype_supported",
    "supported_dtypes", "DeviceResourceOps", "alloc", "create_queue", "destroy_queue", "free", "get_backend",
    "register_backend", "registered_devices", "try_get_backend", "unregister_backend", "default_backend",
    "default_device", "default_cuda_device",
]
