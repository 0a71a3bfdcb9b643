"""The encoder-cache benchmark runs quickly, follows the schema and checks its descriptor counts."""

import argparse
import os

import pytest

from vtnumba.bench import ec
from vtnumba.bench.schema import validate_suite


def _ec_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("vtnumba_ec_")}


def test_quick_run_follows_the_schema():
    before = _ec_files()
    res = ec.run(argparse.Namespace(quick=True, sizes=[4096, 65536]))
    validate_suite(res)
    assert res["suite"] == "ec" and res["baselines"]["memcpy GB/s"] > 0
    impls = {(r["impl"], r["size"]) for r in res["results"] if r["case"] == "ec transfer"}
    for size in (4096, 65536):
        for impl in ("ec save", "ec load", "memcpy save", "memcpy load", "ec save pipelined", "ec load pipelined"):
            assert (impl, size) in impls
    desc = [r for r in res["results"] if r["case"] == "ec descriptors/entry"]
    assert [r["value"] for r in desc] == [1.0, 1.0]  # contiguous entries: one run, one descriptor
    assert "save 64 KiB / memcpy same buffers" in res["ratios"]
    # The fixed cost per step (ec step minus the same copy), per size and direction, in microseconds.
    fixed = {(r["impl"], r["size"]): r for r in res["results"] if r["case"] == "ec fixed cost per step"}
    assert set(fixed) == {(f"ec {d}", n) for d in ("save", "load") for n in (4096, 65536)}
    assert all(r["metric"] == "us" and abs(r["value"]) < 1e5 for r in fixed.values()), fixed  # noisy: may dip below 0
    assert _ec_files() == before


def test_fragmented_case_counts_one_descriptor_per_run():
    r = ec._bench_size(__import__("vtnumba").CPUBackend(), 64 * 2048, 3, True, "fragtest")
    assert r["runs"] == 8 and r["descriptors"] == 8  # 64 rows in runs of 8


def test_bad_sizes():
    with pytest.raises(ValueError, match="--sizes: 1000 is not a positive multiple of the 2048-byte block"):
        ec.run(argparse.Namespace(quick=True, sizes=[1000]))
