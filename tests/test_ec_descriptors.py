"""DescriptorBuffers.add_block_runs -- the compiled builder of an entry's copy descriptors --
against coalesce_runs (its numpy reference), and the checks in front of its unchecked loop."""

import numpy as np
import pytest

from vtnumba.ec import DescriptorBufferPool, coalesce_runs

BLOCK = 64


def _expected(ids, region_base, flat_base, total_bytes, flat_is_src):
    """Descriptors from the numpy reference: one per run, the last trimmed to total_bytes."""
    slots, first, num = coalesce_runs(ids)
    src, dst, sizes = [], [], []
    for s, f, n in zip(slots.tolist(), first.tolist(), num.tolist()):
        region = region_base + f * BLOCK
        flat = flat_base + s * BLOCK
        nbytes = min(n * BLOCK, total_bytes - s * BLOCK)
        src.append(flat if flat_is_src else region)
        dst.append(region if flat_is_src else flat)
        sizes.append(nbytes)
    return src, dst, sizes


@pytest.mark.parametrize("flat_is_src", [True, False])
def test_builder_matches_the_reference_on_random_ids(rng, flat_is_src):
    pool = DescriptorBufferPool()
    for _ in range(20):
        n = int(rng.integers(1, 40))
        ids = np.sort(rng.choice(200, size=n, replace=False)).astype(np.int64)
        rng.shuffle(ids[: n // 3])  # some out of order: runs break there
        total = int((n - 1) * BLOCK + rng.integers(1, BLOCK + 1))  # the last block partly used
        bufs = pool.acquire(n)
        bufs.sizes[:] = 0xDEAD  # poison: every slot written must be overwritten
        count = bufs.add_block_runs(0, ids, n, 200, 1 << 40, 1 << 20, BLOCK, total, flat_is_src)
        src, dst, sizes = _expected(ids.tolist(), 1 << 40, 1 << 20, total, flat_is_src)
        assert count == len(sizes)
        assert bufs.src_ptrs[:count].tolist() == src and bufs.dst_ptrs[:count].tolist() == dst
        assert bufs.sizes[:count].tolist() == sizes and sum(sizes) == total
        pool.release(bufs)


@pytest.mark.parametrize("count, n_used, total, words", [
    (0, 5, 5 * BLOCK, "n_used=5"),           # more ids used than given
    (3, 4, 4 * BLOCK, "count=3"),            # past the descriptor slots
    (0, 4, 5 * BLOCK, "total_bytes=320"),    # more bytes than the used blocks hold
    (0, 4, 2 * BLOCK, "total_bytes=128"),    # a used block left empty
])
def test_what_would_run_the_loop_past_its_arrays_is_refused(count, n_used, total, words):
    bufs = DescriptorBufferPool().acquire(4)
    capacity = bufs.sizes.shape[0]
    ids = np.arange(4, dtype=np.int64)
    if words.startswith("count"):
        count = capacity - 1
        words = f"count={count}"
    with pytest.raises(ValueError, match=words):
        bufs.add_block_runs(count, ids, n_used, 10, 0, 0, BLOCK, total, True)
