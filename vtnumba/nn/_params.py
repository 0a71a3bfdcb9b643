"""Parameters that live on the host and follow their input to the device.

The :mod:`vtnumba.nn` modules keep their weights as numpy arrays (what a checkpoint loader
produces and what the ``cpu`` target computes with).  When a forward receives *device*
arrays (the ``cuda``/``cudasim`` targets) the module needs the same weights in device
memory: :class:`Params` uploads each one once, on first use, and hands out the cached copy
afterwards.  Assigning a new array to a parameter drops its stale device copy.
"""

from __future__ import annotations

import numpy as np


def is_host(arr) -> bool:
    return isinstance(arr, np.ndarray)


class Params:
    """Mixin: ``self.param(name, like)`` is parameter ``name`` in the same memory as ``like``."""

    def __setattr__(self, name, value):
        cache = self.__dict__.get("_device_params")
        if cache is not None and name in cache:
            del cache[name]  # a new host array: its old device copy is stale
        object.__setattr__(self, name, value)

    def param(self, name: str, like):
        value = getattr(self, name)
        if value is None or is_host(like):
            return value
        cache = self.__dict__.setdefault("_device_params", {})
        if name not in cache:
            from numba import cuda

            cache[name] = cuda.to_device(np.ascontiguousarray(value, dtype=np.float32))
        return cache[name]


__all__ = ["Params", "is_host"]
