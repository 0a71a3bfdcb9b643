"""``vtnumba info``: what this process runs on, and why.

Prints the versions of the stack (Python, numpy, numba, numba-cuda, mpi4py and the MPI
library), which ``numba.cuda`` is active and on which driver binding (numba-cuda's on NVIDIA's
``cuda.bindings`` is the one vtnumba needs; see :mod:`vtnumba.backend.cuda_stack`), the chosen
target and the reason for the choice, the GPU (name and compute capability) or "none",
whether kernels run in numba's simulator, and the MPI rank and size when started under
``mpiexec``.  On the ``cuda`` target without a usable GPU it says why, and exits 1.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def under_mpiexec() -> bool:
    """Was this process started by an MPI launcher?  Judged from the variables it sets (PMI, PMIx, Open MPI, Hydra)."""
    return any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "HYDRA_CONTROL_FD"))


def collect_info() -> dict:
    """Everything ``vtnumba info`` reports, as a flat dict (JSON-serialisable); chooses the target if not yet chosen.

    An ``"error"`` key is present when the chosen target cannot run here (``cuda`` without a usable GPU).
    """
    from vtnumba.target import current_target

    choice = current_target()
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "cuda_bindings": _version("cuda-bindings"),
        "mpi4py": _version("mpi4py"),
        "target": choice.name,
        "target_reason": choice.reason,
        "simulator": choice.simulator,
        "gpu": "none",
        "compute_capability": None,
    }
    try:
        from mpi4py import MPI

        info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0].strip()
        if under_mpiexec() or MPI.COMM_WORLD.Get_size() > 1:
            info["mpi_rank"] = MPI.COMM_WORLD.Get_rank()
            info["mpi_size"] = MPI.COMM_WORLD.Get_size()
    except Exception as exc:  # MPI missing must not hide everything else
        info["mpi_library"] = f"unavailable ({exc})"
    from vtnumba.backend.cuda_stack import describe_cuda_stack

    stack = describe_cuda_stack()
    info["numba_cuda_active"] = f"{stack['implementation']} ({stack['numba_cuda_file'] or 'not importable'})"
    if not stack["ok"]:
        info["numba_cuda_problem"] = stack["problem"]
    if choice.name == "cuda":
        from vtnumba.target import gpu_usable

        ok, why = gpu_usable()
        if not ok:
            info["gpu"] = f"unavailable: {why}"
            info["error"] = ("the cuda target needs a usable GPU; run with --target cpu (host kernels) or "
                             "--target cudasim (the CUDA kernels in numba's simulator)")
            return info
        from numba import cuda

        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        info["gpu"] = name
        info["compute_capability"] = list(dev.compute_capability)
    elif choice.name == "cudasim":
        info["gpu"] = "none (kernels run in numba's CUDA simulator)"
    return info


def print_info(as_json: bool = False) -> int:
    """Print :func:`collect_info` as aligned ``key  value`` lines, or as JSON; returns the exit status (1 on error)."""
    info = collect_info()
    status = 1 if "error" in info else 0
    if as_json:
        print(json.dumps(info, indent=2))
        return status
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "compute_capability" and value is None:
            value = "n/a"
        print(f"{key:<{width}}  {value}")
    sys.stdout.flush()
    return status
