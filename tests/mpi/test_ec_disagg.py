"""Under ``mpiexec -n 2`` or ``-n 3``: the encoder -> prefill demo in-process, with eviction pressure and failures.

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_ec_disagg.py -q

Every failure case checks both sides: the rank that failed raises its own error, every
other rank a :class:`~vtnumba.ec.PeerFailure` naming it -- nobody waits for a timeout --
and nothing of vtnumba's is left in ``/dev/shm``.  (Kills and stops need whole processes:
``tests/test_ec_faults.py`` launches them.)
"""

import importlib.util
import os

import pytest
from conftest import shm_files
from mpi4py import MPI

from vtnumba.ec import PeerFailure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("ec_disagg_demo", os.path.join(ROOT, "mpi", "ec_disagg.py"))
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

SMALL = ["--entries", "14", "--max-rows", "300", "--hidden", "32", "--timeout", "20", "--quiet"]


def _all(comm, ok: bool) -> bool:
    """Collective: did every rank pass?  (So one rank's failure cannot leave the other waiting.)"""
    return comm.allreduce(int(bool(ok)), op=MPI.MIN) == 1


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    c.Barrier()
    yield c
    c.Barrier()
    c.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("queues", ["sync", "threaded"])
def test_round_trip_byte_exact_with_eviction(comm, queues):
    before = shm_files()
    args = demo.build_parser().parse_args(SMALL + ["--queues", queues])
    res = demo.run(args, comm)
    comm.Barrier()
    ok = shm_files() <= before
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        c = res["consumer"]
        ok &= c["verified"] + c["evicted_before_load"] == 14 and c["verified"] > 0
        ok &= res["evictions"] > 0 and res["bytes_saved"] > 0
        ok &= c["stale_reports"] == 0
        ok &= [t["verified"] for t in c["tp_ranks"]] == [c["verified"]] * (size - 2)  # every TP rank, every entry
    elif rank == 1:
        ok &= res["verified"] > 0 and res["bytes_loaded"] > 0
    else:
        ok &= res["verified"] > 0 and res["bytes_loaded"] > 0
    assert _all(comm, ok), res


def _expect_failure(comm, argv, failing_rank, own_error, words):
    """Run with ``argv``; ``failing_rank`` raises ``own_error``, every other rank PeerFailure."""
    before = shm_files()
    args = demo.build_parser().parse_args(SMALL + argv)
    rank = comm.Get_rank()
    with pytest.raises(Exception) as ei:
        demo.run(args, comm)
    comm.Barrier()
    err = ei.value
    if rank == failing_rank:
        ok = isinstance(err, own_error)
    else:
        ok = isinstance(err, PeerFailure) and err.rank == failing_rank
    ok = ok and all(w in str(err) for w in words) and shm_files() <= before
    assert _all(comm, ok), f"rank {rank}: {type(err).__name__}: {err}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_consumer_raising_mid_run_leaves_nothing_behind(comm):
    _expect_failure(comm, ["--fail-at", "3"], 1, RuntimeError, ["injected failure at consumer step 3"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank_point", ["0:created", "1:opened", "0:shared", "0:saving@2", "1:loading@2",
                                        "last:loading@2", "1:loaded"])
def test_a_rank_raising_at_any_point_of_setup_or_transfer(comm, rank_point):
    rank, point = rank_point.split(":", 1)
    failing = comm.Get_size() - 1 if rank == "last" else int(rank)
    name = point.partition("@")[0]
    _expect_failure(comm, ["--inject", f"raise:{failing}:{point}"], failing, RuntimeError,
                    [f"injected failure at '{name}'"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_producer_consumer_config_mismatch(comm):
    before = shm_files()
    args = demo.build_parser().parse_args(SMALL + ["--consumer-hidden", "16"])
    rank = comm.Get_rank()
    with pytest.raises(Exception) as ei:
        demo.run(args, comm)
    comm.Barrier()
    err = ei.value
    # Every consumer opens with the wrong config: each raises its ValueError -- unless the first
    # one's failure report reached it before the producer's handle did.
    expected = (PeerFailure,) if rank == 0 else (ValueError,) if rank == 1 else (ValueError, PeerFailure)
    ok = isinstance(err, expected) and shm_files() <= before
    ok &= "hidden_size=16" in str(err) and "hidden_size=32" in str(err)
    assert _all(comm, ok), str(err)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(120)
def test_a_consumer_stopped_by_another_before_it_opened_still_answers_the_producer(comm):
    # The consumer leader fails before the other consumers got the region's handle: they stop
    # with a PeerFailure, which is not echoed -- and the producer, which hears every consumer out
    # before it closes the region's descriptor, waited out its timeout for them (a flaky failure
    # of the fault tests on a busy machine, where the handle arrives after the leader's report).
    import time

    from vtnumba.ec import ECConsumer, ECProducer
    from vtnumba.ec.channel import ECChannel
    from vtnumba.ec.endpoints import TAG_SETUP

    rank = comm.Get_rank()
    if rank == 1:
        ECChannel(comm, 10).report_failure("consumer leader, while opening the region: RuntimeError: boom")
    comm.Barrier()  # the report is out before the others start
    t0 = time.monotonic()
    if rank >= 2:  # no handle yet: the leader's report is all there is
        with pytest.raises(PeerFailure, match="rank 1 failed"):
            ECConsumer(comm, hidden_size=8, timeout_s=10)
    comm.Barrier()  # they have stopped before the producer sends its handle
    if rank == 0:
        with pytest.raises(PeerFailure) as ei:
            ECProducer(comm, hidden_size=8, region_bytes=1024, timeout_s=10)
        ok = ei.value.rank == 1 and time.monotonic() - t0 < 5  # at once, blaming the leader
    else:
        comm.recv(source=0, tag=TAG_SETUP)  # the handle nobody opened: taken off the line
        ok = True
    assert _all(comm, ok)
