"""TPSP: fusing a row-parallel matmul with reduce-scatter, residual + norm and all-gather
======================================================================================

What it does (TPSP: *tensor-parallel + sequence-parallel* -- the weights split across the
ranks, the tokens split across them for the norm): takes one tensor-parallel layer -- a row-parallel projection followed by a
norm, the ``o_proj``/``down_proj`` + layernorm pair of every transformer block -- and runs
it three ways on the same data: in float64 numpy on the whole matrices (the truth), as the
regular forward (matmul, ``MPI_Reduce_scatter_block``, add + norm, ``MPI_Allgather``), and
as the fused TPSP op over peer memory, in microchunks.  Then it shows how a model decides
per batch which one to run, and what happens when one rank cannot join.  Figures: the
microchunk pipeline on a timeline, and the time of a call against the microchunk size,
with the regular forward beside it -- and why they are what they are on this machine.

**Builds on:** :doc:`07_reduce_scatter_all_gather` (the collectives TPSP fuses),
:doc:`04_matmul_ladder` (its matmul) and :doc:`05_fused_add_rmsnorm` (its norm).
Next: :doc:`09_encoder_cache`.

Run it::

    mpiexec -n 2 python tutorials/08_tpsp.py                # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/08_tpsp.py --target cudasim

Key insight: after the reduce-scatter each rank owns only ``R = ceil(T / tp)`` token rows,
so it only needs to add the residual and normalise *those* rows -- the residual can stay
sharded -- and the partial sums never need a separate scatter: the matmul writes each
rank's rows straight into peer-visible memory, and a few flags say when a slot is ready.
"""

# %%
# Setup
# -----
#
# Every rank runs this file; rank 0 narrates.  ``init_distributed`` makes the
# tensor-parallel group ("tp") of all ranks.
import os
import time

from vtnumba.apps.tutorial import as_ms, start  # first: it shares the cores before numpy loads BLAS

# isort: split
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

lesson = start("08 TPSP: matmul -> reduce-scatter -> residual + norm -> all-gather", min_ranks=2)

from vtnumba.bench.timing import stats_from_times  # noqa: E402
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
# One layer, seen whole
# ---------------------
#
# ``X [T, K]`` are the activations, ``W [H, K]`` the projection
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
# Sequence parallelism
# --------------------
#
# The residual is *sharded by token rows*.  With ``R = ceil(T/tp)``
# rank r owns rows ``r*R .. r*R+R-1``; the last shard is zero-padded when T is not a
# multiple of tp.  Every shard has the same shape, which is what lets the exchange use
# fixed-size slots.
R = -(-T // tp)
residual = shard_residual(residual_full, tp, rank)
start_row, stop_row = token_range(T, tp, rank)
lesson.say(f"R = ceil({T}/{tp}) = {R} rows per rank; rank 0 owns tokens {token_range(T, tp, 0)}, "
           f"rank {tp - 1} owns {token_range(T, tp, tp - 1)} (+ {tp * R - T} padding rows)")

# %%
# The regular forward
# -------------------
#
# Step by step with stock parts: numpy's BLAS for the partial sum,
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
# The fused op
# ------------
#
# ``open`` is collective: every rank maps every other rank's workspace
# (anonymous shared memory -- memfd -- on cpu/cudasim, CUDA IPC on a GPU) and the ranks *agree* -- if
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
# These are the steps, per chunk, exactly as :mod:`vtnumba.tpsp.pipeline` queues them --
# ``compute`` on the compute queue, ``reduce`` and ``collect`` on the exchange queue, every
# wait and signal itself a queue operation:
#
# .. vt-source:: vtnumba.tpsp.pipeline.ChunkPipeline.compute
#
# .. vt-source:: vtnumba.tpsp.pipeline.ChunkPipeline.reduce
#
# .. vt-source:: vtnumba.tpsp.pipeline.ChunkPipeline.collect
#
# The host only queues them, chunk i+1's matmul before chunk i's exchange:
#
# .. vt-source:: vtnumba.tpsp.pipeline.ChunkPipeline.run
out, new_res = backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps)
out, new_res = to_host(out), to_host(new_res)
lesson.say(f"fused op: relative error vs float64 {rel_err(out, truth):.2e}, vs regular {rel_err(out, reg_out):.2e}")
lesson.check(rel_err(out, truth) < 1e-5, "fused op == float64 layer")
lesson.check(np.allclose(new_res, reg_res, rtol=1e-5, atol=1e-5), "fused new residual == regular new residual")

# %%
# Microchunks
# -----------
#
# Chunk c handles c rows of *every* rank's shard per step, so each step gives every rank
# work; with two slot sets, chunk i+1's matmul can run while chunk i is being exchanged
# (on a GPU stream, or a threaded host queue).  The flags are epoch counters that only
# grow -- one per chunk, across calls -- so nothing is ever reset.  Each size is timed over
# a few calls (the slowest rank of each call counts).
def slowest_call_times(fn, calls: int) -> list[float]:
    """Per call: a barrier, then the call; the slowest rank's time of each call (seconds)."""
    fn()  # warm
    times = []
    for _ in range(calls):
        lesson.comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(lesson.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return times


chunk_times = {}
for chunk in (1, 2, 8, 38, R) if not sim else (1, 2, R):
    before = ws.chunks_done
    out_c, _ = backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps, config=TPSPConfig(chunk))
    steps = ws.chunks_done - before
    if not sim:  # (simulator times would say nothing)
        chunk_times[chunk] = stats_from_times(slowest_call_times(
            lambda: backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps, config=TPSPConfig(chunk)),
            5))
    took = f", {chunk_times[chunk].median_s * 1e3:7.2f} ms per call" if chunk in chunk_times else ""
    lesson.say(f"  chunk {chunk:>4} rows/rank -> {steps:>3} steps{took}, max |diff| vs one step "
               f"{np.max(np.abs(to_host(out_c) - out)):.1e}")
    lesson.check(steps == -(-R // chunk) and np.allclose(to_host(out_c), out, rtol=1e-5, atol=1e-6),
                 f"chunk {chunk}: {-(-R // chunk)} steps, same result")

# %%
# Awkward token counts
# --------------------
#
# With T < tp some ranks own only padding; with T % tp != 0 the
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
# How a model uses it
# -------------------
#
# ``profile`` takes the model's ops groups (projection + the norm
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
# Agreement
# ---------
#
# If one rank cannot map its peers' memory (here: a test hook makes rank 1
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
# The pipeline on a timeline
# --------------------------
#
# To *see* the microchunks, one call with four chunks per rank is traced.  On the ``cpu``
# target the queues are synchronous: each step runs the moment the host queues it, in
# the pipeline's order -- ``compute(0)``, ``compute(1)``, then ``reduce(i)``, ``collect(i)``,
# ``compute(i+2)`` for each chunk -- and a red bar is a step waiting for a peer's flag (the
# other rank is a little behind).  The bars labelled ``c0``, ``c1``, ... are the chunks'
# matmuls, where wide enough to carry a label.  On a GPU the compute and exchange queues
# are two streams, and the bars of one chunk's exchange lie under the next chunk's matmul --
# which is why the exchange stream has the higher priority: its kernels are queued after that
# matmul, and at equal priority the GPU would give them SMs only once the matmul's blocks had
# all been handed out.
tl_handle = backend.open(tp_size=tp, hidden_size=H, max_batched_tokens=T, name="timeline")
tl_config = TPSPConfig(-(-R // 4))
backend.tpsp_matmul_rs_norm_ag(tl_handle, xd, wd, bd, resd, nwd, norm.eps, config=tl_config)  # warm-up
with lesson.timeline("tpsp_chunks.png", f"One fused call, {-(-R // tl_config.chunk_tokens_per_rank)} microchunks "
                     "per rank, on each rank's compute and exchange queues.  Green: a chunk's matmul (compute) and "
                     "its reduce + norm and gathers (exchange); red: waits for a flag from a peer; brown: flag "
                     "writes.  The grey bar is the host's call, with its handshake (red) at the start.",
                     title="08: the TPSP chunk pipeline (compute and exchange queues per rank)"):
    backend.tpsp_matmul_rs_norm_ag(tl_handle, xd, wd, bd, resd, nwd, norm.eps, config=tl_config)
backend.close(tl_handle)

# %%
# Fused against regular, and why
# ------------------------------
#
# Both paths are timed in alternating rounds, each call as in the chunk sweep (a barrier,
# the call, the slowest rank's time), with ``T = 300`` tokens and the handle's default
# microchunk (the whole shard: one step).  What to expect depends on the machine.  On the ``cpu``
# target the regular forward's MPI collectives and the fused op's exchange both copy
# through shared memory -- the same bytes -- and host queues run the steps one after
# another, so there is little for fusion to save, while every chunk adds Python work
# (queue operations, flags).  On a GPU the fused op earns its keep: the exchange of chunk
# i runs on its own stream while chunk i+1's matmul runs, the flags are stream memory
# operations (no host in the loop), and the partial sums go straight into the peers'
# memory instead of through a staged MPI collective.  ``vtnumba bench tpsp`` measures it
# properly (many rounds, the reference shapes).
if not sim:
    handle = backend.open(tp_size=tp, hidden_size=H, max_batched_tokens=T, name="timing")
    paths = {"regular": lambda: regular_matmul_rs_norm_ag(group, xd, wd, bd, resd, nwd, norm.eps),
             "fused": lambda: backend.tpsp_matmul_rs_norm_ag(handle, xd, wd, bd, resd, nwd, norm.eps)}
    rounds = {label: [] for label in paths}
    for _ in range(3):  # alternating rounds: both paths see the same state of the machine
        for label, run in paths.items():
            rounds[label] += slowest_call_times(run, 3)
    st = {label: stats_from_times(v) for label, v in rounds.items()}
    ratio = st["fused"].median_s / st["regular"].median_s
    lesson.say(f"slowest rank, median of 9 calls (p10-p90): regular {st['regular'].median_s * 1e3:.2f} ms "
               f"({st['regular'].p10_s * 1e3:.2f}-{st['regular'].p90_s * 1e3:.2f}), fused "
               f"{st['fused'].median_s * 1e3:.2f} ms ({st['fused'].p10_s * 1e3:.2f}-{st['fused'].p90_s * 1e3:.2f})")
    overlap = st["fused"].p10_s <= st["regular"].p90_s and st["regular"].p10_s <= st["fused"].p90_s
    verdict = "within the noise of each other" if overlap else \
        f"fused {'faster' if ratio < 1 else 'slower'} by {abs(1 - ratio):.0%}"
    why = ("the cpu target: both exchanges are copies through shared memory and the host runs the steps one "
           "after another, so fusion saves little while its handshake, queue operations and flags cost Python "
           "time" if lesson.target == "cpu" else
           "a GPU: the exchange overlaps the next chunk's matmul on its own stream")
    lesson.say(f"fused / regular = {ratio:.2f}: {verdict}, as expected on {why}")

    def draw_chunks(plt):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        xs = sorted(chunk_times)
        med, lo, hi = zip(*(as_ms(chunk_times[c]) for c in xs))
        ax.errorbar(xs, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], marker="o", capsize=3,
                    label="fused TPSP op, by microchunk size")
        r_med, r_lo, r_hi = as_ms(st["regular"])
        ax.axhline(r_med, color="#ff7f0e", label="regular forward (no chunks)")
        ax.axhspan(r_lo, r_hi, color="#ff7f0e", alpha=0.15)
        ax.set_xscale("log")
        ax.set_yscale("log")  # 150 steps and one step differ a hundredfold
        ax.set_xticks(xs, [f"{c}\n({-(-R // c)} step{'s' if -(-R // c) > 1 else ''})" for c in xs])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xlabel(f"microchunk: rows of every rank's shard per step (R = {R})")
        ax.set_ylabel("ms per call (slowest rank, log scale)")
        ax.set_title(f"08: one TPSP layer, T={T}, H={H}, {tp} ranks, target {lesson.target}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="median, bar/band p10-p90", title_fontsize=7.5)
        fig.tight_layout()
        return fig

    lesson.figure("tpsp_chunk_sweep.png", "Time of one fused call against the microchunk size, with the regular "
                  "forward as a band (its p10-p90).  Many small chunks cost a step each -- queue operations and "
                  "flags in Python on this machine; one chunk is one step.", draw_chunks)
    backend.close(handle)
    lesson.check(all(v.median_s > 0 for v in st.values()), "both paths ran and were timed")
backend.close()
lesson.say("done: the fused op equals the float64 layer and the regular forward, chunked or not")

# %%
# Expected output
# ---------------
#
# * Relative errors around ``1e-7`` for the regular forward and the fused op, chunked or
#   not; the chunk sweep's results agree with one step to ``1e-6``.
# * The chunk sweep: 150 steps at chunk 1 take about a hundred times longer than one step of
#   150 rows; the figure's line falls as the chunks grow.
# * The timeline: on each rank the compute queue's four matmuls and the exchange queue's
#   reduces, gathers and flag writes, one after another, with red waits wherever one rank
#   got ahead of the other.
# * ``fused / regular`` around 1.0 to 1.4 on the cpu target (measured on a 2-core machine),
#   a call of a few tenths of a millisecond either way: at this size fusion saves little,
#   and the fused op's handshake, queue operations and flags are Python work that the
#   regular forward's two MPI calls do not have -- with the reason printed next to it; the
#   verdict says whether the difference is within the noise of the rounds, as it often is.
#   (``vtnumba bench tpsp``, with its larger layer, finds the two within the noise from a
#   few hundred tokens on: there the matmul dominates.)
# * ``TPSP unavailable for 'declined' ...`` (a warning from rank 0), then ``None`` on every
#   rank: the ranks fell back together.
#
# Common issues
# -------------
#
# * ``this lesson needs 2 or more processes, got 1``: run it under ``mpiexec -n 2``.
# * ``TPSPShapeMismatch``: the ranks called the op with different T, H, norm or eps; every
#   rank must make the same call (the message shows each rank's arguments).
# * A microchunk larger than this rank's shard of the call is simply cut to the shard.  One
#   larger than the workspace slot -- ``max_batched_tokens / tp`` rows, capped at
#   ``tpsp_max_microchunk_tokens / tp`` (16384 tokens over all ranks) -- is cut to the slot:
#   a step never moves more than a slot holds (a larger ``max_batched_tokens`` does not help
#   past the cap).
# * On a laptop the fused op is not faster than the regular forward: that is expected (see
#   above); measure on a GPU with ``vtnumba bench tpsp``.
#
# Try next
# --------
#
# 1. Trace the whole lesson with ``vtnumba trace --out out/tpsp -- mpiexec -n 2 python
#    tutorials/08_tpsp.py`` and open ``out/tpsp.json`` in Perfetto: find the chunk-1 call and
#    count its steps.
# 2. Draw the timeline on a host backend with threaded queues,
#    ``vtnumba.tpsp.host.HostTPSPBackend("tp", threaded=True)``: the compute and exchange
#    bars now overlap -- and is the call faster on two cores, with two ranks?  Why not?
