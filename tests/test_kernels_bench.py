"""The kernels benchmark runs end to end and returns the documented schema."""

import argparse
import sys

import pytest

from vtnumba.backend.cuda import CUDABackend
from vtnumba.bench import kernels as bench
from vtnumba.bench.schema import suite, validate_suite


def test_quick_run_follows_schema():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--norm-shape", "64x256"])
    args.quick, args.sizes = True, [64]
    result = bench.run(args)
    validate_suite(result)
    assert result["suite"] == "kernels"
    for key in ("rmsnorm fused / numpy (speed-up)", "layernorm fused / numpy (speed-up)",
                "rmsnorm fused GB/s / memcpy traffic GB/s", "linear_fp32 n=64 vtnumba / numpy",
                "peer_reduce_rmsnorm_tp2 fused / numpy (speed-up)"):
        assert result["ratios"][key] > 0, key
    impls = {(r["case"], r["impl"]) for r in result["results"]}
    assert ("rmsnorm", "vtnumba-fused-host") in impls and ("linear_fp32", "numpy-blas") in impls
    assert result["baselines"]["memcpy traffic GB/s (read + write)"] > 0


def test_device_part_runs_in_the_simulator():
    # Numbers from the simulator mean nothing; this shows the GPU code path works end to end.
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    try:
        results, ratios, baselines, notes = [], {}, {}, []
        cfg = bench._settings(argparse.Namespace(quick=True, sizes=None, norm_shape=None))
        bench.bench_device(cfg, CUDABackend(), results, ratios, baselines, notes, simulator=True)
    finally:
        sys.setswitchinterval(old)
    validate_suite(suite("kernels", "cudasim", 1, results, ratios, baselines, notes))
    impls = {r["impl"] for r in results}
    assert {"vtnumba-naive", "vtnumba-smem", "vtnumba-regtile", "vtnumba-fused-cuda", "cuMemcpyDtoD"} <= impls
    assert "rmsnorm fused cuda GB/s / device copy traffic GB/s" in ratios


def test_bad_norm_shape():
    with pytest.raises(ValueError, match=r"--norm-shape='12' must look like ROWSxH"):
        bench._settings(argparse.Namespace(quick=True, sizes=None, norm_shape="12"))
