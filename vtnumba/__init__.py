"""vtnumba: an inference-engine runtime you can read, run, step through and measure.

Three parts, one code base, three targets (``cpu``, ``cudasim``, ``cuda``):

1. the device runtime (:mod:`vtnumba.backend`, :mod:`vtnumba.memory`);
2. TPSP, the fused tensor-parallel matmul / reduce-scatter / norm / all-gather
   (:mod:`vtnumba.tpsp`, over :mod:`vtnumba.dist` and :mod:`vtnumba.kernels`);
3. the encoder-cache connector (:mod:`vtnumba.ec`).

The programs built on them (command line, demos, benchmarks) are in :mod:`vtnumba.apps`
and :mod:`vtnumba.bench`; ``docs/architecture`` draws the floor plan.

``import vtnumba`` is cheap: the names below are loaded on first use, so a program can
choose its target and share the cores between MPI ranks (:mod:`vtnumba.apps.processes`)
before numpy or ``numba.cuda`` are imported.  It changes nothing in the process, with one
exception that honours the caller's own request: ``VTNUMBA_TARGET=cudasim`` switches numba's
simulator on right away (:func:`vtnumba.target.apply_requested_target`), so that even
``import vtnumba; import numba.cuda`` gets the simulator.
"""

from vtnumba.target import apply_requested_target as _apply_requested_target

_apply_requested_target()

__version__ = "0.1.0"

# name -> module that defines it (loaded on first access, see the module docstring)
_LAZY = {
    **{name: "vtnumba.backend" for name in (
        "CPU", "Backend", "Buffer", "Capabilities", "CPUBackend", "Device", "DeviceResourceOps", "DeviceType",
        "DType", "Event", "GraphHandle", "Queue", "alloc", "create_queue", "default_backend", "default_cuda_device",
        "default_device",
        "destroy_queue", "free", "get_backend", "register_backend", "try_get_backend")},
    "CUDABackend": "vtnumba.backend.cuda",
    "current_target": "vtnumba.target",
    "select_target": "vtnumba.target",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vtnumba' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY) + ["__version__"]
