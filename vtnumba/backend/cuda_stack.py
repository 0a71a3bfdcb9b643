"""Which ``numba.cuda`` this process gets, and refusing the wrong one with a clear message.

Two different packages answer ``import numba.cuda``:

* **numba-cuda** (NVIDIA's package, what vtnumba needs): it installs a ``.pth`` file whose
  import hook redirects ``numba.cuda`` to ``numba_cuda/numba/cuda/``, built on NVIDIA's
  ``cuda.bindings`` (``cuda-bindings`` on PyPI) -- the raw driver API that vtnumba's CUDA IPC,
  stream memory operations and batched copies call;
* **numba's own, deprecated** ``numba/cuda/`` (still shipped inside numba 0.6x), built on a
  ctypes binding of the driver.

If the ``.pth`` hook is not processed -- a virtual environment that lists another
environment's site-packages by a plain path line, say -- ``import numba.cuda`` silently
gives the old one: kernels still run, but every ``cuda.bindings`` call then fails much
later with a baffling message (``expected LP_c_byte_Array_64 instance instead of
CUipcMemHandle`` when opening an IPC handle).  :func:`check_cuda_stack` turns that into one
clear error at backend creation; :func:`describe_cuda_stack` is what ``vtnumba info`` shows.

Both look *where* ``numba.cuda`` would be loaded from (``importlib.util.find_spec``, which
runs the redirect hook but imports nothing), so they are cheap and never lock the process
into or out of numba's simulator.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

FIX_HINT = ("install numba-cuda into the environment that runs vtnumba (pip install 'numba-cuda[cu13]'), "
            "and make sure its .pth files are processed: a venv that reuses another environment's packages must "
            "add them with site.addsitedir() in a .pth file, not with a plain path line")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_cuda_stack() -> dict:
    """Where ``numba.cuda`` comes from and which driver binding it uses (imports nothing heavy).

    Keys: ``implementation`` (``"numba-cuda"``, ``"numba (deprecated built-in)"`` or
    ``"missing"``), ``numba_cuda_file``, ``numba_cuda`` / ``cuda_bindings`` / ``numba``
    (installed versions or None), ``ok`` and ``problem`` (None when ok).
    """
    try:
        spec = importlib.util.find_spec("numba.cuda")
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    info = {
        "numba_cuda_file": origin,
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "cuda_bindings": _version("cuda-bindings"),
    }
    if origin is None:
        info.update(implementation="missing", ok=False, problem=f"numba.cuda cannot be imported; {FIX_HINT}")
        return info
    parts = os.path.normpath(origin).split(os.sep)
    if "numba_cuda" in parts:
        info["implementation"] = "numba-cuda"
        if info["cuda_bindings"] is None:
            info.update(ok=False, problem=f"numba-cuda is active but the cuda-bindings package is missing; {FIX_HINT}")
        else:
            info.update(ok=True, problem=None)
    else:
        info.update(implementation="numba (deprecated built-in)", ok=False,
                    problem=(f"numba.cuda is numba's deprecated built-in CUDA target ({origin}), not numba-cuda's "
                             "(its ctypes driver binding breaks CUDA IPC, stream memory operations and batched "
                             f"copies); {FIX_HINT}"))
    return info


def check_cuda_stack(info: dict | None = None) -> dict:
    """Raise RuntimeError (saying what is active and how to fix it) unless numba-cuda with
    NVIDIA's ``cuda.bindings`` is what ``import numba.cuda`` gives.  Returns the description."""
    info = describe_cuda_stack() if info is None else info
    if not info["ok"]:
        raise RuntimeError(f"vtnumba's cuda target needs numba-cuda: {info['problem']}")
    return info


__all__ = ["describe_cuda_stack", "check_cuda_stack", "FIX_HINT"]
