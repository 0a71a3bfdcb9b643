"""Devices: *where* memory lives (mirrors vllm.cpp's ``vt::Device``; *what* it holds, the dtypes,
is :mod:`vtnumba.backend.dtype`).

A :class:`Device` is a ``(DeviceType, index)`` pair.  ``Device(t, 0)`` shares the type-level
registry slot (see :mod:`vtnumba.backend.registry`).  Which CUDA device a process uses by
default is :mod:`vtnumba.backend.device_choice`'s answer: on a machine with several GPUs,
one per MPI rank.
Indices run from 0 to :data:`MAX_DEVICES_PER_TYPE` - 1, as in vllm.cpp's fixed-size table (``vt/backend.h``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vtnumba.backend.arrays import is_int

MAX_DEVICES_PER_TYPE = 16


class DeviceType(enum.Enum):
    """The kinds of device vtnumba knows: the host CPU and CUDA GPUs (real or simulated)."""

    #: The host CPU, with numpy memory and host queues (see :class:`~vtnumba.backend.cpu.CPUBackend`).
    CPU = "cpu"
    #: A CUDA GPU, or numba's simulator of one (see :class:`~vtnumba.backend.cuda.CUDABackend`).
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Device:
    """One device: its type and its index among the devices of that type."""

    #: The kind of device; a string such as ``"cuda"`` is accepted and converted.
    type: DeviceType
    #: Which device of that type, 0 to :data:`MAX_DEVICES_PER_TYPE` - 1 (0 is the type's default device).
    index: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.type, str):
            try:
                object.__setattr__(self, "type", DeviceType(self.type.lower()))
            except ValueError:
                raise ValueError(f"Device type={self.type!r} is not a DeviceType; expected 'cpu' or 'cuda'") from None
        if not isinstance(self.type, DeviceType):
            raise TypeError(f"Device type={self.type!r} must be a DeviceType, got {type(self.type).__name__}")
        if not is_int(self.index):
            raise TypeError(f"Device index={self.index!r} must be an int")
        if not 0 <= int(self.index) < MAX_DEVICES_PER_TYPE:
            raise ValueError(
                f"Device index={self.index} out of range; expected 0 <= index < {MAX_DEVICES_PER_TYPE}"
            )
        object.__setattr__(self, "index", int(self.index))

    def __str__(self) -> str:
        return f"{self.type.value}:{self.index}"


def as_device(device) -> Device:
    """``device`` as a :class:`Device`: a Device as it is, a DeviceType as its device 0, or a
    string as PyTorch writes devices -- ``"cpu"``, ``"cuda"`` (device 0) or ``"cuda:1"``."""
    if isinstance(device, Device):
        return device
    if isinstance(device, DeviceType):
        return Device(device, 0)
    if isinstance(device, str):
        kind, colon, index = device.partition(":")
        try:
            if colon and not (index.isascii() and index.isdigit()):  # (int() also takes "1_0", " 1", "+1")
                raise ValueError(index)
            return Device(kind, int(index) if colon else 0)
        except ValueError:
            raise ValueError(f"device={device!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N' with "
                             f"0 <= N < {MAX_DEVICES_PER_TYPE}") from None
    raise TypeError(f"device={device!r} must be a Device, a DeviceType, or a string like 'cpu', 'cuda' or 'cuda:1'")


CPU = Device(DeviceType.CPU, 0)
