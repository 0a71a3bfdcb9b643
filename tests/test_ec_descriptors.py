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


@pytest.mark.parametrize("flat_form", ["address", "array"])
@pytest.mark.parametrize("flat_is_src", [True, False])
def test_copy_block_runs_builds_what_add_block_runs_builds_and_copies_it(rng, flat_is_src, flat_form):
    """The one-call path of synchronous queues: the same descriptors as add_block_runs, and the
    bytes the copy engine's reference moves with them -- into a poisoned destination.  The flat
    side given by its address, or as the array itself (its address read in the compiled call)."""
    from vtnumba.backend.address_ranges import registered
    from vtnumba.backend.cpu import CPUBackend
    from vtnumba.memory.copy_engine import batched_copy_reference

    be = CPUBackend()
    pool = DescriptorBufferPool()
    block = 48  # (not a power of two: addresses off any alignment a loop might assume)
    region = rng.integers(-128, 128, 120 * block, dtype=np.int8)
    flat = rng.integers(-128, 128, 50 * block, dtype=np.int8)
    with registered(region), registered(flat):
        for _ in range(10):
            n = int(rng.integers(1, 50))
            ids = np.sort(rng.choice(120, size=n, replace=False)).astype(np.int64)
            rng.shuffle(ids[: n // 3])
            total = int((n - 1) * block + rng.integers(1, block + 1))
            region_got, flat_got = region.copy(), flat.copy()
            region_want, flat_want = region.copy(), flat.copy()
            with registered(region_got), registered(flat_got), registered(region_want), registered(flat_want):
                got, want = pool.acquire(n), pool.acquire(n)
                flat_arg = flat_got.ctypes.data if flat_form == "address" else flat_got.view(np.uint8)
                count = got.copy_block_runs(ids, n, 120, region_got.ctypes.data, flat_arg, block, total, flat_is_src)
                ref = want.add_block_runs(0, ids, n, 120, region_want.ctypes.data, flat_want.ctypes.data, block,
                                          total, flat_is_src)
                batched_copy_reference(want.src_ptrs[:ref], want.dst_ptrs[:ref], want.sizes[:ref], backend=be)
                assert count == ref
                assert (got.sizes[:count] == want.sizes[:ref]).all()
                np.testing.assert_array_equal(region_got, region_want)
                np.testing.assert_array_equal(flat_got, flat_want)
                changed = (region_got != region) if flat_is_src else (flat_got != flat)
                assert changed.any(), "random bytes were copied over random bytes: something must differ"
    be.close()


def test_copy_block_runs_copies_nothing_when_an_id_or_an_address_is_bad(rng):
    from vtnumba.backend.address_ranges import registered
    from vtnumba.ec.descriptors import BadBlockId

    bufs = DescriptorBufferPool().acquire(8)
    region = np.full(8 * BLOCK, 7, np.int8)
    flat = rng.integers(-128, 128, 4 * BLOCK, dtype=np.int8)
    with registered(region), registered(flat):
        with pytest.raises(BadBlockId) as info:
            bufs.copy_block_runs(np.array([1, 2, 9, 3], np.int64), 4, 8, region.ctypes.data, flat.ctypes.data,
                                 BLOCK, 4 * BLOCK, True)
        assert info.value.index == 2 and info.value.block_id == 9
        assert (region == 7).all()
        # A region base that is not live memory: the address check refuses it, naming the descriptor.
        with pytest.raises(ValueError, match="dst_ptrs"):
            bufs.copy_block_runs(np.arange(4, dtype=np.int64), 4, 8, region.ctypes.data + 5 * BLOCK,
                                 flat.ctypes.data, BLOCK, 4 * BLOCK, True)
        assert (region == 7).all()
    with pytest.raises(ValueError, match="n_used=5"):  # the same fit checks as add_block_runs
        bufs.copy_block_runs(np.arange(4, dtype=np.int64), 5, 8, 0, 0, BLOCK, 5 * BLOCK, True)


def test_copy_block_runs_with_an_unregistered_flat_side_checks_the_region_side(rng):
    """check_flat=False: the output (flat side) is an array the caller holds, never registered;
    the region side is still checked."""
    from vtnumba.backend.address_ranges import registered

    bufs = DescriptorBufferPool().acquire(8)
    region = np.full(8 * BLOCK, 7, np.int8)
    flat = rng.integers(-128, 128, 4 * BLOCK, dtype=np.int8)  # not registered
    ids = np.array([2, 3, 6, 7], np.int64)
    with registered(region):
        with pytest.raises(ValueError, match="src_ptrs"):  # checked as usual, the flat side is refused
            bufs.copy_block_runs(ids, 4, 8, region.ctypes.data, flat.ctypes.data, BLOCK, 4 * BLOCK, True)
        assert (region == 7).all()
        assert bufs.copy_block_runs(ids, 4, 8, region.ctypes.data, flat.ctypes.data, BLOCK, 4 * BLOCK, True,
                                    check_flat=False) == 2
        np.testing.assert_array_equal(region.reshape(8, BLOCK)[[2, 3, 6, 7]].reshape(-1), flat)
    with pytest.raises(ValueError, match="dst_ptrs"):  # the region side, no longer live: refused
        bufs.copy_block_runs(ids, 4, 8, region.ctypes.data, flat.ctypes.data, BLOCK, 4 * BLOCK, True,
                             check_flat=False)


def test_marks_shorter_than_the_region_are_refused_not_written_past():
    # The compiled loop wrote marks[id] for every id: a marks array of 4 for a 16-block region
    # wrote into memory it did not own (here: the rest of a bigger array).
    bufs = DescriptorBufferPool().acquire(4)
    big = np.zeros(32, np.uint32)
    with pytest.raises(ValueError, match=r"marks \(if given\) of num_blocks=16 entries"):
        bufs.add_block_runs(0, np.array([10], np.int64), 1, 16, 0, 0, 8, 8, True, False, big[:4], 7)
    assert not big.any()
    assert bufs.add_block_runs(0, np.array([10], np.int64), 1, 16, 0, 0, 8, 8, True, False, big[:16], 7) == 1
    assert big[10] == 7


def test_add_copies_refuses_what_it_would_have_broadcast_or_wrapped():
    bufs = DescriptorBufferPool().acquire(4)
    # One destination was broadcast to three sources; -1 became 2**64 - 1; 1.5 became 1.
    with pytest.raises(ValueError, match="have 3, 1 and 3 entries; expected one of each per descriptor"):
        bufs.add_copies(0, [1, 2, 3], [5], [8, 8, 8])
    with pytest.raises(ValueError, match=r"src_ptrs=\[-1\] holds a value outside 0..2\*\*64-1"):
        bufs.add_copies(0, [-1], [4], [8])
    with pytest.raises(TypeError, match=r"sizes=\[1.5\] must be a flat sequence of whole numbers"):
        bufs.add_copies(0, [1], [4], [1.5])
    with pytest.raises(TypeError, match="start=1.0 must be an int slot"):
        bufs.add_copies(1.0, [1], [4], [8])
    # A device address with the high bit set, beside small ones, keeps every bit.
    assert bufs.add_copies(0, [2**63 + 16, 4], [8, 2**64 - 1], [8, 8]) == 2
    assert bufs.src_ptrs[:2].tolist() == [2**63 + 16, 4] and bufs.dst_ptrs[1] == 2**64 - 1


@pytest.mark.parametrize("ids, exc, match", [
    ([1.5, 2.5, 3.9], TypeError, "must be whole-number int block ids, got dtype float64"),  # (truncated to 1 run)
    (["1", "2"], TypeError, "must be whole-number int block ids"),
    ([2**63 - 1, -2**63], ValueError, r"must be block ids in 0..2\*\*62-1"),  # (the difference wrapped to 1)
    (np.array([2**64 - 1, 0], np.uint64), ValueError, r"holds block id 18446744073709551615, outside any region's"),
    ([2**70], ValueError, r"holds block id 1180591620717411303424, outside any region's block ids"),  # (OverflowError)
    ([-2**70, 0], ValueError, r"holds block id -1180591620717411303424, outside"),
    (5, ValueError, "must be a flat sequence of block ids"),
])
def test_coalesce_runs_refuses_ids_it_would_have_mangled(ids, exc, match):
    with pytest.raises(exc, match=match):
        coalesce_runs(ids)


def test_copy_block_runs_given_the_flat_array_checks_the_region_and_the_array_bounds(rng):
    """The flat side as an array the caller holds (never registered): its size bounds the copy,
    it must be C-contiguous, and the region side is still checked -- nothing copied otherwise."""
    from vtnumba.backend.address_ranges import registered

    bufs = DescriptorBufferPool().acquire(8)
    region = np.full(8 * BLOCK, 7, np.int8)
    output = rng.integers(-128, 128, (4, BLOCK), dtype=np.int8)  # four rows of one block each
    ids = np.array([5, 6, 2, 3], np.int64)
    with registered(region):
        for bad in (output[:3].view(np.uint8),       # holds 3 blocks, the copy asks for 4
                    output[:, :BLOCK // 2].view(np.uint8)):  # not C-contiguous
            with pytest.raises(ValueError, match="flat array"):
                bufs.copy_block_runs(ids, 4, 8, region.ctypes.data, bad, BLOCK, 4 * BLOCK, True)
            assert (region == 7).all()
        with pytest.raises(ValueError, match="dst_ptrs"):  # a region base past live memory
            bufs.copy_block_runs(ids, 4, 8, region.ctypes.data + 5 * BLOCK, output.view(np.uint8), BLOCK,
                                 4 * BLOCK, True)
        assert (region == 7).all()
        count = bufs.copy_block_runs(ids, 4, 8, region.ctypes.data, output.view(np.uint8), BLOCK, 4 * BLOCK, True)
    assert count == 2  # runs [5, 6] and [2, 3]
    blocks = region.reshape(8, BLOCK)
    np.testing.assert_array_equal(blocks[[5, 6, 2, 3]], output)
    assert (blocks[[0, 1, 4, 7]] == 7).all()
