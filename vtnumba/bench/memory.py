"""``vtnumba bench memory``: what the caching allocator saves, as a ratio measured in one run.

Per block size (512 B .. 64 MiB by default) and per case, one "op" is timed:

* **alloc+free** -- allocate a block and free it.  ``cached`` is a warm
  :class:`~vtnumba.memory.CachingAllocator` (every allocation a cache hit); ``uncached``
  is the stock path, ``backend.alloc`` + ``backend.free`` each time (``cudaMalloc``/
  ``cudaFree`` on a GPU, ``np.empty`` on the host); ``allocator miss`` is the allocator
  with ``empty_cache()`` after every free, i.e. its bookkeeping *plus* a backend allocation.
  On a GPU numba batches its ``cudaFree`` calls and runs them from whichever later call
  tips the batch over, so both ops end with ``backend.flush_frees()``: each pays its own free.
* **alloc+fill+free** -- the same, with the block's first write (a ``memset`` of all of it,
  synchronised) inside the op.  Fresh host memory pays page faults on first touch; cached
  memory was touched before.  That, not the call itself, is most of what caching saves on
  the cpu target; on a GPU the allocation call itself is the expensive part.

The ratios are ``uncached / cached`` time per op: above 1 means caching wins.
"""

from __future__ import annotations

import numpy as np

from vtnumba.bench import schema
from vtnumba.bench.schema import format_bytes
from vtnumba.bench.timing import Stats, measure, measure_interleaved, progress_step

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (512, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)


def add_arguments(parser) -> None:
    """The suite's own flag: ``--sizes`` (block sizes in bytes)."""
    from vtnumba.bench.runner import positive_int

    parser.add_argument("--sizes", nargs="+", type=positive_int, default=None,
                        help="block sizes in bytes (default 512 B .. 64 MiB; quick 4 KiB .. 16 MiB)")


def _per_op(st: Stats, ops: int) -> Stats:
    """Stats of one call of ``ops`` operations, scaled to one operation."""
    return Stats(st.median_s / ops, st.p10_s / ops, st.p90_s / ops, st.samples)


def _bench_size(backend, q, n: int, repeat: int, fill: bool) -> dict[str, Stats]:
    from vtnumba.memory import CachingAllocator

    # Enough operations per timed call to sit well above the timer's resolution.
    ops = max(1, min(200, (4 * MiB if not fill else 16 * MiB) // n))
    alloc = CachingAllocator(backend)

    def touch(buf):
        if fill:
            backend.memset(q, buf, 0x5A)
            backend.synchronize(q)

    def cached():
        for _ in range(ops):
            b = alloc.allocate(n, q)
            touch(b)
            alloc.free(b)

    def uncached():
        for _ in range(ops):
            b = backend.alloc(n)
            touch(b)
            backend.free(b)
            backend.flush_frees()  # (numba would run the cudaFree later, inside another op)

    def miss():
        for _ in range(ops):
            b = alloc.allocate(n, q)
            touch(b)
            alloc.free(b)
            alloc.empty_cache()
            backend.flush_frees()

    def warm():  # (untimed, before each cached sample: the miss case empties the cache)
        alloc.free(alloc.allocate(n, q))

    cases = {"uncached (backend.alloc+free)": uncached, "cached (CachingAllocator hit)": cached}
    if not fill:
        cases["allocator miss (empty_cache each time)"] = miss
    # Interleaved rounds: the three meet the same machine (see measure_interleaved).
    hits_before, misses_before = alloc.stats()["cache_hits"], alloc.stats()["cache_misses"]
    times = measure_interleaved(cases, rounds=repeat, warmup=1, prepare={"cached (CachingAllocator hit)": warm})
    s = alloc.stats()
    # Every allocate of the cached case must have hit: the only misses allowed are the miss
    # case's (ops per call) and the warm-ups' (one per cached call), over 1 + repeat calls.
    misses_allowed = (1 + repeat) * (1 + (0 if fill else ops))
    if s["cache_misses"] - misses_before > misses_allowed or s["cache_hits"] - hits_before < (1 + repeat) * ops:
        raise RuntimeError(f"bench memory: the cached case missed the cache ({s})")
    alloc.empty_cache()
    return {name: _per_op(st, ops) for name, st in times.items()}



def check_arguments(args, world_size: int) -> None:
    """``--sizes`` must fit in memory (:func:`vtnumba.bench.runner.check_sizes_fit`)."""
    from vtnumba.bench.runner import check_sizes_fit

    check_sizes_fit(getattr(args, "sizes", None))

def run(args) -> dict:
    """Measure every block size on rank 0; returns the suite result (see the module docstring)."""
    from vtnumba.backend.default import default_backend
    from vtnumba.target import current_target

    quick = bool(getattr(args, "quick", False))
    sizes = getattr(args, "sizes", None) or (QUICK_SIZES if quick else DEFAULT_SIZES)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ValueError(f"--sizes: {s!r} is not a positive number of bytes")
    backend = default_backend()
    target = current_target().name
    q = backend.create_queue("bench-memory")
    results, ratios = [], {}
    try:
        for i, n in enumerate(sizes, 1):
            progress_step(f"{format_bytes(n)} blocks", i, len(sizes))
            # np.percentile interpolates: with n calls the p10 lies 0.1 * (n - 1) of the way from the
            # fastest call to the next one.  Five calls (not three) keep one odd call from setting it.
            repeat = 5 if quick else 10
            for case, fill in (("alloc+free", False), ("alloc+fill+free", True)):
                times = _bench_size(backend, q, n, repeat, fill)
                for impl, st in times.items():
                    results.append(schema.row(case, impl, n, "bytes", "us/op", st.median_s * 1e6, st))
                cached = times["cached (CachingAllocator hit)"].median_s
                uncached = times["uncached (backend.alloc+free)"].median_s
                ratios[f"{case} {format_bytes(n)}: uncached / cached"] = uncached / cached
                if not fill:
                    ratios[f"{case} {format_bytes(n)}: allocator miss / hit"] = \
                        times["allocator miss (empty_cache each time)"].median_s / cached
    finally:
        backend.destroy_queue(q)
    empty = measure(lambda: np.empty(4 * KiB, np.uint8), repeat=20, warmup=2)
    notes = [
        "one op = allocate + free (+ a synchronised memset of the whole block in alloc+fill+free); "
        "us/op is the median over repeated calls of many ops",
        "ratios are uncached / cached time per op: > 1 means the cache wins",
        f"backend {backend.name}; on the cpu target backend.alloc is np.empty, whose cost is mostly the "
        "first-touch page faults that alloc+fill+free shows; on a GPU it is cudaMalloc/cudaFree",
        "large host allocations vary from run to run: glibc serves them with mmap or from its heap "
        "depending on a threshold that grows after a large free (so uncached >= 1 MiB is noisy)",
    ]
    return schema.suite("memory", target, 1, results, ratios, {"np.empty(4 KiB) us": empty.median_s * 1e6}, notes)

