"""Process-wide settings a program makes before it loads anything heavy, and its command line's checks.

Under ``mpiexec -n N`` on one machine, every rank's OpenBLAS would otherwise start one
thread per core, so N ranks run N x cores threads that fight for the same cores (two
ranks with a BLAS thread per core each ran the MiniLM encoder at about half the speed of
one thread each).  BLAS reads its thread count once, when numpy is first imported, so a
program calls :func:`share_cores_between_local_ranks` first thing -- the command line, the
tutorial helper, the ``mpi/`` scripts and the test suite's conftest do.  The library never
does it by itself: ``import vtnumba`` changes nothing in the process.  An explicit
``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` always wins.

Command lines under ``mpiexec``: :class:`RankZeroErrorsParser` prints a usage error once,
and :func:`check_output_folder` refuses an output folder that cannot be written *before*
the run, not after minutes of it.
"""

import argparse
import os
import tempfile
from pathlib import Path

from vtnumba.trace import world_rank


def share_cores_between_local_ranks() -> None:
    """Give each of the MPI ranks on this machine an equal share of its cores for BLAS."""
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if not local or any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return
    try:
        ranks = max(1, int(local))
    except ValueError:
        return
    if ranks > 1:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))


class RankZeroErrorsParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors only world rank 0 prints.

    Under ``mpiexec -n N`` every rank parses the same command line, so a bad flag would print
    the same usage message N times; here the other ranks exit with the same status (2),
    silently.  Subcommand parsers made from it behave the same (argparse makes them of the
    parent's class)."""

    def error(self, message):
        if world_rank() not in (None, 0):
            self.exit(2)
        super().error(message)


def check_output_folder(flag: str, folder) -> None:
    """ValueError naming ``flag`` unless ``folder`` exists or can be made, and a file can be
    written in it -- asked by trying (as root, ``os.access`` says yes to nearly anything)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{flag} {folder}: is a file, not a folder")
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {folder}: cannot write there ({exc.strerror or exc}); "
                         "expected a folder this user can create files in") from None


__all__ = ["RankZeroErrorsParser", "check_output_folder", "share_cores_between_local_ranks"]
