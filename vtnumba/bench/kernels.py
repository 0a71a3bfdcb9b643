"""``vtnumba bench kernels``: the kernel ladder measured against stock baselines in the same run.

On every target (the host references are what the ``cpu`` target runs):

* **fused add + norm** (RMSNorm and LayerNorm) vs. the same math in plain numpy: the
  speed-up, and the fused kernel's bandwidth as a fraction of a copy's, ``np.copyto`` split
  over the same host threads as the fused norm's rows (the one-thread copy is reported
  beside it);
* **peer reduce + norm** (tp = 2) vs. numpy summing the sources and then normalising;
* **host matmul** GFLOP/s (``linear``, float32 and float16 inputs) vs. numpy's BLAS ``x @ w.T``.

On a real GPU (``cuda`` target) additionally, all timed with CUDA events on one queue, every
row with the fraction of its ceiling measured in the same run:

* each step of the matmul ladder (:data:`vtnumba.kernels.matmul.LADDER`: naive, smem,
  regtile, wide, warptile, dbuf, async) in GFLOP/s and as a fraction of cuBLAS SGEMM (through
  CuPy, or torch if CuPy is absent) run on the same queue;
* the memory-bound kernels -- fused RMSNorm and LayerNorm, the peer reduce + RMSNorm of two
  sources, the gather copy -- as a fraction of the device's copy bandwidth: a warmed-up
  1 GiB device-to-device ``cuMemcpyDtoDAsync``
  (:func:`vtnumba.bench.timing.device_copy_rate`).  A small or cold copy, timed from the
  host, understates that ceiling several times over and flatters every kernel measured
  against it; a norm shape that fits in L2 would flatter the kernel too, so the GPU norms
  use 8192 x 4096 unless ``--norm-shape`` says otherwise.

With ``--ptxas`` (no GPU needed: nvJitLink from pip, else a ``ptxas`` on PATH; see
:mod:`vtnumba.kernels.ptx`) the suite also lists registers / shared memory / spills per
kernel and compute capability (``kernel_resources``), and prints one note per kernel for
sm_90.  Where ``nvdisasm`` is installed too (the test extra brings it), a kernel that spills
also gets where the spills land: the spill reloads and stores its main loop pays per turn,
beside that loop's FMAs (``main_loop_*``; :func:`vtnumba.kernels.ptx.read_sass`).

**How bandwidth is counted.**  ``timing.memcpy_bandwidth_gbs`` reports bytes *copied* per
second; a copy of n bytes reads n and writes n.  To compare like with like this suite
counts *traffic* (bytes read + bytes written) for everything, and times the memcpy baseline
as ``np.copyto`` between the norm's own arrays, in the same interleaved rounds as the norms
and their numpy baselines (a shared machine's bandwidth drifts; alternating keeps the
ratios fair).  A fused norm that moves its 4 arrays (read y and residual, write
new_residual and out) at memcpy speed scores 1.0.  On the host the fused norms split a large
call's rows over the process's threads (:func:`vtnumba.kernels._common.split_rows`), so the
ceiling for ``fused GB/s / memcpy traffic GB/s`` is the same copy split the same way (numpy's
copy releases the GIL); the one-thread copy is reported beside it.
"""

from __future__ import annotations

import argparse
import shutil

import numpy as np

from vtnumba.bench import schema
from vtnumba.bench.timing import (
    device_copy_rate,
    measure_interleaved,
    memcpy_bandwidth_gbs,
    stream_handle,
    time_on_queue,
)
from vtnumba.target import current_target

EPS = 1e-5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--norm-shape``, ``--ptxas`` and the suite's other options (see ``vtnumba bench kernels --help``)."""
    parser.add_argument("--norm-shape", type=_norm_shape_arg, default=None, metavar="ROWSxH",
                        help="shape of the norm benchmarks (default 8192x4096; on the host 1024x1024 with --quick)")
    parser.add_argument("--ptxas", action="store_true",
                        help="report registers/shared memory/spills per kernel (nvJitLink, else ptxas on PATH), "
                             "and with nvdisasm installed where a kernel's spills land in its main loop; the first "
                             "run compiles every kernel (minutes), later ones read out/ptxas-cache/ until the "
                             "kernels or the compilers change")
    from vtnumba.bench.runner import positive_int

    parser.add_argument("--device-matmul-sizes", type=positive_int, nargs="+", default=None, metavar="N",
                        help="square matmul sizes of the ladder on a GPU (default 2048 4096; 1024 with --quick)")
    parser.add_argument("--host-matmul-sizes", type=positive_int, nargs="+", default=None, metavar="N",
                        help="square matmul sizes of the host matmul against numpy's BLAS (default 1024 2048; "
                             "256 with --quick)")


def _parse_shape(text: str) -> tuple[int, int]:
    try:
        rows, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--norm-shape={text!r} must look like ROWSxH, e.g. 8192x4096") from None
    if rows < 1 or h < 1:
        raise ValueError(f"--norm-shape={text!r} must have positive sizes")
    return rows, h


def _norm_shape_arg(text: str) -> str:
    """``--norm-shape``'s argparse type: checked at parse time (kept as text; _settings reads it)."""
    try:
        _parse_shape(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must look like ROWSxH with positive sizes, e.g. 8192x4096") from None
    return text


def check_arguments(args, world_size: int) -> None:
    """Sizes that cannot fit in this machine's memory: ValueError naming the flag, before any suite runs
    (they were a MemoryError inside the suite).  A norm row set is held about six times over (input,
    bias, residual, outputs, numpy's temporaries), a host matmul three times."""
    from vtnumba.bench.runner import check_sizes_fit

    shape = getattr(args, "norm_shape", None)
    if shape:
        rows, h = _parse_shape(shape)
        check_sizes_fit([6 * 4 * rows * h], f"--norm-shape={shape}")
    for n in getattr(args, "host_matmul_sizes", None) or ():
        check_sizes_fit([3 * 4 * n * n], f"--host-matmul-sizes {n}")


def _settings(args) -> dict:
    quick = bool(getattr(args, "quick", False))
    shape = getattr(args, "norm_shape", None)
    sizes = getattr(args, "host_matmul_sizes", None)
    device_sizes = getattr(args, "device_matmul_sizes", None)
    for flag, given in (("--device-matmul-sizes", device_sizes), ("--host-matmul-sizes", sizes)):
        for n in given or ():
            if type(n) is not int or n < 1:
                raise ValueError(f"{flag}: {n!r} is not a positive whole matrix size")
    return {
        "device_mm_sizes": list(device_sizes) if device_sizes else None,
        "quick": quick,
        "norm_shape": _parse_shape(shape) if shape else ((1024, 1024) if quick else (8192, 4096)),
        "norm_shape_arg": _parse_shape(shape) if shape else None,
        "mm_sizes": [int(s) for s in sizes] if sizes else ([256] if quick else [1024, 2048]),
        "repeat": 3 if quick else 10,
    }


# ---------------------------------------------------------------------------- host (cpu) part
def _numpy_norm(y, bias, residual, weight, norm_bias, layer):
    """The same math written the obvious way in numpy (the stock baseline)."""
    z = y + bias + residual
    if layer:
        mean = z.mean(axis=-1, keepdims=True)
        var = ((z - mean) ** 2).mean(axis=-1, keepdims=True)
        return (z - mean) / np.sqrt(var + EPS) * weight + norm_bias, z
    return z / np.sqrt((z * z).mean(axis=-1, keepdims=True) + EPS) * weight, z


def _bench_host_norms(cfg, results, ratios, baselines):
    from vtnumba.kernels import fused_add_layer_norm, fused_add_rms_norm, peer_reduce_norm

    from vtnumba.kernels._common import host_threads, split_rows

    rows, h = cfg["norm_shape"]
    elem = rows * h * 4  # bytes of one array
    rng = np.random.default_rng(0)
    y, res, peer = (rng.standard_normal((rows, h), dtype=np.float32) for _ in range(3))
    weight, bias, norm_bias = (rng.standard_normal(h, dtype=np.float32) for _ in range(3))
    out, new_res = np.empty_like(y), np.empty_like(y)
    fns = {
        "rmsnorm": lambda: fused_add_rms_norm(y, res, weight, EPS, bias=bias, out=out, new_residual=new_res),
        "rmsnorm numpy": lambda: _numpy_norm(y, bias, res, weight, None, False),
        "layernorm": lambda: fused_add_layer_norm(y, res, weight, norm_bias, EPS, bias=bias, out=out,
                                                  new_residual=new_res),
        "layernorm numpy": lambda: _numpy_norm(y, bias, res, weight, norm_bias, True),
        # Peer reduce (tp = 2) + norm vs. numpy summing the sources, then the same norm.
        "peer_reduce_rmsnorm_tp2": lambda: peer_reduce_norm([y, peer], bias, res, weight, None, EPS, out, new_res),
        "peer_reduce_rmsnorm_tp2 numpy": lambda: _numpy_norm(y + peer, bias, res, weight, None, False),
        # The memcpy baseline on the same arrays, timed in the same rounds -- one thread, and
        # split over the host threads the way the fused norms split their rows (numpy's copy
        # releases the GIL): the ceiling those compare with.
        "memcpy": lambda: np.copyto(out, y),
        "memcpy split": lambda: split_rows(lambda a, b: np.copyto(out[a:b], y[a:b]), 0, rows, 4 * elem),
    }
    # Rounds of one call each: a median over 9 interleaved rounds (about 0.2 s at --quick's
    # 1024 x 1024) instead of 2, whose ratios swung by half between runs on a busy machine.
    st = measure_interleaved(fns, rounds=9 if cfg["quick"] else 5,
                             repeat=1 if cfg["quick"] else max(1, cfg["repeat"] // 3))
    copy_gbs = 2 * elem / st["memcpy"].median_s / 1e9  # traffic: read n + write n
    results.append(schema.row("memcpy", "numpy.copyto", rows * h, "elements", "GB/s (traffic)", copy_gbs,
                              st["memcpy"], shape=(rows, h)))
    baselines["memcpy traffic GB/s (norm arrays, interleaved)"] = copy_gbs
    split_gbs = 2 * elem / st["memcpy split"].median_s / 1e9
    results.append(schema.row("memcpy", f"numpy.copyto split like the norms ({host_threads()} thread(s))", rows * h,
                              "elements", "GB/s (traffic)", split_gbs, st["memcpy split"], shape=(rows, h)))
    baselines["memcpy traffic GB/s (norm arrays, split like the norms)"] = split_gbs
    # traffic: read y, residual (+ peer); write new_residual, out
    for case, traffic in (("rmsnorm", 4 * elem), ("layernorm", 4 * elem), ("peer_reduce_rmsnorm_tp2", 5 * elem)):
        fused, base = st[case], st[f"{case} numpy"]
        gbs = traffic / fused.median_s / 1e9
        results.append(schema.row(case, "vtnumba-fused-host", rows * h, "elements", "GB/s", gbs, fused, shape=(rows, h)))
        results.append(schema.row(case, "numpy", rows * h, "elements", "GB/s", traffic / base.median_s / 1e9, base,
                                  shape=(rows, h)))
        ratios[f"{case} fused / numpy (speed-up)"] = base.median_s / fused.median_s
        ratios[f"{case} fused GB/s / memcpy traffic GB/s"] = gbs / split_gbs


def _bench_host_matmul(cfg, results, ratios):
    from vtnumba.kernels import linear

    rng = np.random.default_rng(1)
    for n in cfg["mm_sizes"]:
        x = rng.standard_normal((n, n), dtype=np.float32)
        w = rng.standard_normal((n, n), dtype=np.float32)
        out = np.empty((n, n), np.float32)
        flops = 2.0 * n ** 3
        x16, w16 = x.astype(np.float16), w.astype(np.float16)
        # The float16 baseline is what numpy offers for it: widen to float32, then BLAS
        # (numpy's own float16 matmul is a slow loop, no baseline worth beating).
        st = measure_interleaved({
            "fp32": lambda: linear(x, w, out=out),
            "fp32 numpy": lambda: np.matmul(x, w.T, out=out),
            "fp16": lambda: linear(x16, w16, out=out),
            "fp16 numpy": lambda: np.matmul(x16.astype(np.float32), w16.astype(np.float32).T, out=out),
        }, rounds=max(5, cfg["repeat"]))
        for case, dt in (("linear_fp32", "fp32"), ("linear_fp16_in_fp32_acc", "fp16")):
            mine, base = st[dt], st[f"{dt} numpy"]
            results.append(schema.row(case, "vtnumba-host", n, "M=N=K", "GFLOP/s", flops / mine.median_s / 1e9, mine))
            results.append(schema.row(case, "numpy-blas", n, "M=N=K", "GFLOP/s", flops / base.median_s / 1e9, base))
            ratios[f"{case} n={n} vtnumba / numpy"] = base.median_s / mine.median_s


# ---------------------------------------------------------------------------- device part
def _baseline_gemm(n: int, stream_handle, device_index: int = 0):
    """A cuBLAS SGEMM through CuPy or torch, as ``(name, call)``, or None.

    ``call`` enqueues ``C = A @ B`` on the stream ``stream_handle`` (our queue's, on GPU
    ``device_index``: the libraries' arrays must live on that GPU, not on their default
    device 0), so the same events time cuBLAS and vtnumba's kernels."""
    try:
        import cupy as cp

        with cp.cuda.Device(device_index):
            a = cp.random.standard_normal((n, n), dtype=cp.float32)
            b = cp.random.standard_normal((n, n), dtype=cp.float32)
            c = cp.empty((n, n), dtype=cp.float32)
        stream = cp.cuda.ExternalStream(int(stream_handle), device_index)

        def call_cupy():
            with cp.cuda.Device(device_index), stream:
                cp.matmul(a, b, out=c)

        call_cupy()  # once now: a library that fails on its first real call falls through to torch
        stream.synchronize()
        return "cupy(cuBLAS)", call_cupy
    except Exception:  # noqa: BLE001 - not installed, no device, or cuBLAS failed: try torch
        pass
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        torch.backends.cuda.matmul.allow_tf32 = False  # compare with true float32 SGEMM
        dev = torch.device("cuda", device_index)
        a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
        c = torch.empty(n, n, device=dev)
        stream = torch.cuda.ExternalStream(int(stream_handle), device=dev)

        def call_torch():
            with torch.cuda.stream(stream):
                torch.matmul(a, b, out=c)

        call_torch()
        stream.synchronize()
        return "torch(cuBLAS)", call_torch
    except Exception:  # noqa: BLE001
        return None


def _device_still_usable() -> bool:
    """After a failed launch: can this process still use the GPU?  A kernel's illegal memory
    access leaves the context unusable -- every later call fails -- while a launch refused up
    front (or an error raised in Python) leaves it as it was."""
    from numba import cuda

    try:
        cuda.to_device(np.ones(1, np.float32)).copy_to_host()
        cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _device_norm_shape(cfg) -> tuple[int, int]:
    """The fused norm's shape on a GPU: ``--norm-shape`` if given, else 8192 x 4096 even with
    --quick.  Four 128 MiB arrays are far larger than the L2 cache and still take well under a
    millisecond, while a quick host-sized 1024 x 1024 would sit in L2 and measure the cache."""
    return cfg["norm_shape_arg"] or (8192, 4096)


def bench_device(cfg, backend, results, ratios, baselines, notes, *, simulator: bool = False) -> None:
    """The device copy ceiling, the fused norms against it, and the matmul ladder against cuBLAS.

    Every GPU figure is timed with events on one queue (:func:`timing.time_on_queue`).  The
    ceiling for memory-bound kernels is a warmed 1 GiB device-to-device copy
    (:func:`timing.device_copy_rate`), counted as traffic: 2 x the bytes copied.
    In the simulator (``simulator=True``) the sizes are tiny and the numbers measure the
    simulator, not a GPU; the run only shows that the path works end to end.
    """
    from numba import cuda

    from vtnumba.kernels import (
        VARIANTS,
        fused_add_layer_norm,
        fused_add_rms_norm,
        gather_rows,
        matmul,
        matmul_cuda,
        peer_reduce_norm,
    )

    q = backend.create_queue("bench")
    rng = np.random.default_rng(2)
    repeat, inner, warmup = (1, 1, 1) if simulator else (cfg["repeat"], 5, 2)

    launch_bound = []  # (what, host us per call, device us per call)
    dead = None  # a rung's failure that left the device unusable: the ladder stops there

    def timed(fn, what=None):
        host_s = []
        st = time_on_queue(backend, q, fn, repeat=repeat, inner=inner, warmup=warmup, host_s=host_s)
        host = float(np.median(host_s))
        if what is not None and not simulator and host > st.median_s:
            launch_bound.append((what, host * 1e6, st.median_s * 1e6))
        return st

    try:
        # The ceiling first: everything memory-bound below is a fraction of it.
        copy = device_copy_rate(backend, q, 64 << 10 if simulator else 1 << 30, repeat=repeat)
        copy_gbs = copy.traffic_gbs
        results.append(schema.row("device_copy", copy.impl, copy.nbytes, "bytes", "GB/s (traffic)", copy_gbs,
                                  copy.stats))
        baselines["device copy traffic GB/s"] = copy_gbs
        notes.extend(copy.notes)
        notes.append(f"device copy: {copy.nbytes / 2**20:.0f} MiB with {copy.impl} on the benchmark's queue, "
                     "warmed up, timed with events; traffic = 2 x bytes copied")

        rows, h = (4, 64) if simulator else _device_norm_shape(cfg)
        y, res, peer = (cuda.to_device(rng.standard_normal((rows, h), dtype=np.float32)) for _ in range(3))
        w, bias, nb = (cuda.to_device(rng.standard_normal(h, dtype=np.float32)) for _ in range(3))
        out, new_res = cuda.device_array((rows, h), np.float32), cuda.device_array((rows, h), np.float32)
        backend.order_after_default_stream(q)  # to_device copies go through the legacy stream
        elem = rows * h * 4  # bytes of one [rows, h] float32 array
        # (case, impl, call, traffic): traffic = bytes read + bytes written, as for the copy.
        memory_bound = [
            ("rmsnorm", "vtnumba-fused-cuda", 4 * elem,  # read y, residual; write new_residual, out
             lambda: fused_add_rms_norm(y, res, w, EPS, bias=bias, out=out, new_residual=new_res, queue=q)),
            ("layernorm", "vtnumba-fused-cuda", 4 * elem,
             lambda: fused_add_layer_norm(y, res, w, nb, EPS, bias=bias, out=out, new_residual=new_res, queue=q)),
            ("peer_reduce_rmsnorm_tp2", "vtnumba-fused-cuda", 5 * elem,  # + the second source
             lambda: peer_reduce_norm([y, peer], bias, res, w, None, EPS, out, new_res, queue=q)),
            ("gather_rows", "vtnumba-cuda", 2 * elem,  # read src, write one destination
             lambda: gather_rows(y, [out], 0, queue=q)),
        ]
        for case, impl, traffic, fn in memory_bound:
            st = timed(fn, case)
            gbs = traffic / st.median_s / 1e9
            results.append(schema.row(case, impl, rows * h, "elements", "GB/s", gbs, st, shape=(rows, h)))
            kind = "fused cuda" if case != "gather_rows" else "cuda"
            ratios[f"{case} {kind} GB/s / device copy traffic GB/s"] = gbs / copy_gbs

        # The aim (issue 17) is stated at 4096^3; --quick keeps a GPU run to seconds, and
        # --device-matmul-sizes asks for the aim's size in a quick run (scripts/gpu_check.sh).
        mm_sizes = cfg.get("device_mm_sizes") or ([16] if simulator else ([1024] if cfg["quick"] else [2048, 4096]))
        handle = None if simulator else stream_handle(q)
        unavailable = matmul_cuda.unavailable_rungs()  # e.g. async before Ampere: said once, then skipped
        notes += [f"matmul {variant}: not run ({why})" for variant, why in unavailable.items()]
        for n in mm_sizes:
            if dead is not None:
                break
            host_a = rng.standard_normal((n, n), dtype=np.float32)
            host_b = rng.standard_normal((n, n), dtype=np.float32)
            a, b = cuda.to_device(host_a), cuda.to_device(host_b)
            c = cuda.device_array((n, n), np.float32)
            # Every rung's answer is checked before it may count: a fast wrong kernel must not
            # "meet" the aim.  A few random rows of C against float64 on the host.
            check_rows = np.sort(rng.choice(n, size=min(n, 8), replace=False))
            expected = host_a[check_rows].astype(np.float64) @ host_b.astype(np.float64)
            flops = 2.0 * n ** 3
            base = None if simulator else _baseline_gemm(n, handle, backend.device.index)
            backend.order_after_default_stream(q)  # the inputs' copies (and CuPy's) ran on the legacy stream
            base_gflops = None
            if base is not None:
                name, call = base
                try:
                    st = timed(call)
                except Exception as exc:  # noqa: BLE001 - the ladder's own rows still count
                    notes.append(f"matmul n={n} {name}: FAILED ({type(exc).__name__}: {exc}); no cuBLAS ratio")
                else:
                    base_gflops = flops / st.median_s / 1e9
                    results.append(schema.row("matmul_fp32", name, n, "M=N=K", "GFLOP/s", base_gflops, st))
            best = None
            for variant in VARIANTS:  # ladder order: one row per rung
                if variant == "naive" and n > 2048:
                    continue  # seconds of naive matmul per size add nothing to the ladder's story
                if variant in unavailable:
                    continue
                try:
                    st = timed(lambda: matmul(a, b, out=c, queue=q, variant=variant))
                    got = np.stack([c[int(i)].copy_to_host() for i in check_rows]).astype(np.float64)
                except Exception as exc:  # noqa: BLE001 - reported; the figures measured so far still count
                    if _device_still_usable():
                        # Refused, or wrong in Python: the GPU is fine, the other rungs and sizes go on.
                        notes.append(f"matmul n={n} {variant}: FAILED ({type(exc).__name__}: {exc})")
                        continue
                    notes.append(f"matmul n={n} {variant}: FAILED ({type(exc).__name__}: {exc}); the device is "
                                 "unusable after it, the ladder stops")
                    dead = exc
                    break
                gflops = flops / st.median_s / 1e9
                results.append(schema.row("matmul_fp32", f"vtnumba-{variant}", n, "M=N=K", "GFLOP/s", gflops, st))
                err = float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
                if not err <= 1e-4:  # (NaN fails too)
                    notes.append(f"matmul n={n} {variant}: WRONG RESULT (max error {err:.2g} of the largest "
                                 "element, on 8 sampled rows): left out of 'best rung'")
                    continue
                if best is None or gflops > best[1]:
                    best = (variant, gflops)
                if base_gflops is not None:
                    ratios[f"matmul_fp32 n={n} {variant} / cuBLAS"] = gflops / base_gflops
            if base_gflops is not None and best is not None:
                ratios[f"matmul_fp32 n={n} best rung ({best[0]}) / cuBLAS"] = best[1] / base_gflops
        if not simulator and base is None:
            notes.append("no CuPy or torch: ladder not compared with cuBLAS")
        notes.append("matmul rungs: each answer checked against float64 on 8 sampled rows of C (max error <= 1e-4 of "
                     "the largest element) before it may be the 'best rung'")
        notes.append("GPU rows are device time: the queue is held until a sample's calls are all queued, so the "
                     "host's launch work is not in the figure (see timing.time_on_queue)")
        for what, host_us, dev_us in launch_bound:
            notes.append(f"{what}: launch-bound -- the host needs {host_us:.0f} us to launch one call, the device "
                         f"{dev_us:.0f} us to run it; back to back, calls come no faster than the host launches them")
    finally:
        try:
            backend.destroy_queue(q)
        except Exception:  # noqa: BLE001 - the device died in a rung (reported above); keep the results
            if dead is None:
                raise


def _ptxas_cache_path(cmd: list[str]) -> str:
    """Where the report of ``cmd`` is kept: compiling every kernel for two GPU generations takes
    minutes on a laptop, and the report changes only with the kernels' source and the
    compilers -- so it is keyed by a hash of both (and of the command), under ``out/``."""
    import hashlib
    import importlib.metadata
    import os

    from vtnumba.bench.runner import OUT_DIR
    from vtnumba.kernels.ptx import kernel_source_files

    h = hashlib.sha256(" ".join(cmd[1:]).encode())
    for path in kernel_source_files():
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    for dist in ("numba", "numba-cuda", "cuda-bindings", "cuda-toolkit", "nvidia-nvjitlink", "nvidia-cuda-nvcc",
                 "nvidia-cuda-nvrtc"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    ptxas = shutil.which("ptxas")  # (the fallback assembler: a toolkit installed or upgraded is another key)
    if ptxas:
        h.update(f"{ptxas}@{os.stat(ptxas).st_mtime_ns}".encode())
    return os.path.join(OUT_DIR, "ptxas-cache", f"{h.hexdigest()[:24]}.json")


def _ptxas_resources(notes) -> list[dict]:
    """Registers / shared memory / spills per kernel, from a subprocess without the simulator
    (or from the last such report, when neither the kernels nor the compilers changed)."""
    import json
    import os
    import subprocess
    import sys

    from vtnumba.kernels.ptx import find_nvdisasm, nvjitlink_available

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    # With nvdisasm too, where the spills land (the main loop's share of them).
    sass = ["--sass"] if nvjitlink_available() and find_nvdisasm() else []
    cmd = [sys.executable, "-m", "vtnumba.kernels.ptx", "--cc", "80", "90", "--ptxas", *sass]
    cache = _ptxas_cache_path(cmd)
    try:
        with open(cache) as f:
            report = json.load(f)
        notes.append(f"ptxas report from {cache} (the kernels' source and the compilers are unchanged since)")
    except (OSError, ValueError):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        try:
            report = json.loads(proc.stdout)
        except ValueError:
            notes.append(f"ptxas report failed: {proc.stderr.strip()[-300:]}")
            return []
        # Kept only when every kernel got its report: a failure (no assembler, a broken
        # install) must be tried again next time, not read back until the kernels change.
        def failed(e: dict) -> bool:
            parts = [e, e.get("ptxas") or {"error": "no report"}, e.get("sass") or {}]
            return any(p.get("error") for p in parts)

        if proc.returncode == 0 and not any(failed(e) for e in report.get("results", [])):
            try:  # (best effort: an unwritable out/ only costs the next run the compile)
                os.makedirs(os.path.dirname(cache), exist_ok=True)
                with open(f"{cache}.{os.getpid()}", "w") as f:
                    json.dump(report, f)
                os.replace(f"{cache}.{os.getpid()}", cache)
            except OSError:
                pass
    out = []
    for e in report["results"]:
        usage = e.get("ptxas") or {}
        out.append({"kernel": e["name"], "sig": e["sig"], "cc": e["cc"], **usage})
        hot = (e.get("sass") or {}).get("hot_loop")
        if hot:  # the main loop's spill traffic per turn, beside its FMAs
            out[-1].update(main_loop_spill_loads=hot["spill_loads"], main_loop_spill_stores=hot["spill_stores"],
                           main_loop_fma=hot["fma"], main_loop_instructions=hot["instructions"])
        if usage.get("version_lowered"):
            note = f"ptxas: PTX .version lowered to {usage['version_lowered']} for the resource report only"
            if note not in notes:
                notes.append(note)
    notes.extend(_resource_notes(out))
    return out


def _resource_notes(resources: list[dict], cc: str = "9.0") -> list[str]:
    """One printable line per kernel (its first signature, i.e. float32, at ``cc``): what the
    table printer shows of ``kernel_resources``."""
    lines, seen = [], set()
    for e in resources:
        if e["cc"] != cc or e["kernel"] in seen:
            continue
        seen.add(e["kernel"])
        if e.get("registers") is None:
            lines.append(f"ptxas sm_{cc.replace('.', '')} {e['kernel']}: {e.get('error', 'no report')[:120]}")
            continue
        where = ""
        if e["spill_store_bytes"] and "main_loop_spill_loads" in e:
            where = (f"; main loop: {e['main_loop_spill_loads']} spill reloads and {e['main_loop_spill_stores']} "
                     f"stores per turn, beside {e['main_loop_fma']} FMAs in {e['main_loop_instructions']} "
                     "instructions")
        lines.append(f"ptxas sm_{cc.replace('.', '')} {e['kernel']}: {e['registers']} registers, "
                     f"{e['smem_bytes']} B shared memory, spills {e['spill_store_bytes']} B stored / "
                     f"{e['spill_load_bytes']} B loaded{where}")
    return lines


# ---------------------------------------------------------------------------- entry point
def run(args) -> dict:
    """Measure every kernel of the ladder beside its stock baseline and return the suite's results."""
    cfg = _settings(args)
    target = current_target().name
    results: list = []
    ratios: dict = {}
    notes: list = []
    memcpy = memcpy_bandwidth_gbs()
    baselines = {"memcpy GB/s (bytes copied)": memcpy, "memcpy traffic GB/s (read + write)": 2 * memcpy}
    notes.append("GB/s counts traffic (bytes read + bytes written); see vtnumba.bench.kernels docstring")

    _bench_host_norms(cfg, results, ratios, baselines)
    from vtnumba.kernels._common import PARALLEL_MIN_BYTES, host_threads

    notes.append(f"host fused norms: calls moving >= {PARALLEL_MIN_BYTES >> 20} MiB split their rows over "
                 f"{host_threads()} thread(s) (this process's share of the cores, as BLAS); numpy's elementwise "
                 "ops use one; their 'memcpy traffic' ceiling is np.copyto split over the same threads the same "
                 "way (the one-thread copy is the row beside it)")
    _bench_host_matmul(cfg, results, ratios)

    if target == "cuda":
        from vtnumba.backend.default import default_backend

        bench_device(cfg, default_backend(), results, ratios, baselines, notes)
    elif target == "cudasim":
        notes.append("cudasim: the CUDA kernels are tested, not timed, in the simulator; host references measured")
    if target != "cuda" and cfg["device_mm_sizes"]:
        notes.append(f"--device-matmul-sizes applies on a GPU (target cuda); on {target} no device ladder runs")

    suite = schema.suite("kernels", target, 1, results, ratios, baselines, notes)
    if getattr(args, "ptxas", False):
        from vtnumba.kernels.ptx import nvjitlink_available

        if nvjitlink_available() or shutil.which("ptxas"):
            suite["kernel_resources"] = _ptxas_resources(suite["notes"])
        else:
            suite["notes"].append("--ptxas: neither nvJitLink nor a ptxas on PATH; resource report skipped")
    return suite

