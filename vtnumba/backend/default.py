"""The process's default device and backend, following the chosen target.

On the ``cuda`` target the default device is the GPU of this rank's node-local rank (or
``VTNUMBA_DEVICE``): :mod:`vtnumba.backend.device_choice` says why and how.

``default_backend()`` looks in the registry first and creates (and registers) the
target's backend on first use (and again after the registered one was closed): a :class:`CPUBackend` for ``cpu``, a :class:`CUDABackend`
for ``cuda`` and ``cudasim``.  Everything above the backend layer asks here instead of
constructing backends itself, so a whole run shares one backend per device.
"""

from __future__ import annotations

import threading

from vtnumba.backend.base import Backend
from vtnumba.backend.device import CPU, Device, DeviceType, as_device
from vtnumba.backend.registry import register_backend, try_get_backend
from vtnumba.target import current_target

_lock = threading.Lock()


def default_cuda_device() -> Device:
    """This process's CUDA device: ``cuda:N`` with ``N`` from
    :func:`~vtnumba.backend.device_choice.process_cuda_device` on the cuda target, ``cuda:0``
    (the simulated device) otherwise."""
    from vtnumba.backend.device_choice import process_cuda_device

    return Device(DeviceType.CUDA, process_cuda_device().index)


def default_device() -> Device:
    """The target's device: ``cpu:0`` on the cpu target, :func:`default_cuda_device` on cuda and cudasim."""
    return CPU if current_target().name == "cpu" else default_cuda_device()


def default_backend(device: Device | DeviceType | str | None = None) -> Backend:
    """The registered backend for ``device`` (default: the target's), created on first use --
    and made anew once the registered one was closed (a closed backend refuses all work)."""
    if device is None:
        device = default_device()
    else:
        device = as_device(device)  # a DeviceType or "cuda" means its device 0; "cuda:1" its device 1
    with _lock:
        backend = try_get_backend(device)
        if backend is None or backend.closed:
            if device.type is DeviceType.CPU:
                from vtnumba.backend.cpu import CPUBackend

                backend = CPUBackend(device)
            else:
                from vtnumba.backend.cuda import CUDABackend

                backend = CUDABackend(device)
            register_backend(device, backend)
        return backend
