"""Fault injection: make one rank raise, die, stop or be interrupted at a named point, to test that the job still ends.

The fault tests of every multi-rank program (``mpi/*.py``, ``vtnumba demo``, ``bench``) need
the same thing: *world rank r fails at point p* -- by raising an exception, by ``SIGKILL``
(none of its code runs again), by ``SIGSTOP`` (alive, never answering) or by ``SIGINT`` (a
Ctrl-C reaching that rank alone: ``kill -INT`` of one rank's pid) -- and then check
that every rank ends within the program's timeout, with a message that names the rank, and
that nothing is left in ``/dev/shm``.  The programs take the spec as a hidden ``--inject``
flag, ``how:rank:point[@n]`` (the ``n``-th pass of the point; default the first)::

    mpiexec -n 3 python mpi/ec_disagg.py --inject stop:1:loading@2
    mpiexec -n 2 python mpi/tpsp_model.py --inject kill:0:tpsp

Each program names its own points (the encoder-cache endpoints' ``created``, ``saving``
...; a benchmark suite's name), and checks the spec against them when it parses it.  This
module sits beside :mod:`vtnumba.target` in the core layer and imports nothing, so code
that must not start MPI (``from vtnumba.ec import *``) can use it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

#: How a rank can fail: raise an exception, be killed (SIGKILL), stop (SIGSTOP), be interrupted (SIGINT).
HOWS = ("raise", "kill", "stop", "interrupt")
#: What a Ctrl-C is called wherever a rank reports one (its KeyboardInterrupt has no message).
INTERRUPTED = "interrupted (Ctrl-C, or SIGINT from mpiexec)"


@dataclass(frozen=True)
class FaultInjection:
    """``how:rank:point[@n]``: world rank ``rank`` fails the ``n``-th time it passes ``point``."""

    how: str       #: "raise", "kill" (SIGKILL), "stop" (SIGSTOP) or "interrupt" (SIGINT)
    rank: int      #: the world rank that fails
    point: str     #: where: one of the program's points
    nth: int = 1   #: at its n-th pass of ``point``

    @classmethod
    def parse(cls, text: str, points: Iterable[str] | Mapping[str, int], world_size: int | None = None) -> "FaultInjection":
        """Read ``how:rank:point[@n]`` against the program's ``points``; ValueError naming ``--inject`` otherwise.

        ``points`` may map each point to how many times a run passes it: then an ``n`` the run
        never reaches is refused, as is a ``rank`` outside ``world_size`` -- a fault that can
        never fire would make a fault test pass without testing anything.
        """
        passes = dict(points) if isinstance(points, Mapping) else None
        points = tuple(points)
        example = f"kill:1:{points[0] if points else 'point'}@2"
        try:
            how, rank, where = text.split(":")
            point, _, nth = where.partition("@")
            spec = cls(how, int(rank), point, int(nth or 1))
        except ValueError:
            raise ValueError(f"--inject={text!r} must look like {example}") from None
        if how not in HOWS or point not in points or spec.nth < 1 or spec.rank < 0:
            raise ValueError(f"--inject={text!r}: expected ({'|'.join(HOWS)}):RANK:({'|'.join(points)})[@N] "
                             "with RANK >= 0 and N >= 1")
        if world_size is not None and spec.rank >= world_size:
            raise ValueError(f"--inject={text!r}: rank {spec.rank} does not exist; the job has ranks 0..{world_size - 1}")
        if passes is not None and spec.nth > passes[point]:
            raise ValueError(f"--inject={text!r}: a run passes {point!r} {passes[point]} time(s), so @{spec.nth} "
                             "would never fire")
        return spec

    def check_fires(self, world_size: int, passes: Callable[[int], tuple[str, Iterable[str]]]) -> "FaultInjection":
        """Refuse (ValueError naming ``--inject``) a fault its rank could never reach; returns self.

        For programs whose ranks play different parts: ``passes(rank)`` says what world rank
        ``rank`` is and which of the points it passes -- ``("the consumer leader", ("opened",
        "loading", "loaded"))``, or a mapping from each point to the most times it can be
        passed (None: as often as the run has steps).  Every rank can work this out for every
        rank, so every rank refuses the same spec alike, before any of them waits for another.
        An ``@n`` that only the run's length decides is checked at the end instead
        (:meth:`FaultHook.check_fired`).
        """
        if self.rank >= world_size:
            raise ValueError(f"--inject={self._text()!r}: rank {self.rank} does not exist; the job has ranks "
                             f"0..{world_size - 1}")
        what, points = passes(self.rank)
        counts = dict(points) if isinstance(points, Mapping) else {}
        points = tuple(points)
        if self.point not in points:
            does = f"passes only {', '.join(points)}" if points else "passes none of the points"
            raise ValueError(f"--inject={self._text()!r}: rank {self.rank} is {what}, which never passes "
                             f"{self.point!r} (it {does}), so the fault would never fire")
        most = counts.get(self.point)
        if most is not None and self.nth > most:
            raise ValueError(f"--inject={self._text()!r}: rank {self.rank} ({what}) passes {self.point!r} at most "
                             f"{most} time(s), so @{self.nth} would never fire")
        return self

    def _text(self) -> str:
        return f"{self.how}:{self.rank}:{self.point}" + (f"@{self.nth}" if self.nth != 1 else "")

    def on_point(self, rank: int) -> "FaultHook | None":
        """The hook world rank ``rank`` calls at each point it passes (None unless it is the one to fail)."""
        return FaultHook(self) if rank == self.rank else None


class FaultHook:
    """What the failing rank calls at each point it passes: fails at the spec's ``n``-th pass.

    A program whose run length decides how often a point is passed asks :meth:`check_fired`
    at its end: a fault that never fired means a fault test that tested nothing."""

    def __init__(self, spec: FaultInjection):
        self.spec = spec
        self.passes = 0      #: passes of the spec's point so far
        self.fired = False   #: True once it has failed (a "raise"; "kill" and "stop" do not return)

    def __call__(self, point: str) -> None:
        if point != self.spec.point:
            return
        self.passes += 1
        if self.passes != self.spec.nth:
            return
        self.fired = True
        if self.spec.how == "raise":
            raise RuntimeError(f"injected failure at {point!r} (--inject)")
        # What this rank printed must reach the terminal before the signal lands.
        sys.stdout.flush()
        sys.stderr.flush()
        if self.spec.how == "interrupt":
            # The process's own SIGINT handler runs at the next bytecode and raises
            # KeyboardInterrupt (vtnumba's tells the peers first: vtnumba.dist.failures).
            os.kill(os.getpid(), signal.SIGINT)
            raise KeyboardInterrupt  # (reached only where SIGINT is ignored)
        os.kill(os.getpid(), signal.SIGKILL if self.spec.how == "kill" else signal.SIGSTOP)

    def check_fired(self) -> None:
        """RuntimeError naming ``--inject`` unless the fault fired (call it when the run is over)."""
        if not self.fired:
            raise RuntimeError(f"--inject={self.spec._text()!r} never fired: this run passed {self.spec.point!r} "
                               f"{self.passes} time(s), not {self.spec.nth}; choose a smaller @N")


def failure_text(exc: BaseException) -> str:
    """``"Type: message"`` for a failure report -- and, for an exception without a message (the
    KeyboardInterrupt of a Ctrl-C), what it is instead of nothing after the colon."""
    detail = str(exc) or {KeyboardInterrupt: INTERRUPTED}.get(type(exc), "no message")
    return f"{type(exc).__name__}: {detail}"


def say(line: str) -> None:
    """Print one line of a failure report to stderr in a single ``write``: ``print`` writes the
    text and its newline separately, so two ranks' lines sharing a terminal could run into
    one another.  (Here, in the core layer, so that code which must not start MPI uses it too;
    :mod:`vtnumba.dist.failures` re-exports it.)"""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def parse_inject(text: str | None, points: Iterable[str] | Mapping[str, int], rank: int,
                 world_size: int | None = None) -> FaultHook | None:
    """A program's ``--inject`` flag to the hook this rank calls at each point (None: no fault here)."""
    if text is None:
        return None
    return FaultInjection.parse(text, points, world_size).on_point(rank)


__all__ = ["HOWS", "INTERRUPTED", "FaultInjection", "FaultHook", "failure_text", "parse_inject", "say"]
