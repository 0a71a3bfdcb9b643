"""Under ``mpiexec -n 2``: the encoder -> prefill demo in-process, with eviction pressure and failures.

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_ec_disagg.py -q
"""

import importlib.util
import os

import pytest
from mpi4py import MPI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("ec_disagg_demo", os.path.join(ROOT, "mpi", "ec_disagg.py"))
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

SMALL = ["--entries", "14", "--max-rows", "300", "--hidden", "32", "--timeout", "20", "--quiet"]


def _ec_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("vtnumba_ec_")}


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
    before = _ec_files()
    args = demo.build_parser().parse_args(SMALL + ["--queues", queues])
    res = demo.run(args, comm)
    comm.Barrier()
    ok = not os.path.exists(res["region_path"]) and _ec_files() == before
    if comm.Get_rank() == 0:
        c = res["consumer"]
        ok &= c["verified"] + c["evicted_before_load"] == 14 and c["verified"] > 0
        ok &= res["evictions"] > 0 and res["bytes_saved"] > 0
        ok &= c["stale_reports"] == 0
    elif comm.Get_rank() == 1:
        ok &= res["verified"] > 0 and res["bytes_loaded"] > 0
    assert _all(comm, ok), res


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_consumer_raising_mid_run_leaves_nothing_behind(comm):
    before = _ec_files()
    args = demo.build_parser().parse_args(SMALL + ["--fail-at", "3"])
    rank = comm.Get_rank()
    from vtnumba.ec.channel import PeerFailure

    expected = RuntimeError if rank == 1 else PeerFailure
    with pytest.raises(expected) as ei:
        demo.run(args, comm)
    comm.Barrier()
    ok = _ec_files() == before and "injected failure at consumer step 3" in str(ei.value)
    assert _all(comm, ok), str(ei.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_producer_consumer_config_mismatch(comm):
    before = _ec_files()
    args = demo.build_parser().parse_args(SMALL + ["--consumer-hidden", "16"])
    rank = comm.Get_rank()
    from vtnumba.ec.channel import PeerFailure

    expected = PeerFailure if rank == 0 else ValueError
    with pytest.raises(expected) as ei:
        demo.run(args, comm)
    comm.Barrier()
    ok = _ec_files() == before and "hidden_size=16" in str(ei.value) and "hidden_size=32" in str(ei.value)
    assert _all(comm, ok), str(ei.value)
