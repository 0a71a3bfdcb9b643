"""The encoder-cache benchmark runs quickly, follows the schema and checks its descriptor counts."""

import argparse

import pytest
from conftest import shm_files

from vtnumba.bench import ec
from vtnumba.bench.schema import validate_suite


def test_quick_run_follows_the_schema():
    before = shm_files("vtnumba_ec_")
    res = ec.run(argparse.Namespace(quick=True, sizes=[4096, 65536]))
    validate_suite(res)
    assert res["suite"] == "ec" and res["baselines"]["memcpy GB/s"] > 0
    impls = {(r["impl"], r["size"]) for r in res["results"] if r["case"] == "ec transfer"}
    # The pipelined rows need threaded cpu queues: the cpu target only.
    pipelined = ("ec save pipelined", "ec load pipelined") if res["target"] == "cpu" else ()
    for size in (4096, 65536):
        for impl in ("ec save", "ec load", "memcpy save", "memcpy load", *pipelined):
            assert (impl, size) in impls
    desc = [r for r in res["results"] if r["case"] == "ec descriptors/entry"]
    assert [r["value"] for r in desc] == [1.0, 1.0]  # contiguous entries: one run, one descriptor
    assert "save 64 KiB / memcpy same buffers" in res["ratios"]
    # ... and beside them, what they stand on: a hand-off to another thread and back.
    hand_off = [r for r in res["results"] if r["case"] == "thread hand-off"]
    assert len(hand_off) == (res["target"] == "cpu") and all(0 < r["value"] < 1e6 for r in hand_off)
    # ... and what a copy of each size leaves in the caches: one call right after it, and again.
    after = {(r["impl"], r["size"]): r for r in res["results"] if r["case"] == "host call after a copy"}
    assert set(after) == {(f"{w} ({when})", n) for w, when in (("cold", "right after it"), ("warm", "called again"))
                          for n in (4096, 65536)}
    assert all(r["metric"] == "us" and 0 < r["value"] < 1e5 for r in after.values()), after
    # The fixed cost per step (ec step minus the same copy), per size and direction, in microseconds.
    fixed = {(r["impl"], r["size"]): r for r in res["results"] if r["case"] == "ec fixed cost per step"}
    assert set(fixed) == {(f"ec {d}", n) for d in ("save", "load") for n in (4096, 65536)}
    assert all(r["metric"] == "us" and abs(r["value"]) < 1e5 for r in fixed.values()), fixed  # noisy: may dip below 0
    # ... and the step size that would hide it: solved from the same two medians.
    size_for = {(r["impl"], r["size"]): r["value"] for r in res["results"] if r["case"] == "ec step size for 0.8 x memcpy"}
    assert set(size_for) == set(fixed)
    for (impl, n), mib in size_for.items():
        assert mib >= 0 and (mib == 0) == (fixed[impl, n]["value"] <= 0), (impl, n, mib)
    assert shm_files("vtnumba_ec_") <= before


def test_break_even_step_size():
    # 10 us of fixed cost beside a copy of 1 MiB in 50 us: a 1 MiB step reaches 50/60 = 0.83;
    # 0.8 needs the copy to take 4 x 10 us, i.e. 0.8 MiB.
    mib = ec.break_even_bytes(10.0, 50e-6, ec.MiB, 0.8) / ec.MiB
    assert mib == pytest.approx(0.8)
    copy_s = mib * 50e-6  # check by the definition: copy / (fixed + copy) at that size
    assert copy_s / (10e-6 + copy_s) == pytest.approx(0.8)
    assert ec.break_even_bytes(10.0, 50e-6, ec.MiB, 0.5) / ec.MiB == pytest.approx(0.2)
    assert ec.break_even_bytes(-3.0, 50e-6, ec.MiB, 0.8) == 0.0  # noise made the step look free
    for aim in (0, 1, 1.5):
        with pytest.raises(ValueError, match="aim="):
            ec.break_even_bytes(10.0, 50e-6, ec.MiB, aim)


def test_steps_of_several_entries_are_measured_and_checked():
    """``--entries-per-step 3``: batched rows next to the one-entry rows, per-entry fixed cost,
    ratios against one memcpy of the step's bytes; every entry loaded back byte for byte."""
    res = ec.run(argparse.Namespace(quick=True, sizes=[65536], entries_per_step=3))
    validate_suite(res)
    batched = {r["impl"] for r in res["results"] if r["case"] == "ec transfer, 3 entries/step"}
    assert {"ec save", "ec load", "memcpy save", "memcpy load"} <= batched
    per_entry = [r for r in res["results"] if r["case"] == "ec fixed cost per entry, batched"]
    assert {r["impl"] for r in per_entry} == {"ec save", "ec load"}
    assert {"save 3 x 64 KiB per step / memcpy same buffers", "load 3 x 64 KiB per step / memcpy same buffers"} \
        <= set(res["ratios"])
    none = ec.run(argparse.Namespace(quick=True, sizes=[65536], entries_per_step=1))
    assert not any("entries/step" in r["case"] for r in none["results"])


def test_a_batched_case_loads_back_every_entry():
    be = __import__("vtnumba").CPUBackend()
    case = ec._Case(be, 4 * 2048, False, "entries", entries=3)
    try:
        case.save()
        case.load()
        case.check_loaded()
        assert sorted(case.loaded) == ["e0", "e1", "e2"]
        assert case.descriptors_per_save() == 1.0  # each entry one run
        case.loaded["e1"][0, 0] += 1  # a wrong byte in one entry is caught
        with pytest.raises(RuntimeError, match="loaded bytes of e1 differ"):
            case.check_loaded()
    finally:
        case.close()
        be.close()


@pytest.mark.parametrize("bad", [0, 65, 2.5])
def test_bad_entries_per_step(bad):
    with pytest.raises(ValueError, match="--entries-per-step"):
        ec.run(argparse.Namespace(quick=True, sizes=[4096], entries_per_step=bad))


def test_fragmented_case_counts_one_descriptor_per_run():
    r = ec._bench_size(__import__("vtnumba").CPUBackend(), 64 * 2048, 3, True, "fragtest")
    assert r["runs"] == 8 and r["descriptors"] == 8  # 64 rows in runs of 8


def test_bad_sizes():
    with pytest.raises(ValueError, match="--sizes: 1000 is not a positive multiple of the 2048-byte block"):
        ec.run(argparse.Namespace(quick=True, sizes=[1000]))


def test_gpu_runs_say_whether_the_region_was_pinned():
    # On a GPU the EC aim is against a *pinned* copy: a mapping cuMemHostRegister refused makes
    # both the copies and their baseline pageable, and the run must say so.
    ok = "registered 8388608 bytes with cuMemHostRegister"
    refused = "cuMemHostRegister failed (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED); transfers use pageable memory"
    assert ec.pin_notes({"producer": {ok}, "consumer": {ok}}) == [
        "region memory, producer mapping: pinned (cuMemHostRegister)",
        "region memory, consumer mapping: pinned (cuMemHostRegister)"]
    producer, consumer = ec.pin_notes({"producer": {ok}, "consumer": {ok, refused}})
    assert producer.endswith(": pinned (cuMemHostRegister)")
    assert consumer.startswith(f"region memory, consumer mapping: NOT PINNED ({refused})"), consumer


def test_link_bandwidths_on_a_cuda_backend(device_backend):
    """On a GPU the save and load rows are also set against the host link -- large pinned D2H and
    H2D copies -- not the host's memcpy (in the simulator the copies are tiny: the path only)."""
    rates = ec.link_bandwidths(device_backend, 1 << 20)
    assert set(rates) == {"save", "load"} and all(r > 0 for r in rates.values())

