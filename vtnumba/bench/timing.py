"""Timing helpers shared by every benchmark: warm up, repeat, report median and spread.

Host code is timed with ``time.perf_counter`` (:func:`measure`).  Work that runs on a GPU
queue is timed with events recorded on that queue (:func:`time_on_queue`): the GPU stamps
them when it reaches them, so the figure is device time, without the host's launch and
synchronisation overheads.  :func:`device_copy_rate` measures the ceiling that memory-bound
kernels are compared with: a large, warmed-up device copy.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np


@dataclass
class Stats:
    median_s: float
    p10_s: float
    p90_s: float
    samples: int

    @property
    def spread(self) -> float:
        """Relative spread (p90 - p10) / median: how much to trust the median."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["spread"] = self.spread
        return d


def measure(fn: Callable[[], object], *, repeat: int = 10, warmup: int = 2, min_time_s: float = 0.0,
            max_time_s: float = 30.0) -> Stats:
    """Run ``fn`` ``warmup`` times, then at least ``repeat`` times (or until ``min_time_s``),
    never longer than ``max_time_s``; return the distribution of single-call times."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    t_start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - t_start
        if (len(times) >= repeat and elapsed >= min_time_s) or elapsed >= max_time_s:
            break
    return stats_from_times(times)


def stats_from_times(times) -> Stats:
    """Median and 10th/90th percentiles of a list of single-call times (seconds)."""
    arr = np.asarray(times, dtype=np.float64)
    return Stats(float(np.median(arr)), float(np.percentile(arr, 10)), float(np.percentile(arr, 90)), len(arr))


def time_rounds_on_group(group, impls: dict, repeat: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time several implementations of one collective fairly: every round calls each impl
    once, in a rotating order (so none always runs on a warmer cache), each call starting
    at a barrier; a call's time is the *slowest rank's* (a collective is as slow as its
    slowest member).  Returns impl name -> list of seconds, ``repeat`` per impl."""
    from mpi4py import MPI

    from vtnumba.dist import barrier

    names = list(impls)
    times = {k: [] for k in names}
    for rnd in range(warmup + repeat):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        local = np.zeros(len(names))
        for k in order:
            barrier(group)
            t0 = time.perf_counter()
            impls[k]()
            local[names.index(k)] = time.perf_counter() - t0
        worst = np.empty_like(local)
        group.cpu_comm.Allreduce(local, worst, op=MPI.MAX)
        if rnd >= warmup:
            for i, k in enumerate(names):
                times[k].append(float(worst[i]))
    return times


def memcpy_bandwidth_gbs(nbytes: int = 64 << 20, repeat: int = 10) -> float:
    """Host memcpy bandwidth in GB/s (bytes read + written counted once, like STREAM copy)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    st = measure(lambda: np.copyto(dst, src), repeat=repeat, warmup=2)
    return nbytes / st.median_s / 1e9


def time_on_queue(backend, q, fn: Callable[[], object], *, repeat: int = 10, inner: int = 1, warmup: int = 2,
                  max_time_s: float = 30.0) -> Stats:
    """Per-call time of ``fn``, which enqueues work on queue ``q`` of ``backend``.

    Each sample is an event recorded on ``q``, ``inner`` calls back to back, and a second
    event; the sample is the events' distance divided by ``inner``.  Calling back to back
    lets the host enqueue the next call while the device runs the current one, so a short
    kernel is not measured as mostly launch overhead.  ``warmup`` calls come first (the
    first call compiles the kernel; the first touch of fresh memory maps its pages).  At
    least one sample is taken, and no more once ``max_time_s`` has passed.

    On a real GPU the events are CUDA events (device timestamps).  In the simulator they
    only mark when the host got there, which is all a simulator can say.
    """
    for _ in range(warmup):
        fn()
    backend.synchronize(q)
    start, end = backend.create_event(), backend.create_event()
    times: list[float] = []
    t_start = time.perf_counter()
    try:
        while len(times) < repeat:
            backend.record_event(start, q)
            for _ in range(inner):
                fn()
            backend.record_event(end, q)
            times.append(backend.elapsed_ms(start, end) / 1e3 / inner)  # waits for `end`
            if time.perf_counter() - t_start >= max_time_s:
                break
    finally:
        backend.destroy_event(start)
        backend.destroy_event(end)
    return stats_from_times(times)


@dataclass
class CopyRate:
    """How fast one device copy ran: ``nbytes`` per copy, ``stats`` the per-copy times."""

    direction: str  # "d2d", "d2h" or "h2d"
    nbytes: int
    stats: Stats
    impl: str  # what did the copy, for result rows
    notes: list[str] = field(default_factory=list)

    @property
    def copied_gbs(self) -> float:
        """Bytes copied per second (GB/s): what a link between host and device carries."""
        return self.nbytes / self.stats.median_s / 1e9

    @property
    def traffic_gbs(self) -> float:
        """Bytes read plus bytes written per second (GB/s): a copy of n bytes reads n and
        writes n.  The figure to compare a kernel's traffic with (see bench.kernels)."""
        return 2 * self.copied_gbs


def stream_handle(q):
    """The cuda.bindings ``CUstream`` under a CUDA backend's queue (real GPU only), for
    driver calls and for other libraries' external-stream wrappers (``int()`` of it is the
    raw handle)."""
    handle = getattr(q, "handle", None)  # a stream the backend created with cuda.bindings
    return handle if handle is not None else q.stream.handle  # numba's Stream.handle is a CUstream


def _free_device_bytes() -> int | None:
    """Free memory of the current CUDA device, as the driver sees it (None if unknown)."""
    from cuda.bindings import driver as cu

    err, free, _total = cu.cuMemGetInfo()
    return int(free) if err == cu.CUresult.CUDA_SUCCESS else None


def device_copy_rate(backend, q=None, nbytes: int = 1 << 30, *, direction: str = "d2d", repeat: int = 10,
                     inner: int = 5, warmup: int = 3, max_free_fraction: float = 0.4) -> CopyRate:
    """Measure one large copy on a CUDA backend's queue: the bandwidth ceiling of a memory-bound kernel.

    Why each choice:

    * **large** (1 GiB by default): the GPU's L2 cache (tens of MB) must not hold the data,
      or the "memory" bandwidth is really cache bandwidth; the size shrinks so that the two
      buffers take at most ``max_free_fraction`` of the free device memory;
    * **the driver's copy** (``cuMemcpyDtoDAsync`` / ``DtoHAsync`` / ``HtoDAsync`` of
      cuda.bindings) on ``q``'s stream: nothing but the copy engine or the copy kernel runs,
      with no Python-side checks per call;
    * **warmed up**: the first copies pay for mapping fresh pages and raising the clocks;
    * **timed with events on the same queue** (:func:`time_on_queue`).

    ``direction`` "d2h" and "h2d" copy to or from pinned host memory (the rate of the
    host link).  ``q`` defaults to a queue made (and destroyed) here.

    In numba's simulator there is no driver: the copy is ``backend.copy`` of at most 64 KiB,
    which shows the code path works and measures nothing about a GPU.
    """
    if direction not in ("d2d", "d2h", "h2d"):
        raise ValueError(f"direction={direction!r} must be 'd2d', 'd2h' or 'h2d'")
    if nbytes < 1:
        raise ValueError(f"nbytes={nbytes} must be positive")
    from vtnumba.backend.device import DeviceType

    if getattr(backend, "device_type", None) is not DeviceType.CUDA:
        raise ValueError(f"device_copy_rate needs a CUDA backend, got {type(backend).__name__}")
    from numba import cuda

    own_queue = q is None
    if own_queue:
        q = backend.create_queue("copy-rate")
    try:
        if backend.capabilities.simulator:
            nbytes = min(nbytes, 64 << 10)
            dev = cuda.device_array(nbytes, np.uint8)
            other = cuda.device_array(nbytes, np.uint8) if direction == "d2d" else np.zeros(nbytes, np.uint8)
            dst, src = (other, dev) if direction == "d2h" else (dev, other)
            st = time_on_queue(backend, q, lambda: backend.copy(q, dst, src, nbytes), repeat=repeat, inner=1,
                               warmup=1)
            return CopyRate(direction, nbytes, st, "backend.copy (simulator)",
                            ["simulator: the device copy is np.copyto; its rate says nothing about a GPU"])

        from cuda.bindings import driver as cu

        notes = []
        free = _free_device_bytes()
        if free is not None:
            buffers = 2 if direction == "d2d" else 1
            fit = int(free * max_free_fraction) // buffers
            if fit < nbytes:
                fit -= fit % (1 << 20)
                notes.append(f"device copy shrunk from {nbytes} to {fit} bytes: {free} bytes free")
                nbytes = max(fit, 1 << 20)
        dev = cuda.device_array(nbytes, np.uint8)
        dev_ptr = dev.__cuda_array_interface__["data"][0]
        handle = stream_handle(q)
        if direction == "d2d":
            other = cuda.device_array(nbytes, np.uint8)
            other_ptr = other.__cuda_array_interface__["data"][0]
            call, impl = (lambda: cu.cuMemcpyDtoDAsync(dev_ptr, other_ptr, nbytes, handle)), "cuMemcpyDtoDAsync"
        else:
            other = cuda.pinned_array(nbytes, np.uint8)  # pageable memory would be staged by the driver
            other_ptr = other.ctypes.data
            if direction == "d2h":
                call, impl = (lambda: cu.cuMemcpyDtoHAsync(other_ptr, dev_ptr, nbytes, handle)), "cuMemcpyDtoHAsync"
            else:
                call, impl = (lambda: cu.cuMemcpyHtoDAsync(dev_ptr, other_ptr, nbytes, handle)), "cuMemcpyHtoDAsync"

        def copy():
            (err,) = call()
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"{impl} of {nbytes} bytes failed: {err}")

        st = time_on_queue(backend, q, copy, repeat=repeat, inner=inner, warmup=warmup)
        return CopyRate(direction, nbytes, st, impl, notes)
    finally:
        if own_queue:
            backend.destroy_queue(q)
