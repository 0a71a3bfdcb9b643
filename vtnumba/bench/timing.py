"""Timing helpers shared by every benchmark: warm up, repeat, report median and spread."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
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
