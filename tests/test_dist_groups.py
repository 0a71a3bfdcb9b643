"""vtnumba.dist process groups and control helpers on a one-rank world (plain pytest, no mpiexec).

The multi-rank behaviour (splits, non-members, mismatched arguments) is in
tests/mpi/test_dist_groups_mpi.py; here every code path that a single rank can reach.
"""

import numpy as np
import pytest
from mpi4py import MPI

from vtnumba import dist
from vtnumba.dist import comm as dcomm


@pytest.fixture
def world():
    dist.destroy_distributed()
    g = dist.init_distributed()
    yield g
    dist.destroy_distributed()


def test_init_registers_tp_and_world(world):
    assert world.name == "tp" and world.size == MPI.COMM_WORLD.Get_size() == 1
    assert world.rank == 0 and world.world_ranks == [0]
    assert world.peer_access is True
    assert dist.get_tp_group() is world and dist.get_group("tp") is world
    w = dist.get_world_group()
    assert w.size == 1 and w is not world
    # Data and control traffic travel on distinct communicators (separate MPI contexts).
    assert MPI.Comm.Compare(world.comm, world.cpu_comm) == MPI.CONGRUENT
    assert world.comm != world.cpu_comm
    assert world.node_comm.Get_size() == 1


def test_init_is_idempotent_and_rejects_a_different_tp_size(world):
    assert dist.init_distributed() is world
    assert dist.init_distributed(tp_size=1) is world
    with pytest.raises(ValueError, match=r"already initialised with tp_size=1.*destroy_distributed"):
        dist.init_distributed(tp_size=2)


@pytest.mark.parametrize("bad,exc,match", [
    (2, ValueError, r"tp_size=2 must divide the world size 1"),
    (0, ValueError, r"tp_size=0 must divide the world size 1"),
    (1.0, TypeError, r"tp_size=1.0 must be an int"),
    (True, TypeError, r"tp_size=True must be an int"),
])
def test_init_rejects_bad_tp_size(bad, exc, match):
    dist.destroy_distributed()
    with pytest.raises(exc, match=match):
        dist.init_distributed(tp_size=bad)
    assert not dist.is_initialized()
    # the failed attempt left nothing behind: a correct call works
    g = dist.init_distributed(tp_size=1)
    assert g.size == 1
    dist.destroy_distributed()


def test_init_with_an_explicit_comm_and_destroy_frees_everything():
    dist.destroy_distributed()
    g = dist.init_distributed(comm=MPI.COMM_SELF)
    h = dist.new_group("extra", [0])
    dist.destroy_distributed()
    assert g.freed and h.freed
    assert g.comm == MPI.COMM_NULL and g.cpu_comm == MPI.COMM_NULL  # Free() nulls the handles
    dist.destroy_distributed()  # repeat is harmless
    with pytest.raises(TypeError, match="comm must be an MPI communicator"):
        dist.init_distributed(comm="world")


def test_distributed_frees_only_what_it_created():
    dist.destroy_distributed()
    with dist.distributed() as g:  # alone: creates the groups and frees them after the block
        assert dist.is_initialized() and dist.get_tp_group() is g
    assert not dist.is_initialized() and g.freed

    outer = dist.init_distributed()  # inside a program that set them up: uses them, frees nothing
    with dist.distributed(tp_size=1) as g:
        assert g is outer
    assert dist.is_initialized() and not outer.freed
    with pytest.raises(ValueError, match=r"already initialised with tp_size=1"), dist.distributed(tp_size=2):
        pass
    assert dist.get_tp_group() is outer
    dist.destroy_distributed()


def test_distributed_leaves_the_groups_when_its_block_raises():
    # A failing rank must still report over the failure board (which destroy_distributed closes),
    # and cannot free communicators collectively with peers that are elsewhere.
    dist.destroy_distributed()
    with pytest.raises(RuntimeError, match="the body failed"), dist.distributed() as g:
        raise RuntimeError("the body failed")
    assert dist.is_initialized() and not g.freed
    from vtnumba.dist import failures

    assert failures._board is not None
    dist.destroy_distributed()


def test_unknown_group_name_lists_known_ones(world):
    with pytest.raises(KeyError, match=r"no process group named 'pp'; known groups: \['tp', 'world'\]"):
        dist.get_group("pp")
    with pytest.raises(ValueError, match="no process group named 'pp'"):  # also a ValueError
        dist.get_group("pp")


def test_not_initialised_is_a_clear_error():
    dist.destroy_distributed()
    with pytest.raises(RuntimeError, match=r"call vtnumba.dist.init_distributed\(\) first"):
        dist.get_tp_group()
    with pytest.raises(RuntimeError, match="init_distributed"):
        dist.new_group("x", [0])


def test_new_group_and_its_validation(world):
    g = dist.new_group("solo", [0])
    assert g.name == "solo" and g.size == 1 and g.world_ranks == [0] and dist.get_group("solo") is g
    g2 = dist.new_group("solo_np", np.array([0]))  # numpy ints are ranks too
    assert g2.world_ranks == [0]
    for name, ranks, match in [
        ("solo", [0], r"name='solo' is already a group"),
        ("", [0], r"name='' must be a non-empty str"),
        (None, [0], r"name=None must be a non-empty str"),
        ("empty", [], r"ranks=\[\] is empty"),
        ("far", [0, 5], r"must be world ranks in 0..0"),
        ("dup", [0, 0], r"contains duplicates"),
        ("neg", [-1], r"must be world ranks"),
        ("float", [0.0], r"must be ints"),
        ("notseq", 3, r"must be a sequence of world ranks"),
    ]:
        with pytest.raises(ValueError, match=match):
            dist.new_group(name, ranks)
    # failed calls did not register their names
    with pytest.raises(KeyError, match="no process group named 'empty'"):
        dist.get_group("empty")


def test_all_ranks_ready_barrier_allgather_bytes(world):
    assert dist.all_ranks_ready(True, world) is True
    assert dist.all_ranks_ready(False, world) is False
    assert dist.all_ranks_ready(1, world) is True
    dist.barrier(world, timeout_s=5)
    assert dist.allgather_bytes(b"\x00\xffhello", world) == [b"\x00\xffhello"]
    assert dist.allgather_bytes(b"", world) == [b""]
    with pytest.raises(TypeError, match="data must be bytes"):
        dist.allgather_bytes("text", world)
    with pytest.raises(ValueError, match=r"timeout_s=0(\.0)? must be a positive, finite number"):
        dist.barrier(world, timeout_s=0)
    with pytest.raises(TypeError, match="must be a vtnumba ProcessGroup"):
        dist.barrier(None)


def test_agree_errors_raises_the_same_typed_error(world):
    dist.agree_errors(None, world)  # nobody failed
    with pytest.raises(ValueError, match=r"ctx: failed on 1 of 1 ranks of group 'tp' -- rank 0: bad size"):
        dist.agree_errors(ValueError("bad size"), world, context="ctx")
    with pytest.raises(RuntimeError, match="rank 0: oops"):
        dist.agree_errors(OSError("oops"), world)  # types outside the list become default_type
    with pytest.raises(KeyError):
        dist.agree_errors(ValueError("x"), world, exc_type=KeyError)


def test_wait_request_times_out_with_a_clear_message(world):
    class NeverDone:
        def Test(self):
            return False

    with pytest.raises(RuntimeError, match=r"probe on group 'tp' \(rank 0 of 1, world ranks \[0\]\) timed out "
                                           r"after 0.05 s"):
        dcomm.wait_request(NeverDone(), world, "probe", 0.05)


def test_fake_node_hook_turns_off_peer_access(world, monkeypatch):
    monkeypatch.setenv("VTNUMBA_FAKE_NODE_SIZE", "1")
    g = dist.new_group("fake_nodes", [0])
    assert g.peer_access is True  # one rank is always on one node
    monkeypatch.setenv("VTNUMBA_FAKE_NODE_SIZE", "0")
    with pytest.raises(ValueError, match="VTNUMBA_FAKE_NODE_SIZE='0' must be a positive int"):
        dist.new_group("fake_nodes_bad", [0])
