"""The encoder-cache connector: hand encoder outputs from a producer process to a consumer.

Upstream: vLLM's CPU encoder-cache connector (``ec_transfer/ec_connector/cpu``).  An encoder
process (producer) computes embeddings for multimodal inputs, keyed by ``mm_hash``, and
saves them into a block-structured shared-memory region; a prefill process (consumer)
loads them into its device encoder cache instead of recomputing them.

One concept per module:

* :mod:`~vtnumba.ec.region` -- :class:`ECSharedRegion`, the shared memory both map (named in
  ``/dev/shm``, or anonymous: never a name);
* :mod:`~vtnumba.ec.embedding_cache` -- :class:`EmbeddingCache`, which blocks hold what
  (not-ready / ready / pinned, FIFO eviction);
* :mod:`~vtnumba.ec.metadata` -- the per-step messages scheduler <-> workers;
* :mod:`~vtnumba.ec.scheduler` -- :class:`ECScheduler` for producer, consumer or both;
* :mod:`~vtnumba.ec.descriptors` -- block runs and reusable copy-descriptor buffers;
* :mod:`~vtnumba.ec.destination` -- load buffers and their ``record_stream`` rule;
* :mod:`~vtnumba.ec.worker` -- :class:`ECWorker`, the batched copies and completions;
* :mod:`~vtnumba.ec.errors` -- :class:`ChannelTimeout` and :class:`PeerFailure`;
* :mod:`~vtnumba.ec.channel` -- producer <-> consumer messages over mpi4py, with timeouts;
* :mod:`~vtnumba.ec.endpoints` -- :class:`ECProducer` and :class:`ECConsumer`, which own all
  of the above for one side.

Nothing here imports mpi4py at import time (importing ``mpi4py.MPI`` starts MPI): the
channel and the endpoints import it when they are given a communicator.
"""

from vtnumba.ec.descriptors import DescriptorBufferPool, DescriptorBuffers, coalesce_runs
from vtnumba.ec.destination import LoadDestination, LoadDestinations
from vtnumba.ec.embedding_cache import CacheEntry, CacheStats, EmbeddingCache
from vtnumba.ec.endpoints import ECConsumer, ECProducer
from vtnumba.ec.errors import ChannelTimeout, PeerFailure
from vtnumba.ec.metadata import ECConnectorMetadata, ECWorkerMetadata
from vtnumba.ec.region import (
    HEADER_BYTES,
    ECRegionConfig,
    ECRegionError,
    ECRegionHandle,
    ECSharedRegion,
    create_ec_shared_region,
    open_ec_shared_region,
    region_path,
)
from vtnumba.ec.scheduler import ROLES, ECScheduler, ECUpdate
from vtnumba.ec.worker import ECWorker, Transfer
from vtnumba.ec.channel import ECChannel  # noqa: E402 - after the MPI-free modules it builds on

__all__ = [
    "CacheEntry", "CacheStats", "ChannelTimeout", "DescriptorBufferPool", "DescriptorBuffers", "ECChannel",
    "ECConnectorMetadata", "ECConsumer", "ECProducer", "ECRegionConfig", "ECRegionError", "ECRegionHandle",
    "ECScheduler", "ECSharedRegion", "ECUpdate", "ECWorker", "ECWorkerMetadata", "EmbeddingCache", "HEADER_BYTES",
    "LoadDestination", "LoadDestinations", "PeerFailure", "ROLES", "Transfer", "coalesce_runs",
    "create_ec_shared_region", "open_ec_shared_region", "region_path",
]
