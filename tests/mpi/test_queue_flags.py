"""QueueFlags across ranks: flags raised and awaited *by queues*, and the guarded finish (mpiexec -n 2 / -n 3).

These are the flags TPSP orders its chunks with; on a GPU they are stream memory operations.
Here the queues are threaded cpu queues (really asynchronous: a queued wait holds back the
work behind it) and numba's simulator; the last test runs the GPU fallback's flag *kernels*
in the simulator, rank against rank.
"""

import contextlib
import re
import time

import numpy as np
import pytest
from mpi_helpers import COMM, collectively, group  # noqa: F401  (group is a fixture)

from vtnumba.backend import CPUBackend
from vtnumba.backend.arrays import host_view
from vtnumba.backend.atomics import store_release
from vtnumba.backend.polling import poll_until
from vtnumba.dist import RELEASED, PeerBuffers, QueueFlags, QueueFlagsError, list_segments

NAMES = ("ready", "done")


@contextlib.contextmanager
def flags_and_queue(group, backend, timeout_s: float, queue_name: str, barrier_before_close: bool = False):
    """QueueFlags on ``group`` and one queue of ``backend``, released on the way out -- also
    after a failed assertion, so every rank still reaches the collective close."""
    flags = QueueFlags(group, NAMES, backend, timeout_s=timeout_s)
    q = backend.create_queue(queue_name)
    try:
        yield flags, q
    finally:
        backend.destroy_queue(q)
        if barrier_before_close:
            COMM.Barrier()
        flags.close()


@pytest.fixture
def threaded():
    b = CPUBackend(threaded=True)
    yield b
    b.close()


@pytest.fixture(params=["cpu-threaded", pytest.param("gpu", marks=pytest.mark.cuda)])
def queues_backend(request):
    """Queues that run on their own: threaded cpu queues here, and a real GPU's streams where
    there is one -- there the waits are cuStreamWaitValue32 across processes, and a failure
    must release them through CUDA IPC memory."""
    if request.param == "gpu":
        from vtnumba.backend.cuda import CUDABackend

        b = CUDABackend()
    else:
        b = CPUBackend(threaded=True)
    yield b
    b.close()


def test_a_ring_of_queued_waits_and_signals(group, threaded):
    """Rank r's queue waits for rank r-1's flag, then does its work, then signals rank r+1."""
    def body():
        me, n = group.rank, group.size
        # (The buffers outlive the queue: its work writes into them.)
        with PeerBuffers(8 * n, group, CPUBackend(), timeout_s=20) as order, \
                flags_and_queue(group, threaded, 20, "ring") as (flags, q):
            stamps = order.views(np.int64, (n,))[0]  # rank 0's buffer: one slot per rank
            if me > 0:
                flags.wait(q, "ready", 1, sources=me - 1)
            threaded.submit(q, lambda _s: stamps.__setitem__(me, time.monotonic_ns()), "work")
            flags.signal(q, "ready", 1, targets=(me + 1) % n)
            flags.signal(q, "done", 1)
            flags.wait(q, "done", 1)  # every rank has done its work
            flags.finish([q], what="the ring")
            seen = stamps.copy()
            assert np.all(np.diff(seen) > 0), f"work ran out of ring order: {seen}"

    collectively(body)


def test_handshake_returns_every_ranks_meta(group, threaded):
    def body():
        flags = QueueFlags(group, NAMES, threaded, timeout_s=20)
        try:
            metas = flags.handshake((7, group.rank, 3))
            assert [m[:3] for m in metas] == [(7, r, 3) for r in range(group.size)]
            metas = flags.handshake((8, 0))
            assert all(m[:2] == (8, 0) for m in metas)
        finally:
            flags.close()

    collectively(body)


def test_a_peer_that_fails_releases_everyone_and_everyone_raises(group, queues_backend):
    """Rank 0 gives up without ever signalling; every other rank's queue was waiting for it."""
    def body():
        with flags_and_queue(group, queues_backend, 30, "victim") as (flags, q):
            flags.handshake((1,))
            t0 = time.perf_counter()
            if group.rank == 0:
                flags.fail([q])
            else:
                flags.wait(q, "ready", 1, sources=0)
                with pytest.raises(QueueFlagsError, match=r"rank 0(, \d+)* aborted during the exchange"):
                    flags.finish([q])
                assert time.perf_counter() - t0 < 10, "the failure was noticed by timeout, not by the abort"
            # Every word a queue of this rank could wait on is released: nothing stays blocked.
            own = flags.received()
            if group.rank == 0:
                assert all(v == RELEASED for v in own.values())

    collectively(body)


def test_a_rank_failing_because_of_a_peer_does_not_take_the_blame(group, threaded):
    """Rank 0's abort has reached rank 1's area but not yet the others' (a failing rank stamps
    the areas one after the other).  Rank 1 gives up because of it; whoever then finds rank
    1's stamp must also find rank 0's -- relayed by rank 1 -- and name rank 0."""
    def body():
        with flags_and_queue(group, threaded, 30, "victim") as (flags, q):
            flags.handshake((1,))
            epoch = flags.call_epoch
            if group.rank == 0:
                if group.size > 1:  # the first of the stamps fail() writes, and no other yet
                    store_release(flags.host._areas[1], flags.host._abort_at + 0, epoch)
            else:
                if group.rank == 1:
                    flags.wait(q, "ready", 1, sources=0)  # held back until rank 1 gives up
                else:  # wait until rank 1 has given up, so rank 0's own stamp cannot be what we see
                    poll_until(lambda: flags.host.abort_stamp(1) == epoch, 10, lambda w: "rank 1's abort")
                with pytest.raises(QueueFlagsError) as failed:
                    flags.finish([q])
            COMM.Barrier()  # (no assertion before it: a rank that skipped it would leave the others here)
            if group.rank == 0:
                flags.fail([q])  # the rest of rank 0's failure: every area stamped, every word released
            else:
                assert re.search(r": rank 0(, \d+)* aborted during the exchange", str(failed.value)), failed.value

    collectively(body)


def test_a_peer_that_never_signals_is_named_after_the_deadline(group, queues_backend):
    def body():
        # (The last rank may not close -- collective -- before the others gave up: a barrier first.)
        with flags_and_queue(group, queues_backend, 0.5, "stuck", barrier_before_close=True) as (flags, q):
            flags.handshake((1,))
            last = group.size - 1
            if group.rank != last:
                flags.wait(q, "done", 3, sources=last)  # the last rank never raises it
                with pytest.raises(QueueFlagsError, match=rf"'done' from rank {last}: 0 \(waited for 3\)"):
                    flags.finish([q])

    collectively(body)


def test_a_release_a_peer_overwrote_is_stored_again_while_draining(group, threaded):
    """A peer still running the call stores its epoch 1 over the word rank 0 just released,
    before rank 0's queue looked -- and that queue waits for epoch 2, which the peer, busy
    elsewhere, does not send.  Rank 0's drain must release the word again, not sit out its
    30 s deadline."""
    def body():
        with flags_and_queue(group, threaded, 30, "overwritten") as (flags, q):
            flags.handshake((1,))
            if group.rank == 0:
                word = flags._slot("ready", 1)
                own = host_view(flags._areas[0])
                release_words = flags._release_words
                first = [True]

                def overwritten_release(rank, slots, timeout_s=None):
                    if rank == 0 and first[0]:  # the first release of our own area: the peer's store wins
                        first[0] = False
                        release_words(rank, [s for s in slots if s != word], timeout_s)
                        store_release(own, word, 1)
                        return
                    release_words(rank, slots, timeout_s)

                flags._release_words = overwritten_release
                flags.wait(q, "ready", 2, sources=1)
                t0 = time.perf_counter()
                flags.fail([q])
                took = time.perf_counter() - t0
            # The peers are busy elsewhere until rank 0's fail() has returned, as a peer that has
            # not reached finish() yet is: none of them releases anything for rank 0 meanwhile.
            COMM.Barrier()  # (no assertion before it: a rank that skipped it would leave the others here)
            if group.rank == 0:
                assert not first[0], "the injected overwrite did not happen"
                assert took < 5, f"fail() drained in {took:.1f} s: the overwritten word was not released again"
                assert threaded.queue_error(q) is None  # the wait passed; it did not time out
                assert int(own[word]) == RELEASED
            else:
                with pytest.raises(QueueFlagsError, match=r"rank 0(, \d+)* aborted"):
                    flags.finish([q])

    collectively(body)


def test_a_peer_that_cannot_be_released_does_not_stop_the_others(group, threaded):
    """Rank 0 fails, and storing into rank 1's area raises (a mapping gone bad): fail() warns,
    does not raise -- the caller's error is the one to report -- and still releases its own
    area and every other peer's words."""
    def body():
        with flags_and_queue(group, threaded, 30, "victim") as (flags, q):
            flags.handshake((1,))
            if group.rank == 0:
                release_words = flags._release_words
                asked = []

                def broken_for_rank_1(rank, slots, timeout_s=None):
                    asked.append(rank)
                    if rank == 1:
                        raise RuntimeError("the peer's mapping is gone")
                    release_words(rank, slots, timeout_s)

                flags._release_words = broken_for_rank_1
                with pytest.warns(RuntimeWarning, match=r"could not release rank 1's flag words .*mapping is gone"):
                    flags.fail([])
                assert asked == list(range(group.size)), asked  # rank 1's failure did not stop the rest
                assert all(v == RELEASED for v in flags.received().values())
                for r in range(2, group.size):  # (rank 1 releases its own area itself when it fails)
                    words = host_view(flags._areas[r])
                    assert all(int(words[flags._slot(name, 0)]) == RELEASED for name in NAMES), r
            else:  # rank 1's queue is not released by rank 0: it must find the abort stamp
                flags.wait(q, "ready", 1, sources=0)
                with pytest.raises(QueueFlagsError, match=r"rank 0(, \d+)* aborted"):
                    flags.finish([q])

    collectively(body)


def test_bad_arguments_are_named(group, threaded):
    def body():
        with flags_and_queue(group, threaded, 20, "bad") as (flags, q):
            with pytest.raises(ValueError, match="unknown flag name='nope'"):
                flags.signal(q, "nope", 1)
            with pytest.raises(ValueError, match="targets=99 must be group ranks"):
                flags.signal(q, "ready", 1, targets=99)
            with pytest.raises(ValueError, match=f"must be an epoch in 0..{RELEASED - 1}"):
                flags.signal(q, "ready", RELEASED)
            with pytest.raises(TypeError, match="flag value '3' must be an int epoch"):
                flags.wait(q, "ready", "3")  # (it was "'<=' not supported", naming nothing)
        with pytest.raises(RuntimeError, match="closed"):
            flags.signal(q, "ready", 1)

    collectively(body)
    with pytest.raises(ValueError, match="contains duplicates"):
        QueueFlags(group, ("a", "a"), CPUBackend(), timeout_s=20)


def test_nothing_left_in_dev_shm(group):
    def body():
        before = set(list_segments())
        flags = QueueFlags(group, NAMES, CPUBackend(), timeout_s=20)
        flags.close()
        assert set(list_segments()) <= before

    collectively(body)


@pytest.mark.simulator_only
def test_the_flag_kernels_order_two_simulated_ranks(group):
    """The GPU fallback (one-thread flag kernels), run rank against rank in numba's simulator:
    the last rank's wait kernel spins until rank 0's write kernel, launched later, arrives."""
    from numba import cuda

    from vtnumba.backend.cuda import CUDABackend
    from vtnumba.backend.cuda_flags import launch_wait_flag, launch_write_flag

    def body():
        pb = PeerBuffers(4 * group.size, group, CUDABackend(), timeout_s=20)
        try:
            words = pb.views(np.uint32, (group.size,))
            last = group.size - 1
            COMM.Barrier()
            if group.rank == 0:
                time.sleep(0.3)  # let the waiter start spinning first
                launch_write_flag(words[last], 0, 5, cuda.default_stream())
            elif group.rank == last:
                t0 = time.perf_counter()
                launch_wait_flag(words[last], 0, 5, cuda.default_stream())
                assert time.perf_counter() - t0 > 0.1, "the wait kernel returned before the flag was written"
                assert int(words[last][0]) == 5
            COMM.Barrier()
        finally:
            pb.close()

    collectively(body)
