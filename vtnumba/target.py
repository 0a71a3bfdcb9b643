"""Choosing the execution target once per process: ``cuda``, ``cudasim`` or ``cpu``.

vtnumba runs the same code three ways (see ``docs/architecture``):

* ``cuda``    -- ``@cuda.jit`` kernels on a real GPU, CUDA streams and events;
* ``cudasim`` -- the same kernels in numba's CUDA simulator (host memory seen as device);
* ``cpu``     -- host reference kernels (numpy / ``@numba.njit``), host queues.

The choice must be made *before* anything imports ``numba.cuda``: the simulator is
selected by the environment variable ``NUMBA_ENABLE_CUDASIM=1`` which numba reads once,
at import time.  That is why this module never imports ``numba.cuda`` itself unless it has
to probe for a GPU, and why the CLI parses ``--target`` before importing anything heavy.

``VTNUMBA_TARGET=auto|cuda|cudasim|cpu`` sets the default; ``select_target()`` (called by
the CLI with its ``--target`` flag) overrides it.  ``auto`` means ``cuda`` when a GPU is
usable, else ``cpu`` -- and *usable* means more than present: ``auto`` has the driver make
a CUDA context on the GPU the process would use (:mod:`vtnumba.device_rule`), and let it go,
so a GPU that refuses one (another process holds it in exclusive-process mode, its memory is
full) sends the process to ``cpu`` with the driver's reason, instead of failing in
``CUDABackend``.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from dataclasses import dataclass

TARGETS = ("auto", "cuda", "cudasim", "cpu")


@dataclass(frozen=True)
class TargetChoice:
    """The target this process runs on, and a sentence saying why."""

    #: The resolved target, ``"cuda"``, ``"cudasim"`` or ``"cpu"`` (never ``"auto"``).
    name: str
    #: Why this target was chosen (which flag or variable asked for it, or what ``auto`` found when it probed).
    reason: str

    @property
    def simulator(self) -> bool:
        """True on ``cudasim``, where kernels run in numba's CUDA simulator."""
        return self.name == "cudasim"

    @property
    def uses_cuda_kernels(self) -> bool:
        """True on ``cuda`` and ``cudasim``, where the ``@cuda.jit`` kernels run (not the host references)."""
        return self.name in ("cuda", "cudasim")


_choice: TargetChoice | None = None


class TargetError(ValueError):
    """An unknown target name (``--target`` or ``VTNUMBA_TARGET``); for ``auto`` on a machine
    with a GPU, a ``VTNUMBA_DEVICE`` that names no GPU there; for ``cudasim``, a malformed
    ``VTNUMBA_DEVICE``."""


def _validate(name: str, where: str) -> str:
    if not isinstance(name, str) or name.strip().lower() not in TARGETS:
        raise TargetError(f"{where}={name!r} is not a target; expected one of {', '.join(TARGETS)}")
    return name.strip().lower()


def _numba_cuda_imported() -> bool:
    return "numba.cuda" in sys.modules


def _simulator_requested() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _simulator_active_in_numba() -> bool:
    config = sys.modules.get("numba.core.config")
    return bool(config is not None and config.ENABLE_CUDASIM)


def apply_requested_target() -> None:
    """What ``import vtnumba`` does: if ``VTNUMBA_TARGET=cudasim`` asks for the simulator, switch
    numba's simulator on now -- so that even ``import vtnumba; import numba.cuda`` gets it --
    nothing else (``auto``, ``cpu``, ``cuda``, no variable at all -- or a misspelt one, which
    :func:`select_target` refuses with a clear message when the target is chosen) leaves any
    trace in the process."""
    requested = os.environ.get("VTNUMBA_TARGET", "")
    if requested.strip().lower() == "cudasim" and not _numba_cuda_imported() and not _simulator_requested():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        _reload_numba_config()


def _reload_numba_config() -> None:
    """numba reads its environment variables once, when ``numba`` is first imported (and
    numba-cuda uses numba's config): if that already happened, make it read them again so the
    simulator switch set above is the one ``import numba.cuda`` sees."""
    config = sys.modules.get("numba.core.config")
    if config is not None:
        config.reload_config()


def gpu_usable() -> tuple[bool, str]:
    """Is a real CUDA GPU usable from this process?  Returns ``(usable, why)``.

    A cheap look for the driver library comes first, so machines without a GPU never pay
    for importing ``numba.cuda`` (and never lock the process out of the simulator).
    """
    if _simulator_requested():
        return False, "NUMBA_ENABLE_CUDASIM=1 is set, so numba.cuda is the simulator"
    if ctypes.util.find_library("cuda") is None and not os.path.exists("/dev/nvidiactl"):
        return False, "no CUDA driver (libcuda) found"
    try:
        from numba import cuda

        if cuda.is_available() and len(cuda.gpus):
            # cuda.gpus[i] names a device without making a context on it (get_current_device
            # would make one on GPU 0 -- memory there, in every rank, whatever GPU it uses).
            name = cuda.gpus[0].name
            name = name.decode() if isinstance(name, bytes) else str(name)
            return True, f"CUDA GPU found: {name}" + (f" (and {len(cuda.gpus) - 1} more)" if len(cuda.gpus) > 1 else "")
        return False, "numba.cuda reports no usable GPU"
    except Exception as exc:  # a broken driver install must not crash 'auto'
        return False, f"probing the GPU failed: {exc}"


def _gpu_context_problem() -> str | None:
    """Can this process make a CUDA context on the GPU the cuda target would give it?  None if
    it can, else what went wrong.

    Finding a GPU is not being able to use it: a GPU in exclusive-process mode that another
    process holds, or one whose memory is full, refuses a new context.  ``auto`` asks here,
    while it can still choose ``cpu``, on the process's own GPU (no rank touches another's).
    The context is made and let go again -- numba makes it anew when the process first uses
    the GPU, a fraction of a second once -- because numba's memory manager must be chosen
    before a context exists (:func:`vtnumba.memory.install_numba_memory_manager`), and the
    target is chosen before that.  A bad ``VTNUMBA_DEVICE`` is the user's error, not the GPU's:
    it raises :class:`TargetError`.
    """
    from numba import cuda

    from vtnumba.device_rule import choose_cuda_device

    try:
        count = len(cuda.gpus)
    except Exception as exc:  # noqa: BLE001 - whatever the driver says is the reason
        return f"listing the GPUs failed ({type(exc).__name__}: {exc})"
    try:
        index = choose_cuda_device(count).index
    except ValueError as exc:  # a bad VTNUMBA_DEVICE: the user's to fix, so no fallback
        raise TargetError(str(exc)) from None
    previous = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    ask_for_cuda_connections()  # (the driver reads it when a context is made: before the first one)
    try:
        problem = _primary_context_problem(index)
    except Exception as exc:  # noqa: BLE001
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return None
    if previous is None:  # not the cuda target after all: leave the environment as it was
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    return f"cuda:{index} would not make a CUDA context ({problem})"


def _primary_context_problem(index: int) -> str | None:
    """Retain GPU ``index``'s primary context (the one numba uses) and release it again; None
    if the driver made it, else the driver's error.  Released by the last holder, a primary
    context is destroyed, its memory with it."""
    from cuda.bindings import driver as cu  # (numba-cuda's own binding to the driver)

    ok = cu.CUresult.CUDA_SUCCESS
    (err,) = cu.cuInit(0)  # (every call returns a tuple, its error first)
    if err != ok:
        return f"cuInit: {err.name}"
    err, device = cu.cuDeviceGet(index)
    if err != ok:
        return f"cuDeviceGet({index}): {err.name}"
    err, _ = cu.cuDevicePrimaryCtxRetain(device)
    if err != ok:
        return f"cuDevicePrimaryCtxRetain: {err.name}"
    cu.cuDevicePrimaryCtxRelease(device)
    return None


#: Hardware work queues a process asks of its GPU (``CUDA_DEVICE_MAX_CONNECTIONS``; the driver's
#: default is 8).  Streams share them, and a stream held by a flag wait holds up every stream
#: behind it on its hardware queue -- including one that would release it.  TPSP and the peer
#: flags use many streams, so vtnumba asks for the most.  The driver reads the variable when
#: the process's CUDA context is made: it is set when the cuda target is chosen (before any
#: context, in a program that chooses first) and again by CUDABackend; a value already in the
#: environment -- the user's -- wins.
CUDA_CONNECTIONS = "32"


def ask_for_cuda_connections() -> None:
    """Ask for :data:`CUDA_CONNECTIONS` hardware work queues, unless the environment names a number."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_CONNECTIONS)


def select_target(name: str | None = None, *, source: str = "target") -> TargetChoice:
    """Choose the process-wide target (``name`` overrides ``VTNUMBA_TARGET``).

    ``source`` is what an error calls ``name``: ``"target"`` for a Python caller, the
    command-line flag (``"--target"``) for a program.

    Calling it again with the same resolved target is harmless; asking for a different one
    once a target has been chosen raises, because numba cannot switch simulator mode in place.
    """
    global _choice
    source = source if name is not None else "VTNUMBA_TARGET"
    requested = _validate(name if name is not None else os.environ.get("VTNUMBA_TARGET", "auto"), source)

    if requested == "auto" and _choice is not None:
        # Already chosen: 'auto' accepts it.  (Probing again could answer differently -- a GPU
        # freed since -- and make a context on a GPU this process does not use.)
        return _choice
    if requested == "auto":
        ok, why = gpu_usable()
        if ok:
            problem = _gpu_context_problem()
            if problem:
                ok, why = False, f"{why}, but {problem}"
        resolved = TargetChoice("cuda", f"auto: {why}") if ok else TargetChoice("cpu", f"auto: {why}; using the cpu target")
    elif requested == "cudasim":
        resolved = TargetChoice("cudasim", f"{source}=cudasim: kernels run in numba's CUDA simulator")
    elif requested == "cuda":
        resolved = TargetChoice("cuda", f"{source}=cuda")
    else:
        resolved = TargetChoice("cpu", f"{source}=cpu: host reference kernels")

    if _choice is not None and _choice.name != resolved.name:
        raise RuntimeError(
            f"the target is already {_choice.name!r} in this process; cannot switch to {resolved.name!r} "
            "(choose it once, before anything imports numba.cuda)"
        )
    if resolved.name == "cudasim":
        from vtnumba.device_rule import requested_device

        try:  # (the simulator has one device, so only a malformed value is an error -- said here, not first on a GPU)
            requested_device()
        except ValueError as exc:
            raise TargetError(str(exc)) from None
        if _numba_cuda_imported() and not _simulator_active_in_numba():
            raise RuntimeError(
                f"target 'cudasim' was requested ({source}), but numba.cuda was already imported as the real CUDA "
                "target: numba reads the simulator switch only once, when numba.cuda is first imported. Choose the "
                "target before anything imports numba.cuda -- import vtnumba (or call vtnumba.select_target) first, "
                "or start Python with NUMBA_ENABLE_CUDASIM=1")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        _reload_numba_config()
    if resolved.name == "cuda":
        ask_for_cuda_connections()
    os.environ["VTNUMBA_TARGET"] = resolved.name  # child processes (mpiexec -n) inherit the choice
    _choice = resolved
    return resolved


def current_target() -> TargetChoice:
    """The process's target, choosing it from the environment on first use."""
    return _choice if _choice is not None else select_target()


def target_name() -> str:
    """The process's target name, ``"cuda"``, ``"cudasim"`` or ``"cpu"`` (chosen on first use, as above)."""
    return current_target().name


def _reset_for_tests() -> None:
    """Forget the choice (tests only: numba's simulator mode itself cannot be reset)."""
    global _choice
    _choice = None
