"""The multi-device registry: which Backend serves which Device (vllm.cpp's backend registry).

Backends are registered per device type and optionally per device index.  The
type-level slot *is* index 0: ``register_backend(DeviceType.CUDA, b)`` and
``register_backend(Device(CUDA, 0), b)`` write the same slot, so code that only knows the
type and code that knows the device agree.  Up to ``MAX_DEVICES_PER_TYPE`` devices per
type.  :class:`DeviceResourceOps` and the free functions give device-addressed access to
the most common operations (allocate, free, make and destroy queues).
"""

from __future__ import annotations

import threading

from vtnumba.backend.base import Backend, Buffer, Queue
from vtnumba.backend.device import MAX_DEVICES_PER_TYPE, Device, DeviceType, as_device

_registry: dict[tuple[DeviceType, int], Backend] = {}
_lock = threading.Lock()


def _key(device) -> tuple[DeviceType, int]:
    d = as_device(device)
    return d.type, d.index


def register_backend(device, backend: Backend, *, replace: bool = True) -> None:
    """Make ``backend`` serve ``device`` (a DeviceType means its index 0)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
    key = _key(device)
    if key[0] is not backend.device_type:
        raise ValueError(f"backend {backend.name} serves {backend.device_type.value} devices, "
                         f"not device={device}")
    if key[1] != backend.device.index:  # (device 1's work would silently run on device 0)
        raise ValueError(f"backend {backend.name} serves {backend.device}, not {key[0].value}:{key[1]}")
    if backend.closed:
        raise ValueError(f"backend {backend.name} on {backend.device} is closed; register a new one")
    with _lock:
        if not replace and key in _registry:
            raise ValueError(f"a backend is already registered for {key[0].value}:{key[1]}")
        _registry[key] = backend


def unregister_backend(device) -> Backend | None:
    """Remove and return the backend serving ``device`` (None if there was none)."""
    with _lock:
        return _registry.pop(_key(device), None)


def try_get_backend(device) -> Backend | None:
    """The backend for ``device`` or ``None`` (never raises for a missing one)."""
    key = _key(device)
    with _lock:
        return _registry.get(key)


def get_backend(device) -> Backend:
    """The backend for ``device``; raises a clear error when none is registered."""
    backend = try_get_backend(device)
    if backend is None:
        t, i = _key(device)
        with _lock:
            have = ", ".join(f"{k[0].value}:{k[1]}" for k in sorted(_registry, key=lambda k: (k[0].value, k[1])))
        raise RuntimeError(f"no backend registered for device {t.value}:{i} "
                           f"(registered: {have or 'none'}); call register_backend or vtnumba.default_backend()")
    return backend


def registered_devices() -> list[Device]:
    """Every device slot that has a backend, sorted by type and index."""
    with _lock:
        return [Device(t, i) for (t, i) in sorted(_registry, key=lambda k: (k[0].value, k[1]))]


class DeviceResourceOps:
    """Device-addressed resource operations: look up the backend, then forward."""

    @staticmethod
    def alloc(device, nbytes: int) -> Buffer:
        """``nbytes`` of memory on ``device`` (its registered backend's ``alloc``)."""
        return get_backend(device).alloc(nbytes)

    @staticmethod
    def free(device, buf: Buffer) -> None:
        """Free ``buf`` through ``device``'s backend."""
        get_backend(device).free(buf)

    @staticmethod
    def create_queue(device, name: str | None = None, *, priority: str = "normal") -> Queue:
        """A new queue on ``device`` (``priority``: see :meth:`Backend.create_queue`)."""
        return get_backend(device).create_queue(name, priority=priority)

    @staticmethod
    def destroy_queue(device, q: Queue) -> None:
        """Wait for ``q``'s work, then release it, through ``device``'s backend."""
        get_backend(device).destroy_queue(q)


alloc = DeviceResourceOps.alloc
free = DeviceResourceOps.free
create_queue = DeviceResourceOps.create_queue
destroy_queue = DeviceResourceOps.destroy_queue

__all__ = ["register_backend", "unregister_backend", "get_backend", "try_get_backend", "registered_devices",
           "DeviceResourceOps", "alloc", "free", "create_queue", "destroy_queue", "MAX_DEVICES_PER_TYPE"]
