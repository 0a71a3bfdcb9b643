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
    arr = np.asarray(times)
    return Stats(float(np.median(arr)), float(np.percentile(arr, 10)), float(np.percentile(arr, 90)), len(times))


def memcpy_bandwidth_gbs(nbytes: int = 64 << 20, repeat: int = 10) -> float:
    """Host memcpy bandwidth in GB/s (bytes read + written counted once, like STREAM copy)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    st = measure(lambda: np.copyto(dst, src), repeat=repeat, warmup=2)
    return nbytes / st.median_s / 1e9
