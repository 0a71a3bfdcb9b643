"""The device runtime: devices, dtypes, the Backend seam, the CPU and CUDA backends, the registry."""

from vtnumba.backend.base import Backend, Buffer, Event, GraphHandle, Queue, check_nbytes
from vtnumba.backend.cpu import CPUBackend
from vtnumba.backend.device import CPU, MAX_DEVICES_PER_TYPE, Device, DeviceType
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
from vtnumba.backend.default import default_backend, default_device

__all__ = [
    "Backend", "Buffer", "Event", "GraphHandle", "Queue", "check_nbytes", "CPUBackend", "CPU",
    "MAX_DEVICES_PER_TYPE", "Device", "DeviceType", "DType", "as_dtype", "check_dtype_supported",
    "supported_dtypes", "DeviceResourceOps", "alloc", "create_queue", "destroy_queue", "free", "get_backend",
    "register_backend", "registered_devices", "try_get_backend", "unregister_backend", "default_backend",
    "default_device",
]
