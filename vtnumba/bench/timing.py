"""Timing helpers shared by every benchmark: warm up, repeat, report median and spread.

Host code is timed with ``time.perf_counter`` (:func:`measure`).  Work that runs on a GPU
queue is timed with events recorded on that queue (:func:`time_on_queue`): the GPU stamps
them when it reaches them, so the figure is device time, without the host's launch and
synchronisation overheads.  :func:`device_copy_rate` measures the ceiling that memory-bound
kernels are compared with: a large, warmed-up device copy.

Two implementations compared on a busy machine: time them in the *same rounds*
(:func:`time_rounds_on_group`) and compare round by round (:func:`paired_differences`,
:func:`paired_ratios`).  A neighbour that slows one round slows both calls of that round,
and the per-round difference cancels it; the difference of two separately taken medians
does not, and can even come out negative when the smaller part is the quieter one.

Long benchmarks say what they are doing: :func:`progress_step` names the step a suite
is in, and :class:`Progress` prints it (on rank 0 only) once the step has taken longer
than a couple of seconds.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np


@dataclass
class Stats:
    """The distribution of single-call times: median and 10th/90th percentiles, in seconds."""

    #: The median time of one call (seconds): the figure a row reports.
    median_s: float
    #: The 10th percentile (seconds): 10% of the calls were faster.
    p10_s: float
    #: The 90th percentile (seconds): 10% of the calls were slower.
    p90_s: float
    #: How many calls were timed.
    samples: int


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


def measure_interleaved(fns: dict[str, Callable[[], object]], *, rounds: int, repeat: int = 1, warmup: int = 1,
                        prepare: dict[str, Callable[[], object]] | None = None) -> dict[str, Stats]:
    """Time several contenders in alternating rounds; return each one's pooled :class:`Stats`.

    On a shared machine the speed of memory and cores drifts from second to second: timing
    one contender to the end and then the next compares two different machines, and their
    ratio is noise (a ratio of two calls of the same BLAS routine came out anywhere from
    0.02 to 2.9).  Here every round times each contender ``repeat`` times, so all meet the
    same conditions; the order rotates from round to round, so none always runs right after
    the same other one (whose cache contents or freed memory it might inherit).
    ``prepare[name]``, if given, runs untimed before each of that contender's samples (e.g.
    warm a cache the contender before it emptied).
    """
    names = list(fns)
    prepare = prepare or {}
    for name in names:
        for _ in range(warmup):  # first-call compilation, page faults of fresh outputs
            prepare.get(name, _nothing)()
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, before = fns[name], prepare.get(name, _nothing)
            for _ in range(repeat):
                before()
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: stats_from_times(times) for name, times in samples.items()}


def _nothing() -> None:
    pass


def stats_from_times(times) -> Stats:
    """Median and 10th/90th percentiles of a list of single-call times (seconds)."""
    try:
        arr = np.asarray(times, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"times={times!r} must be a list of seconds") from None
    if arr.ndim != 1 or arr.size == 0:  # (an empty list was numpy's IndexError; 2-D counted its rows)
        raise ValueError(f"times must be a non-empty flat list of seconds, got shape {arr.shape}")
    return Stats(float(np.median(arr)), float(np.percentile(arr, 10)), float(np.percentile(arr, 90)), len(arr))


def time_rounds_on_group(group, impls: dict, repeat: int, warmup: int = 1,
                         orders: list[list[str]] | None = None) -> dict[str, list[float]]:
    """Time several implementations of one collective fairly: every round calls each impl
    once, in a rotating order (so none always runs on a warmer cache), each call starting
    at a barrier; a call's time is the *slowest rank's* (a collective is as slow as its
    slowest member).  Returns impl name -> list of seconds, ``repeat`` per impl, where
    element ``i`` of every list comes from the same round ``i`` (what
    :func:`paired_differences` relies on).

    ``orders`` replaces the rotation: round ``r`` calls the impls in ``orders[r % len(orders)]``.
    A benchmark that subtracts two impls passes orders that keep those two adjacent.
    """
    from mpi4py import MPI

    from vtnumba.dist import barrier

    names = list(impls)
    if orders is not None:
        for order in orders:
            if sorted(order) != sorted(names):
                raise ValueError(f"orders: {order} must name each of {names} exactly once")
    times = {k: [] for k in names}
    for rnd in range(warmup + repeat):
        if orders is None:
            order = names[rnd % len(names):] + names[:rnd % len(names)]
        else:
            order = orders[rnd % len(orders)]
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


@dataclass
class PairedStats:
    """The distribution of a per-round comparison of two implementations (a - b, or a / b).

    ``median``, ``p10`` and ``p90`` are in the comparison's own unit (seconds for a
    difference, a plain number for a ratio); ``samples`` is the number of rounds.
    """

    #: The median over rounds of the per-round comparison.
    median: float
    #: Its 10th percentile.
    p10: float
    #: Its 90th percentile.
    p90: float
    #: The number of rounds compared.
    samples: int

    def contains(self, value: float) -> bool:
        """True if ``value`` lies between p10 and p90: the rounds do not agree on which side
        of ``value`` the comparison falls (0 for a difference, 1 for a ratio)."""
        return self.p10 <= value <= self.p90


def _paired(a, b, op) -> PairedStats:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired samples need two equally long, non-empty lists (got {a.shape} and {b.shape})")
    d = op(a, b)
    return PairedStats(float(np.median(d)), float(np.percentile(d, 10)), float(np.percentile(d, 90)), int(d.size))


def paired_differences(a, b) -> PairedStats:
    """Median and p10/p90 of ``a[i] - b[i]``, where ``a[i]`` and ``b[i]`` were timed in the same round.

    Why not ``median(a) - median(b)``: each median has its own noise, and when ``b`` is the
    larger and noisier part (a matmul under a small overhead), its noise can exceed the
    overhead and the subtraction comes out negative.  Within one round both calls see the
    same machine, so most of that noise cancels in the difference.  Nothing is clamped:
    a negative median difference is reported as it is, and :meth:`PairedStats.contains`
    says whether zero lies inside the p10..p90 range, i.e. whether the sign is just noise.
    """
    return _paired(a, b, np.subtract)


def paired_ratios(a, b) -> PairedStats:
    """Median and p10/p90 of ``a[i] / b[i]`` over rounds (see :func:`paired_differences`)."""
    return _paired(a, b, np.divide)


def memcpy_bandwidth_gbs(nbytes: int = 64 << 20, repeat: int = 10) -> float:
    """Host memcpy bandwidth in GB/s: bytes copied per second, each byte counted once (STREAM's
    Copy counts it twice, read and written: that figure is twice this one -- the "copy traffic"
    the suites compare memory-bound kernels with)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    st = measure(lambda: np.copyto(dst, src), repeat=repeat, warmup=2)
    return nbytes / st.median_s / 1e9


def thread_round_trip(rounds: int = 200, repeat: int = 5) -> Stats:
    """One message handed to another thread and its answer back, through a ``queue.SimpleQueue``
    -- the hand-off a threaded cpu queue makes for every operation given to it (and the
    ``Event`` it sets wakes the waiting thread the same way).  The figure is the mean round
    trip of each batch of ``rounds``, over ``repeat`` batches after one of warm-up.

    It is the floor under any step that waits for work run on a queue's thread: two
    wake-ups of a sleeping thread.  What they cost depends on the machine far more than on
    the code -- over a hundred microseconds on the 2-core virtual machine this was written
    on -- which is why it is measured in the same run as the rows it explains.
    """
    if type(rounds) is not int or rounds < 1 or type(repeat) is not int or repeat < 1:
        raise ValueError(f"rounds={rounds!r}, repeat={repeat!r}; expected positive ints")
    ask, answer = queue.SimpleQueue(), queue.SimpleQueue()

    def echo() -> None:
        while (item := ask.get()) is not None:
            answer.put(item)

    helper = threading.Thread(target=echo, name="vtnumba-round-trip", daemon=True)
    helper.start()
    try:
        times = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            for i in range(rounds):
                ask.put(i)
                answer.get()
            times.append((time.perf_counter() - t0) / rounds)
    finally:
        ask.put(None)
        helper.join()
    return stats_from_times(times[1:])


def call_after_copy(nbytes: int, repeat: int = 100) -> tuple[Stats, Stats]:
    """``(cold, warm)``: one host call right after a memcpy of ``nbytes`` went through the CPU's
    caches, and the same call again at once.  The call is :func:`vtnumba.memory.copy_engine.address_of`
    of a numpy array -- a Python function, a numpy view and a compiled call: the kind of
    operation a waited-for encoder-cache step makes a few dozen of around its copy.

    A copy larger than a core's L2 cache evicts what the interpreter had cached -- its own
    code, the objects the step touches -- and every operation after it reloads them: the
    fixed cost of a step grows with the size of the copy it waits for (on the 2-core virtual
    machine this was written on: 8 us at 64 KiB, about 40 us at 1-2 MiB).  Measured in the same run as the
    rows it explains, since it depends on the machine's caches, not on the code.
    """
    from vtnumba.memory.copy_engine import address_of

    if type(nbytes) is not int or nbytes < 1 or type(repeat) is not int or repeat < 1:
        raise ValueError(f"nbytes={nbytes!r}, repeat={repeat!r}; expected positive ints")
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    probe = np.zeros((4, 4), np.float32)
    address_of(probe)  # (compiled, or loaded from numba's cache, before anything is timed)
    cold, warm = [], []
    for _ in range(repeat):
        np.copyto(dst, src)
        t0 = time.perf_counter()
        address_of(probe)
        t1 = time.perf_counter()
        address_of(probe)
        warm.append(time.perf_counter() - t1)
        cold.append(t1 - t0)
    return stats_from_times(cold), stats_from_times(warm)


def time_on_queue(backend, q, fn: Callable[[], object], *, repeat: int = 10, inner: int = 1, warmup: int = 2,
                  max_time_s: float = 30.0, host_s: list | None = None) -> Stats:
    """Per-call time of ``fn``, which enqueues work on queue ``q`` of ``backend``.

    Each sample is an event recorded on ``q``, ``inner`` calls back to back, and a second
    event; the sample is the events' distance divided by ``inner``.  ``warmup`` calls come
    first (the first call compiles the kernel; the first touch of fresh memory maps its
    pages).  At least one sample is taken, and no more once ``max_time_s`` has passed.

    **The queue is held while the calls are queued** (where queues run on their own: a
    real GPU, threaded cpu queues).  Without that, the device stamps the first event, runs
    each kernel as soon as the host has queued it, and the sample includes the host's
    launch work -- a kernel of 100 us launched by 150 us of Python would be measured at
    150 us.  So the queue first waits on a flag (``wait_value32``), the events and calls go
    in behind it, and only then does another queue raise the flag: the events time the
    kernels back to back, nothing else.  ``host_s``, if given, receives the host's own time
    per call of each sample, so a caller can say when the device outruns its launches.

    On a real GPU the events are CUDA events (device timestamps).  In the simulator they
    only mark when the host got there, which is all a simulator can say.
    """
    for _ in range(warmup):
        fn()
    backend.synchronize(q)
    start, end = backend.create_event(), backend.create_event()
    gated = backend.capabilities.async_queues
    if gated:
        gate = backend.asarray(np.zeros(1, np.uint32))
        opener = backend.create_queue("timing-gate")
    times: list[float] = []
    t_start = time.perf_counter()
    held = 0  # the gate value the queue waits for now (0: not held)
    # While the queue is held, no free may wait for it: a GPU's cuMemFree would wait for the
    # gate, which this thread opens only after fn() returned (see Backend.defer_frees).
    with backend.defer_frees():
        try:
            while len(times) < repeat:
                if gated:
                    held = len(times) + 1
                    backend.wait_value32(q, gate, 0, held, timeout_s=max(60.0, max_time_s))
                backend.record_event(start, q)
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                if host_s is not None:
                    host_s.append((time.perf_counter() - t0) / inner)
                backend.record_event(end, q)
                if gated:
                    backend.write_value32(opener, gate, 0, held)  # go: everything is queued
                    held = 0
                times.append(backend.elapsed_ms(start, end) / 1e3 / inner)  # waits for `end`
                if time.perf_counter() - t_start >= max_time_s:
                    break
        finally:
            if gated:
                try:
                    if held:  # fn raised with the queue held: let it go, or it waits out the deadline
                        backend.write_value32(opener, gate, 0, held)
                    backend.destroy_queue(opener)
                except Exception:  # noqa: BLE001 - keep the error that got us here
                    pass
            backend.destroy_event(start)
            backend.destroy_event(end)
    return stats_from_times(times)


@dataclass
class CopyRate:
    """How fast one device copy ran: ``nbytes`` per copy, ``stats`` the per-copy times."""

    #: ``"d2d"``, ``"d2h"`` or ``"h2d"``.
    direction: str
    #: Bytes moved by one copy.
    nbytes: int
    #: The per-copy times.
    stats: Stats
    #: What did the copy (the driver call), for result rows.
    impl: str
    #: Anything the reader should know (a shrunk size, the simulator).
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


# ---------------------------------------------------------------------------- progress lines
def progress_line(suite: str, label: str, index: int | None = None, total: int | None = None,
                  elapsed_s: float | None = None, still: bool = False) -> str:
    """``bench tpsp: T=4096 (3/6) ... 41 s so far``: the line a slow step prints
    (``still=True``: ``bench tpsp: T=4096 (3/6) still running ... 71 s so far``)."""
    count = f" ({index}/{total})" if index is not None and total is not None else ""
    so_far = f" {elapsed_s:.0f} s so far" if elapsed_s is not None else ""
    return f"bench {suite}: {label}{count}{' still running' if still else ''} ...{so_far}"


class Progress:
    """Say what a benchmark suite is doing whenever a step takes long enough to wonder.

    A suite calls :func:`progress_step` at the start of each size or step.  A step that
    finishes within ``delay_s`` prints nothing (a quick run stays quiet); a step still
    running after ``delay_s`` prints one line, flushed, naming the step and its place in
    the suite.  If a suite reports no steps at all, a "still running" line appears every
    ``quiet_s`` so that no wait is silent.

    Only the process with ``enabled=True`` prints (the runner enables rank 0 only: under
    ``mpiexec`` every rank runs the same steps, and N copies of each line are noise).  The
    lines come from a sleeping helper thread: it wakes when a step starts or a deadline
    passes, so it takes no measurable time from the code being timed.
    """

    def __init__(self, suite: str, *, enabled: bool = True, delay_s: float = 2.0, quiet_s: float = 15.0,
                 stream: TextIO | None = None):
        self.suite = suite
        self.enabled = enabled
        self.delay_s = delay_s
        self.quiet_s = quiet_s
        self.stream = stream
        #: The lines printed so far (the tests read them).
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._t0 = time.monotonic()
        self._step: tuple[str, int | None, int | None] | None = None
        self._step_t0 = self._t0
        self._step_printed = False
        self._last_line_t = self._t0
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._watch, name=f"bench-progress-{suite}", daemon=True)
            self._thread.start()

    def step(self, label: str, index: int | None = None, total: int | None = None) -> None:
        """A new step begins; its line is printed if it is still running ``delay_s`` from now."""
        if not self.enabled:
            return
        with self._lock:
            self._step = (label, index, total)
            self._step_t0 = time.monotonic()
            self._step_printed = False
        self._wake.set()

    def close(self) -> None:
        """Stop the helper thread (the runner calls this when the suite ends, however it ends)."""
        if self._thread is None:
            return
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _print(self, line: str) -> None:
        self.lines.append(line)
        stream = self.stream if self.stream is not None else sys.stderr  # looked up late: tests capture it
        print(line, file=stream, flush=True)
        self._last_line_t = time.monotonic()

    def _watch(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                if self._step is not None and not self._step_printed:
                    deadline = self._step_t0 + self.delay_s
                    if now >= deadline:
                        label, index, total = self._step
                        self._print(progress_line(self.suite, label, index, total, now - self._t0))
                        self._step_printed = True
                        continue
                else:
                    deadline = max(self._last_line_t, self._step_t0) + self.quiet_s
                    if now >= deadline:
                        if self._step is None:  # a suite that reports no steps
                            line = f"bench {self.suite}: still running ... {now - self._t0:.0f} s so far"
                        else:
                            label, index, total = self._step
                            line = progress_line(self.suite, label, index, total, now - self._t0, still=True)
                        self._print(line)
                        continue
            self._wake.wait(max(deadline - now, 0.01))
            self._wake.clear()


_current: Progress | None = None


def set_progress(progress: Progress | None) -> Progress | None:
    """Make ``progress`` the one :func:`progress_step` reports to; returns the previous one."""
    global _current
    previous, _current = _current, progress
    return previous


def progress_step(label: str, index: int | None = None, total: int | None = None) -> None:
    """Tell the user which step of a benchmark suite runs now, e.g. ``progress_step("T=4096", 3, 6)``.

    Suites call this at the start of every size; the runner turns it into a line on rank
    0 when the step takes more than ~2 s.  Called outside the runner (a test calling a
    suite's ``run`` directly) it does nothing.
    """
    if _current is not None:
        _current.step(label, index, total)
