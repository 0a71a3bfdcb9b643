"""The tiled matmul ladder
=======================

What it does: meets the projection at the heart of TPSP, ``partial = x @ W.T``, first as
the host reference that the ``cpu`` target runs (numpy's BLAS), timed across sizes, then
as the rungs of the CUDA ladder in :mod:`vtnumba.kernels.matmul_cuda` -- ``naive`` (one
thread per output), ``smem`` (shared-memory tiles), ``regtile`` (an 8 x 8 register tile
per thread), and whatever rungs come after -- shown in full, compiled to PTX to count what
each rung buys, and (on ``cudasim`` and ``cuda``) checked against the reference and timed.
Last, ``linear_rows_to``: the same matmul with its output rows routed to one destination
per rank, which is how TPSP's matmul writes straight into the peers' inboxes.

**Builds on:** :doc:`03_caching_allocator` (device memory and queues) -- and the arrays a
kernel takes from :doc:`02_async_copies_pinned`.  Next: :doc:`05_fused_add_rmsnorm`.

Run it::

    mpiexec -n 2 python tutorials/04_matmul_ladder.py                 # default target; on cpu: host path + PTX
    mpiexec -n 2 python tutorials/04_matmul_ladder.py --target cudasim  # the ladder, tiny shapes
    mpiexec -n 2 python tutorials/04_matmul_ladder.py --target cuda     # the ladder, GFLOP/s
    python tutorials/04_matmul_ladder.py                              # one rank

Key insight: every step of the ladder computes the same numbers; what changes is how many
multiply-adds each load from memory feeds.  The naive kernel is bound by memory, shared
tiles cut global traffic by the tile width, and register tiles cut shared-memory traffic
until the arithmetic units are the limit.
"""

# %%
# Setup
# -----
#
# The target is chosen first (before anything imports ``numba.cuda``), and before
# numpy: importing ``vtnumba.apps.tutorial`` shares the cores between the local MPI ranks,
# which numpy's BLAS reads once, when it loads.  Each rank draws its own matrices, so each rank checks
# its own results; rank 0 narrates.
from vtnumba.apps.tutorial import as_rate, start, time_calls

lesson = start("04 the tiled matmul ladder")

import numpy as np  # noqa: E402

from vtnumba.bench.timing import measure, stats_from_times  # noqa: E402
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
# The contract and the host reference
# -----------------------------------
#
# ``matmul(a, b, bias)`` is ``a [M, K] @ b [K, N]
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
# Bad input
# ---------
#
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
# The host path across sizes
# --------------------------
#
# How fast is the host path?  The wrapper adds only argument checks to numpy's ``a @ b``,
# so its line should lie on numpy's wherever a product takes more than a few hundred
# microseconds (from about 256^3); below that the wrapper's 10-20 microseconds of checks are
# a visible share.  Both are timed in interleaved rounds
# (both ranks time at once and share the machine; under ``mpiexec -n 2`` each rank's BLAS
# has half the cores, so the numbers are per rank).  The figure shows GFLOP/s -- ``2 S^3``
# floating-point operations per ``S x S`` product -- with the median and the p10-p90
# spread of the calls.
SIZES = (64, 128, 256, 512, 1024) if target != "cudasim" else (64, 128, 256)
host_series = {"numpy a @ b (BLAS)": [], "vtnumba matmul (host reference)": []}
for S in SIZES:
    A = rng.standard_normal((S, S), dtype=np.float32)
    B = rng.standard_normal((S, S), dtype=np.float32)
    C = np.empty((S, S), np.float32)
    calls = max(3, min(20, int(2e8 // (2 * S ** 3))))  # small sizes: more calls for a stable median
    times = {"numpy": [], "vtnumba": []}
    for _ in range(4):
        times["numpy"] += time_calls(lambda: np.matmul(A, B, out=C), calls)
        times["vtnumba"] += time_calls(lambda: matmul(A, B, out=C), calls)
    st_np, st_vt = stats_from_times(times["numpy"]), stats_from_times(times["vtnumba"])
    host_series["numpy a @ b (BLAS)"].append((S, as_rate(st_np, 2 * S ** 3)))
    host_series["vtnumba matmul (host reference)"].append((S, as_rate(st_vt, 2 * S ** 3)))
    lesson.say(f"host, {S:>4}^3: numpy {gflops(S, S, S, st_np.median_s):6.1f} GFLOP/s, vtnumba matmul "
               f"{gflops(S, S, S, st_vt.median_s):6.1f} GFLOP/s (time ratio numpy/vtnumba "
               f"{st_np.median_s / st_vt.median_s:.2f})")
lesson.check(np.allclose(C, A @ B, rtol=1e-4, atol=1e-3), "the timed host matmul is still right")
lesson.perf_plot("host_matmul.png", "The host path across sizes (rank 0): vtnumba's matmul on numpy arrays is "
                 "numpy's BLAS plus argument checks, so the lines meet once a product takes more than a few "
                 "hundred microseconds; below that the checks are a visible share of each call.", host_series,
                 xlabel="square matrix size S (S x S times S x S)",
                 ylabel="GFLOP/s per rank", title="04: host matmul, numpy vs vtnumba", xfmt=lambda s: f"{s}^3")

# %%
# The ladder
# ----------
#
# Here are the kernels, straight from :mod:`vtnumba.kernels.matmul_cuda`, in the order
# of the ladder.  Each fixes the main cost of the one before: ``naive`` reads every
# operand from global memory (``2 K`` loads per ``K`` multiply-adds); ``smem`` stages a
# tile of A and B in shared memory, so each global element is loaded once per block; and
# ``regtile`` has each thread keep an 8 x 8 block of outputs in registers, so 16 shared
# loads feed 64 multiply-adds.  The rungs after it -- ``wide``, ``warptile``, ``dbuf`` and
# ``async`` -- each state their one idea in their docstring.  Every bound is checked, so
# any M, N, K works.
#
# .. vt-source:: vtnumba.kernels.matmul_cuda
#    :cuda-kernels:
#
# On the ``cpu`` target there is no device, so these kernels cannot run -- but they can
# still be *compiled*: ``cuda.compile_ptx`` runs numba's real front end and NVVM without a
# GPU.  Counting instructions in each rung's PTX shows what it buys: the float
# multiply-adds (``fma``) per load from shared memory go from 0.5 (``smem``: two shared
# loads per multiply-add) to 4 (``regtile``: 8 + 8 loads feed an 8 x 8 outer product), and
# to 16 from ``wide`` on (each shared load moves 4 floats).  ``wide`` and above also write
# their k-step out 8 times instead of looping over it -- numba has no ``#pragma unroll`` --
# which is why their code holds 512 multiply-adds where ``regtile``'s holds 64.  The counts
# are of the code, not of what runs; the ratio is the point.  This needs the real
# ``numba.cuda`` (not the simulator) and NVVM from ``pip install numba-cuda[cu13]``; only
# rank 0 compiles, and the lesson prints the reason if it cannot.  The rungs are whatever
# ``matmul_cuda.PTX_SIGNATURES`` lists, so a new rung shows up here by itself.
if target != "cudasim" and rank == 0:
    try:
        from vtnumba.kernels import matmul_cuda
        from vtnumba.kernels.ptx import compile_kernel_ptx

        counts, failed = {}, {}
        for name, kernel, sig in matmul_cuda.PTX_SIGNATURES:
            if "float16" in sig or name in counts or name in failed:
                continue
            try:
                ptx = compile_kernel_ptx(kernel, sig, (8, 0))  # as launched: with the kernel's own options
            except Exception as exc:  # noqa: BLE001 - one rung that cannot compile here does not stop the others
                failed[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:90]}"
                continue
            counts[name] = {op: ptx.count(op) for op in ("fma.rn.f32", "ld.shared", "ld.global")}
        lesson.say("PTX of each ladder rung (float32 inputs, sm_80), instructions in the code:")
        lesson.say(f"  {'rung':<10} {'fma.f32':>8} {'ld.shared':>10} {'ld.global':>10}   fma per shared load")
        for name, c in counts.items():
            ratio = f"{c['fma.rn.f32'] / c['ld.shared']:.1f}" if c["ld.shared"] else "- (no shared memory)"
            lesson.say(f"  {name:<10} {c['fma.rn.f32']:>8} {c['ld.shared']:>10} {c['ld.global']:>10}   {ratio}")
        for name, why in failed.items():
            lesson.say(f"  {name:<10} (cannot be compiled without a GPU here: {why})")

        def draw_ptx(plt):
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
            names = list(counts)
            x = np.arange(len(names))
            for k, (op, label) in enumerate((("fma.rn.f32", "fma.f32"), ("ld.shared", "ld.shared"),
                                            ("ld.global", "ld.global"))):
                ax1.bar(x + (k - 1) * 0.27, [counts[n][op] for n in names], width=0.27, label=label)
            ax1.set_xticks(x, names)
            ax1.set_ylabel("instructions in the PTX")
            ax1.set_title("what each rung's code contains", fontsize=9)
            ax1.legend(fontsize=8)
            ratios = [counts[n]["fma.rn.f32"] / counts[n]["ld.shared"] if counts[n]["ld.shared"] else 0.0
                      for n in names]
            ax2.bar(x, ratios, color="#2ca02c")
            for xi, r, n in zip(x, ratios, names):
                ax2.text(xi, r, f"{r:.1f}" if counts[n]["ld.shared"] else "no smem", ha="center", va="bottom",
                         fontsize=8)
            ax2.set_xticks(x, names)
            ax2.set_ylabel("fma per shared-memory load")
            ax2.set_title("arithmetic fed by each shared load", fontsize=9)
            fig.suptitle("04: the matmul ladder compiled to PTX (sm_80, float32), no GPU needed", fontsize=10)
            fig.tight_layout()
            return fig

        if counts:
            lesson.figure("ladder_ptx.png", "The ladder's rungs compiled to PTX on this machine: instruction "
                          "counts per rung (left) and multiply-adds per shared-memory load (right) -- the number "
                          "the register tile raises eightfold over the shared-memory tile.", draw_ptx)
    except Exception as exc:  # noqa: BLE001 - an optional look, never the lesson's result
        lesson.say(f"(cannot compile to PTX here: {type(exc).__name__}: {str(exc)[:120]})")

# %%
# The ladder on a device
# ----------------------
#
# On ``cudasim`` and ``cuda`` the same ``matmul`` call takes device arrays and runs the
# rung chosen by ``variant`` -- every name in ``vtnumba.kernels.VARIANTS``.  Every rung is
# checked against the host reference on the odd shape, then timed across sizes.  In the
# simulator each CUDA thread is a Python thread, so the shapes stay tiny and the times
# say nothing about a GPU (the output and the figure say so); on a real GPU the sizes go
# up to 4096 (rank 0 only: under ``mpiexec`` the ranks may share one GPU, and timing both
# at once would halve each).
if on_device:
    from numba import cuda

    from vtnumba.kernels.matmul_cuda import unavailable_rungs

    # A rung this GPU cannot run (async before Ampere: no cp.async) is named and left out.
    left_out = unavailable_rungs()
    for v, why in left_out.items():
        lesson.say(f"rung {v} left out on this GPU: {why}")
    rungs = [v for v in VARIANTS if v not in left_out]
    da, db, dbias = cuda.to_device(a), cuda.to_device(b), cuda.to_device(bias)
    lesson.say(f"device ladder on [{M}x{K}] @ [{K}x{N}] + bias ({target}), rungs {', '.join(rungs)}:")
    errs = {}
    for v in rungs:
        out = cuda.device_array((M, N), np.float32)
        matmul(da, db, dbias, out=out, variant=v)
        errs[v] = rel_err(out.copy_to_host(), truth)
        diff = float(np.max(np.abs(out.copy_to_host() - c_host)))
        lesson.say(f"  {v:<8} rel. error vs float64 {errs[v]:.1e}, max |diff| vs host {diff:.1e}")
    lesson.check(all(e < 1e-5 for e in errs.values()), "every ladder rung == float64 (and the host reference)")

    big_ok = True
    if rank == 0:
        dev_sizes = (8, 16) if target == "cudasim" else (256, 512, 1024, 2048, 4096)
        ladder = {v: [] for v in rungs}
        lesson.say(f"  timed on rank 0{lesson.sim_note}:")
        for L in dev_sizes:
            hA = rng.standard_normal((L, L), dtype=np.float32)
            hB = rng.standard_normal((L, L), dtype=np.float32)
            dA, dB, dC = cuda.to_device(hA), cuda.to_device(hB), cuda.device_array((L, L), np.float32)
            ref = matmul(hA, hB).astype(np.float64)  # the host reference (BLAS) for the check
            for v in rungs:
                # (A warm-up call compiles the kernel on a GPU; the simulator compiles nothing.)
                st = measure(lambda v=v: (matmul(dA, dB, out=dC, variant=v), cuda.synchronize()),
                             repeat=1 if target == "cudasim" else 10, warmup=int(target == "cuda"))
                err = rel_err(dC.copy_to_host(), ref)
                big_ok &= err < 1e-5
                ladder[v].append((L, as_rate(st, 2 * L ** 3)))
                lesson.say(f"  {L:>4}^3 {v:<8} {gflops(L, L, L, st.median_s):10.3g} GFLOP/s  ({st.median_s * 1e3:.2f} ms, "
                           f"rel. error vs host {err:.1e})")
        gpu = "numba's simulator" if target == "cudasim" else cuda.get_current_device().name
        gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
        lesson.perf_plot("ladder.png", f"The ladder's rungs across sizes on {gpu} (rank 0).", ladder,
                         xlabel="square matrix size S", ylabel="GFLOP/s", title=f"04: the matmul ladder on {target}",
                         xfmt=lambda s: f"{s}^3")
    lesson.check(big_ok, "every rung is right at every timed size")
else:
    lesson.say("cpu target: no device, so the ladder does not run here; the host path above is what the cpu "
               "target uses (try --target cudasim to run the kernels in numba's simulator)")

# %%
# The TPSP epilogue: linear_rows_to
# ---------------------------------
#
# In TPSP, token rows ``[r*R, (r+1)*R)`` of the
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

lesson.say("done")

# %%
# Expected output
# ---------------
#
# * Relative errors around ``1e-7`` (float32 rounding) for the host path and every rung.
# * The host figure: the numpy and vtnumba lines meet from about 256^3 up; GFLOP/s grow with the
#   size until BLAS is compute-bound (per rank, sharing the machine with the other rank).
# * On ``cpu``, the PTX table and figure: ``fma per shared load`` 0.5 for ``smem`` and 4.0
#   for ``regtile`` (``naive`` has no shared memory).  On ``cudasim``, one line per rung at
#   8 and 16 -- labelled as simulator times, which mean nothing for a GPU.  On ``cuda``,
#   naive -> smem -> regtile climb by several times at 2048 and up; the rungs above regtile
#   have not been timed on a GPU yet (``docs/benchmarks.rst``).
# * The routed rows of ``linear_rows_to`` match ``linear()`` and the padding rows are zero.
#
# Common issues
# -------------
#
# * ``TypeError: arrays must all be numpy arrays or all device arrays`` -- a numpy array
#   mixed with device arrays.  vtnumba refuses it: numba would silently copy the numpy
#   array to the device and back, which breaks peer buffers and queue order.  Use
#   ``cuda.to_device`` (or a backend buffer's ``view``) for every argument.
# * The simulator is slow (a few thousand to a few tens of thousands of CUDA threads per
#   second, depending on the kernel and the machine): keep shapes tiny there; a 256 x 256
#   matmul would take minutes.
# * GFLOP/s from one call on a GPU include the first-call compilation: warm up first
#   (``measure(..., warmup=1)`` does).
# * ``cuda.compile_ptx`` fails with the simulator on (``NUMBA_ENABLE_CUDASIM=1``) and
#   without NVVM: install ``numba-cuda[cu13]``.
#
# Try next
# --------
#
# 1. Change ``TILE`` in :mod:`vtnumba.kernels.matmul_cuda` from 16 to 8 and run again
#    (``--target cudasim`` to run it): the results stay right, because every bound is
#    checked, and the PTX table's ``fma per shared load`` of ``smem`` stays at 0.5 -- the
#    tile size sets how often a block goes to *global* memory, not how often a thread goes
#    to shared memory.  What does the register tile change instead?
# 2. Add a rung: copy ``matmul_smem_kernel``, give each thread two outputs along ``j``,
#    register it in ``KERNELS`` and ``launch_config`` (``matmul_cuda.py``) and in ``LADDER``
#    (``matmul.py``: the rungs in order, with their one idea), and run this lesson --
#    the kernel listing, the PTX table and the device figure pick it up by themselves.
# 3. Read what the registers cost, without a GPU:
#    ``NUMBA_ENABLE_CUDASIM=0 python -m vtnumba.kernels.ptx --cc 90 --ptxas --sass --only dbuf async``.
#    Both rungs hit the 128 registers their launch bounds allow; only ``async`` spills, and
#    ``hot_loop`` says where: a few dozen reloads per k-step beside its 512 FMAs, none among
#    them.  Change the launch bounds in ``_TWO_BLOCKS_PER_SM`` (``matmul_cuda.py``) to
#    ``(_NTHREADS, 1)`` and read it again: the spills vanish at about 210 registers a
#    thread.  How many 256-thread blocks fit on an SM of 65,536 registers now, and what
#    does a block waiting at its barrier then leave the SM to do?
