"""The kernels benchmark runs end to end and returns the documented schema."""

import argparse
import time

import pytest
from conftest import DEVICE_TARGET

from vtnumba.bench import kernels as bench
from vtnumba.bench import timing
from vtnumba.bench.schema import suite, validate_suite


def test_quick_run_follows_schema():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    # The options as `vtnumba bench kernels` parses them (the host matmul's sizes included).
    args = parser.parse_args(["--norm-shape", "64x256", "--device-matmul-sizes", "8", "--host-matmul-sizes", "64"])
    args.quick = True
    result = bench.run(args)
    validate_suite(result)
    assert result["suite"] == "kernels"
    if result["target"] == "cuda":  # the ladder ran at the size asked for
        assert {r["size"] for r in result["results"] if r["case"] == "matmul_fp32"} == {8}
    else:  # no device ladder here: the run says the flag went unused instead of ignoring it
        assert any(n.startswith("--device-matmul-sizes applies on a GPU") for n in result["notes"]), result["notes"]
    for key in ("rmsnorm fused / numpy (speed-up)", "layernorm fused / numpy (speed-up)",
                "rmsnorm fused GB/s / memcpy traffic GB/s", "linear_fp32 n=64 vtnumba / numpy",
                "peer_reduce_rmsnorm_tp2 fused / numpy (speed-up)"):
        assert result["ratios"][key] > 0, key
    impls = {(r["case"], r["impl"]) for r in result["results"]}
    assert ("rmsnorm", "vtnumba-fused-host") in impls and ("linear_fp32", "numpy-blas") in impls
    assert result["baselines"]["memcpy traffic GB/s (read + write)"] > 0
    # The norms' ceiling is the copy split over the host threads as they split their rows (it
    # was the one-thread copy, which two-thread norms outran: "fractions" above 1).
    split = result["baselines"]["memcpy traffic GB/s (norm arrays, split like the norms)"]
    fused = next(r["value"] for r in result["results"] if (r["case"], r["impl"]) == ("rmsnorm", "vtnumba-fused-host"))
    assert result["ratios"]["rmsnorm fused GB/s / memcpy traffic GB/s"] == pytest.approx(fused / split)
    assert any(r["case"] == "memcpy" and r["impl"].startswith("numpy.copyto split like the norms")
               for r in result["results"])


def _run_device_part(device_backend):
    results, ratios, baselines, notes = [], {}, {}, []
    # --device-matmul-sizes reaches the ladder: 8, not the simulator's default 16 (one block either way).
    cfg = bench._settings(argparse.Namespace(quick=True, host_matmul_sizes=None, norm_shape=None, device_matmul_sizes=[8]))
    bench.bench_device(cfg, device_backend, results, ratios, baselines, notes, simulator=True)
    return results, ratios, baselines, notes


@pytest.mark.parametrize("pre_ampere", [False, True], ids=["this-device", "no-cp.async"])
def test_device_part_runs_end_to_end_on_the_device(device_backend, pre_ampere, monkeypatch):
    # The GPU code path end to end at the simulator's tiny sizes (bench_device's simulator=True),
    # on the device target: numbers that small mean nothing, the schema and the cases do.
    # "no-cp.async" stands in a GPU older than Ampere: the async rung must be left out and
    # named, and the ladder must go on past it (to every size).
    if pre_ampere:
        from vtnumba.kernels import matmul_cuda

        monkeypatch.setattr(matmul_cuda, "async_copies_supported",
                            lambda: (False, "cp.async needs compute capability 8.0 or newer; this GPU is 7.5"))
    results, ratios, baselines, notes = _run_device_part(device_backend)
    assert not [n for n in notes if "WRONG RESULT" in n or "FAILED" in n], notes
    validate_suite(suite("kernels", DEVICE_TARGET, 1, results, ratios, baselines, notes))
    impls = {(r["case"], r["impl"]) for r in results}
    # Every rung of the ladder the device can run has its row, in ladder order (before Ampere
    # the async rung is left out, with a note saying why).
    from vtnumba.kernels import VARIANTS, matmul_cuda

    unavailable = matmul_cuda.unavailable_rungs()
    rungs = [r["impl"] for r in results if r["case"] == "matmul_fp32"]
    assert rungs == [f"vtnumba-{v}" for v in VARIANTS if v not in unavailable]
    assert all(any(f"matmul {v}: not run" in n for n in notes) for v in unavailable), notes
    assert {r["size"] for r in results if r["case"] == "matmul_fp32"} == {8}
    assert {("rmsnorm", "vtnumba-fused-cuda"), ("layernorm", "vtnumba-fused-cuda"),
            ("peer_reduce_rmsnorm_tp2", "vtnumba-fused-cuda"), ("gather_rows", "vtnumba-cuda")} <= impls
    assert "device_copy" in {case for case, _ in impls}
    # Each memory-bound row reports its fraction of the copy ceiling.
    for case in ("rmsnorm", "layernorm", "peer_reduce_rmsnorm_tp2"):
        assert ratios[f"{case} fused cuda GB/s / device copy traffic GB/s"] > 0
    assert ratios["gather_rows cuda GB/s / device copy traffic GB/s"] > 0
    assert baselines["device copy traffic GB/s"] > 0


def test_a_wrong_matmul_rung_cannot_be_the_best(device_backend, monkeypatch):
    # Every rung's answer is checked before its speed may count toward the cuBLAS aim: a rung
    # that returns garbage (here smem, made to leave C half written) is named and left out.
    import vtnumba.kernels as kernels

    real = kernels.matmul

    def matmul(a, b, out=None, queue=None, variant=None):
        result = real(a, b, out=out, queue=queue, variant=variant)
        if variant == "smem":
            device_backend.synchronize(queue)
            out[: out.shape[0] // 2] = 0.0
        return result

    monkeypatch.setattr(kernels, "matmul", matmul)
    results, _, _, notes = _run_device_part(device_backend)
    wrong = [n for n in notes if "WRONG RESULT" in n]
    assert len(wrong) == 1 and wrong[0].startswith("matmul n=8 smem: WRONG RESULT"), notes


@pytest.mark.parametrize("usable", [True, False], ids=["device-still-usable", "device-lost"])
def test_a_failing_rung_stops_the_ladder_only_when_the_device_is_lost(device_backend, monkeypatch, usable):
    # A rung that raises (refused at launch, say) must not cost the other rungs or the other
    # sizes -- the 4096^3 aim among them -- unless it left the GPU unusable.
    import vtnumba.kernels as kernels

    real = kernels.matmul

    def matmul(a, b, out=None, queue=None, variant=None):
        if variant == "wide":
            raise RuntimeError("launch refused (stood in for)")
        return real(a, b, out=out, queue=queue, variant=variant)

    monkeypatch.setattr(kernels, "matmul", matmul)
    monkeypatch.setattr(bench, "_device_still_usable", lambda: usable)
    results, ratios, baselines, notes = [], {}, {}, []
    cfg = bench._settings(argparse.Namespace(quick=True, host_matmul_sizes=None, norm_shape=None, device_matmul_sizes=[8, 16]))
    bench.bench_device(cfg, device_backend, results, ratios, baselines, notes, simulator=True)
    rows = {(r["impl"], r["size"]) for r in results if r["case"] == "matmul_fp32"}
    failed = [n for n in notes if "FAILED" in n]
    assert failed and failed[0].startswith("matmul n=8 wide: FAILED (RuntimeError: launch refused"), notes
    if usable:  # every other rung at both sizes
        assert len(failed) == 2 and not any("ladder stops" in n for n in failed), failed
        assert ("vtnumba-warptile", 8) in rows and ("vtnumba-regtile", 16) in rows and ("vtnumba-dbuf", 16) in rows
    else:  # the rungs before it, and nothing after
        assert len(failed) == 1 and "the ladder stops" in failed[0], failed
        assert ("vtnumba-regtile", 8) in rows and ("vtnumba-warptile", 8) not in rows
        assert not any(size == 16 for _, size in rows)


def test_resource_notes_print_one_line_per_kernel():
    # What --ptxas prints (the runner prints notes): one line per kernel at sm_90, float32 first.
    resources = [
        {"kernel": "wide", "sig": "f32", "cc": "9.0", "registers": 126, "smem_bytes": 8448,
         "spill_store_bytes": 0, "spill_load_bytes": 0},
        {"kernel": "wide", "sig": "f16", "cc": "9.0", "registers": 120, "smem_bytes": 8448,
         "spill_store_bytes": 0, "spill_load_bytes": 0},
        {"kernel": "wide", "sig": "f32", "cc": "8.0", "registers": 128, "smem_bytes": 8448,
         "spill_store_bytes": 4, "spill_load_bytes": 4},
        {"kernel": "naive", "sig": "f32", "cc": "9.0", "error": "ptxas fatal"},
    ]
    assert bench._resource_notes(resources) == [
        "ptxas sm_90 wide: 126 registers, 8448 B shared memory, spills 0 B stored / 0 B loaded",
        "ptxas sm_90 naive: ptxas fatal"]
    # A kernel that spills, read with --sass too: where its spills land.
    spilling = [{"kernel": "async", "sig": "f32", "cc": "9.0", "registers": 128, "smem_bytes": 31104,
                 "spill_store_bytes": 108, "spill_load_bytes": 140, "main_loop_spill_loads": 27,
                 "main_loop_spill_stores": 0, "main_loop_fma": 512, "main_loop_instructions": 1010}]
    assert bench._resource_notes(spilling) == [(
        "ptxas sm_90 async: 128 registers, 31104 B shared memory, spills 108 B stored / 140 B loaded; main loop: "
        "27 spill reloads and 0 stores per turn, beside 512 FMAs in 1010 instructions")]


def test_the_cublas_baseline_runs_on_the_benchmarked_gpu(monkeypatch):
    # With one GPU per rank (or VTNUMBA_DEVICE), the ladder's queue may be on GPU 3: CuPy's
    # arrays, stream and calls must be there too, not on its default GPU 0.  A stand-in CuPy
    # records the device current at each step.
    import contextlib
    import sys
    import types

    log, current = [], [0]

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    class ExternalStream:
        def __init__(self, ptr, device_id=-1):
            log.append(("stream", ptr, device_id))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    def made(what):
        return lambda *a, **k: log.append((what, current[0]))

    fake = types.SimpleNamespace(
        float32="float32", cuda=types.SimpleNamespace(Device=device, ExternalStream=ExternalStream),
        random=types.SimpleNamespace(standard_normal=made("array")), empty=made("array"), matmul=made("matmul"))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    name, call = bench._baseline_gemm(8, 0x1234, 3)
    call()
    assert name == "cupy(cuBLAS)"
    assert log == [("array", 3)] * 3 + [("stream", 0x1234, 3)] + [("matmul", 3)] * 2, log


def test_device_copy_rate_on_the_device(device_backend):
    # The helper the peer and ec benchmarks can share: every direction.  The simulator copies at
    # most 64 KiB (its rate says nothing about a GPU); a GPU copies what it is asked to.
    backend = device_backend
    want = (64 << 10) if backend.capabilities.simulator else (1 << 20)
    for direction in ("d2d", "d2h", "h2d"):
        rate = timing.device_copy_rate(backend, nbytes=1 << 20, direction=direction, repeat=2)
        assert rate.nbytes == want and rate.direction == direction
        assert rate.stats.samples == 2 and rate.traffic_gbs == 2 * rate.copied_gbs > 0
    with pytest.raises(ValueError, match="direction"):
        timing.device_copy_rate(backend, direction="p2p")


def test_device_copy_rate_needs_a_cuda_backend():
    from vtnumba.backend.cpu import CPUBackend

    with pytest.raises(ValueError, match="needs a CUDA backend"):
        timing.device_copy_rate(CPUBackend())


def test_time_on_queue_counts_inner_calls():
    # Events around `inner` calls, divided by `inner`: per-call time, never more samples than asked.
    from vtnumba.backend.cpu import CPUBackend

    backend = CPUBackend()
    q = backend.create_queue("t")
    calls = []
    try:
        st = timing.time_on_queue(backend, q, lambda: calls.append(1), repeat=3, inner=4, warmup=2)
    finally:
        backend.destroy_queue(q)
    assert st.samples == 3 and len(calls) == 2 + 3 * 4


def test_time_on_queue_holds_the_queue_until_a_sample_is_queued():
    # A kernel launched by slow host code must be timed as the kernel, not as the launches: the
    # queue waits on a flag until all of a sample's calls are queued.  Threaded cpu queues run on
    # their own like a GPU's streams; each "launch" here takes 2 ms of host time.
    from vtnumba.backend.cpu import CPUBackend

    import contextlib

    backend = CPUBackend(threaded=True)
    q = backend.create_queue("t")
    queued, ran, host = [], [], []
    # While the queue is held, frees are held back too (on a GPU a cuMemFree would wait for the
    # held queue: Backend.defer_frees) -- every timed call runs inside.
    deferring, deferred_calls = [0], []

    @contextlib.contextmanager
    def defer_frees():
        deferring[0] += 1
        try:
            yield
        finally:
            deferring[0] -= 1

    backend.defer_frees = defer_frees

    def slow_launch():
        deferred_calls.append(deferring[0] > 0)
        time.sleep(0.002)
        queued.append(time.perf_counter())
        backend.launch_host_func(q, lambda: ran.append(time.perf_counter()))

    try:
        st = timing.time_on_queue(backend, q, slow_launch, repeat=3, inner=4, warmup=1, host_s=host)
    finally:
        backend.destroy_queue(q)
        backend.close()
    assert st.samples == 3 and len(host) == 3 and min(host) >= 0.002
    assert deferred_calls == [False] + [True] * 12 and deferring == [0], deferred_calls  # (warm-up first)
    for k in range(3):  # after the warm-up call: sample k's four calls ran after the last was queued
        calls = slice(1 + 4 * k, 1 + 4 * k + 4)
        assert min(ran[calls]) >= queued[calls][-1], (k, ran, queued)
    assert st.median_s < 0.002, f"the sample ({st.median_s * 1e3:.2f} ms per call) includes the launches"
    # A call that raises while the queue is held lets the queue go: later work is not stuck
    # behind the gate until its deadline.
    backend = CPUBackend(threaded=True)
    q = backend.create_queue("t")
    calls = []

    def fails_on_the_third_call():
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom")

    try:
        with pytest.raises(ValueError, match="boom"):
            timing.time_on_queue(backend, q, fails_on_the_third_call, repeat=3, inner=2, warmup=1)
        t0 = time.perf_counter()
        backend.synchronize(q)
        assert time.perf_counter() - t0 < 5
    finally:
        backend.destroy_queue(q)
        backend.close()


def test_bad_matmul_sizes_name_their_flag():
    for flag in ("device_matmul_sizes", "host_matmul_sizes"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}: 0 is not a positive"):
            bench._settings(argparse.Namespace(quick=True, norm_shape=None, **{flag: [64, 0]}))


def test_bad_norm_shape():
    with pytest.raises(ValueError, match=r"--norm-shape='12' must look like ROWSxH"):
        bench._settings(argparse.Namespace(quick=True, host_matmul_sizes=None, norm_shape="12"))
