"""Fused residual add + RMSNorm
============================

What it does: after every attention and MLP block a transformer adds the block's output
(and its bias) to the residual stream and normalises the sum.  This lesson writes that
step in plain numpy, then calls vtnumba's fused version -- ``fused_add_rms_norm`` and
``fused_add_layer_norm`` from :mod:`vtnumba.kernels` -- and compares the two: the error
against float64, the time, and the bandwidth against a plain memory copy.  On ``cudasim``
and ``cuda`` the same call runs the CUDA kernel (one block per row) on device arrays.

Run it::

    mpiexec -n 2 python tutorials/05_fused_add_rmsnorm.py            # cpu target
    mpiexec -n 2 python tutorials/05_fused_add_rmsnorm.py --target cudasim
    python tutorials/05_fused_add_rmsnorm.py                         # one rank

Key insight: the step does almost no arithmetic per byte, so its speed is set by how many
times it walks over memory.  numpy walks over ``[rows, H]`` arrays five or six times (add,
add, square, mean, scale, scale); the fused loop reads each input once and writes each
output once -- the same traffic as a copy, which is the speed limit to compare against.
"""

# %%
# Setup.  The host part runs at a realistic size on every target -- numpy arrays always
# run the host reference -- so every rank times 4096 token rows of hidden size 1024 (16 MiB
# per array).  The device part uses tiny shapes in the simulator.
from vtnumba.apps.tutorial import start

lesson = start("05 fused residual add + RMSNorm")

import numpy as np  # noqa: E402

from vtnumba.bench.timing import measure, memcpy_bandwidth_gbs  # noqa: E402
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
# 1. The same math in plain numpy (float32, what you would write first) and in float64
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
lesson.say(f"[{ROWS}x{H}] max |error| vs float64: fused {max_err(out, truth):.1e}, numpy float32 "
           f"{max_err(out_np, truth):.1e}; new residual {max_err(new_residual, z64):.1e}")
lesson.check(max_err(out, truth) < 1e-4 and max_err(new_residual, z64) < 1e-5,
             "fused add + RMSNorm == float64 (out and new residual)")

# %%
# 2. Time and bandwidth.  The fused call must read ``y`` and ``residual`` and write ``out``
# and ``new_residual``: 4 x 16 MiB of traffic (the H-sized vectors are noise).  Bandwidth
# here counts *traffic* (bytes read + bytes written) for everything, like
# ``vtnumba bench kernels``: ``memcpy_bandwidth_gbs(n)`` reports bytes *copied* per second,
# and a copy reads and writes each byte, so its traffic is twice that.  The copy is timed
# on arrays of the norm's size (16 MiB) -- how much of a working set fits in the caches
# changes the answer a lot -- in rounds that alternate with the norms, because both ranks
# time at once and share the memory system; each keeps its best round.
traffic = 4 * ROWS * H * 4
o_buf, r_buf = np.empty_like(y), np.empty_like(y)
best = {"fused": np.inf, "numpy": np.inf, "copy GB/s": 0.0}
for _ in range(3):
    st = measure(lambda: fused_add_rms_norm(y, residual, weight, EPS, bias=bias, out=o_buf, new_residual=r_buf),
                 repeat=5, warmup=1)
    best["fused"] = min(best["fused"], st.median_s)
    best["numpy"] = min(best["numpy"], measure(lambda: numpy_add_rms_norm(y, residual, weight, EPS, bias),
                                               repeat=5, warmup=1).median_s)
    best["copy GB/s"] = max(best["copy GB/s"], memcpy_bandwidth_gbs(ROWS * H * 4, repeat=5))
t_fused, t_numpy = best["fused"], best["numpy"]
copy_traffic_gbs = 2 * best["copy GB/s"]
fused_gbs, numpy_gbs = traffic / t_fused / 1e9, traffic / t_numpy / 1e9
lesson.say(f"fused {t_fused * 1e3:.2f} ms ({fused_gbs:.1f} GB/s), numpy {t_numpy * 1e3:.2f} ms "
           f"({numpy_gbs:.1f} GB/s of useful traffic): fused is {t_numpy / t_fused:.1f}x faster")
lesson.say(f"a 16 MiB memcpy on this rank: {copy_traffic_gbs:.1f} GB/s of traffic -> the fused loop runs at "
           f"{fused_gbs / copy_traffic_gbs:.0%} of a copy's speed, numpy at {numpy_gbs / copy_traffic_gbs:.0%}")
lesson.check(t_fused < t_numpy, "one pass over memory beats five or six")

# %%
# 3. In place.  A model keeps one residual buffer and updates it every layer:
# ``new_residual=residual`` is allowed (each element is read before it is written, by the
# same thread), and so is ``out=y``.  Only ``out is new_residual`` is refused -- ``z`` is
# re-read after ``out`` is written.
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
# 4. LayerNorm (BERT's norm, used by the MiniLM capstone): ``out = (z - mean) *
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
# 5. The CUDA kernel.  On ``cudasim`` and ``cuda`` the very same calls take device arrays
# and launch :func:`vtnumba.kernels.norm_cuda.fused_add_norm_kernel`: one block per row,
# a power-of-two number of threads (here 128 for H = 80), a tree reduction in shared
# memory.  The result is checked against the host reference at the same shape (H = 80 is
# not a power of two, so some threads own fewer elements).  In the simulator every CUDA
# thread is a Python thread, so the rows are few.
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
        lesson.say(f"GPU [{ROWS}x{H}]: fused {ms_norm * 1e3:.1f} us = {traffic / ms_norm / 1e6:.0f} GB/s; "
                   f"device copy {2 * ROWS * H * 4 / ms_copy / 1e6:.0f} GB/s of traffic")
        backend.destroy_queue(q)
else:
    lesson.say("cpu target: the CUDA kernel does not run here (try --target cudasim)")

# %%
# Common issues:
#
# * The first call of the host loop compiles it with ``numba.njit`` (cached on disk
#   afterwards); time after a warm-up call.
# * Everything is float32: pass float16 activations through ``astype(np.float32)`` first,
#   or you get a ``TypeError`` naming the array.
# * ``out`` and ``new_residual`` must be different arrays; either may alias its input.
# * Under ``mpiexec`` on a laptop both ranks share the memory bus: per-rank GB/s is about
#   half of what one process alone gets -- compare with the memcpy measured the same way.
lesson.say("done")
