"""Plumbing shared by every kernel entry point: where the arrays live, argument checks, launching.

Each public kernel function (``matmul``, ``fused_add_rms_norm``, ``peer_reduce_norm`` ...)
follows the same three steps, and this module holds the shared part of each:

1. **Where do the arrays live?**  numpy arrays run the host reference (the ``cpu``
   target); numba device arrays (a real ``DeviceNDArray``, or the simulator's
   ``FakeCUDAArray``) run the ``@cuda.jit`` kernel.  Mixing the two in one call is an
   error: a numpy array handed to a kernel would be *copied* in and back, which silently
   breaks peer buffers and stream ordering.
2. **Are the arguments what the kernel expects?**  Shapes, dtypes and C-contiguity are
   checked at the public boundary, with messages that name the argument, the value and
   what was expected -- a kernel would otherwise index out of bounds or compute garbage.
3. **Run it in queue order.**  With a ``queue`` the work goes through
   ``backend.submit(queue, fn)`` -- on cpu ``fn`` is the host reference itself (run on the
   queue's worker thread in threaded mode, so queue order and events stay meaningful); on
   cuda ``fn`` launches the kernel into the queue's stream.  Without a queue the call is
   synchronous: the host reference runs inline, a kernel runs on the default stream and is
   waited for (in the simulator under the process-wide launch lock, because the simulator
   can run only one kernel per process at a time).

Nothing here imports ``numba.cuda`` unless a device array is actually seen, so the cpu
target never pays for (or is locked out of the simulator by) that import.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vtnumba.backend.arrays import (  # noqa: F401  (re-exported: the kernels' shared vocabulary)
    DEVICE,
    HOST,
    array_kind,
    cdiv,
    check_array,
    check_eps,
    check_not_partly_overlapping,
    check_outputs_apart,
    common_kind,
    empty,
    is_c_contiguous,
)

#: How the host references are compiled.  ``nogil`` lets a threaded queue run them beside
#: other work.  The fast-math flags allow what vectorising a float32 sum needs -- reassociation
#: (SIMD lanes keep separate partial sums), contraction into FMAs, reciprocal approximations,
#: ignoring the sign of zero -- but *not* "no NaNs / no infinities": a NaN in a row must come
#: out as NaN, as on a GPU, not be optimised into anything else.  ``error_model="numpy"`` makes
#: a division by zero an IEEE infinity or NaN instead of a Python ZeroDivisionError raised
#: from inside a queued kernel.
#: ``cache=True`` keeps the compiled machine code on disk (``__pycache__`` beside the source),
#: so the second run of a program skips the compilation that makes the first one wait.
HOST_JIT = dict(nogil=True, fastmath={"reassoc", "contract", "arcp", "nsz"}, error_model="numpy", cache=True)


def drop_stale_numba_cache(module_file: str, *dependencies: str) -> None:
    """Delete ``module_file``'s numba cache entries if a file its cached functions call into changed.

    numba checks a cached function against its *own* source file only: a kernel that calls a
    jitted helper from another file (``_streaming.store_norm_row``, say) would keep running
    the old helper's machine code after that file is edited -- a wrong result with no error,
    the worst thing for someone learning by changing the code.  So each such module calls
    this before defining its kernels: a hash of ``dependencies`` (paths, or module file names
    beside ``module_file``) is kept in ``__pycache__/<module>.deps``, and when it differs the
    module's ``.nbi``/``.nbc`` entries are removed, which makes numba compile afresh.
    """
    import hashlib
    from pathlib import Path

    here = Path(module_file).resolve()
    cache = here.parent / "__pycache__"
    digest = hashlib.sha256()
    for dep in dependencies:
        path = Path(dep) if Path(dep).is_absolute() else here.parent / dep
        digest.update(path.read_bytes())
    stamp = cache / f"{here.stem}.deps"
    try:
        if stamp.exists() and stamp.read_text() == digest.hexdigest():
            return
        for entry in list(cache.glob(f"{here.stem}.*.nbi")) + list(cache.glob(f"{here.stem}.*.nbc")):
            entry.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest.hexdigest())
    except OSError:
        pass  # a read-only install: numba then caches elsewhere (or not at all); nothing to clean here


# ---------------------------------------------------------------------------- host threads
#: A host kernel splits its rows over several threads only when the call moves at least this
#: many bytes (reads + writes): handing work to a thread costs tens of microseconds, a call of
#: this size takes a few hundred.
PARALLEL_MIN_BYTES = 4 << 20


def host_threads() -> int:
    """Threads a host kernel may use: this process's share of the cores, as BLAS gets it.

    Under ``mpiexec`` the ranks of a machine share its cores
    (:func:`vtnumba.apps.processes.share_cores_between_local_ranks` sets
    ``OPENBLAS_NUM_THREADS``), and a host kernel takes the same share; otherwise every core
    this process may run on.
    """
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    global _pool, _pool_size
    _pool, _pool_size = None, 0  # a forked child has the pool object but none of its threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def split_rows(fn: Callable[[int, int], None], r0: int, r1: int, nbytes: int) -> None:
    """Run ``fn(a, b)`` over the rows ``[r0, r1)``, split into :func:`host_threads` contiguous
    ranges run at once when the call moves at least :data:`PARALLEL_MIN_BYTES`; else ``fn(r0, r1)``.

    Why: one core streaming a fused norm is limited by how many cache misses *it* can have in
    flight, not by the memory bus; a second core roughly doubles that.  ``fn`` must release
    the GIL (the ``nogil`` host references do) and each range must be independent (rows
    are).  The caller's thread runs the first range itself, so nothing waits on a busy pool.
    Errors from any range are raised here, after every range has finished.
    """
    global _pool, _pool_size
    n = int(r1) - int(r0)
    k = min(host_threads(), n)
    if k <= 1 or nbytes < PARALLEL_MIN_BYTES:
        fn(int(r0), int(r1))
        return
    with _pool_lock:
        if _pool is None or _pool_size < k - 1:
            # (an outgrown pool is not shut down: a concurrent call may still be using it)
            _pool, _pool_size = ThreadPoolExecutor(max_workers=k - 1, thread_name_prefix="vtnumba-host-rows"), k - 1
        pool = _pool
    bounds = [int(r0) + n * i // k for i in range(k + 1)]
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, k)]
    error = None
    try:
        fn(bounds[0], bounds[1])
    except BaseException as exc:  # noqa: BLE001 - raised below, once every range has finished
        error = exc
    # Every range finishes before anything is raised: none may still be writing the caller's
    # arrays after the call returned.  The first error in range order is the one raised.
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
    if error is not None:
        raise error


def _resolve_backend(kind: str, queue, backend):
    from vtnumba.backend.base import Queue
    from vtnumba.backend.device import DeviceType

    if not isinstance(queue, Queue):
        raise TypeError(f"queue must be a vtnumba Queue or None, got {type(queue).__name__}")
    if backend is None:
        backend = queue.backend
    elif queue.backend is not backend:
        raise ValueError(f"queue={queue.name} belongs to {queue.backend.name}, not to backend={backend.name}")
    want = DeviceType.CPU if kind == HOST else DeviceType.CUDA
    if backend.device_type is not want:
        what = "numpy arrays need a cpu backend queue" if kind == HOST else \
            "device arrays need a cuda backend queue"
        raise TypeError(f"queue={queue.name} is on {backend.name}, but {what}")
    return backend


def run(kind: str, name: str, queue, backend, host_fn: Callable[[], None],
        launch_fn: Callable[[Any], None], *, uses=(), **trace_args) -> None:
    """Run ``host_fn()`` (host arrays) or ``launch_fn(stream)`` (device arrays) in queue order.

    See the module docstring for the three cases (queue / no queue / simulator).
    """
    if backend is not None:
        from vtnumba.backend.base import Backend
        from vtnumba.backend.device import DeviceType

        if not isinstance(backend, Backend):  # (without a queue it is not otherwise used: say so now)
            raise TypeError(f"backend must be a vtnumba Backend or None, got {type(backend).__name__}")
        if queue is None and (backend.device_type is DeviceType.CPU) != (kind == HOST):
            # (Nothing would use it, but the caller meant the work for it: a silent mismatch.)
            what = "numpy arrays run on a cpu backend" if kind == HOST else "device arrays run on a cuda backend"
            raise TypeError(f"backend={backend.name} does not serve these arrays: {what}")
    if queue is not None:
        backend = _resolve_backend(kind, queue, backend)
        # ``uses``: the arrays the work touches, for the hazard checker (see Backend.submit).
        if kind == HOST:
            backend.submit(queue, lambda _stream: host_fn(), name=name, uses=uses, **trace_args)
        else:
            backend.submit(queue, launch_fn, name=name, uses=uses, **trace_args)
        return
    if kind == HOST:
        host_fn()
        return
    from numba import cuda

    from vtnumba.backend.arrays import simulator_active
    from vtnumba.backend.cuda import SIM_LAUNCH_LOCK

    if simulator_active():
        with SIM_LAUNCH_LOCK:
            launch_fn(cuda.default_stream())
        return
    stream = cuda.default_stream()
    launch_fn(stream)
    stream.synchronize()  # no queue means a synchronous call: the result is ready on return

