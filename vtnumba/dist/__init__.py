"""Distributed layer: process groups on mpi4py, agreement, peer buffers, signals, reference collectives.

Reading order (each module is one concept):

* :mod:`~vtnumba.dist.groups`       -- ``init_distributed`` (or ``with distributed()``), named groups,
  ``get_tp_group``;
* :mod:`~vtnumba.dist.comm`         -- ``all_ranks_ready`` (vLLM TPSP's agreement), ``barrier``
  with a timeout, ``allgather_bytes``, ``allreduce_max``, ``agree_errors``, ``agree_on_call``;
* :mod:`~vtnumba.dist.shm`          -- shared-memory segments, anonymous (``memfd``; a named ``/dev/shm``
  file only where ``/proc/<pid>/fd`` cannot be opened): cpu / cudasim peer memory;
* :mod:`~vtnumba.dist.cuda_ipc`     -- CUDA IPC handles as raw bytes (real-GPU peer memory);
* :mod:`~vtnumba.dist.peer_buffers` -- ``PeerBuffers``: symmetric memory over either transport;
* :mod:`~vtnumba.dist.signals`      -- ``PeerSignals``: host-side epoch flags with timeouts;
* :mod:`~vtnumba.dist.queue_flags`  -- ``QueueFlags``: epoch flags raised and awaited by queues
  (GPU streams: stream memory operations), with a guarded finish;
* :mod:`~vtnumba.dist.failures`     -- failures are messages: ``PeerFailed`` in every wait,
  ``run_collectively`` and the exit protocol that always ends the job;
* :mod:`~vtnumba.dist.collectives`  -- reduce-scatter / all-gather over peer buffers (their flags
  raised by the host, ``PeerSignals``, or in queue order, ``QueuedSignals``), and the MPI
  baselines they are measured against.
"""

from vtnumba.dist.collectives import QueuedSignals, all_gather, mpi_all_gather, mpi_reduce_scatter, reduce_scatter
from vtnumba.dist.comm import (
    DEFAULT_TIMEOUT_S,
    agree_errors,
    agree_on_call,
    all_ranks_ready,
    allgather_bytes,
    allreduce_max,
    barrier,
    set_default_timeout,
)
from vtnumba.dist.failures import PeerFailed, phase, run_collectively
from vtnumba.dist.groups import (
    GroupNotFoundError,
    ProcessGroup,
    destroy_distributed,
    distributed,
    get_group,
    get_tp_group,
    get_world_group,
    init_distributed,
    is_initialized,
    new_group,
)
from vtnumba.dist.peer_buffers import PeerAccessError, PeerBuffers
from vtnumba.dist.queue_flags import RELEASED, QueueFlags, QueueFlagsError
from vtnumba.dist.shm import ShmSegment, list_segments
from vtnumba.dist.signals import DEFAULT_NAMES, PeerSignals

__all__ = [
    "ProcessGroup", "GroupNotFoundError", "init_distributed", "destroy_distributed", "distributed",
    "is_initialized",
    "new_group", "get_group", "get_tp_group", "get_world_group",
    "DEFAULT_TIMEOUT_S", "set_default_timeout", "all_ranks_ready", "barrier", "allgather_bytes", "allreduce_max",
    "agree_errors",
    "agree_on_call",
    "PeerBuffers", "PeerAccessError", "ShmSegment", "list_segments",
    "PeerFailed", "phase", "run_collectively", "PeerSignals", "DEFAULT_NAMES", "QueueFlags", "QueueFlagsError", "RELEASED",
    "reduce_scatter", "all_gather", "mpi_reduce_scatter", "mpi_all_gather", "QueuedSignals",
]
