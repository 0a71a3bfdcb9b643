"""Process groups over mpi4py: the world, tensor-parallel groups, and a registry by name.

Upstream concept (vLLM): an inference engine keeps one named group per kind of parallelism ("tp" for
tensor parallelism) and hands it to every layer that communicates.  A group carries two
communicators that span the same ranks:

* ``comm``     -- the *data* communicator (what a device collective, or the MPI fallback
  of one, uses);
* ``cpu_comm`` -- the *control* communicator (agreement, barriers, handle exchange).

They are distinct MPI communicators (separate contexts), so a control message can never be
matched by a data receive or the other way round, whatever order the two kinds of traffic
happen in.

A group also knows whether its ranks can touch each other's memory: ``peer_access`` is true
only when every rank of the group is on one node (``MPI.COMM_TYPE_SHARED``).  A group that
spans nodes cannot use peer buffers; callers fall back to MPI collectives.

``init_distributed(tp_size)`` splits the world into consecutive tensor-parallel groups of
``tp_size`` ranks (ranks 0..tp-1, tp..2tp-1, ...) and registers this rank's as ``"tp"``; the
whole world is registered as ``"world"``.  ``new_group(name, ranks)`` adds any other group.
``with distributed(tp_size) as tp:`` does the same for one block of code, and frees the groups
after it only if it was the one that created them.
Creation is collective over the world: arguments are first compared across ranks, so a
mismatch (or bad input on one rank) raises the same error on every rank instead of hanging.

Test hook: ``VTNUMBA_FAKE_NODE_SIZE=k`` (read when a group is created) pretends every ``k``
consecutive world ranks form one node, so the multi-node path is testable on one machine.
"""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mpi4py import MPI

from vtnumba.backend.arrays import is_int
from vtnumba.dist import failures
from vtnumba.dist.comm import agree_errors, arrive


class GroupNotFoundError(KeyError, ValueError):
    """Raised by :func:`get_group` for a name this process does not know (a KeyError and a ValueError)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


@dataclass(eq=False)
class ProcessGroup:
    """A set of ranks that communicate together.  Made by :func:`init_distributed`/:func:`new_group`."""

    #: The name it is registered under (``"world"``, ``"tp"``, or the one given to :func:`new_group`).
    name: str
    #: The data communicator, used by a device collective or its MPI fallback.
    comm: MPI.Comm
    #: The control communicator for agreement, barriers and handle exchange (same ranks, separate context).
    cpu_comm: MPI.Comm
    #: The ranks of this group on this rank's node.
    node_comm: MPI.Comm
    #: The world rank of each group rank, indexed by group rank.
    world_ranks: list[int]
    #: True when every rank is on one node, so peer buffers are possible; otherwise use MPI collectives.
    peer_access: bool
    #: This process's rank within the group (0 .. size - 1).
    rank: int = field(init=False)
    #: The number of ranks in the group.
    size: int = field(init=False)
    #: True once :func:`destroy_distributed` has freed the group's communicators; do not use it after.
    freed: bool = field(default=False, init=False)
    #: None while usable; once a collective on the group timed out, what timed out.  The MPI
    #: request of a timed-out collective cannot be cancelled, so the group's communicators can
    #: never match up again: every later collective on it raises at once (see
    #: :func:`~vtnumba.dist.comm.wait_request`) instead of waiting out its own timeout.
    unusable: str | None = field(default=None, init=False)

    def __post_init__(self):
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def _free(self) -> None:
        if self.freed:
            return
        self.freed = True
        for c in (self.node_comm, self.cpu_comm, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()

    def __repr__(self) -> str:
        state = " (freed)" if self.freed else ""
        return (f"<ProcessGroup {self.name!r} rank {self.rank}/{self.size} world_ranks={self.world_ranks} "
                f"peer_access={self.peer_access}{state}>")


@dataclass
class _State:
    parent: MPI.Comm               # the communicator init_distributed was given (not owned)
    world: ProcessGroup
    tp_size: int
    groups: dict[str, ProcessGroup | None]   # None: a known group this rank is not a member of
    members: dict[str, list[int]]


_state: _State | None = None
_lock = threading.RLock()


def fake_node_size() -> int | None:
    """``VTNUMBA_FAKE_NODE_SIZE`` (a test hook: pretend every k consecutive ranks share a node),
    or None; a value that is not a positive int is a ValueError naming the variable."""
    fake = os.environ.get("VTNUMBA_FAKE_NODE_SIZE", "").strip()
    if not fake:
        return None
    try:
        k = int(fake)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"VTNUMBA_FAKE_NODE_SIZE={fake!r} must be a positive int (ranks per pretended node)")
    return k


def _node_ids(world: MPI.Comm, shared: MPI.Comm) -> list[int]:
    """One node id per world rank: the world rank of the node's first rank (or a fake layout)."""
    k = fake_node_size()
    if k is not None:
        return [r // k for r in range(world.Get_size())]
    leader = shared.bcast(world.Get_rank(), root=0)
    return list(world.allgather(leader))


def _make_group(name: str, parent: MPI.Comm, color: int, key: int, world_ranks: list[int]) -> ProcessGroup | None:
    """Collective over ``parent``: split off the ranks with ``color`` (MPI.UNDEFINED = not a member)."""
    base = parent.Split(color, key)
    shared = parent.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        nodes = _node_ids(parent, shared)
    finally:
        shared.Free()
    if base == MPI.COMM_NULL:
        return None
    cpu = base.Dup()
    my_node = nodes[parent.Get_rank()]
    node_comm = base.Split(my_node, base.Get_rank())
    peer_access = len({nodes[r] for r in world_ranks}) == 1
    group = ProcessGroup(name, base, cpu, node_comm, list(world_ranks), peer_access)
    return group


def _agree_args(parent_group: ProcessGroup, local_error: BaseException | str | None, args: tuple,
                what: str) -> None:
    """Every rank must have called ``what`` with identical arguments; else the same error everywhere."""
    import pickle

    from vtnumba.dist.comm import allgather_bytes

    mine = pickle.dumps(args)
    everyone = allgather_bytes(mine, parent_group)
    err = local_error
    if err is None and any(e != mine for e in everyone):
        shown = "; ".join(f"rank {r}: {pickle.loads(e)!r}" for r, e in enumerate(everyone))
        err = ValueError(f"{what} must be called with the same arguments on every rank, got {shown}")
    agree_errors(err, parent_group, context=what, default_type=ValueError)


def init_distributed(tp_size: int | None = None, comm: MPI.Comm | None = None) -> ProcessGroup:
    """Set up the world and this rank's tensor-parallel group; returns the ``"tp"`` group.

    ``tp_size`` defaults to the world size.  The world (``comm``, default ``MPI.COMM_WORLD``)
    is split into consecutive groups of ``tp_size`` ranks.  Calling it again with the same
    (or no) ``tp_size`` returns the same group; a different one raises ValueError -- call
    :func:`destroy_distributed` first.
    """
    global _state
    with _lock:
        if _state is not None:
            if tp_size is not None and tp_size != _state.tp_size:
                raise ValueError(f"init_distributed(tp_size={tp_size!r}): already initialised with "
                                 f"tp_size={_state.tp_size}; call destroy_distributed() first to change it")
            if comm is not None and comm != _state.parent:
                raise ValueError("init_distributed(comm=...): already initialised over another communicator; "
                                 "call destroy_distributed() first")
            return _state.groups["tp"]

        parent = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(parent, MPI.Comm) or parent == MPI.COMM_NULL:
            raise TypeError(f"comm must be an MPI communicator, got {comm!r}")
        n = parent.Get_size()
        world_ranks = list(range(n))
        # Making the groups is a series of Split/Dup/allgather calls that block in C: every
        # rank arrives first, in a barrier that polls (see arrive).
        arrive(parent, "init_distributed")
        world = _make_group("world", parent, 0, parent.Get_rank(), world_ranks)

        err = None
        if tp_size is None:
            tp = n
        elif not is_int(tp_size):
            err, tp = TypeError(f"tp_size={tp_size!r} must be an int"), None
        elif not 1 <= tp_size <= n or n % tp_size:
            err, tp = ValueError(f"tp_size={tp_size} must divide the world size {n} (a value in 1..{n} "
                                 f"with {n} % tp_size == 0)"), None
        else:
            tp = tp_size = int(tp_size)  # (a numpy integer, too)
        try:
            _agree_args(world, err, (tp_size,), "init_distributed")
        except BaseException:
            world._free()
            raise
        if err is not None:  # identical on every rank (arguments agreed), so raising here is safe
            world._free()
            raise err
        me = parent.Get_rank()
        first = (me // tp) * tp
        tp_group = _make_group("tp", world.comm, me // tp, me, list(range(first, first + tp)))
        _state = _State(parent, world, tp, {"world": world, "tp": tp_group},
                        {"world": world_ranks, "tp": tp_group.world_ranks})
        # From now on a rank that fails can tell the others at once (see vtnumba.dist.failures).
        failures.install(parent)
        return tp_group


def destroy_distributed() -> None:
    """Free every group's communicators (collective: every rank must call it).  Safe to repeat."""
    global _state
    with _lock:
        if _state is None:
            return
        state, _state = _state, None
        failures.uninstall()
        # Free in reverse creation order; the world goes last (the others were split from it).
        for g in reversed([g for g in state.groups.values() if g is not None and g is not state.world]):
            g._free()
        state.world._free()


@contextmanager
def distributed(tp_size: int | None = None, comm: MPI.Comm | None = None) -> Iterator[ProcessGroup]:
    """``with distributed() as tp:`` -- :func:`init_distributed` for the block, undone after it
    only if this call did the setting up.

    A program or a benchmark suite that may run on its own *or* inside a larger program needs
    exactly this: on its own it creates the groups and frees them at the end; inside a program
    that already initialised them it uses that setup (same rules as ``init_distributed``: a
    different ``tp_size`` raises ValueError) and leaves it in place for its owner.  Collective,
    like both calls it stands for.

    When the block raises, the groups stay: freeing communicators is collective, and a rank
    that failed cannot count on its peers being there to free them too -- it reports the
    failure (over the failure board, which ``destroy_distributed`` would close) and leaves
    through :func:`vtnumba.dist.run_collectively`'s exit protocol instead.
    """
    created = not is_initialized()
    group = init_distributed(tp_size, comm)
    yield group  # (an exception raised in the block comes out here and skips what follows)
    if created:
        destroy_distributed()


def is_initialized() -> bool:
    """Has :func:`init_distributed` run (and not been undone by :func:`destroy_distributed`)?"""
    return _state is not None


def _require_state() -> _State:
    if _state is None:
        raise RuntimeError("vtnumba.dist is not initialised; call vtnumba.dist.init_distributed() first")
    return _state


def new_group(name: str, ranks) -> ProcessGroup | None:
    """Create a named group of world ``ranks`` (collective over the world).

    Group rank ``i`` is world rank ``ranks[i]``.  Returns the group on member ranks and
    ``None`` on the others (which still remember the name, so it stays unique everywhere).
    """
    with _lock:
        state = _require_state()
        n = state.world.size
        err = None
        if not isinstance(name, str) or not name:
            err = f"name={name!r} must be a non-empty str"
        elif name in state.groups:
            err = f"name={name!r} is already a group (known: {sorted(state.groups)})"
        try:
            rank_list = [int(r) if isinstance(r, numbers.Integral) and not isinstance(r, bool) else r
                         for r in ranks]
        except TypeError:
            rank_list = None
            err = err or f"ranks={ranks!r} must be a sequence of world ranks"
        if err is None:
            if not rank_list:
                err = "ranks=[] is empty; a group needs at least one rank"
            elif any(isinstance(r, bool) or not isinstance(r, int) for r in rank_list):
                err = f"ranks={rank_list!r} must be ints"
            elif any(not 0 <= r < n for r in rank_list):
                err = f"ranks={rank_list!r} must be world ranks in 0..{n - 1}"
            elif len(set(rank_list)) != len(rank_list):
                err = f"ranks={rank_list!r} contains duplicates"
        _agree_args(state.world, err, (name, rank_list if err is None else repr(ranks)), "new_group")
        me = state.world.rank
        member = me in rank_list
        group = _make_group(name, state.world.comm, 0 if member else MPI.UNDEFINED,
                            rank_list.index(me) if member else 0, rank_list)
        state.groups[name] = group
        state.members[name] = list(rank_list)
        return group


def get_group(name: str) -> ProcessGroup:
    """The group called ``name``; a clear error for unknown names or groups this rank is not in."""
    state = _require_state()
    with _lock:
        if name not in state.groups:
            raise GroupNotFoundError(f"no process group named {name!r}; known groups: {sorted(state.groups)}")
        group = state.groups[name]
        if group is None:
            raise GroupNotFoundError(f"this rank (world rank {state.world.rank}) is not a member of group "
                                     f"{name!r} (world ranks {state.members[name]})")
        return group


def get_tp_group() -> ProcessGroup:
    """This rank's tensor-parallel group (from :func:`init_distributed`)."""
    return get_group("tp")


def get_world_group() -> ProcessGroup:
    """The group of every rank (registered as ``"world"`` by :func:`init_distributed`)."""
    return get_group("world")


__all__ = ["ProcessGroup", "GroupNotFoundError", "init_distributed", "destroy_distributed", "distributed",
           "is_initialized", "new_group", "get_group", "get_tp_group", "get_world_group"]
