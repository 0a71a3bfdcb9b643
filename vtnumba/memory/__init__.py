"""Memory above the backend: a caching allocator, a step arena, a hazard checker, the copy engine.

* :mod:`~vtnumba.memory.allocator` -- :class:`CachingAllocator` (segments, size classes,
  per-queue pools, ``record_stream``) and its :class:`Block`;
* :mod:`~vtnumba.memory.arena` -- :class:`StepArena`, bump allocation reset every step;
* :mod:`~vtnumba.memory.hazards` -- the opt-in checker for the missing ``record_stream``;
* :mod:`~vtnumba.memory.current_queue` -- ``using_queue``, the thread's current queue;
* :mod:`~vtnumba.memory.numba_emm` -- the allocator as numba's memory-manager plugin (cuda);
* :mod:`~vtnumba.memory.copy_engine` -- ``batched_copy``: many (src, dst, nbytes) descriptors in
  one call on a queue (vLLM's ``swap_blocks_batch``), every address checked first;
* :mod:`~vtnumba.memory.shared_files` -- private ``/dev/shm`` files (0600, ``O_EXCL``,
  ``O_NOFOLLOW``, unlinked at exit) for the peer segments and the encoder-cache region.
"""

from vtnumba.memory.allocator import (
    LARGE_ROUND,
    MIN_BLOCK,
    SMALL_MAX,
    SMALL_SEGMENT,
    AllocatorOutOfMemory,
    Block,
    CachingAllocator,
    note_use,
    round_size,
)
from vtnumba.memory.arena import ArenaOverflowError, StepArena
from vtnumba.memory.copy_engine import batched_copy, batched_copy_reference
from vtnumba.memory.current_queue import current_queue, using_queue
from vtnumba.memory.hazards import (
    HazardChecker,
    HazardError,
    HazardReport,
    active_checker,
    check_hazards,
    hazard_checks_off,
)
from vtnumba.memory.numba_emm import install_numba_memory_manager, numba_memory_manager_class, record_stream_array

__all__ = [
    "batched_copy", "batched_copy_reference", "LARGE_ROUND", "MIN_BLOCK", "SMALL_MAX", "SMALL_SEGMENT", "AllocatorOutOfMemory", "Block", "CachingAllocator",
    "round_size", "ArenaOverflowError", "StepArena", "current_queue", "using_queue", "HazardChecker", "HazardError",
    "HazardReport", "active_checker", "check_hazards", "hazard_checks_off", "note_use", "install_numba_memory_manager",
    "numba_memory_manager_class", "record_stream_array",
]
