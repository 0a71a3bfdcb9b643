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
