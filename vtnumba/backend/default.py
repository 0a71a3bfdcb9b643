"""The process's default device and backend, following the chosen target.

``default_backend()`` looks in the registry first and creates (and registers) the
target's backend on first use: a :class:`CPUBackend` for ``cpu``, a :class:`CUDABackend`
for ``cuda`` and ``cudasim``.  Everything above the backend layer asks here instead of
constructing backends itself, so a whole run shares one backend per device.
"""

from __future__ import annotations

import threading

from vtnumba.backend.base import Backend
from vtnumba.backend.device import CPU, Device, DeviceType
from vtnumba.backend.registry import register_backend, try_get_backend
from vtnumba.target import current_target

_lock = threading.Lock()


def default_device() -> Device:
    """The target's device: ``cpu:0`` on the cpu target, ``cuda:0`` on cuda and cudasim."""
    return CPU if current_target().name == "cpu" else Device(DeviceType.CUDA, 0)


def default_backend(device: Device | None = None) -> Backend:
    """The registered backend for ``device`` (default: the target's), created on first use."""
    device = device or default_device()
    with _lock:
        backend = try_get_backend(device)
        if backend is None:
            if device.type is DeviceType.CPU:
                from vtnumba.backend.cpu import CPUBackend

                backend = CPUBackend(device)
            else:
                from vtnumba.backend.cuda import CUDABackend

                backend = CUDABackend(device)
            register_backend(device, backend)
        return backend
