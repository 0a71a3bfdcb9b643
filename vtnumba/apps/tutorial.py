"""Small helpers every tutorial uses: parse ``--target``, choose it, print from rank 0.

Tutorials run as ``mpiexec -n 2 python tutorials/NN_name.py [--target T]`` and also as
plain ``python tutorials/NN_name.py`` (one rank).  :func:`start` must run before anything
imports ``numba.cuda`` (the simulator switch is read at import time).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from vtnumba.apps.processes import share_cores_between_local_ranks
from vtnumba.target import TARGETS, select_target

# A tutorial imports this module first, before numpy: share the cores between the ranks now.
share_cores_between_local_ranks()


@dataclass
class Lesson:
    comm: object
    rank: int
    size: int
    target: str
    args: argparse.Namespace

    def say(self, *parts, **kw) -> None:
        """Print on rank 0 only (every rank runs the lesson; one voice tells it)."""
        if self.rank == 0:
            print(*parts, **kw)
            sys.stdout.flush()

    def check(self, ok: bool, what: str) -> None:
        """A self-check every rank agrees on: all ranks pass, or the lesson fails on all."""
        from mpi4py import MPI

        all_ok = self.comm.allreduce(bool(ok), op=MPI.LAND)
        self.say(f"  check: {what}: {'ok' if all_ok else 'FAILED'}")
        if not all_ok:
            raise SystemExit(f"self-check failed: {what}")


def start(description: str, extra_args=None) -> Lesson:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", choices=TARGETS, default=None, help="cpu, cudasim, cuda or auto")
    if extra_args:
        extra_args(parser)
    args = parser.parse_args()
    choice = select_target(args.target)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    lesson = Lesson(comm, comm.Get_rank(), comm.Get_size(), choice.name, args)
    lesson.say(f"[{description}] target={choice.name} ({choice.reason}); {lesson.size} rank(s)")
    return lesson
