"""The copy engine: many ``(src, dst, nbytes)`` descriptors moved by one call on one queue.

Upstream: vLLM's ``swap_blocks_batch`` custom op, which the encoder-cache worker
(``ECCPUWorker``) uses to move every block run of a step with *one* call instead of one
``copy_`` per block.  Each copy is tiny and the per-call overhead (a Python call, a driver
call, a launch) dominates, so the worker first *coalesces* consecutive blocks into runs and
then hands the whole list of runs to a single batched call.  The descriptors are three equal-length integer arrays
filled in bulk: source addresses, destination addresses, byte counts.

How each target does it:

* ``cpu``     -- a ``@numba.njit(nogil=True)`` loop that calls libc ``memmove`` on the raw
  addresses.  One compiled call serves both shapes of batch: a few large runs (each
  ``memmove`` runs at memcpy speed, and the call costs well under a microsecond -- less
  than one ``ctypes.memmove`` or ``np.copyto`` from Python) and many small runs (the loop
  over them is machine code, not Python).  ``nogil`` matters: the whole batch runs
  without the GIL, so on threaded queues the Python thread that queued it keeps
  scheduling the next step meanwhile.  On *synchronous* queues (the default cpu mode,
  where every queued operation runs at once on the caller's thread) the loop is called
  directly instead of through ``backend.submit`` -- in the same compiled call as the
  address check below, which runs over the whole batch first: the result is the same --
  the copy is done on return -- without the submission's closure and bookkeeping.
  Tracing and the hazard checker still see it go through ``submit``.
* ``cudasim`` -- simulator "device" memory *is* host memory, so the same host loop runs,
  through ``backend.submit`` and therefore under the simulator's launch lock.
* ``cuda``    -- one ``cuMemcpyBatchAsync`` (driver >= 12.8) on the queue's stream; a single
  descriptor, or an older driver, uses ``cuMemcpyAsync`` on the same stream.  Both infer
  the direction (H2D, D2H, D2D) from the unified addresses; host memory should be pinned
  (page-locked, e.g. :meth:`vtnumba.ec.ECSharedRegion.pin_memory`), or the driver stages
  the copy through a bounce buffer and it stops being asynchronous.

Ordering: the batch as a whole is ordered on its queue like any other work, but copies
*inside* one batch have no order among themselves (that is also ``cuMemcpyBatchAsync``'s
contract) -- never put two descriptors whose ranges depend on each other in one batch.

Lifetime: the copy reads and writes the memory the descriptors point at when it *runs*.  On
threaded cpu queues and GPUs that is later than the call, so keep that memory's contents as
they should be copied until the queue has passed the copy.  The descriptor arrays themselves
are taken at the call (copied for a worker thread, handed to the driver as lists on a GPU),
and a buffer freed meanwhile is kept until the queue has passed (``Backend.free``), so
reusing either cannot make the queued copy touch other memory.

**Addresses are checked before anything is touched.**  ``batched_copy`` validates the
*shape* of its input (equal lengths, integer dtypes, sizes >= 0, no null pointer with a
non-zero size) and then that every byte range it would read or write lies inside live
memory this process knows about (:mod:`vtnumba.backend.address_ranges`: every backend
Buffer, every open encoder-cache region, and what a caller registered).  A bad address is
a ValueError naming the descriptor -- not a segmentation fault on the host, nor an illegal
memory access that leaves a GPU process's CUDA context dead.

The check is built to cost little next to the copy: one compiled (``numba.njit``) pass over
the descriptors does a binary search of each address in the sorted table of live ranges and
looks for null addresses -- well under a microsecond for the encoder cache's usual batch of
one run per entry, and machine-code speed for thousands.  Only when it finds a bad
descriptor does the slower, vectorised numpy check run, to say which one and why.  (One
narrowing, for callers that build descriptors themselves: :func:`checked_host_copy` may be
told to check one side only, when the other side's ranges lie inside an array the caller
holds -- the encoder-cache worker copying a numpy output it was handed.)

:func:`batched_copy_reference` is the host reference with the same signature: one
``ctypes.memmove`` per descriptor, in the calling thread.
"""

from __future__ import annotations

import ctypes
import warnings
import weakref

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

from vtnumba import trace
from vtnumba.backend.address_ranges import LIVE
from vtnumba.backend.arrays import address_of as _array_address
from vtnumba.backend.base import Backend, Buffer, Queue, observing_uses

__all__ = ["batched_copy", "batched_copy_reference", "check_descriptors", "check_ranges", "address_of",
           "cuda_batch_api_available", "prepare", "host_batched_copy", "is_live", "live_address", "runs_inline",
           "checked_host_copy", "host_copy_now", "live_table", "raise_bad_descriptor", "CHECK_SRC",
           "CHECK_DST", "CHECK_BOTH"]

# --------------------------------------------------------------------------- validation
_U64, _I64 = np.dtype(np.uint64), np.dtype(np.int64)


def _as_u64(name: str, arr) -> np.ndarray:
    a = arr if type(arr) is np.ndarray else np.asarray(arr)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape={a.shape}")
    if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64: an empty list means "nothing to copy"
        return np.zeros(0, np.uint64)
    if a.dtype == _U64 or a.dtype == _I64:
        # int64 and uint64 share the bit pattern of an address: reinterpret, never convert
        # (device addresses may have the high bit set, which int64 arithmetic would reject).
        return (a if a.flags.c_contiguous else np.ascontiguousarray(a)).view(np.uint64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (int64 or uint64 addresses/sizes), got dtype={a.dtype}")
    if a.dtype.kind == "i" and a.size and int(a.min()) < 0:
        raise ValueError(f"{name} has a negative entry {int(a.min())}; expected addresses/sizes >= 0")
    return a.astype(np.uint64)


def _null_error(src: np.ndarray, dst: np.ndarray, sz: np.ndarray) -> None:
    """Raise for the first null address with a non-zero size (nothing if there is none)."""
    for name, ptrs in (("src_ptrs", src), ("dst_ptrs", dst)):
        bad = np.flatnonzero((ptrs == 0) & (sz > 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}] is a null address but sizes[{i}]={int(sz[i])}; "
                             "expected a valid address for every non-empty copy")


#: Which side of each descriptor :func:`checked_host_copy` checks against live memory.
CHECK_SRC, CHECK_DST, CHECK_BOTH = 1, 2, 3


@numba.njit(nogil=True, cache=True)
def _scan(src, dst, sizes, starts, reach, sides=CHECK_BOTH):  # pragma: no cover - compiled; tested via batched_copy
    # One pass over a validated-shape batch: a null address with a non-zero size, or a byte
    # range outside every live range (binary search: the last range starting at or before
    # the address must reach its end), stops the scan.  Returns the total byte count, or
    # -1 - i for the first bad descriptor i.  ``sides``: which addresses to check (see
    # checked_host_copy).
    total = 0
    m = starts.shape[0]
    for i in range(sizes.shape[0]):
        n = sizes[i]
        if n == 0:
            continue
        for side in range(2):
            p = src[i] if side == 0 else dst[i]
            if p == 0:
                return -1 - i
            if not (sides >> side) & 1:
                continue  # (this side's range is the caller's to vouch for: see checked_host_copy)
            lo, hi = 0, m
            while lo < hi:  # first range starting after p
                mid = (lo + hi) // 2
                if starts[mid] <= p:
                    lo = mid + 1
                else:
                    hi = mid
            # (Compared as "reach - p < n", not "reach < p + n": a huge size must not wrap around.)
            if lo == 0 or reach[lo - 1] < p or reach[lo - 1] - p < n:
                return -1 - i
        total += n
    return total


def _checked(src_ptrs, dst_ptrs, sizes):
    """The shape checks of check_descriptors: three equal-length uint64 arrays (or an error)."""
    if (type(src_ptrs) is np.ndarray and type(dst_ptrs) is np.ndarray and type(sizes) is np.ndarray
            and src_ptrs.dtype is _U64 and dst_ptrs.dtype is _U64 and sizes.dtype is _U64
            and src_ptrs.ndim == 1 and dst_ptrs.ndim == 1 and sizes.ndim == 1
            and src_ptrs.flags.c_contiguous and dst_ptrs.flags.c_contiguous and sizes.flags.c_contiguous):
        # The form the encoder-cache worker passes: nothing to convert, and uint64 sizes
        # cannot be negative.  (Tested inline, ``is`` for the dtype: this runs every step.)
        src, dst, sz = src_ptrs, dst_ptrs, sizes
    else:
        sz_raw = sizes if type(sizes) is np.ndarray else np.asarray(sizes)
        if sz_raw.dtype.kind == "i" and sz_raw.ndim == 1 and sz_raw.size and sz_raw.min() < 0:
            i = int(np.argmin(sz_raw))
            raise ValueError(f"sizes[{i}]={int(sz_raw[i])} is negative; expected byte counts >= 0")
        src = _as_u64("src_ptrs", src_ptrs)
        dst = _as_u64("dst_ptrs", dst_ptrs)
        sz = _as_u64("sizes", sz_raw)
    if not (src.size == dst.size == sz.size):
        raise ValueError(f"descriptor arrays differ in length: len(src_ptrs)={src.size}, "
                         f"len(dst_ptrs)={dst.size}, len(sizes)={sz.size}; expected equal lengths")
    return src, dst, sz


def check_descriptors(src_ptrs, dst_ptrs, sizes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a descriptor list and return it as three contiguous ``uint64`` arrays.

    Raises TypeError for non-integer dtypes, ValueError for unequal lengths, a negative
    size, or a null address with a non-zero size -- each naming the argument and index.
    Cheap on the common path (three uint64 arrays are taken as they are), because it runs
    once per batched copy.
    """
    src, dst, sz = _checked(src_ptrs, dst_ptrs, sizes)
    if sz.size and not (src.all() and dst.all()):  # some address is 0: only an error for a non-empty copy
        _null_error(src, dst, sz)
    return src, dst, sz


def live_table() -> tuple[np.ndarray, np.ndarray]:
    """The sorted live ranges as two uint64 arrays, ``(starts, reach)`` -- what the compiled
    checks search (:func:`checked_host_copy`); cached by LIVE until memory is registered or freed."""
    starts, _, reach, _ = LIVE._table()
    return starts, reach


def _validated_total(src: np.ndarray, dst: np.ndarray, sz: np.ndarray) -> int:
    """Null and live-range checks of a shape-checked batch (nothing copied); its total byte count."""
    total = _scan(src, dst, sz, *live_table())
    if total < 0:
        raise_bad_descriptor(src, dst, sz, -1 - total)
    return int(total)


def raise_bad_descriptor(src: np.ndarray, dst: np.ndarray, sz: np.ndarray, i: int, sides: int = CHECK_BOTH) -> None:
    """A compiled check of ``sides`` found descriptor ``i`` bad (and nothing was copied): let the
    thorough checks say what, naming the descriptor -- a null address, or a range outside live memory."""
    _null_error(src, dst, sz)
    if sides & CHECK_SRC:
        LIVE.check("src_ptrs", src, sz)
    if sides & CHECK_DST:
        LIVE.check("dst_ptrs", dst, sz)
    # The thorough checks passed: the table changed in between (another thread freed or registered memory).
    raise ValueError(f"descriptor {i} (src_ptrs[{i}]={int(src[i]):#x}, dst_ptrs[{i}]={int(dst[i]):#x}, "
                     f"sizes[{i}]={int(sz[i])}) left live memory while it was being checked")


def host_copy_now(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, count: int) -> int:
    """Check and copy the first ``count`` descriptors of three uint64 arrays on the host, now, on
    this thread (:func:`checked_host_copy`); the bytes copied.  ValueError naming a bad
    descriptor, and then nothing was copied.  For callers that know the copy runs inline
    (:func:`runs_inline`) and built the arrays themselves."""
    total = checked_host_copy(src, dst, sizes, count, *live_table())
    if total < 0:
        raise_bad_descriptor(src[:count], dst[:count], sizes[:count], -1 - total)
    return total


def check_ranges(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """ValueError unless every non-empty descriptor reads and writes inside live memory
    (:data:`vtnumba.backend.address_ranges.LIVE`); the arguments are equal-length uint64 arrays."""
    LIVE.check("src_ptrs", src, sizes)
    LIVE.check("dst_ptrs", dst, sizes)


@numba.njit(nogil=True, cache=True)
def _covered(address, nbytes, starts, reach):  # pragma: no cover - compiled
    address = np.uint64(address)  # a Python int arrives as int64: compare addresses as uint64
    nbytes = np.uint64(nbytes)
    lo, hi = 0, starts.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= address:
            lo = mid + 1
        else:
            hi = mid
    return lo > 0 and reach[lo - 1] >= address and reach[lo - 1] - address >= nbytes


def is_live(address: int, nbytes: int) -> bool:
    """Is ``[address, address + nbytes)`` inside one range of live memory this process knows
    (:data:`vtnumba.backend.address_ranges.LIVE`)?  A compiled binary search: cheap enough to
    ask once per step (the encoder-cache worker asks it before registering an output)."""
    return _covered(address, nbytes, *live_table())


@numba.njit(nogil=True, cache=True)
def _data_address(byte_view):  # pragma: no cover - compiled
    return byte_view.ctypes.data


@numba.njit(nogil=True, cache=True)
def _live_data_address(byte_view, nbytes, starts, reach):  # pragma: no cover - compiled
    address = byte_view.ctypes.data
    return address, _covered(address, nbytes, starts, reach)


def live_address(arr, nbytes: int) -> tuple[int, bool]:
    """``(address_of(arr), is_live(address, nbytes))`` -- for a numpy array in one compiled
    call instead of two (the encoder-cache worker asks both of every output it saves, and
    right after a large copy has evicted the CPU's caches each call costs microseconds)."""
    if type(arr) is np.ndarray and arr.ndim and arr.size and arr.flags.c_contiguous:
        return _live_data_address(arr.view(np.uint8), nbytes, *live_table())
    address = address_of(arr)
    return address, is_live(address, nbytes)


def address_of(obj) -> int:
    """The address of the first byte of a Buffer, a numpy array, or a (simulated) device array.

    On ``cpu`` and ``cudasim`` this is a host address; on ``cuda`` a device address.  The
    object must be C-contiguous (the copy treats it as one flat byte range).
    """
    if isinstance(obj, Buffer):
        return obj.ptr
    if type(obj) is np.ndarray and obj.ndim and obj.flags.c_contiguous and obj.size:
        # numpy's own ways (``.ctypes.data``, ``__array_interface__``) build a helper object
        # per call, about a microsecond; a compiled function reads the pointer in a third of
        # that.  (Through a byte view: numba's CPU arrays have no float16.)
        return _data_address(obj.view(np.uint8))
    return _array_address(obj)


# --------------------------------------------------------------------------- host loop
def _python_loop(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    # ctypes.memmove releases the GIL for each call; fine for a handful of descriptors.
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        if n:
            ctypes.memmove(d, s, n)


@intrinsic
def _memmove(typingctx, dst, src, nbytes):  # pragma: no cover - compiled
    """``memmove(dst, src, nbytes)`` on raw addresses, inside compiled code.

    Emitted as LLVM's ``llvm.memmove`` intrinsic, which becomes a call to libc's ``memmove``
    *by name*: unlike a ctypes function pointer (an address that differs from process to
    process), nothing process-specific is baked into the machine code, so the loops below
    are cached on disk like any other and a new process loads them instead of compiling.
    """
    if not all(isinstance(t, types.Integer) for t in (dst, src, nbytes)):
        return None

    def codegen(context, builder, signature, args):
        d, s, n = args
        cgutils.raw_memmove(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t),
                            n, 1)
        return context.get_dummy_value()

    return types.void(dst, src, nbytes), codegen


@numba.njit(nogil=True, cache=True)
def _memmove_loop(src, dst, sizes):  # pragma: no cover - compiled; tested through batched_copy
    for i in range(src.shape[0]):
        if sizes[i] != 0:
            _memmove(dst[i], src[i], sizes[i])


@numba.njit(nogil=True, cache=True)
def checked_host_copy(src, dst, sizes, count, starts, reach, sides=CHECK_BOTH):  # pragma: no cover - compiled
    """The first ``count`` descriptors, checked and then copied on the host, in one compiled call.

    What a synchronous queue runs: the live-range check (:func:`_scan`, against ``starts``
    and ``reach`` from :func:`live_table`) and the copy back to back, on the calling thread,
    without the GIL.  Nothing is touched unless every descriptor passed: returns the bytes
    copied, or ``-1 - i`` for the first bad descriptor ``i`` (see :func:`raise_bad_descriptor`).
    (One call instead of two: on a synchronous queue each Python-level call is a measurable
    part of a 1 MiB copy.)  Callable from other compiled code, too.

    ``sides`` (:data:`CHECK_BOTH`, :data:`CHECK_SRC` or :data:`CHECK_DST`): a caller whose
    ranges on one side lie, by construction, inside an array it holds -- its address read
    from the array, its size bounded by the array's -- may check only the other side.  An
    unchecked side is still refused when it is a null address.
    """
    src, dst, sizes = src[:count], dst[:count], sizes[:count]
    total = _scan(src, dst, sizes, starts, reach, sides)
    if total >= 0:
        _memmove_loop(src, dst, sizes)
    return total


def prepare(backend: Backend | None = None) -> None:
    """Load the compiled host loops now (compiled on the first run on a machine, about a second;
    from numba's disk cache afterwards) -- so the first timed copy does not include it."""
    if backend is None or _plan(backend).host:
        src = np.zeros(1, np.uint64)
        checked_host_copy(src, src, src, 1, src, src)  # numba compiles on the first call, not at definition
        _memmove_loop(src, src, src)
    live_address(np.zeros(1, np.uint8), 1)


def host_batched_copy(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """Run a validated uint64 descriptor list on the host, now, without the GIL."""
    if src.size:
        _memmove_loop(src, dst, sizes)


# --------------------------------------------------------------------------- CUDA driver path
_cuda_batch_ok: bool | None = None
_cuda_attrs: dict = {}  # src_access_order -> [CUmemcpyAttributes], made once (a struct per call costs)


def cuda_batch_api_available() -> bool:
    """True when ``cuMemcpyBatchAsync`` exists in cuda.bindings and the driver is >= 12.8."""
    global _cuda_batch_ok
    if _cuda_batch_ok is None:
        try:
            from cuda.bindings import driver as cu

            err, version = cu.cuDriverGetVersion()
            _cuda_batch_ok = (err == cu.CUresult.CUDA_SUCCESS and version >= 12080
                              and hasattr(cu, "cuMemcpyBatchAsync"))
        except Exception:
            _cuda_batch_ok = False
    return _cuda_batch_ok


def _cuda_context() -> None:
    """Make sure this thread has the CUDA context current (numba's own calls do that for
    themselves; raw cuda.bindings calls do not -- on a thread that never touched numba they
    would fail with CUDA_ERROR_INVALID_CONTEXT) -- this process's GPU's context."""
    from vtnumba.backend.cuda import current_context

    current_context()


def _stream_handle(stream):
    from cuda.bindings import driver as cu

    h = getattr(stream, "handle", stream)
    if isinstance(h, (int, np.integer)):
        return cu.CUstream(int(h))
    if hasattr(h, "value") and not isinstance(h, cu.CUstream):  # a ctypes c_void_p
        return cu.CUstream(int(h.value or 0))
    return h


def _batch_attrs(cu, src_access_order: str) -> list:
    attrs = _cuda_attrs.get(src_access_order)
    if attrs is None:
        attr = cu.CUmemcpyAttributes()
        attr.srcAccessOrder = (cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
                               if src_access_order == "any" else
                               cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        attrs = _cuda_attrs[src_access_order] = [attr]
    return attrs


def _cuda_batched_copy(stream, lists, src_access_order: str) -> None:
    """``lists``: the descriptors as three Python lists (read here, on the caller's thread:
    the driver call itself copies them, so nothing needs keeping alive afterwards)."""
    global _cuda_batch_ok
    from cuda.bindings import driver as cu

    src, dst, sizes = lists
    if 0 in sizes:  # empty descriptors move nothing, and the batch API may refuse them
        src, dst, sizes = tuple(zip(*[(s, d, nb) for s, d, nb in zip(src, dst, sizes) if nb])) or ((), (), ())
    n = len(sizes)
    if n == 0:
        return
    _cuda_context()  # the driver calls below need one current on this thread
    h = _stream_handle(stream)
    # (The batch API refuses the legacy NULL stream -- a queue on stream 0, such as the numba
    # memory-manager plugin's default pool, would fail the call every time: it copies one by one.)
    if n > 1 and int(h) != 0 and cuda_batch_api_available():
        try:
            res = cu.cuMemcpyBatchAsync([cu.CUdeviceptr(p) for p in dst], [cu.CUdeviceptr(p) for p in src],
                                        list(sizes), n, _batch_attrs(cu, src_access_order), [0], 1, h)
        except RuntimeError as exc:
            # cuda.bindings binds one revision of the function and raises if the driver lacks
            # it (bindings 13 on a 12.8 driver): nothing was copied, and the loop below can.
            warnings.warn(f"cuMemcpyBatchAsync is not usable with this driver ({exc}); using cuMemcpyAsync per "
                          "descriptor from now on", RuntimeWarning, stacklevel=3)
            _cuda_batch_ok = False
            res = cu.CUresult.CUDA_ERROR_NOT_SUPPORTED
        err = res[0] if isinstance(res, tuple) else res
        if err == cu.CUresult.CUDA_SUCCESS:
            return
        # Refused.  Only "not supported" (an old device, memory it cannot batch) turns the batch
        # API off for good; any other error may be this batch's alone.  Either way the
        # per-descriptor loop below copies it -- and a real addressing error fails there too,
        # with a message.
        if err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED and _cuda_batch_ok:
            warnings.warn(f"cuMemcpyBatchAsync of {n} descriptors is not supported here; using cuMemcpyAsync "
                          "per descriptor from now on", RuntimeWarning, stacklevel=3)
            _cuda_batch_ok = False
    # One descriptor (the usual encoder-cache entry: one run) needs no batch: one driver call
    # either way, and this one takes no attribute structs.
    for s, d, nb in zip(src, dst, sizes):
        if nb:
            (err,) = cu.cuMemcpyAsync(cu.CUdeviceptr(d), cu.CUdeviceptr(s), nb, h)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemcpyAsync({nb} bytes) failed: {err}")


# --------------------------------------------------------------------------- public API
def _resolve(backend: Backend | None) -> Backend:
    if backend is None:
        from vtnumba.backend.default import default_backend

        return default_backend()
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
    return backend


class _Plan:
    """How a backend's copies run, read once from its capabilities (a fresh dataclass per read)."""

    __slots__ = ("host", "inline")

    def __init__(self, backend: Backend):
        caps = backend.capabilities
        self.host = caps.host_addressable        # the host loop can touch its memory
        # Every queue runs its work at once on the caller's thread, outside any launch lock:
        # calling the loop directly is what submit would do (the cpu target's default mode).
        self.inline = caps.host_addressable and not caps.async_queues and not caps.simulator


_plans: "weakref.WeakKeyDictionary[Backend, _Plan]" = weakref.WeakKeyDictionary()
_last_plan: tuple = (lambda: None, None)  # (weak reference to the backend asked last, its plan)


def _plan(backend: Backend) -> _Plan:
    global _last_plan
    last_ref, plan = _last_plan
    if last_ref() is backend:
        # A process copies on one backend almost always: one weak-reference call instead of
        # the dictionary's lookup (which builds a weak reference per call).
        return plan
    plan = _plans.get(backend)
    if plan is None:
        plan = _plans[backend] = _Plan(backend)
    _last_plan = (weakref.ref(backend), plan)
    return plan


def _runs_on_host(backend: Backend) -> bool:
    return _plan(backend).host


def runs_inline(backend: Backend, queue: Queue | None = None) -> bool:
    """Would a copy queued on ``queue`` (a queue of ``backend``, or None) run right now, on this
    thread, with nobody watching -- so that the caller may run :func:`checked_host_copy` itself?

    True on the cpu target's synchronous queues, where every queued operation runs on the
    spot; False on threaded queues, on GPUs and in the simulator (which runs copies under
    its launch lock), and whenever tracing or a hazard checker is on (they must see the copy
    go through ``Backend.submit``) or the queue is not ``backend``'s.
    """
    return (_plan(backend).inline and trace.RECORDER is None and not observing_uses() and not backend.closed
            and (queue is None or (queue.backend is backend and not queue.destroyed)))


def batched_copy(src_ptrs, dst_ptrs, sizes, queue: Queue | None = None, backend: Backend | None = None, *,
                 src_access_order: str = "stream") -> int:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i, as one call.

    With ``queue`` the batch is submitted in queue order and may still be running when
    this returns (threaded cpu queues, real GPUs); without it the copy is complete on
    return.  ``src_access_order="any"`` tells the CUDA driver the sources are not written
    by earlier work on the stream (true for the shared region on loads), which lets it
    start reading early; it is ignored on the host.  Returns the number of bytes copied.
    """
    if src_access_order != "stream" and src_access_order != "any":
        raise ValueError(f"src_access_order={src_access_order!r}; expected 'stream' or 'any'")
    src, dst, sz = _checked(src_ptrs, dst_ptrs, sizes)
    be = backend if backend is not None and _last_plan[0]() is backend else _resolve(backend)  # (checked before)
    if queue is not None and not isinstance(queue, Queue):
        raise TypeError(f"queue must be a vtnumba Queue or None, got {type(queue).__name__}")
    if runs_inline(be, queue):
        # A synchronous queue would run the copy right now, on this thread: do just that,
        # the checks and the copy in one compiled call.
        return host_copy_now(src, dst, sz, sz.size)
    plan = _plan(be)
    total = _validated_total(src, dst, sz)
    if sz.size == 0:
        return 0
    own_queue = queue is None
    q = be.create_queue("batched_copy") if own_queue else queue
    try:
        # Every descriptor's two ranges, for a hazard checker that may be watching (see Backend.submit).
        uses = [(int(p), int(n)) for p, n in zip(np.concatenate([src, dst]).tolist(), np.concatenate([sz, sz]).tolist())
                if n] if observing_uses() else ()
        if plan.host:
            # The copy runs later, on the queue's thread: copies of the descriptors checked
            # above (they may be the caller's own arrays, which it is free to reuse at once --
            # a changed address would reach memmove unchecked).
            src, dst, sz = src.copy(), dst.copy(), sz.copy()
            be.submit(q, lambda _stream: _memmove_loop(src, dst, sz), "batched_copy", uses=uses,
                      descriptors=int(sz.size), bytes=total)
        else:
            # The driver reads the descriptors during the call: hand it Python lists made now.
            lists = (src.tolist(), dst.tolist(), sz.tolist())
            be.submit(q, lambda stream: _cuda_batched_copy(stream, lists, src_access_order), "batched_copy",
                      uses=uses, descriptors=int(sz.size), bytes=total)
    finally:
        if own_queue:
            be.destroy_queue(q)  # waits for the copy: "no queue" means "done on return"
    return total


def batched_copy_reference(src_ptrs, dst_ptrs, sizes, queue: Queue | None = None, backend: Backend | None = None, *,
                           src_access_order: str = "stream") -> int:
    """Host reference for :func:`batched_copy`: one ``ctypes.memmove`` per descriptor, now.

    Same signature; if ``queue`` is given, the queue is drained first so the reference sees
    what the batched version would.  Host addresses only (cpu and cudasim targets).
    """
    if src_access_order not in ("stream", "any"):
        raise ValueError(f"src_access_order={src_access_order!r}; expected 'stream' or 'any'")
    src, dst, sz = check_descriptors(src_ptrs, dst_ptrs, sizes)
    be = _resolve(backend)
    check_ranges(src, dst, sz)
    if not _runs_on_host(be):
        raise RuntimeError("batched_copy_reference moves bytes with the host CPU; it cannot touch the device "
                           f"addresses of {be.name} (use it on the cpu or cudasim targets)")
    if queue is not None:
        be.synchronize(queue)
    _python_loop(src, dst, sz)
    return int(sz.sum(dtype=np.uint64)) if sz.size else 0
