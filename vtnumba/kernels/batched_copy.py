"""Compatibility name: the batched copy lives in :mod:`vtnumba.memory.copy_engine` (it moves
bytes between allocations -- memory's concern -- and runs no arithmetic kernel)."""

from vtnumba.memory.copy_engine import (  # noqa: F401
    address_of,
    batched_copy,
    batched_copy_reference,
    check_descriptors,
    check_ranges,
    cuda_batch_api_available,
    host_batched_copy,
    prepare,
)

__all__ = ["batched_copy", "batched_copy_reference", "check_descriptors", "check_ranges", "address_of",
           "cuda_batch_api_available", "prepare", "host_batched_copy"]
