"""Helpers shared by the MPI test modules (imported by name; pytest puts this folder on sys.path)."""

import traceback

import pytest
from mpi4py import MPI

from vtnumba.dist import destroy_distributed, get_tp_group, init_distributed, is_initialized

COMM = MPI.COMM_WORLD


def collectively(fn):
    """Run ``fn`` on every rank and fail on every rank if it raised on any: one rank's failure
    must never leave the others waiting in the next collective."""
    try:
        fn()
        err = None
    except BaseException as exc:  # noqa: BLE001
        err = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    bad = [f"--- rank {r}:\n{e}" for r, e in enumerate(COMM.allgather(err)) if e]
    if bad:
        pytest.fail("\n".join(bad), pytrace=False)


@pytest.fixture(scope="module")
def group():
    """The world-sized tensor-parallel group."""
    # Another test module may have left a tensor-parallel group of another size behind.
    if is_initialized() and get_tp_group().size != COMM.Get_size():
        destroy_distributed()
    return init_distributed()
