"""``vtnumba bench memory`` returns the documented schema with the cached/uncached ratios."""

import argparse

import pytest

from vtnumba.bench import memory
from vtnumba.bench.schema import validate_suite


def test_quick_run_follows_the_schema():
    res = memory.run(argparse.Namespace(quick=True, sizes=[4096, 1 << 20]))
    validate_suite(res)
    assert res["suite"] == "memory" and res["ranks"] == 1
    for label in ("4 KiB", "1 MiB"):
        for key in (f"alloc+free {label}: uncached / cached", f"alloc+fill+free {label}: uncached / cached",
                    f"alloc+free {label}: allocator miss / hit"):
            assert res["ratios"][key] > 0
    impls = {r["impl"] for r in res["results"]}
    assert impls == {"uncached (backend.alloc+free)", "allocator miss (empty_cache each time)",
                     "cached (CachingAllocator hit)"}
    assert all(r["value"] > 0 and r["metric"] == "us/op" for r in res["results"])
    # Each row carries the p10/p90 of its metric, which the tables and the plots' error bars show.
    assert all(r["value_p10"] <= r["value"] <= r["value_p90"] for r in res["results"])


def test_bad_sizes():
    with pytest.raises(ValueError, match="--sizes: -1 is not a positive number of bytes"):
        memory.run(argparse.Namespace(quick=True, sizes=[-1]))
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    assert parser.parse_args(["--sizes", "512", "4096"]).sizes == [512, 4096]


def test_the_stock_and_miss_ops_pay_their_own_frees(monkeypatch):
    """On a GPU numba runs its cudaFree calls in batches, from whichever later call tips the
    batch over: the uncached and miss ops flush them after every free, so each op's time
    includes its own free (on the host flush_frees is a no-op; here it is recorded)."""
    from vtnumba.backend.cpu import CPUBackend

    events, sizes_run = [], []
    real_free, real_bench_size = CPUBackend.free, memory._bench_size
    monkeypatch.setattr(CPUBackend, "free", lambda self, b: (events.append("free"), real_free(self, b))[1])
    monkeypatch.setattr(CPUBackend, "flush_frees", lambda self: events.append("flush"))
    monkeypatch.setattr(memory, "_bench_size", lambda *a: (sizes_run.append(a), real_bench_size(*a))[1])
    memory.run(argparse.Namespace(quick=True, sizes=[1 << 20]))
    flushed = sum(1 for a, b in zip(events, events[1:] + [None]) if a == "free" and b == "flush")
    assert flushed > 0 and events.count("flush") == flushed, "a flush comes right after a free"
    # The only frees not flushed: each case's final empty_cache, after its timings (none where
    # the last op timed was a miss, which had emptied the cache already).
    assert len(sizes_run) == 2 and 0 <= events.count("free") - flushed <= 2


@pytest.mark.cuda
def test_flush_frees_runs_the_frees_numba_queued(device_backend):
    from vtnumba.backend.cuda import current_context

    pending = current_context().deallocations
    device_backend.flush_frees()
    buf = device_backend.alloc(1 << 20)
    device_backend.free(buf)
    del buf
    assert len(pending) >= 1, "numba queues the cuMemFree of a dropped array"
    with device_backend.defer_frees():
        device_backend.flush_frees()
        assert len(pending) >= 1, "inside defer_frees the frees stay queued"
    device_backend.flush_frees()
    assert len(pending) == 0

