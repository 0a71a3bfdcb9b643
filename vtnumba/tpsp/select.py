"""``get_tpsp_backend(group_name, device)``: the TPSP backend for a device.

A CPU device gets :class:`~vtnumba.tpsp.host.HostTPSPBackend` (numpy arrays); a CUDA
device -- a real GPU or, on the ``cudasim`` target, numba's simulator -- gets
:class:`~vtnumba.tpsp.cuda.CudaTPSPBackend` (device arrays).  Without ``device`` the
process target decides (:func:`vtnumba.default_device`).
"""

from __future__ import annotations

from vtnumba.backend.device import Device, DeviceType, as_device


def _as_device(device) -> Device:
    if device is None:
        from vtnumba.backend import default_device

        return default_device()
    return as_device(device)


def get_tpsp_backend(group_name: str = "tp", device=None, **kwargs):
    """A new TPSP backend serving ``group_name`` on ``device`` (extra keyword arguments go to it)."""
    dev = _as_device(device)
    if dev.type is DeviceType.CPU:
        from vtnumba.tpsp.host import HostTPSPBackend

        return HostTPSPBackend(group_name, dev, **kwargs)
    from vtnumba.tpsp.cuda import CudaTPSPBackend

    return CudaTPSPBackend(group_name, dev, **kwargs)


__all__ = ["get_tpsp_backend"]
