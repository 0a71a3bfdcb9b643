"""Which GPU this process uses, chosen once: :mod:`vtnumba.device_rule`'s rule, applied.

The rule (one GPU per node-local rank, or ``VTNUMBA_DEVICE``) lives in the core layer, so
the target's choice can use it too; it is re-exported here, where the backend asks for the
process's device: :func:`process_cuda_device` asks the driver for the device count only on
the ``cuda`` target -- the simulator has one device, and the ``cpu`` target none.
"""

from __future__ import annotations

from vtnumba.device_rule import (LOCAL_RANK_VARIABLES, DeviceChoice, choose_cuda_device, node_local_rank,
                                 requested_device)

_chosen: DeviceChoice | None = None


def process_cuda_device() -> DeviceChoice:
    """This process's choice, made once (not kept while no GPU is usable): on the ``cuda`` target
    from the visible GPUs, else device 0.

    Asks numba for the device count only on the ``cuda`` target, so the other targets never
    touch the driver.
    """
    global _chosen
    if _chosen is None:
        from vtnumba.target import current_target

        target = current_target().name
        if target != "cuda":
            requested_device()  # (only a malformed VTNUMBA_DEVICE is an error here: no GPU to count)
            _chosen = DeviceChoice(0, f"target {target}: one (simulated or no) CUDA device")
        else:
            from numba import cuda

            if not cuda.is_available():  # (CUDABackend then says so; counting devices would raise here)
                return DeviceChoice(0, "no usable CUDA GPU: device 0")
            _chosen = choose_cuda_device(len(cuda.gpus))
    return _chosen


# (DeviceChoice, LOCAL_RANK_VARIABLES, choose_cuda_device and node_local_rank stay importable from here.)
__all__ = ["process_cuda_device"]
