"""Which GPU a process takes: one per MPI rank of the node, unless told otherwise -- the rule.

An ``mpiexec -n 4`` job on a node with four GPUs should put one rank on each, not all four
on GPU 0 (where they would share its SMs and memory while three GPUs idle).  MPI programs
on GPUs settle this the same way: a rank's *node-local* rank (its place among the ranks on
its own machine) picks the device, modulo the number of devices, so ranks share GPUs evenly
when there are more ranks than GPUs -- e.g. two ranks on the one GPU of a laptop or of the
H200 machine, which is how vtnumba's TPSP and peer tests run there.

The node-local rank comes from the variables the launcher sets for each process
(:data:`LOCAL_RANK_VARIABLES`: MPICH's Hydra sets ``MPI_LOCALRANKID``, Open MPI
``OMPI_COMM_WORLD_LOCAL_RANK``, Slurm ``SLURM_LOCALID``), not from an MPI call: the device
must be known before MPI is set up -- already when the target is chosen
(:mod:`vtnumba.target`: ``auto`` makes its CUDA context on this device to see that it is
usable).  Outside a launcher there is no local rank, and the process uses device 0.

``VTNUMBA_DEVICE=N`` puts every rank of the job on device ``N`` instead (``local``, the
default, is the rule above).  Ranks on different GPUs still share their peer buffers: CUDA
IPC opens a peer's memory on another GPU with peer access enabled.  ``CUDA_VISIBLE_DEVICES``
keeps its usual meaning -- it renumbers the devices a process sees, and indices here count
the visible ones.

This module is the rule alone, a function of the environment and the device count, so the
lowest layer (the target's choice) can use it; :mod:`vtnumba.backend.device_choice` applies
it once per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: The launchers' per-process "which of this node's ranks am I" variables, in the order asked.
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "PMI_LOCAL_RANK", "LOCAL_RANK")


@dataclass(frozen=True)
class DeviceChoice:
    """The CUDA device index this process uses, and a sentence saying why."""

    #: The device's index among the visible CUDA devices.
    index: int
    #: Why this device (which variable decided it, or what the node-local rank was).
    reason: str


def node_local_rank(environ=None) -> tuple[int, str] | None:
    """``(rank among this node's processes, the variable that said so)``, or None outside a launcher."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    return None


def requested_device(environ=None) -> int | None:
    """The device index ``VTNUMBA_DEVICE`` names, or None for ``local`` (the default).

    ValueError naming the variable for anything else -- checked on the cuda and cudasim
    targets (and by the command-line programs on every target), so a typo shows on the laptop
    that runs the simulator, not first on the GPU machine.
    """
    environ = os.environ if environ is None else environ
    asked = environ.get("VTNUMBA_DEVICE", "local").strip().lower() or "local"
    if asked == "local":
        return None
    if not asked.isdigit():
        raise ValueError(f"VTNUMBA_DEVICE={environ.get('VTNUMBA_DEVICE')!r} is not a device; expected 'local' "
                         "(one device per node-local rank) or a device index (0, 1, ...)")
    return int(asked)


def choose_cuda_device(device_count: int, environ=None) -> DeviceChoice:
    """The device for this process among ``device_count`` visible ones (module docstring).

    Raises ValueError naming ``VTNUMBA_DEVICE`` when it is neither ``local`` nor the index of
    a visible device, and naming ``device_count`` when there is no device to choose.
    """
    environ = os.environ if environ is None else environ
    if not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device_count={device_count!r}: expected at least one visible CUDA device")
    try:
        asked = requested_device(environ)
    except ValueError:
        asked = device_count  # (a malformed value: the message below also says what is here)
    if asked is not None:
        if asked >= device_count:
            raise ValueError(f"VTNUMBA_DEVICE={environ.get('VTNUMBA_DEVICE')!r} is not a device here; expected "
                             f"'local' (one device per node-local rank) or an index from 0 to {device_count - 1} "
                             f"({device_count} visible CUDA device(s))")
        return DeviceChoice(asked, f"VTNUMBA_DEVICE={asked}")
    local = node_local_rank(environ)
    if local is None:
        return DeviceChoice(0, "no launcher's node-local rank: device 0")
    rank, variable = local
    index = rank % device_count
    shared = " (ranks share devices: more ranks than devices)" if rank >= device_count else ""
    return DeviceChoice(index, f"node-local rank {rank} ({variable}) of {device_count} visible device(s){shared}")


__all__ = ["DeviceChoice", "LOCAL_RANK_VARIABLES", "choose_cuda_device", "node_local_rank", "requested_device"]
