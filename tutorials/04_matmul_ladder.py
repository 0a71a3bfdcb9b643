"""The tiled matmul ladder
=======================

What it does: meets the projection at the heart of TPSP, ``partial = x @ W.T``, first as
the host reference that the ``cpu`` target runs (numpy's BLAS), then as the three steps of
the CUDA ladder in :mod:`vtnumba.kernels.matmul_cuda` -- ``naive`` (one thread per
output), ``smem`` (shared-memory tiles) and ``regtile`` (an 8 x 8 register tile per
thread) -- each checked against the reference and timed.  Last, ``linear_rows_to``: the
same matmul with its output rows routed to one destination per rank, which is how TPSP's
matmul writes straight into the peers' inboxes.

Run it::

    mpiexec -n 2 python tutorials/04_matmul_ladder.py                 # cpu: host path + PTX
    mpiexec -n 2 python tutorials/04_matmul_ladder.py --target cudasim  # the ladder, tiny shapes
    mpiexec -n 2 python tutorials/04_matmul_ladder.py --target cuda     # the ladder, GFLOP/s
    python tutorials/04_matmul_ladder.py                              # one rank

Key insight: every step of the ladder computes the same numbers; what changes is how many
multiply-adds each load from memory feeds.  The naive kernel is bound by memory, shared
tiles cut global traffic by the tile width, and register tiles cut shared-memory traffic
until the arithmetic units are the limit.
"""

# %%
# Setup.  The target is chosen first (before anything imports ``numba.cuda``), and before
# numpy: importing vtnumba shares the cores between the local MPI ranks, which numpy's
# BLAS reads once, when it loads.  Each rank draws its own matrices, so each rank checks
# its own results; rank 0 narrates.
from vtnumba.apps.tutorial import start

lesson = start("04 the tiled matmul ladder")

import numpy as np  # noqa: E402

from vtnumba.bench.timing import measure  # noqa: E402
from vtnumba.kernels import VARIANTS, linear, linear_rows_to, matmul  # noqa: E402

rank, target = lesson.rank, lesson.target
on_device = target in ("cudasim", "cuda")
rng = np.random.default_rng(40 + rank)


def rel_err(got, truth) -> float:
    """max |got - truth| / max |truth|: the error in units of the result's scale."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - truth)) / np.max(np.abs(truth)))


def gflops(m, n, k, seconds) -> float:
    return 2.0 * m * n * k / seconds / 1e9


# %%
# 1. The contract and the host reference.  ``matmul(a, b, bias)`` is ``a [M, K] @ b [K, N]
# (+ bias)``; ``linear(x, w, bias)`` is ``x [M, K] @ w.T`` for a weight ``w [N, K]`` in the
# nn.Linear layout -- without transposing ``w`` (``w.T`` is a view, BLAS reads it as is).
# Inputs are float32, or float16 with float32 accumulation; the output is float32.  On
# numpy arrays the functions run the host reference, which *is* numpy's BLAS: the design
# says "do not hand-write what numpy does".  The truth is float64 numpy.
M, K, N = 33, 40, 37          # odd on purpose: no size is a multiple of any tile
a = rng.standard_normal((M, K), dtype=np.float32)
b = rng.standard_normal((K, N), dtype=np.float32)
bias = rng.standard_normal(N, dtype=np.float32)
w = np.ascontiguousarray(b.T)  # the same weights in the [N, K] layout
truth = a.astype(np.float64) @ b.astype(np.float64) + bias

c_host = matmul(a, b, bias)
c_lin = linear(a, w, bias)
c_half = matmul(a.astype(np.float16), b.astype(np.float16), bias.astype(np.float16))
truth_half = (a.astype(np.float16).astype(np.float64) @ b.astype(np.float16).astype(np.float64)
              + bias.astype(np.float16))
lesson.say(f"host reference, [{M}x{K}] @ [{K}x{N}] + bias: relative error {rel_err(c_host, truth):.1e} (float32), "
           f"linear(x, w.T layout) {rel_err(c_lin, truth):.1e}, float16 inputs {rel_err(c_half, truth_half):.1e}")
lesson.check(rel_err(c_host, truth) < 1e-6 and rel_err(c_lin, truth) < 1e-6, "host matmul and linear == float64")
lesson.check(c_half.dtype == np.float32 and rel_err(c_half, truth_half) < 1e-6,
             "float16 inputs accumulate (and return) float32")

# %%
# Bad input is refused at the boundary with a message that names the argument -- a kernel
# would otherwise read out of bounds or compute garbage.
try:
    matmul(a, w)  # [33, 40] @ [37, 40]: K does not match
except ValueError as exc:
    lesson.say(f"matmul(a, w) with mismatched K -> ValueError: {exc}")
try:
    matmul(a, b, variant="tensorcore")
except ValueError as exc:
    lesson.say(f"variant='tensorcore' -> ValueError: {exc}")

# %%
# 2. How fast is the host path?  At 1024 x 1024 x 1024 the wrapper adds only argument
# checks to numpy's ``a @ b``, so the ratio should be close to 1.  (Under ``mpiexec -n 2``
# each rank's BLAS has half the cores; the numbers are per rank.)
S = 1024 if target != "cudasim" else 256
A = rng.standard_normal((S, S), dtype=np.float32)
B = rng.standard_normal((S, S), dtype=np.float32)
C = np.empty((S, S), np.float32)
# Interleaved rounds, best median of each: both ranks time at once and share the machine.
t_np, t_vt = [], []
for _ in range(5):
    t_np.append(measure(lambda: np.matmul(A, B, out=C), repeat=3, warmup=1).median_s)
    t_vt.append(measure(lambda: matmul(A, B, out=C), repeat=3, warmup=1).median_s)
t_np, t_vt = min(t_np), min(t_vt)
lesson.say(f"host, {S}^3: numpy a @ b {gflops(S, S, S, t_np):.1f} GFLOP/s, vtnumba matmul "
           f"{gflops(S, S, S, t_vt):.1f} GFLOP/s (time ratio numpy/vtnumba {t_np / t_vt:.2f})")
lesson.check(np.allclose(C, A @ B, rtol=1e-4, atol=1e-3), "the timed host matmul is still right")

# %%
# 3. The ladder.  On the ``cpu`` target there is no device, so the ``@cuda.jit`` kernels
# cannot run -- but they can still be *compiled*: ``cuda.compile_ptx`` runs numba's real
# front end and NVVM without a GPU.  Counting instructions in each kernel's PTX shows what
# each step buys: the number of float multiply-adds (``fma``) per load from shared memory
# goes from 0.5 (``smem``: two shared loads per multiply-add) to 4 (``regtile``: 8 + 8
# loads feed an 8 x 8 outer product).  The counts are of the code, not of what runs
# (loops are unrolled by different amounts); the ratio is the point.  This needs the real
# ``numba.cuda`` (not the simulator) and NVVM from ``pip install numba-cuda[cu13]``; only
# rank 0 compiles, and the lesson prints the reason if it cannot.
if target != "cudasim" and rank == 0:
    try:
        from numba import cuda

        from vtnumba.kernels import matmul_cuda

        lesson.say("PTX of each ladder step (float32 inputs, sm_80), instructions in the code:")
        lesson.say(f"  {'step':<8} {'fma.f32':>8} {'ld.shared':>10} {'ld.global':>10}   fma per shared load")
        for name, kernel, sig in matmul_cuda.PTX_SIGNATURES:
            if "float16" in sig:
                continue
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(8, 0))
            fma, lds, ldg = (ptx.count(op) for op in ("fma.rn.f32", "ld.shared", "ld.global"))
            ratio = f"{fma / lds:.1f}" if lds else "- (no shared memory)"
            lesson.say(f"  {name:<8} {fma:>8} {lds:>10} {ldg:>10}   {ratio}")
    except Exception as exc:  # noqa: BLE001 - an optional look, never the lesson's result
        lesson.say(f"(cannot compile to PTX here: {type(exc).__name__}: {str(exc)[:120]})")

# %%
# On ``cudasim`` and ``cuda`` the same ``matmul`` call takes device arrays and runs the
# kernel chosen by ``variant``.  Every step is checked against the host reference on the
# odd shape (every bound is checked, so any M, N, K works).  In the simulator each CUDA
# thread is a Python thread, so the shape stays tiny and the timings say nothing about a
# GPU; on a real GPU a second, large shape is timed (on rank 0 only: under ``mpiexec`` the
# ranks may share one GPU, and timing both at once would halve each).
if on_device:
    from numba import cuda

    da, db, dbias = cuda.to_device(a), cuda.to_device(b), cuda.to_device(bias)
    lesson.say(f"device ladder on [{M}x{K}] @ [{K}x{N}] + bias ({target}):")
    errs = {}
    for v in VARIANTS:
        out = cuda.device_array((M, N), np.float32)
        st = measure(lambda out=out, v=v: matmul(da, db, dbias, out=out, variant=v), repeat=1,
                     warmup=int(target == "cuda"))
        errs[v] = rel_err(out.copy_to_host(), truth)
        diff = float(np.max(np.abs(out.copy_to_host() - c_host)))
        lesson.say(f"  {v:<8} rel. error vs float64 {errs[v]:.1e}, max |diff| vs host {diff:.1e}, "
                   f"{st.median_s * 1e3:8.1f} ms = {gflops(M, N, K, st.median_s):.2g} GFLOP/s")
    lesson.check(all(e < 1e-5 for e in errs.values()), "every ladder step == float64 (and the host reference)")

    big_ok = True
    if target == "cuda" and rank == 0:
        L = 2048
        hA = rng.standard_normal((L, L), dtype=np.float32)
        hB = rng.standard_normal((L, L), dtype=np.float32)
        dA, dB, dC = cuda.to_device(hA), cuda.to_device(hB), cuda.device_array((L, L), np.float32)
        ref = matmul(hA, hB)  # the host reference (BLAS) for the check
        gpu = cuda.get_current_device().name
        lesson.say(f"  timed at {L}^3 (rank 0, {gpu.decode() if isinstance(gpu, bytes) else gpu}):")
        for v in VARIANTS:
            st = measure(lambda v=v: matmul(dA, dB, out=dC, variant=v), repeat=5, warmup=1)
            err = rel_err(dC.copy_to_host(), ref.astype(np.float64))
            big_ok &= err < 1e-5
            lesson.say(f"  {v:<8} {gflops(L, L, L, st.median_s):9.0f} GFLOP/s  ({st.median_s * 1e3:.2f} ms, "
                       f"rel. error vs host {err:.1e})")
    if target == "cuda":  # every rank knows the target, so every rank joins this check
        lesson.check(big_ok, "the timed large shape is right too")
else:
    lesson.say("cpu target: no device, so the ladder does not run here; the host path above is what the cpu "
               "target uses (try --target cudasim to run the kernels in numba's simulator)")

# %%
# 4. The TPSP epilogue: ``linear_rows_to``.  In TPSP, token rows ``[r*R, (r+1)*R)`` of the
# partial sum belong to rank r (``R = ceil(T / tp)``), and rank r's inbox is a *different
# allocation* -- a peer's memory.  ``linear_rows_to(x, w, bias, dests, R)`` writes each
# destination's rows straight into it, so the reduce-scatter needs no separate scatter
# copy; the rows of the last destination past ``T`` are zero (padding).  Here the
# destinations are three ordinary arrays, as if ``tp = 3``, with ``T = 7`` tokens: R = 3,
# and the last destination holds one token and two zero rows.
T, tp = 7, 3
R = -(-T // tp)
x = rng.standard_normal((T, K), dtype=np.float32)
full = linear(x, w, bias)
dests = [np.full((R, N), np.nan, np.float32) for _ in range(tp)]  # NaN: any row not written shows
linear_rows_to(x, w, bias, dests, R)
for d, dest in enumerate(dests):
    real = max(0, min(R, T - d * R))
    sums = ", ".join(f"{v:7.2f}" for v in dest.sum(axis=1))
    lesson.say(f"  dest {d}: tokens {d * R}..{d * R + real - 1}, {R - real} zero row(s); row sums [{sums}]")
stacked = np.concatenate(dests)
# Compared with a tolerance, not bit for bit: BLAS may block a 3-row product differently
# from a 7-row one, which changes the float32 rounding (not the accuracy).
lesson.say(f"  max |routed - linear(x, w, bias)| = {np.max(np.abs(stacked[:T] - full)):.1e}")
truth_x = x.astype(np.float64) @ w.T.astype(np.float64) + bias
lesson.check(rel_err(stacked[:T], truth_x) < 1e-6 and not stacked[T:].any(),
             "the routed rows are linear()'s rows, the padding rows are zero (no NaN left)")
if on_device:
    from numba import cuda

    ddests = [cuda.to_device(np.full((R, N), np.nan, np.float32)) for _ in range(tp)]
    linear_rows_to(cuda.to_device(x), cuda.to_device(w), cuda.to_device(bias), ddests, R, variant="naive")
    dev_stacked = np.concatenate([d.copy_to_host() for d in ddests])
    lesson.check(rel_err(dev_stacked[:T], truth_x) < 1e-6 and not dev_stacked[T:].any(),
                 f"on {target} the kernel routes the same rows (one launch per destination)")

# %%
# Common issues:
#
# * ``TypeError: arrays must all be numpy arrays or all device arrays`` -- a numpy array
#   mixed with device arrays.  vtnumba refuses it: numba would silently copy the numpy
#   array to the device and back, which breaks peer buffers and queue order.  Use
#   ``cuda.to_device`` (or a backend buffer's ``view``) for every argument.
# * The simulator is slow (about 7,000 CUDA threads per second): keep shapes tiny there;
#   a 256 x 256 matmul would take minutes.
# * GFLOP/s from one call on a GPU include the first-call compilation: warm up first.
# * ``cuda.compile_ptx`` fails with the simulator on (``NUMBA_ENABLE_CUDASIM=1``) and
#   without NVVM: install ``numba-cuda[cu13]``.
lesson.say("done")
