"""``vtnumba info``: what this process runs on, and why.

Prints the versions of the stack (Python, numpy, numba, numba-cuda, mpi4py and the MPI
library), which ``numba.cuda`` is active and on which driver binding (numba-cuda's on NVIDIA's
``cuda.bindings`` is the one vtnumba needs; see :mod:`vtnumba.backend.cuda_stack`), the chosen
target and the reason for the choice, the GPU (name, compute capability, and which of the machine's GPUs and why) or "none",
whether kernels run in numba's simulator, and the MPI rank and size when started under
``mpiexec``.  On the ``cuda`` target without a usable GPU it says why, and exits 1.

Under ``mpiexec`` only rank 0 prints: the values every rank shares once, and one line per
rank for a value that differs (a rank's GPU, say), so the ranks' lines never interleave.
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

        from vtnumba.backend.device_choice import process_cuda_device

        gpu_choice = process_cuda_device()
        dev = cuda.gpus[gpu_choice.index]  # names the device without making a context on it
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        info["gpu"] = name
        info["compute_capability"] = list(dev.compute_capability)
        info["cuda_device"] = f"cuda:{gpu_choice.index} ({gpu_choice.reason})"
    elif choice.name == "cudasim":
        info["gpu"] = "none (kernels run in numba's CUDA simulator)"
    return info


def gather_info(info: dict, timeout_s: float | None = None) -> list[dict] | None:
    """Every rank's :func:`collect_info` on rank 0 (``None`` on the others); ``[info]`` without MPI.

    Collective under ``mpiexec``: every rank calls it.  The exchange has a deadline and
    watches the failure board, so a rank that fails ends the others' wait at once.
    """
    if "mpi_size" not in info or info["mpi_size"] < 2:
        return [info]
    from vtnumba.dist import allgather_bytes, destroy_distributed, get_world_group, init_distributed
    from vtnumba.dist.comm import DEFAULT

    init_distributed()
    try:
        blobs = allgather_bytes(json.dumps(info).encode(), get_world_group(),
                                DEFAULT if timeout_s is None else timeout_s)
    finally:
        destroy_distributed()
    return [json.loads(b) for b in blobs] if info["mpi_rank"] == 0 else None


def merge_rank_infos(infos: list[dict]) -> dict:
    """One description of the job: values all ranks share once, and ``per_rank`` lists for the others.

    ``{"python": "3.11.7", ..., "per_rank": {"mpi_rank": [0, 1], "gpu": ["H200", "H200 (MIG)"]}}``
    -- ``per_rank`` holds only the keys whose values differ (the rank itself always does).
    """
    merged: dict = {}
    per_rank: dict = {}
    keys = list(dict.fromkeys(k for info in infos for k in info))
    for key in keys:
        values = [info.get(key) for info in infos]
        if all(v == values[0] for v in values):
            merged[key] = values[0]
        else:
            per_rank[key] = values
    if len(infos) > 1:
        merged["per_rank"] = per_rank
    return merged


def _print_lines(merged: dict) -> None:
    per_rank = merged.get("per_rank", {})
    keys = [k for k in merged if k != "per_rank"] + [k for k in per_rank if k != "mpi_rank"]
    width = max(len(k) for k in keys)
    for key in keys:
        if key in merged:
            value = "n/a" if key == "compute_capability" and merged[key] is None else merged[key]
            print(f"{key:<{width}}  {value}")
            continue
        # Differs between ranks: one line per rank, so nothing interleaves or hides.
        for rank, value in enumerate(per_rank[key]):
            label = key if rank == 0 else ""
            print(f"{label:<{width}}  [rank {rank}] {value}")


def print_info(as_json: bool = False, timeout_s: float | None = None) -> int:
    """Print what this job runs on, from rank 0 only; returns the exit status: 1 on a rank that
    had an error itself, and on rank 0 if any rank had one; else 0.

    Under ``mpiexec`` the ranks send their :func:`collect_info` to rank 0, which prints the
    values they share once and, for a value that differs, one line per rank (aligned
    ``key  value`` lines, or one JSON object with a ``per_rank`` entry).
    """
    info = collect_info()
    infos = gather_info(info, timeout_s)
    status = 1 if "error" in info else 0
    if infos is None:  # not rank 0: rank 0 speaks for the job
        return status
    merged = merge_rank_infos(infos)
    if any("error" in i for i in infos):
        status = 1
    if as_json:
        print(json.dumps(merged, indent=2))
    else:
        _print_lines(merged)
    sys.stdout.flush()
    return status
