"""Arrays: the one place that knows what kinds of array exist, where they live, and how to check them.

Three kinds of array flow through vtnumba, one per target:

============ ======================================= ==================================
kind         what it is                              can the host read it in place?
============ ======================================= ==================================
host         a numpy array (``cpu`` target)           yes
simulated    numba's ``FakeCUDAArray`` (``cudasim``)  yes: it wraps a numpy array
device       numba's ``DeviceNDArray`` (``cuda``)     no: GPU memory, copy it first
============ ======================================= ==================================

Kernels dispatch on the first two categories only -- :data:`HOST` (numpy: run the host
reference) and :data:`DEVICE` (numba device arrays, real or simulated: launch the
``@cuda.jit`` kernel); whether a device array is *host-addressable* (simulated) is a
property of the backend that made it (:class:`vtnumba.backend.Capabilities`), not something
the upper layers should probe.  This module is where the package looks inside numba's
simulator (its ``FakeCUDAArray`` keeps the numpy array in a private ``_ary`` attribute) and
at ``__cuda_array_interface__``; the rest asks here, except a few low-level modules that
must read the interface or the simulator themselves (the CUDA backend, the memory plugin,
the timing code, the wide loads' simulator twins, the simulator fixes).

It also holds the argument checks every layer uses, so that "an int but not a bool", "a
positive number of seconds" or "a C-contiguous 2-D float32 array" read -- and fail -- the
same way everywhere, with messages that name the argument, the value and what was expected.

Nothing here imports ``numba.cuda`` unless an array that came from it is actually seen: the
``cpu`` target never pays for that import (nor is it locked out of choosing the simulator).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Set
from typing import Any

import numpy as np

HOST = "host"
DEVICE = "device"


# ---------------------------------------------------------------------------- small arithmetic
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints, without floats (rows per rank, blocks per grid)."""
    b = int(b)
    if b <= 0:  # (a bare ZeroDivisionError would not say which count was 0)
        raise ValueError(f"cdiv({a!r}, {b}): the divisor must be a positive int (a tile, block or rank count)")
    return -(-int(a) // b)


# ---------------------------------------------------------------------------- argument checks
def is_int(value) -> bool:
    """An integer in the everyday sense: ``int`` or a numpy integer, but not ``bool``."""
    if type(value) is int:  # the usual case, without the abstract-base-class check (bool is not int here)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """``value`` as an int; TypeError for non-integers (bools and floats included), ValueError out of range."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    value = int(value)
    if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
        lo = "" if min_value is None else f"{min_value} <= "
        hi = "" if max_value is None else f" <= {max_value}"
        raise ValueError(f"{name}={value} is out of range; expected {lo}{name}{hi}")
    return value


def check_nbytes(name: str, value, *, allow_zero: bool = True) -> int:
    """A byte count: a non-negative int (``bool`` and floats are refused)."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be an int number of bytes, got {type(value).__name__}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        expected = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value} is not a valid size; expected {expected}")
    return value


_INF = float("inf")


def check_seconds(name: str, value) -> float:
    """A timeout or duration: a positive, finite number of seconds."""
    if type(value) is float and 0.0 < value < _INF:
        return value  # the usual timeout, in one comparison (every queued flag wait checks its own)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number of seconds, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # (an int past float's range, 10**400: not finite either)
        value = float("inf")
    if not (value > 0 and np.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds")
    return value


# float32's smallest normal and largest finite values, as Python floats.
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def check_eps(eps) -> float:
    """A norm's epsilon: a positive finite float (it keeps ``rsqrt`` finite)."""
    if type(eps) is float and _F32_TINY <= eps <= _F32_MAX:
        # The usual eps (1e-5, 1e-6, 1e-12): a positive float32 without rounding to 0 or inf.
        # (Every kernel call checks its eps: this accepts part of what the checks below accept
        # -- not float32's subnormals -- in one comparison.)
        return eps
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps={eps!r} must be a float")
    try:
        eps = float(eps)
    except OverflowError:  # (an int past float's range)
        raise ValueError(f"eps=(an int of {len(str(eps))} digits) must be a positive finite float that float32 "
                         "can hold (it keeps rsqrt finite): about 1.4e-45 to 3.4e38") from None
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = np.float32(eps)  # what the kernels compute with
    if not eps > 0 or not np.isfinite(eps) or not (as_f32 > 0 and np.isfinite(as_f32)):
        raise ValueError(f"eps={eps} must be a positive finite float that float32 can hold (it keeps rsqrt "
                         f"finite): about 1.4e-45 to 3.4e38")
    return eps


def numeric_dtype(name: str, dtype, use: str = "view raw memory") -> np.dtype:
    """``dtype`` as a numpy dtype that raw memory can hold (a number type: bool, int, float,
    complex); TypeError naming ``name`` for anything else -- a typo like ``"foo"``, ``object``,
    strings, records, datetimes.  ``use`` says what it was meant for, in the message."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}={dtype!r} is not a numpy dtype; expected a number type such as float32") from None
    if dt.hasobject or dt.itemsize == 0 or dt.kind not in "biufc":
        raise TypeError(f"{name}={dt} cannot {use}; expected a number type such as float32")
    return dt


def dtype_labels(a, b) -> tuple[str, str]:
    """Names that tell two dtypes apart in a message: ``.name`` (``float32``), or ``.str``
    (``<f4``, ``>f4``) where only the byte order differs -- both are named ``float32``."""
    a, b = np.dtype(a), np.dtype(b)
    if a.name == b.name and a != b:
        return a.str, b.str
    return a.name, b.name


def check_shape(name: str, shape) -> tuple[int, ...]:
    """A shape: an int or a sequence of non-negative ints (``-1`` and other negatives refused)."""
    dims = (shape,) if is_int(shape) else shape
    if isinstance(dims, (str, bytes, bytearray, memoryview, Mapping, Set)):
        # Iterable, but not a shape: b"ab" would read as (97, 98), {4: 1} as (4,).
        raise TypeError(f"{name}={shape!r} must be an int or a sequence of ints, got {type(shape).__name__}")
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(f"{name}={shape!r} must be an int or a sequence of ints") from None
    for d in dims:
        if not is_int(d):
            raise TypeError(f"{name}={shape!r} must contain ints, got {type(d).__name__} {d!r}")
        if d < 0:
            raise ValueError(f"{name}={shape!r} has a negative extent {int(d)}; expected every extent >= 0")
    return tuple(int(d) for d in dims)


# ---------------------------------------------------------------------------- array kinds
def _from_numba_cuda(obj) -> bool:
    # A cheap test before importing numba.cuda: device arrays come from numba.cuda modules.
    return type(obj).__module__.startswith("numba.cuda")


def simulator_active() -> bool:
    """Is ``numba.cuda`` numba's CUDA simulator in this process (``NUMBA_ENABLE_CUDASIM=1``)?

    Read from numba's config -- which numba-cuda shares -- without importing ``numba.cuda``.
    numba reads its environment once, at ``import numba``;
    :func:`vtnumba.target.select_target` makes it read it again after setting the switch.
    """
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


def is_simulated_array(obj) -> bool:
    """Is ``obj`` a simulator device array (host memory seen as device memory)?"""
    # The module test comes first: on a GPU, checking a real device array must not import
    # (let alone use) anything of the simulator.
    if not type(obj).__module__.startswith("numba.cuda.simulator"):
        return False
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return isinstance(obj, FakeCUDAArray)


def is_device_array(obj) -> bool:
    """Is ``obj`` a numba device array (a real GPU's ``DeviceNDArray`` or a simulated one)?"""
    if not _from_numba_cuda(obj):
        return False
    if is_simulated_array(obj):
        return True
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return isinstance(obj, DeviceNDArray)


def is_gpu_array(obj) -> bool:
    """Is ``obj`` a real GPU's numba ``DeviceNDArray`` (not a simulated one)?"""
    if not type(obj).__module__.startswith("numba.cuda.cudadrv"):
        return False
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return isinstance(obj, DeviceNDArray)


def array_kind(name: str, arr) -> str:
    """:data:`HOST` for a numpy array, :data:`DEVICE` for a numba device array; TypeError otherwise."""
    if isinstance(arr, np.ndarray):
        return HOST
    if is_device_array(arr):
        return DEVICE
    raise TypeError(f"{name} must be a numpy array (cpu) or a numba device array (cuda/cudasim), "
                    f"got {type(arr).__module__}.{type(arr).__name__}")


def common_kind(arrays: dict[str, Any]) -> str:
    """The one kind shared by all non-None arrays in ``arrays`` (name -> array).

    Mixing kinds is refused: a numpy array handed to a kernel would be *copied* in and back
    by numba, which silently breaks peer buffers and queue ordering.
    """
    kinds = {name: array_kind(name, arr) for name, arr in arrays.items() if arr is not None}
    if not kinds:
        # (The first argument is the one a kernel cannot do without: "x is None", not "no arrays".)
        first = next(iter(arrays), "the input")
        raise TypeError(f"{first} must be a numpy array (cpu) or a numba device array (cuda/cudasim), got None")
    if len(set(kinds.values())) > 1:
        hosts = [n for n, k in kinds.items() if k == HOST]
        devs = [n for n, k in kinds.items() if k == DEVICE]
        raise TypeError(f"arrays must all be numpy arrays or all device arrays; got numpy for "
                        f"{', '.join(hosts)} and device arrays for {', '.join(devs)}")
    return next(iter(kinds.values()))


def host_view(arr) -> np.ndarray | None:
    """The numpy array that *is* ``arr``'s memory (numpy itself, or a simulated array's host
    memory), or None when the memory is on a GPU and the host cannot read it in place."""
    if isinstance(arr, np.ndarray):
        return arr
    if is_simulated_array(arr):
        return arr._ary
    return None


def to_host(arr) -> np.ndarray:
    """A numpy array with ``arr``'s contents: a view where the host can read it in place
    (numpy, simulator), else a device-to-host copy (real GPU, synchronous)."""
    view = host_view(arr)
    if view is not None:
        return view
    if is_device_array(arr):
        return arr.copy_to_host()
    raise TypeError(f"cannot read {type(arr).__module__}.{type(arr).__name__} on the host; expected a numpy "
                    "or numba device array")


def wrap_host_memory(host: np.ndarray):
    """Simulator only: present host memory as a device array that kernels use *in place*.

    numba's simulator copies plain numpy kernel arguments in and back after the launch,
    which would hide a peer's concurrent writes and then clobber them; a ``FakeCUDAArray``
    around the same memory is passed through without copying.
    """
    if not simulator_active():
        raise RuntimeError("wrap_host_memory is for numba's CUDA simulator; on a GPU, host memory is not "
                           "device memory (copy it, or register it)")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(host)


def is_c_contiguous(arr) -> bool:
    """C-contiguity for numpy and numba device arrays alike."""
    flags = getattr(arr, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            pass
    fn = getattr(arr, "is_c_contiguous", None)
    return bool(fn()) if fn is not None else False


def address_of(arr) -> int:
    """The address of ``arr``'s first byte: a host address for numpy and simulated arrays,
    a device address for GPU arrays.  ``arr`` must be C-contiguous (copies and views by
    address treat it as one flat byte range)."""
    view = host_view(arr)
    if view is not None:
        if not view.flags["C_CONTIGUOUS"]:
            raise ValueError("array must be C-contiguous to be used by address")
        return int(view.ctypes.data)
    cai = getattr(arr, "__cuda_array_interface__", None)
    if cai is not None:
        if not is_c_contiguous(arr):
            raise ValueError("device array must be C-contiguous to be used by address")
        return int(cai["data"][0])
    raise TypeError(f"cannot take the address of {type(arr).__name__}; expected a numpy array or a numba "
                    "device array")


def check_not_partly_overlapping(name_a: str, a, name_b: str, b, *, same_ok: bool = True) -> None:
    """ValueError if C-contiguous arrays ``a`` and ``b`` share some memory without being the
    same bytes (``same_ok=False``: if they share any).

    A kernel that reads row ``i`` of ``a`` and writes row ``i`` of ``b`` may work in place
    (``b`` *is* ``a``), but a ``b`` shifted by a row overwrites rows of ``a`` that another
    thread (or block) has not read yet -- a silent wrong result that an ``is`` test misses
    (``out=buf[:]`` is not ``buf``).
    """
    ha, hb = host_view(a), host_view(b)
    if ha is not None and hb is not None and not np.may_share_memory(ha, hb):
        return  # the common case, asked of numpy's bounds in a fraction of a microsecond
    a0 = address_of(a)
    b0 = address_of(b)
    a1 = a0 + int(a.size) * np.dtype(a.dtype).itemsize
    b1 = b0 + int(b.size) * np.dtype(b.dtype).itemsize
    if a0 >= b1 or b0 >= a1 or a0 == a1 or b0 == b1:
        return  # disjoint (or one of them is empty)
    if same_ok and (a0, a1) == (b0, b1):
        return
    how = "the same memory" if (a0, a1) == (b0, b1) else f"overlapping memory ({min(a1, b1) - max(a0, b0)} bytes)"
    expected = "different memory" if not same_ok else "either the same array (in place) or separate memory"
    raise ValueError(f"{name_a} and {name_b} share {how}; expected {expected}")


def byte_span(arr) -> tuple[int, int]:
    """``(start, end)`` addresses of a C-contiguous array's bytes: device addresses for a GPU
    array, host addresses for anything host-backed (numpy, or a simulator array's host view)."""
    pointer = getattr(arr, "device_ctypes_pointer", None)  # a numba device array: cheaper than its CAI dict
    start = (pointer.value or 0) if pointer is not None and host_view(arr) is None else address_of(arr)
    return start, start + int(arr.size) * np.dtype(arr.dtype).itemsize


def check_outputs_apart(outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
    """ValueError if an output shares memory with another output or with an input (None
    entries are skipped).

    For kernels that cannot work in place at all -- a matmul block reads rows of ``x`` that
    another block's output tile may already have overwritten, and two destinations of one
    call would receive each other's rows.  On the host numpy would quietly hide the first
    (``np.matmul`` copies an overlapping input) while a GPU computes garbage, so both refuse.
    The arrays are C-contiguous, so their byte ranges *are* their memory.
    """
    outs = [(n, a) for n, a in outputs.items() if a is not None]
    others = outs + [(n, a) for n, a in inputs.items() if a is not None]
    views = [host_view(a) for _, a in others]
    on_host = all(v is not None for v in views)
    spans = None if on_host else [byte_span(a) for _, a in others]
    for i, (name, _) in enumerate(outs):
        for j in range(i + 1, len(others)):
            if on_host:
                shared = np.may_share_memory(views[i], views[j])  # bounds only: exact for contiguous arrays
            else:
                (a0, a1), (b0, b1) = spans[i], spans[j]
                shared = a0 < b1 and b0 < a1
            if shared:
                other = others[j][0]
                what = "another output" if j < len(outs) else "an input the kernel reads while it writes"
                raise ValueError(f"{name} and {other} share memory ({other} is {what}); expected an array of "
                                 f"its own for {name}")


def empty(kind: str, shape, dtype) -> Any:
    """A fresh uninitialised array of ``kind`` (used when a caller passes no ``out``)."""
    if kind == HOST:
        return np.empty(shape, dtype=dtype)
    from numba import cuda

    return cuda.device_array(shape, dtype=dtype)


def _shape_fits(got: tuple, want: tuple) -> bool:
    """``got`` is ``want``, whose entries of None are free (a plain loop: this runs per argument)."""
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if w is not None and g != w:
            return False
    return True


def check_array(name: str, arr, *, ndim: int, dtypes: Iterable, shape: tuple | None = None,
                contiguous: bool = True, writable: bool = False) -> None:
    """Validate one array argument; ``shape`` entries of None are free; ``dtypes``: what
    ``np.dtype`` takes; ``writable``: an output, which a read-only numpy array cannot be
    (numba's compiled kernels refused it with a long typing error naming no argument)."""
    if type(dtypes) is tuple:
        # The usual call, an array that is what was asked for, in a few attribute reads (every
        # kernel call checks each of its arrays).  Anything else -- something wrong, or dtypes
        # that are not a tuple -- takes the checks below, which say what is wrong.
        try:
            if arr.ndim == ndim and arr.dtype in dtypes and (shape is None or _shape_fits(arr.shape, shape)) \
                    and (not contiguous or is_c_contiguous(arr)) \
                    and (not writable or type(arr) is not np.ndarray or arr.flags.writeable):
                return
        except (AttributeError, TypeError):
            pass
    dtypes = tuple(np.dtype(d) for d in dtypes)
    if not hasattr(arr, "ndim") or not hasattr(arr, "dtype"):
        raise TypeError(f"{name} must be a {ndim}-D array (numpy or a numba device array), got {type(arr).__name__}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got ndim={getattr(arr, 'ndim', None)} "
                         f"(shape {getattr(arr, 'shape', None)})")
    if np.dtype(arr.dtype) not in dtypes:
        got = np.dtype(arr.dtype)
        swapped = [d for d in dtypes if d.name == got.name]
        if swapped:  # ("has dtype float32; expected float32": the same name in both byte orders)
            got_label, want_label = dtype_labels(got, swapped[0])
            raise TypeError(f"{name} has dtype {got_label} ({got.name} in the other byte order); expected "
                            f"{want_label}: convert it with .astype(np.{got.name})")
        names = " or ".join(d.name for d in dtypes)
        raise TypeError(f"{name} has dtype {got.name}; expected {names}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(arr.shape, shape, strict=True)):
            if want is not None and got != want:
                wanted = ", ".join("?" if s is None else str(s) for s in shape)
                raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected ({wanted}{',' * (len(shape) == 1)}) "
                                 f"(axis {axis} is {got}, not {want})")
    if contiguous and not is_c_contiguous(arr):
        raise ValueError(f"{name} (shape {tuple(arr.shape)}) must be C-contiguous; pass a contiguous copy")
    if writable and isinstance(arr, np.ndarray) and not arr.flags.writeable:
        raise ValueError(f"{name} is a read-only array (numpy's writeable flag is off); expected an array this call "
                         "can write its result into")


__all__ = [
    "HOST", "DEVICE", "cdiv", "is_int", "check_int", "check_nbytes", "check_seconds", "check_eps", "check_shape",
    "simulator_active", "is_simulated_array", "is_device_array", "is_gpu_array", "array_kind", "common_kind",
    "host_view", "to_host", "wrap_host_memory", "is_c_contiguous", "address_of", "byte_span",
    "check_not_partly_overlapping", "empty", "check_array",
]
