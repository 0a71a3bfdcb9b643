"""Element types vtnumba computes in, and which targets support them.

float32 is the working type everywhere.  float16 is supported for storage and matmul
inputs (accumulating in float32).  bfloat16 exists only on real GPUs with compute
capability >= 8.0, and only inside kernels; numpy has no bfloat16 and numba's simulator
reports ``is_bfloat16_supported() == False``, so on ``cpu`` and ``cudasim`` asking for it
raises a clear error instead of silently computing in another type.
"""

from __future__ import annotations

from enum import Enum

import numpy as np


class DType(Enum):
    """An element type; its value is the numpy-style name (``DType("float16")`` works)."""

    #: 32-bit IEEE float, the working type on every target and what matmuls accumulate in.
    FLOAT32 = "float32"
    #: 16-bit IEEE float, for storage and matmul inputs on every target.
    FLOAT16 = "float16"
    #: 16-bit brain float, available only inside kernels on a real GPU with compute capability >= 8.0.
    BFLOAT16 = "bfloat16"

    @property
    def itemsize(self) -> int:
        """Bytes per element (4 for float32, 2 for float16 and bfloat16)."""
        return 4 if self is DType.FLOAT32 else 2

    def to_numpy(self) -> np.dtype:
        """The numpy dtype used to store this type on the host."""
        if self is DType.BFLOAT16:
            raise TypeError("bfloat16 has no numpy dtype; it is only available inside kernels on a cuda target "
                            "with compute capability >= 8.0")
        return np.dtype(self.value)


def as_dtype(value) -> DType:
    """Accept a :class:`DType`, a numpy dtype or a name ('float32', 'fp16', ...)."""
    if isinstance(value, DType):
        return value
    aliases = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "half": "float16",
               "bf16": "bfloat16"}
    if isinstance(value, str):
        name = aliases.get(value.lower(), value.lower())
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            raise TypeError(f"dtype={value!r} is not a dtype; expected float32, float16 or bfloat16") from None
    try:
        return DType(name)
    except ValueError:
        raise TypeError(f"dtype={value!r} is not supported; expected float32, float16 or bfloat16") from None


_TARGETS = ("cpu", "cudasim", "cuda")


def supported_dtypes(target: str, compute_capability: tuple[int, int] | None = None) -> list[DType]:
    """Which dtypes a target can compute in (bfloat16 only on real GPUs with cc >= 8.0)."""
    if target not in _TARGETS:
        raise ValueError(f"target={target!r} is not a target; expected one of {', '.join(_TARGETS)}")
    if compute_capability is not None:
        cc = compute_capability
        if not (isinstance(cc, tuple) and len(cc) == 2 and all(type(v) is int and v >= 0 for v in cc)):
            # ([9, 0] compared with (8, 0) was a bare TypeError from inside the comparison)
            raise TypeError(f"compute_capability={cc!r} must be a (major, minor) tuple of ints, e.g. (9, 0)")
    dts = [DType.FLOAT32, DType.FLOAT16]
    if target == "cuda" and compute_capability is not None and compute_capability >= (8, 0):
        dts.append(DType.BFLOAT16)
    return dts


def check_dtype_supported(dtype, target: str, compute_capability: tuple[int, int] | None = None) -> DType:
    """``dtype`` as a :class:`DType`, or a TypeError saying why ``target`` cannot compute in it."""
    dt = as_dtype(dtype)
    if dt not in supported_dtypes(target, compute_capability):
        where = {"cpu": "numpy has no bfloat16", "cudasim": "numba's simulator has no bfloat16"}.get(
            target, f"compute capability {compute_capability} < 8.0" if compute_capability is not None else
            "no compute capability was given (bfloat16 needs 8.0 or newer)")
        raise TypeError(f"dtype={dt.value} is not supported on target {target!r}: {where}")
    return dt
