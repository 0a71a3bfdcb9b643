"""TPSP: fusing a row-parallel matmul with reduce-scatter, residual + norm and all-gather
======================================================================================

What it does: takes one tensor-parallel layer -- a row-parallel projection followed by a
norm, the ``o_proj``/``down_proj`` + layernorm pair of every transformer block -- and runs
it three ways on the same data: in float64 numpy on the whole matrices (the truth), as the
regular forward (matmul, ``MPI_Reduce_scatter_block``, add + norm, ``MPI_Allgather``), and
as the fused TPSP op over peer memory, in microchunks.  Then it shows how a model decides
per batch which one to run, and what happens when one rank cannot join.

Run it::

    mpiexec -n 2 python tutorials/08_tpsp.py                # cpu target
    mpiexec -n 2 python tutorials/08_tpsp.py --target cudasim

Key insight: after the reduce-scatter each rank owns only ``R = ceil(T / tp)`` token rows,
so it only needs to add the residual and normalise *those* rows -- the residual can stay
sharded -- and the partial sums never need a separate scatter: the matmul writes each
rank's rows straight into peer-visible memory, and a few flags say when a slot is ready.
"""

# %%
# Setup.  Every rank runs this file; rank 0 narrates.  ``init_distributed`` makes the
# tensor-parallel group ("tp") of all ranks.
import os
import time

import numpy as np
from mpi4py import MPI

from vtnumba.apps.tutorial import start

lesson = start("08 TPSP: matmul -> reduce-scatter -> residual + norm -> all-gather")
if lesson.size < 2:
    raise SystemExit("this lesson needs two or more processes: mpiexec -n 2 python tutorials/08_tpsp.py")

from vtnumba.dist import init_distributed  # noqa: E402
from vtnumba.nn import RMSNorm, RowParallelLinear  # noqa: E402
from vtnumba.tpsp import (  # noqa: E402
    TPSPConfig,
    TPSPOp,
    TPSPOpsGroup,
    get_tpsp_backend,
    regular_matmul_rs_norm_ag,
    shard_residual,
    token_range,
)

group = init_distributed()
tp, rank = group.size, group.rank
sim = lesson.target == "cudasim"
if sim:
    from numba import cuda

    to_target, to_host = cuda.to_device, (lambda a: a.copy_to_host())
else:
    to_target, to_host = (lambda a: a), (lambda a: a)

# %%
# One layer, seen whole.  ``X [T, K]`` are the activations, ``W [H, K]`` the projection
# (nn.Linear layout).  Tensor parallelism splits K: rank r holds ``X[:, K_r]`` and
# ``W[:, K_r]``, so ``x_r @ w_r.T`` is only a *partial* sum of the projection.  Every rank
# builds the whole layer from one seed so it can compute the float64 truth itself; then it
# keeps its slices.  K is split unevenly on purpose (any K works).
T, H = (5, 8 * tp) if sim else (300, 64 * tp)
ks = [(3 if sim else 40) + r for r in range(tp)]
rng = np.random.default_rng(0)
X = rng.standard_normal((T, sum(ks)), dtype=np.float32)
W = rng.standard_normal((H, sum(ks)), dtype=np.float32) / np.float32(np.sqrt(sum(ks)))
bias = rng.standard_normal(H, dtype=np.float32)
residual_full = rng.standard_normal((T, H), dtype=np.float32)
norm = RMSNorm(H, eps=1e-6, seed=1)
lo = sum(ks[:rank])
x = np.ascontiguousarray(X[:, lo:lo + ks[rank]])
w = np.ascontiguousarray(W[:, lo:lo + ks[rank]])

z64 = X.astype(np.float64) @ W.T.astype(np.float64) + bias + residual_full
truth = z64 / np.sqrt((z64 * z64).mean(-1, keepdims=True) + norm.eps) * norm.weight
lesson.say(f"layer: T={T} tokens, K={sum(ks)} split {ks} over {tp} ranks, H={H}")


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# %%
# Sequence parallelism: the residual is *sharded by token rows*.  With ``R = ceil(T/tp)``
# rank r owns rows ``r*R .. r*R+R-1``; the last shard is zero-padded when T is not a
# multiple of tp.  Every shard has the same shape, which is what lets the exchange use
# fixed-size slots.
R = -(-T // tp)
residual = shard_residual(residual_full, tp, rank)
start_row, stop_row = token_range(T, tp, rank)
lesson.say(f"R = ceil({T}/{tp}) = {R} rows per rank; rank 0 owns tokens {token_range(T, tp, 0)}, "
           f"rank {tp - 1} owns {token_range(T, tp, tp - 1)} (+ {tp * R - T} padding rows)")

# %%
# The regular forward, step by step with stock parts: numpy's BLAS for the partial sum,
# ``MPI_Reduce_scatter_block`` so each rank gets the *sum* of its R rows, the fused
# add + RMSNorm kernel on those rows, and ``MPI_Allgather`` so every rank has all T
# normalised rows again.  Four steps, each waiting for the one before.
xd, wd, bd, resd, nwd = (to_target(a) for a in (x, w, bias, residual, norm.weight))
reg_out, reg_res = regular_matmul_rs_norm_ag(group, xd, wd, bd, resd, nwd, norm.eps)
reg_out, reg_res = to_host(reg_out), to_host(reg_res)
lesson.say(f"regular forward: gathered {reg_out.shape}, new residual shard {reg_res.shape}, "
           f"relative error vs float64 {rel_err(reg_out, truth):.2e}")
lesson.check(rel_err(reg_out, truth) < 1e-5, "regular forward == float64 layer")
lesson.check(rel_err(reg_res[:stop_row - start_row], z64[start_row:stop_row]) < 1e-5 if stop_row > start_row
             else True, "the new residual shard is this rank's rows of z = X W^T + bias + residual")

# %%
# The fused op.  ``open`` is collective: every rank maps every other rank's workspace
# (POSIX shared memory on cpu/cudasim, CUDA IPC on a GPU) and the ranks *agree* -- if
# any rank could not, every rank would get ``None``.  The workspace holds two slot sets
# (double buffering) of partial-sum blocks and gather blocks, plus epoch flags.
backend = get_tpsp_backend("tp")
handle = backend.open(tp_size=tp, hidden_size=H, max_batched_tokens=T, name="o_proj")
lesson.check(handle is not None, "every rank opened the peer workspace")
ws = handle.workspace
lesson.say(f"backend {type(backend).__name__}, exchange mode {ws.exchange!r}: "
           f"{ws.pb.nbytes / 1024:.1f} KiB of peer memory per rank, {handle.max_chunk_rows} rows per slot")

# %%
# One call does it all: the matmul writes each destination's rows straight into the
# exchange slots (no scatter copy), the owner sums the ``tp`` partial blocks, adds bias
# and its residual shard and normalises in one pass, then every rank collects every
# rank's normalised rows.  ``inbox_ready`` / ``gather_ready`` / ``consumed`` flags order it.
out, new_res = backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps)
out, new_res = to_host(out), to_host(new_res)
lesson.say(f"fused op: relative error vs float64 {rel_err(out, truth):.2e}, vs regular {rel_err(out, reg_out):.2e}")
lesson.check(rel_err(out, truth) < 1e-5, "fused op == float64 layer")
lesson.check(np.allclose(new_res, reg_res, rtol=1e-5, atol=1e-5), "fused new residual == regular new residual")

# %%
# Microchunks: chunk c handles c rows of *every* rank's shard per step, so each step gives
# every rank work; with two slot sets, chunk i+1's matmul can run while chunk i is being
# exchanged (on a GPU stream, or a threaded host queue).  The flags are epoch counters
# that only grow -- one per chunk, across calls -- so nothing is ever reset.
for chunk in (1, 2, R):
    before = ws.chunks_done
    out_c, _ = backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps, config=TPSPConfig(chunk))
    steps = ws.chunks_done - before
    lesson.say(f"  chunk {chunk:>4} rows/rank -> {steps:>3} steps, max |diff| vs one step "
               f"{np.max(np.abs(to_host(out_c) - out)):.1e}")
    lesson.check(steps == -(-R // chunk) and np.allclose(to_host(out_c), out, rtol=1e-5, atol=1e-6),
                 f"chunk {chunk}: {-(-R // chunk)} steps, same result")

# %%
# Awkward token counts.  With T < tp some ranks own only padding; with T % tp != 0 the
# last shard is partly padding.  Padding rows are zero partials: they get ``bias +
# residual`` (zeros) as their "sum" and are never copied into the output.
for T_small in (1, tp + 1):
    z_small = X[:T_small].astype(np.float64) @ W.T.astype(np.float64) + bias + residual_full[:T_small]
    truth_small = z_small / np.sqrt((z_small ** 2).mean(-1, keepdims=True) + norm.eps) * norm.weight
    o, _ = backend.tpsp_matmul_rs_norm_ag(handle, to_target(np.ascontiguousarray(x[:T_small])), wd, bd,
                                          to_target(shard_residual(residual_full[:T_small], tp, rank)), nwd, norm.eps)
    lesson.check(rel_err(to_host(o), truth_small) < 1e-5, f"T={T_small} tokens on {tp} ranks")
backend.close(handle)

# %%
# How a model uses it.  ``profile`` takes the model's ops groups (projection + the norm
# after it), opens a handle for each, sets the config, picks the token threshold below
# which the regular forward is faster (given here; measured with ``search=True``), and
# checks parity with the regular forward.  ``TPSPOp`` then has the fused op's signature
# and picks the path per call.
proj = RowParallelLinear(sum(ks), H, weight=W, bias=bias)  # keeps this rank's (even) K slice
x_proj = X[:, proj.in_range[0]:proj.in_range[1]]
ctx = backend.profile([TPSPOpsGroup("o_proj", proj, norm)], max_batched_tokens=T, threshold_tokens=4)
lesson.check(ctx is not None and ctx.report.parity_max_err < 1e-4, "static profile: TPSP on from 4 tokens, parity ok")
op = TPSPOp(ctx, "o_proj", norm=norm)
for T_call in (2, T):
    op(to_target(np.ascontiguousarray(x_proj[:T_call])), to_target(proj.weight), to_target(proj.bias),
       to_target(shard_residual(residual_full[:T_call], tp, rank)), nwd, norm.eps)
lesson.say(f"TPSPOp: {op.regular_calls} regular call (T=2 < 4), {op.fused_calls} fused call (T={T})")
lesson.check((op.regular_calls, op.fused_calls) == (1, 1), "the op picked the path by token count")
ctx.close()

# %%
# Agreement.  If one rank cannot map its peers' memory (here: a test hook makes rank 1
# fail), ``open`` returns ``None`` on *every* rank -- nobody is left waiting in a
# collective the others skipped -- and the model runs the regular forward.
os.environ["VTNUMBA_FAIL_PEER_OPEN"] = "1"
try:
    declined = backend.open(tp_size=tp, hidden_size=H, max_batched_tokens=T, name="declined")
finally:
    del os.environ["VTNUMBA_FAIL_PEER_OPEN"]
lesson.say(f"open with rank 1 unable to map peer memory -> {declined} on rank {rank}")
lesson.check(declined is None, "every rank fell back together")

# %%
# Time, on the cpu target: one warm call each at T=300 (the first calls above included
# one-time setup such as loading compiled kernels; ``vtnumba bench tpsp`` measures
# properly: slowest rank, many rounds, the reference shapes).  The numbers depend on the
# machine and its load; the lesson checks only that both paths ran.
if not sim:
    handle = backend.open(tp_size=tp, hidden_size=H, max_batched_tokens=T, name="timing")
    timings = {}
    for label, run in (("regular", lambda: regular_matmul_rs_norm_ag(group, xd, wd, bd, resd, nwd, norm.eps)),
                       ("fused", lambda: backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps))):
        run()  # warm
        lesson.comm.Barrier()
        t0 = time.perf_counter()
        run()
        timings[label] = lesson.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    lesson.say(f"one warm call, slowest rank: regular {timings['regular'] * 1e3:.2f} ms, "
               f"fused {timings['fused'] * 1e3:.2f} ms")
    backend.close(handle)
backend.close()
lesson.say("done: the fused op equals the float64 layer and the regular forward, chunked or not")
