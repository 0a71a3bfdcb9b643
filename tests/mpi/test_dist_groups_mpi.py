"""Process groups and control helpers across ranks (run under mpiexec -n 2 and -n 3).

    mpiexec -n 2 python -m mpi4py -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_dist_groups_mpi.py -q

Every check is made collective (results are allgathered before asserting), so a failure
on one rank fails the test on every rank instead of leaving a peer blocked.
"""


import time

import pytest

from mpi_helpers import COMM, collectively
from vtnumba import dist
from vtnumba.backend.polling import WaitTimeout
from vtnumba.dist.peer_buffers import PeerAccessError

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120)]


def same_error_everywhere(exc_type, fn) -> str:
    """``fn`` must raise ``exc_type`` with the *same* message on every rank; returns it."""
    try:
        fn()
        got = "no exception"
    except BaseException as exc:  # noqa: BLE001
        got = f"{type(exc).__name__}: {exc}"
    everyone = COMM.allgather(got)
    prefix = f"{exc_type.__name__}: "
    assert all(g.startswith(prefix) for g in everyone), everyone
    assert len(set(everyone)) == 1, everyone
    return everyone[0][len(prefix):]


@pytest.fixture
def fresh():
    dist.destroy_distributed()
    yield
    dist.destroy_distributed()


def test_default_tp_group_spans_the_world(fresh):
    n, me = COMM.Get_size(), COMM.Get_rank()

    def body():
        g = dist.init_distributed()
        assert (g.name, g.size, g.rank, g.world_ranks, g.peer_access) == ("tp", n, me, list(range(n)), True)
        assert g.node_comm.Get_size() == n
        assert dist.init_distributed() is g and dist.init_distributed(tp_size=n) is g
        assert dist.get_group("world").size == n
        # both communicators really work, and independently
        assert g.comm.allreduce(me) == g.cpu_comm.allreduce(me) == n * (n - 1) // 2

    collectively(body)


def test_tp_size_one_gives_every_rank_its_own_group(fresh):
    me = COMM.Get_rank()

    def body():
        g = dist.init_distributed(tp_size=1)
        assert (g.size, g.rank, g.world_ranks) == (1, 0, [me])

    collectively(body)


@pytest.mark.mpi(min_size=2)
def test_consecutive_tp_groups(fresh):
    n, me = COMM.Get_size(), COMM.Get_rank()
    if n % 2:
        pytest.skip("needs an even world size")

    def body():
        g = dist.init_distributed(tp_size=2)
        first = me // 2 * 2
        assert g.world_ranks == [first, first + 1] and g.rank == me % 2

    collectively(body)


def test_tp_size_that_does_not_divide_the_world(fresh):
    n = COMM.Get_size()
    bad = 2 if n == 3 else n + 1
    msg = same_error_everywhere(ValueError, lambda: dist.init_distributed(tp_size=bad))
    assert f"tp_size={bad} must divide the world size {n}" in msg
    collectively(lambda: dist.init_distributed())  # nothing half-made was left behind


def test_tp_size_differing_across_ranks(fresh):
    me = COMM.Get_rank()
    msg = same_error_everywhere(ValueError, lambda: dist.init_distributed(tp_size=None if me else 1))
    assert "must be called with the same arguments on every rank" in msg and "rank 0: (1,)" in msg


def test_new_group_members_and_non_members(fresh):
    n, me = COMM.Get_size(), COMM.Get_rank()

    def body():
        dist.init_distributed()
        g = dist.new_group("last_first", [n - 1, 0])
        if me in (0, n - 1):
            assert g.size == 2 and g.world_ranks == [n - 1, 0]
            assert g.rank == (0 if me == n - 1 else 1)  # group rank follows the order given
            assert dist.get_group("last_first") is g
        else:
            assert g is None
            try:
                dist.get_group("last_first")
                raise AssertionError("a non-member got the group")
            except KeyError as exc:
                assert "is not a member of group 'last_first'" in str(exc)
        # the name is taken on every rank, members or not
    collectively(body)
    msg = same_error_everywhere(ValueError, lambda: dist.new_group("last_first", [0]))
    assert "name='last_first' is already a group" in msg


def test_new_group_arguments_differing_across_ranks(fresh):
    me = COMM.Get_rank()
    collectively(lambda: dist.init_distributed())
    msg = same_error_everywhere(ValueError, lambda: dist.new_group(f"name{me}", [0, 1]))
    assert "new_group must be called with the same arguments on every rank" in msg
    # bad input on one rank only: every rank raises the same ValueError
    msg = same_error_everywhere(ValueError, lambda: dist.new_group("g", [0, 99] if me == 1 else [0, 1]))
    assert "rank 1: ranks=[0, 99] must be world ranks" in msg


def test_agreement_helpers(fresh):
    n, me = COMM.Get_size(), COMM.Get_rank()

    def body():
        g = dist.init_distributed()
        assert dist.all_ranks_ready(True, g) is True
        assert dist.all_ranks_ready(me != 1, g) is False  # one rank refuses: everybody hears False
        got = dist.allgather_bytes(bytes([me]) * (me + 1), g)  # different lengths per rank
        assert got == [bytes([r]) * (r + 1) for r in range(n)]
        dist.barrier(g, timeout_s=10)

    collectively(body)
    g = dist.get_tp_group()
    msg = same_error_everywhere(ValueError, lambda: dist.agree_errors(ValueError("bad") if me == 1 else None, g,
                                                                      context="step"))
    assert msg == f"step: failed on 1 of {n} ranks of group 'tp' -- rank 1: bad"


def test_barrier_that_a_peer_never_joins_times_out(fresh):
    me = COMM.Get_rank()
    collectively(lambda: dist.init_distributed())
    probe = dist.new_group("probe", list(range(COMM.Get_size())))
    err = None
    if me == 0:
        try:
            dist.barrier(probe, timeout_s=0.3)
            err = "no timeout"
        except RuntimeError as exc:
            err = str(exc)
        # The group now knows it can never match up again: the next collectives (a teardown's
        # chain of barriers, say) raise at once instead of each waiting out its timeout.
        t0 = time.monotonic()
        for later in (lambda: dist.barrier(probe, timeout_s=30), lambda: dist.allgather_bytes(b"x", probe, 30),
                      lambda: dist.agree_errors(None, probe, timeout_s=30)):
            with pytest.raises(WaitTimeout, match=r"no collective on group 'probe' .* was attempted: an earlier "
                                                  r"barrier on it timed out after 0.3 s"):
                later()
        assert time.monotonic() - t0 < 5
    COMM.Barrier()
    if me != 0:
        dist.barrier(probe, timeout_s=10)  # completes rank 0's abandoned request, so nothing dangles
    errs = COMM.allgather(err)
    assert errs[0].startswith("barrier on group 'probe' (rank 0 of") and "timed out after 0.3 s" in errs[0], errs


def test_a_bad_timeout_on_one_rank_posts_nothing(fresh):
    # The timeout was checked after the request was posted: a rank that refused timeout_s=-1
    # had already let its peer through the barrier (and left an allgather for it to wait out).
    import numpy as np

    me = COMM.Get_rank()
    collectively(lambda: dist.init_distributed())
    probe = dist.new_group("probe_timeout", list(range(COMM.Get_size())))
    got = None
    if me == 1:
        with pytest.raises(ValueError, match=r"timeout_s=-1(\.0)? must be a positive, finite number of seconds"):
            dist.barrier(probe, timeout_s=-1)
        with pytest.raises(TypeError, match=r"timeout_s='5' must be a number of seconds, got str"):
            dist.allgather_bytes(b"x", probe, timeout_s="5")
    COMM.Barrier()
    # Nothing was posted on rank 1: the next barrier matches everyone's first one.  (numpy's
    # numbers are seconds too.)
    dist.barrier(probe, timeout_s=np.float32(10.0))
    got = dist.allgather_bytes(bytes([me]), probe, timeout_s=np.int64(10))
    assert got == [bytes([r]) for r in range(COMM.Get_size())]


def test_group_spanning_nodes_has_no_peer_buffers(fresh, monkeypatch):
    n = COMM.Get_size()
    collectively(lambda: dist.init_distributed())
    monkeypatch.setenv("VTNUMBA_FAKE_NODE_SIZE", "1")  # test hook: every rank is its own "node"
    g = dist.new_group("spread", list(range(n)))
    collectively(lambda: (assert_false(g.peer_access), assert_eq(g.node_comm.Get_size(), 1)))
    msg = same_error_everywhere(PeerAccessError, lambda: dist.PeerBuffers(1024, g))
    assert "spans more than one node" in msg
    assert all(COMM.allgather(dist.PeerBuffers.try_create(1024, g) is None))
    if n >= 3:
        monkeypatch.setenv("VTNUMBA_FAKE_NODE_SIZE", "2")  # nodes {0, 1}, {2, ...}
        a = dist.new_group("same_node", [0, 1])
        b = dist.new_group("two_nodes", [1, 2])
        me = COMM.Get_rank()
        collectively(lambda: (me not in (0, 1) or assert_eq(a.peer_access, True),
                              me not in (1, 2) or assert_eq(b.peer_access, False)))


def assert_false(v):
    assert v is False, v


def assert_eq(a, b):
    assert a == b, (a, b)


def test_the_launchers_node_local_rank_is_mpis():
    # vtnumba.backend.device_choice picks each rank's GPU from the launcher's variables (it
    # sits below MPI); they must agree with MPI's own split of the ranks by node.
    from mpi4py import MPI

    from vtnumba.backend.device_choice import choose_cuda_device, node_local_rank

    def check():
        node = COMM.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            local = node_local_rank()
            assert local is not None and local[0] == node.Get_rank(), (local, node.Get_rank())
            # One GPU per rank where there are as many; all on device 0 where there is one.
            assert choose_cuda_device(node.Get_size()).index == node.Get_rank()
            assert choose_cuda_device(1).index == 0
        finally:
            node.Free()

    collectively(check)


@pytest.mark.parametrize("without", [(), (1,), "all"])
def test_the_cuda_target_is_refused_alike_when_some_ranks_have_no_gpu(monkeypatch, capsys, without):
    # A launcher may give each rank its own CUDA_VISIBLE_DEVICES: a rank that saw no GPU left
    # alone with a usage error, before MPI_Init, and the ranks with one waited there for good.
    import argparse

    from vtnumba.apps import processes
    from vtnumba.target import TargetChoice

    lacking = set(range(COMM.size)) if without == "all" else set(without)
    monkeypatch.setattr("vtnumba.target.gpu_usable", lambda: (COMM.rank not in lacking, "no GPU here (test)"))
    monkeypatch.setattr("vtnumba.target.select_target", lambda name, source: TargetChoice("cuda", f"{source}=cuda"))

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    message = same_error_everywhere(ValueError, lambda: processes.choose_target(Parser(), "cuda")) if lacking \
        else None
    if not lacking:
        assert processes.choose_target(Parser(), "cuda").name == "cuda"
    elif without == "all":
        assert "this process finds no usable CUDA GPU (no GPU here (test))" in message
    else:
        assert f"rank(s) [1] of {COMM.size} find no usable CUDA GPU" in message
        said = capsys.readouterr().err
        assert ("[rank 1] no usable CUDA GPU: no GPU here (test)" in said) == (COMM.rank == 1)
