"""``get_tpsp_backend(group_name, device)``: the TPSP backend for a device.

A CPU device gets :class:`~vtnumba.tpsp.host.HostTPSPBackend` (numpy arrays); a CUDA
device -- a real GPU or, on the ``cudasim`` target, numba's simulator -- gets
:class:`~vtnumba.tpsp.cuda.CudaTPSPBackend` (device arrays).  Without ``device`` the
process target decides (:func:`vtnumba.default_device`).
"""

from __future__ import annotations

from vtnumba.backend.device import Device, DeviceType


def _as_device(device) -> Device:
    if device is None:
        from vtnumba.backend import default_device

        return default_device()
    if isinstance(device, Device):
        return device
    if isinstance(device, DeviceType):
        return Device(device, 0)
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        try:
            return Device(kind, int(index) if index else 0)
        except ValueError as exc:
            raise ValueError(f"device={device!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N'") from exc
    raise TypeError(f"device={device!r} must be a Device, a DeviceType, a string like 'cuda:0', or None")


def get_tpsp_backend(group_name: str = "tp", device=None, **kwargs):
    """A new TPSP backend serving ``group_name`` on ``device`` (extra keyword arguments go to it)."""
    dev = _as_device(device)
    if dev.type is DeviceType.CPU:
        from vtnumba.tpsp.host import HostTPSPBackend

        return HostTPSPBackend(group_name, dev, **kwargs)
    from vtnumba.tpsp.cuda import CudaTPSPBackend

    return CudaTPSPBackend(group_name, dev, **kwargs)


__all__ = ["get_tpsp_backend"]
