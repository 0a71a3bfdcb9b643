"""The encoder-cache connector: hand encoder outputs from a producer process to a consumer.

Seed: vLLM's CPU encoder-cache connector (``ec_transfer/ec_connector/cpu``).  An encoder
process (producer) computes embeddings for multimodal inputs, keyed by ``mm_hash``, and
saves them into a block-structured shared-memory region; a prefill process (consumer)
loads them into its device encoder cache instead of recomputing them.

One concept per module:

* :mod:`~vtnumba.ec.region` -- :class:`ECSharedRegion`, the ``/dev/shm`` file both map;
* :mod:`~vtnumba.ec.embedding_cache` -- :class:`EmbeddingCache`, which blocks hold what
  (not-ready / ready / pinned, FIFO eviction);
* :mod:`~vtnumba.ec.metadata` -- the per-step messages scheduler <-> workers;
* :mod:`~vtnumba.ec.scheduler` -- :class:`ECScheduler` for producer, consumer or both;
* :mod:`~vtnumba.ec.descriptors` -- block runs and reusable copy-descriptor buffers;
* :mod:`~vtnumba.ec.destination` -- load buffers and their ``record_stream`` rule;
* :mod:`~vtnumba.ec.worker` -- :class:`ECWorker`, the batched copies and completions;
* :mod:`~vtnumba.ec.channel` -- producer <-> consumer messages over mpi4py, with timeouts.
"""

from vtnumba.ec.descriptors import DescriptorBufferPool, DescriptorBuffers, coalesce_runs
from vtnumba.ec.destination import LoadDestination, LoadDestinations
from vtnumba.ec.embedding_cache import CacheEntry, CacheStats, EmbeddingCache
from vtnumba.ec.metadata import ECConnectorMetadata, ECWorkerMetadata
from vtnumba.ec.region import (
    HEADER_BYTES,
    ECRegionConfig,
    ECRegionError,
    ECSharedRegion,
    create_ec_shared_region,
    region_path,
)
from vtnumba.ec.scheduler import ROLES, ECScheduler, ECUpdate
from vtnumba.ec.worker import ECWorker, Transfer


def __getattr__(name):
    # The channel imports mpi4py, which initialises MPI: load it only when asked for.
    if name in ("ECChannel", "PeerFailure", "ChannelTimeout"):
        from vtnumba.ec import channel

        return getattr(channel, name)
    raise AttributeError(f"module 'vtnumba.ec' has no attribute {name!r}")


__all__ = [
    "CacheEntry", "CacheStats", "ChannelTimeout", "DescriptorBufferPool", "DescriptorBuffers", "ECChannel",
    "ECConnectorMetadata", "ECRegionConfig", "ECRegionError", "ECScheduler", "ECSharedRegion", "ECUpdate",
    "ECWorker", "ECWorkerMetadata", "EmbeddingCache", "HEADER_BYTES", "LoadDestination", "LoadDestinations",
    "PeerFailure", "ROLES", "Transfer", "coalesce_runs", "create_ec_shared_region", "region_path",
]
