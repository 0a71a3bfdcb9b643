"""Parameters that live on the host and follow their input to the device.

The :mod:`vtnumba.nn` modules keep their weights as numpy arrays (what a checkpoint loader
produces and what the ``cpu`` target computes with).  When a forward receives *device*
arrays (the ``cuda``/``cudasim`` targets) the module needs the same weights in device
memory: :class:`Params` uploads each one once, on first use, through the CUDA backend's
``asarray`` (the :class:`vtnumba.backend.Backend` seam), and hands out the cached copy
afterwards -- a model's weights cross to the device once, not once per call.  Assigning a
new array to a parameter drops its stale device copy.
"""

from __future__ import annotations

import numbers

import numpy as np


def is_host(arr) -> bool:
    """Is ``arr`` a numpy array (the ``cpu`` target's memory)?"""
    return isinstance(arr, np.ndarray)


def _upload(host: np.ndarray):
    from vtnumba.backend import default_backend, default_cuda_device

    # The process's CUDA backend (a GPU, or the simulator): the arrays it makes are the ones
    # every CUDA kernel of vtnumba takes.
    return default_backend(default_cuda_device()).asarray(np.ascontiguousarray(host, dtype=np.float32))


def float32_array(name: str, value) -> np.ndarray:
    """``value`` (an array, nested lists) as float32: a module's parameter.  TypeError naming
    ``name`` if it holds no numbers; ValueError if a finite value is too large for float32
    (1e300 became inf with only numpy's RuntimeWarning)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}={value!r} must be an array of numbers")
    try:
        given = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of numbers ({exc})") from None
    # Real numbers only: numpy turns None into NaN and drops a complex number's imaginary part
    # (with a warning at most) -- a parameter of NaNs, or another one, with no error.
    if given.dtype.kind not in "biuf" and not (given.dtype.kind == "O" and given.size and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in given.flat)):
        raise TypeError(f"{name} must be an array of real numbers, got dtype {given.dtype}")
    try:
        with np.errstate(over="ignore"):
            arr = np.asarray(given, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of numbers ({exc})") from None
    if given.dtype.kind in "fiu" and given.dtype.itemsize > 4 and not np.isfinite(arr).all() \
            and np.isfinite(given).all():
        raise ValueError(f"{name} holds values too large for float32 (its largest is about 3.4e38)")
    return arr


def check_input(layer, name: str, x, features: int, meaning: str, dtypes=(np.float32,)) -> None:
    """``x`` must be a 2-D ``[tokens, features]`` array of one of ``dtypes`` for ``layer``.

    Checked by the module before its kernel sees it, so that a wrong input is named as the
    caller named it (``x``), with the size this module was built for -- not by the kernel's
    own argument names (``y``, ``a``), nor as a mismatch of the module's weight, which the
    caller never passed.
    """
    from vtnumba.backend.arrays import array_kind, check_array

    array_kind(name, x)  # a list, None: TypeError naming it
    shape = tuple(x.shape)
    if len(shape) != 2 or shape[1] != features:
        raise ValueError(f"{name} has shape {shape}; {layer!r} takes [tokens, {meaning}] = [?, {features}]")
    check_array(name, x, ndim=2, dtypes=dtypes)


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
        from vtnumba.backend.arrays import array_kind

        array_kind("x", like)  # not numpy, and not a device array either (a list, say): TypeError naming it
        cache = self.__dict__.setdefault("_device_params", {})
        if name not in cache:
            cache[name] = _upload(value)
        return cache[name]


__all__ = ["Params", "is_host", "check_input", "float32_array"]
