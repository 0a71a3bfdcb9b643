"""Fused residual add + RMSNorm
============================

What it does: after every attention and MLP block a transformer adds the block's output
(and its bias) to the residual stream and normalises the sum.  This lesson writes that
step in plain numpy, then calls vtnumba's fused version -- ``fused_add_rms_norm`` and
``fused_add_layer_norm`` from :mod:`vtnumba.kernels` -- and compares the two: the error
against float64, the time, and the bandwidth against a plain memory copy.  On ``cudasim``
and ``cuda`` the same call runs the CUDA kernel (one block per row) on device arrays.  A
figure shows the bandwidth of the fused step, of numpy and of a plain copy across sizes.

**Builds on:** :doc:`04_matmul_ladder` (how a kernel's speed is bound by memory or by
arithmetic).  Next: :doc:`06_peer_buffers`.

Run it::

    mpiexec -n 2 python tutorials/05_fused_add_rmsnorm.py            # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/05_fused_add_rmsnorm.py --target cudasim
    python tutorials/05_fused_add_rmsnorm.py                         # one rank

Key insight: the step does almost no arithmetic per byte, so its speed is set by how many
times it walks over memory.  numpy walks over ``[rows, H]`` arrays five or six times (add,
add, square, mean, scale, scale); the fused loop reads each input once and writes each
output once -- the same traffic as a copy, which is the speed limit to compare against.
"""

# %%
# Setup
# -----
#
# The host part runs at a realistic size on every target -- numpy arrays always
# run the host reference -- so every rank times 4096 token rows of hidden size 1024 (16 MiB
# per array).  The device part uses tiny shapes in the simulator.
from vtnumba.apps.tutorial import as_rate, human_bytes, start, time_calls

lesson = start("05 fused residual add + RMSNorm")

import numpy as np  # noqa: E402

from vtnumba.bench.timing import stats_from_times  # noqa: E402
from vtnumba.kernels import fused_add_layer_norm, fused_add_rms_norm  # noqa: E402

rank, target = lesson.rank, lesson.target
rng = np.random.default_rng(50 + rank)
ROWS, H, EPS = 4096, 1024, 1e-6

y = rng.standard_normal((ROWS, H), dtype=np.float32)          # the block's output
residual = rng.standard_normal((ROWS, H), dtype=np.float32)   # the residual stream
bias = rng.standard_normal(H, dtype=np.float32)               # the block's output bias
weight = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)  # the norm's scale


def max_err(got, truth) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - truth)))


# %%
# The math, in numpy and fused
# ----------------------------
#
# The same math in plain numpy (float32, what you would write first) and in float64
# (the truth)::
#
#     z   = y + bias + residual            # the new residual stream
#     out = z * rsqrt(mean(z^2) + eps) * weight
def numpy_add_rms_norm(y, residual, weight, eps, bias):
    z = y + bias + residual
    out = z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + np.float32(eps)) * weight
    return out, z


z64 = y.astype(np.float64) + bias + residual
truth = z64 / np.sqrt((z64 * z64).mean(-1, keepdims=True) + EPS) * weight

out_np, z_np = numpy_add_rms_norm(y, residual, weight, EPS, bias)
out, new_residual = fused_add_rms_norm(y, residual, weight, EPS, bias=bias)
# (The first call of the host loop loads it from numba's on-disk cache, or compiles it.)
lesson.say(f"[{ROWS}x{H}] max |error| vs float64: fused {max_err(out, truth):.1e}, numpy float32 "
           f"{max_err(out_np, truth):.1e}; new residual {max_err(new_residual, z64):.1e}")
lesson.check(max_err(out, truth) < 1e-4 and max_err(new_residual, z64) < 1e-5,
             "fused add + RMSNorm == float64 (out and new residual)")

# %%
# Time and bandwidth, across sizes
# --------------------------------
#
# The fused call must read ``y`` and ``residual`` and write ``out`` and ``new_residual``:
# four arrays of traffic (the H-sized vectors are noise).  Bandwidth here counts *traffic*
# (bytes read + bytes written) for everything, like ``vtnumba bench kernels``; a copy
# reads and writes each byte, so its traffic is twice the bytes copied -- and a copy of
# the same arrays is the speed limit a one-pass loop can reach.  Each size is timed in
# rounds that alternate the three (both ranks time at once and share the memory system);
# the figure shows medians with p10-p90 bars.  How much of the working set fits in the
# caches changes the answer a lot, which is why the sizes go from 256 KiB to 16 MiB per
# array.
series = {"fused add + RMSNorm": [], "numpy, pass after pass": [], "memcpy (the speed limit)": []}
for rows in (64, 256, 1024, ROWS):
    ys, rs = y[:rows], residual[:rows]
    o_buf, r_buf = np.empty_like(ys), np.empty_like(ys)
    src, dst = np.ascontiguousarray(ys), np.empty_like(ys)
    calls = max(5, min(40, (4 << 20) // (rows * H)))
    times = {name: [] for name in series}
    for _ in range(3):
        times["fused add + RMSNorm"] += time_calls(
            lambda: fused_add_rms_norm(ys, rs, weight, EPS, bias=bias, out=o_buf, new_residual=r_buf), calls)
        times["numpy, pass after pass"] += time_calls(lambda: numpy_add_rms_norm(ys, rs, weight, EPS, bias), calls)
        times["memcpy (the speed limit)"] += time_calls(lambda: np.copyto(dst, src), calls)
    nbytes = rows * H * 4
    traffic = {"fused add + RMSNorm": 4 * nbytes, "numpy, pass after pass": 4 * nbytes,
               "memcpy (the speed limit)": 2 * nbytes}
    stats = {name: stats_from_times(t) for name, t in times.items()}
    for name in series:
        series[name].append((nbytes, as_rate(stats[name], traffic[name])))
    t_fused, t_numpy = stats["fused add + RMSNorm"].median_s, stats["numpy, pass after pass"].median_s
    gbs = {name: traffic[name] / stats[name].median_s / 1e9 for name in series}
    lesson.say(f"[{rows:>4}x{H}] ({human_bytes(nbytes):>7} per array): fused {t_fused * 1e3:6.2f} ms "
               f"({gbs['fused add + RMSNorm']:5.1f} GB/s), numpy {t_numpy * 1e3:6.2f} ms "
               f"({gbs['numpy, pass after pass']:5.1f} GB/s), memcpy {gbs['memcpy (the speed limit)']:5.1f} GB/s "
               f"of traffic -> fused is {t_numpy / t_fused:.1f}x faster, at "
               f"{gbs['fused add + RMSNorm'] / gbs['memcpy (the speed limit)']:.0%} of a copy's speed")
lesson.perf_plot("norm_bandwidth.png", "Fused residual add + RMSNorm against plain numpy and a memcpy of the same "
                 "arrays (rank 0), in GB/s of traffic (log scale).  The fused loop walks over memory once, numpy "
                 "once per operation, so the fused line stays above numpy's -- most of all on arrays bigger than the "
                 "caches, where each of numpy's passes goes to DRAM; the copy is the ceiling that a one-pass loop "
                 "could reach.  numpy and the copy run faster on arrays that fit in the caches.",
                 series,
                 xlabel="bytes per [rows, 1024] float32 array", ylabel="GB/s of traffic (read + written)",
                 title="05: fused add + RMSNorm vs numpy vs memcpy", logy=True)
lesson.check(t_fused < t_numpy, "one pass over memory beats five or six")

# %%
# In place
# --------
#
# A model keeps one residual buffer and updates it every layer:
# ``new_residual=residual`` is allowed (each element is read before it is written, by the
# same thread), and so is ``out=y``.  What is refused is checked by address, not by ``is``:
# ``out`` and ``new_residual`` may share no memory at all (``z`` is re-read after ``out`` is
# written), and an output that overlaps an input shifted by some rows is an error too (its
# writes would land on rows another thread has not read yet).
o_buf = np.empty_like(y)
stream = residual.copy()
block_out = y.copy()
fused_add_rms_norm(block_out, stream, weight, EPS, bias=bias, out=block_out, new_residual=stream)
lesson.say(f"in place: residual stream updated with max |error| {max_err(stream, z64):.1e}, "
           f"output written over y with max |error| {max_err(block_out, truth):.1e}")
lesson.check(max_err(stream, z64) < 1e-5 and max_err(block_out, truth) < 1e-4, "in-place update == out of place")
try:
    fused_add_rms_norm(y, residual, weight, EPS, out=o_buf, new_residual=o_buf)
except ValueError as exc:
    lesson.say(f"out is new_residual -> ValueError: {exc}")
try:
    fused_add_rms_norm(y, residual, weight[:-1], EPS)
except ValueError as exc:
    lesson.say(f"a weight of the wrong size -> ValueError: {exc}")

# %%
# LayerNorm
# ---------
#
# BERT's norm, used by the MiniLM capstone: ``out = (z - mean) *
# rsqrt(var + eps) * weight + norm_bias``.  The kernel computes the variance as
# ``mean((z - mean)^2)`` in a second pass over the row (which is still in L1), not as
# ``mean(z^2) - mean^2`` in one pass: in float32 the one-pass formula cancels
# catastrophically when the mean is large compared with the spread.  Rows with mean 1000
# and standard deviation 1 show it.
norm_bias = (0.1 * rng.standard_normal(H)).astype(np.float32)
for label, scale, shift in (("ordinary rows", 1.0, 0.0), ("mean 1000, std 1", 1.0, 1000.0)):
    yy = (shift + scale * rng.standard_normal((256, H))).astype(np.float32)
    ln, _ = fused_add_layer_norm(yy, None, weight, norm_bias, EPS)
    y64 = yy.astype(np.float64)
    mu64 = y64.mean(-1, keepdims=True)
    ln_truth = (y64 - mu64) / np.sqrt(((y64 - mu64) ** 2).mean(-1, keepdims=True) + EPS) * weight + norm_bias
    mu = yy.mean(-1, keepdims=True)
    one_pass_var = np.maximum((yy * yy).mean(-1, keepdims=True) - mu * mu, 0)
    ln_one_pass = (yy - mu) / np.sqrt(one_pass_var + np.float32(EPS)) * weight + norm_bias
    lesson.say(f"LayerNorm, {label}: max |error| fused {max_err(ln, ln_truth):.1e}, "
               f"one-pass variance {max_err(ln_one_pass, ln_truth):.1e}")
    lesson.check(max_err(ln, ln_truth) < 1e-3, f"fused LayerNorm == float64 ({label})")

# %%
# The CUDA kernel
# ---------------
#
# On ``cudasim`` and ``cuda`` the very same calls take device arrays and launch
# ``fused_add_norm_kernel``: one block per row, a power-of-two number of threads, each
# thread keeping its part of the row in registers between the two passes, and a tree
# reduction in shared memory (``block_sum``) for the row's sum:
#
# .. vt-source:: vtnumba.kernels.norm_cuda.fused_add_norm_kernel
#
# .. vt-source:: vtnumba.kernels.norm_cuda.block_sum
#
# The ``cpu`` target runs its host twin, compiled with ``numba.njit``: the same two passes
# per row, one row at a time, with scratch rows that stay in L1:
#
# .. vt-source:: vtnumba.kernels.norm._add_norm_rows
#
# The result is checked against the host reference at a shape whose H (80) is not a
# power of two, so some threads own fewer elements.  In the simulator every CUDA thread
# is a Python thread, so the rows are few.
if target in ("cudasim", "cuda"):
    from numba import cuda

    r, h = 5, 80
    ys, rs, bs, ws, nbs = y[:r, :h].copy(), residual[:r, :h].copy(), bias[:h].copy(), weight[:h].copy(), norm_bias[:h]
    host_rms, host_z = fused_add_rms_norm(ys, rs, ws, EPS, bias=bs)
    host_ln, _ = fused_add_layer_norm(ys, rs, ws, nbs.copy(), EPS, bias=bs)
    dy, dr, db, dw, dnb = (cuda.to_device(np.ascontiguousarray(v)) for v in (ys, rs, bs, ws, nbs))
    dev_rms, dev_z = fused_add_rms_norm(dy, dr, dw, EPS, bias=db)
    dev_ln, _ = fused_add_layer_norm(dy, dr, dw, dnb, EPS, bias=db)
    e_rms = float(np.max(np.abs(dev_rms.copy_to_host() - host_rms)))
    e_ln = float(np.max(np.abs(dev_ln.copy_to_host() - host_ln)))
    lesson.say(f"{target} kernel, [{r}x{h}]: max |device - host| RMSNorm {e_rms:.1e}, LayerNorm {e_ln:.1e}")
    lesson.check(e_rms < 1e-5 and e_ln < 1e-5 and np.array_equal(dev_z.copy_to_host(), host_z),
                 "the CUDA kernel and the host reference agree")

    # On a real GPU: time the kernel at the realistic size on a queue with events, against a
    # device-to-device copy of the same arrays (rank 0 only: ranks may share the GPU).
    if target == "cuda" and rank == 0:
        from vtnumba import default_backend

        backend = default_backend()
        q = backend.create_queue("norm")
        gy, gr, gw, gb = (cuda.to_device(v) for v in (y, residual, weight, bias))
        go, gz = cuda.device_array_like(gy), cuda.device_array_like(gy)
        e0, e1 = backend.create_event(), backend.create_event()

        def per_call_ms(fn, n=50):
            fn()
            backend.record_event(e0, q)
            for _ in range(n):
                fn()
            backend.record_event(e1, q)
            backend.synchronize_event(e1)
            return backend.elapsed_ms(e0, e1) / n

        ms_norm = per_call_ms(lambda: fused_add_rms_norm(gy, gr, gw, EPS, bias=gb, out=go, new_residual=gz, queue=q))
        ms_copy = per_call_ms(lambda: backend.copy(q, go, gy, ROWS * H * 4))
        gpu_traffic = 4 * ROWS * H * 4
        lesson.say(f"GPU [{ROWS}x{H}]: fused {ms_norm * 1e3:.1f} us = {gpu_traffic / ms_norm / 1e6:.0f} GB/s; "
                   f"device copy {2 * ROWS * H * 4 / ms_copy / 1e6:.0f} GB/s of traffic")
        backend.destroy_queue(q)
else:
    lesson.say("cpu target: the CUDA kernel does not run here (try --target cudasim)")

lesson.say("done")

# %%
# Expected output
# ---------------
#
# * Errors against float64 around ``1e-6`` for the fused call, about the same as numpy's
#   float32; LayerNorm with mean 1000 shows the one-pass variance's error (``1e-1`` or
#   worse) next to the fused kernel's two-pass one.
# * The figure: the fused line above numpy's at every size -- about 1.5-3x for arrays that
#   fit in the caches (numpy's passes hit the cache too), about 3-7x at 4-16 MiB -- and below
#   the memcpy line, or at it (the ceiling; how close a host loop gets depends on the machine
#   and on what else runs: between a third of it and all of it at 16 MiB on a 2-core machine).  numpy and
#   memcpy run faster on arrays that fit in the caches.  The exact figures move from run to
#   run on a small, shared machine; the order of the lines does not.
# * On ``cudasim``: ``max |device - host|`` around ``1e-7``; on ``cuda``, the fused kernel
#   near the device copy's GB/s.
#
# Common issues
# -------------
#
# * The first call of the host loop compiles it with ``numba.njit`` (cached on disk
#   afterwards); time after a warm-up call.
# * Everything is float32: pass float16 activations through ``astype(np.float32)`` first,
#   or you get a ``TypeError`` naming the array.
# * ``out`` and ``new_residual`` must be separate memory (two views of one buffer count as
#   one); either may *be* its input, but not overlap it shifted by some rows.
# * Under ``mpiexec`` on a laptop both ranks share the memory bus: per-rank GB/s is about
#   half of what one process alone gets -- compare with the memcpy measured the same way.
#
# Try next
# --------
#
# 1. Add a third input to the numpy version (a second residual) and to the traffic count:
#    how far does numpy fall behind now, and why does the fused loop barely notice?
# 2. Run with ``--target cudasim`` and change ``MAX_THREADS`` in
#    :mod:`vtnumba.kernels.norm_cuda` to 8 (the lesson's rows of 80 already take 32 threads,
#    one per quad): the result is still exact -- every thread now loops over several quads of
#    the row -- and only the reduction tree is shorter.
