"""Share the cores between MPI ranks *before* numpy loads its BLAS.

Under ``mpiexec -n N`` on one machine, every rank's OpenBLAS would otherwise start one
thread per core, so N ranks run N x cores threads that fight for the same cores (on a
2-core laptop, two ranks with two BLAS threads each ran the encoder at about half the
speed of one thread each).  BLAS reads its thread count once, when numpy is first
imported, so this runs at the top of ``vtnumba/__init__``.  An explicit
``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` always wins.
"""

import os


def share_cores_between_local_ranks() -> None:
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if not local or any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return
    try:
        ranks = max(1, int(local))
    except ValueError:
        return
    if ranks > 1:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
