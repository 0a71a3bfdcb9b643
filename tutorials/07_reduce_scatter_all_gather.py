"""Reduce-scatter and all-gather over peer buffers
================================================

What it does: builds the two collectives of TPSP's exchange out of peer buffers and flags,
and checks them against numpy and against MPI.  *Reduce-scatter* sums every rank's
``[T, H]`` partial result and leaves each rank only its own block of ``R = ceil(T / tp)``
token rows; *all-gather* puts every rank's ``[R, H]`` block back together into ``[T, H]``
on every rank.  ``T`` need not be a multiple of ``tp``: the last block is zero-padded.
Last, both are timed from 256 KiB to 16 MiB against ``MPI_Reduce_scatter_block`` /
``MPI_Allgather``, and plotted.

**Builds on:** :doc:`06_peer_buffers` (peer memory and flags).  Next: :doc:`08_tpsp`.

Run it::

    mpiexec -n 2 python tutorials/07_reduce_scatter_all_gather.py            # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/07_reduce_scatter_all_gather.py --target cudasim

Key insight: with peer memory a collective is "write my part where everyone can see it,
raise a flag, wait for everyone's flag, read what I need".  Each rank reads only the rows
it owns -- a reduce-scatter moves ``(tp - 1) / tp`` of the data per rank, not all of it --
and no byte passes through a message queue.
"""

# %%
# Setup
# -----
#
# One tensor-parallel group of all ranks; peer buffers (on a GPU already large enough for
# the 16 MiB case at the end; elsewhere small, and the timing section makes its own); and
# the three flags the protocol uses (``inbox_ready``, ``gather_ready``, ``consumed``), each
# an epoch counter.
from vtnumba.apps.tutorial import as_rate, human_bytes, start

# isort: split
lesson = start("07 reduce-scatter and all-gather over peer buffers")

import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from vtnumba.bench.timing import stats_from_times  # noqa: E402
from vtnumba.dist import (  # noqa: E402
    PeerBuffers,
    PeerSignals,
    all_gather,
    barrier,
    destroy_distributed,
    init_distributed,
    mpi_all_gather,
    mpi_reduce_scatter,
    reduce_scatter,
)

group = init_distributed()
rank, tp = group.rank, group.size
sim = lesson.target == "cudasim"
if lesson.target in ("cudasim", "cuda"):
    from numba import cuda

    to_target, to_host, empty = cuda.to_device, (lambda a: a.copy_to_host()), cuda.device_array
else:
    to_target, to_host, empty = np.ascontiguousarray, np.asarray, np.empty

BIG_T, BIG_H = 4096 // tp * tp, 1024      # 16 MiB of float32 (T a multiple of tp: see below)
pb = PeerBuffers(BIG_T * BIG_H * 4 if lesson.target == "cuda" else 4096, group)
signals = PeerSignals(group, backend=pb.backend)
lesson.say(f"{pb}, flags {list(signals.names)}")

# %%
# Reduce-scatter, small enough to read
# ------------------------------------
#
# ``T = 7`` tokens, ``H = 4``; rank r's partial is ``(t + 1) * 10**r`` in every column of
# row t, so in the sum each decimal digit tells which rank contributed.  With ``tp = 2``: ``R = 4``, rank 0 owns tokens 0..3 and rank 1
# owns tokens 4..6 plus one zero row of padding.  Protocol of one step: wait until peers
# are done with my buffer (``consumed``), write my partial into my peer buffer, raise
# ``inbox_ready`` on everyone, wait for everyone's, sum *my* row block straight out of
# every peer's buffer, raise ``consumed``.  Both collectives share that protocol:
#
# .. vt-source:: vtnumba.dist.collectives._exchange
#
# The sum itself is two small kernels over row blocks -- the first two sources added in one
# pass, each further one accumulated -- one CUDA thread per output element; on a GPU the
# loads of ``a``, ``b`` and ``src`` go to the *peers'* memory, over NVLink or PCIe:
#
# .. vt-source:: vtnumba.kernels.reduce_cuda.add_rows_kernel
#
# .. vt-source:: vtnumba.kernels.reduce_cuda.accumulate_rows_kernel
T, H = 7, 4
R = -(-T // tp)
x = np.repeat(((np.arange(T) + 1) * 10.0 ** rank)[:, None], H, axis=1).astype(np.float32)
out = empty((R, H), np.float32)
reduce_scatter(pb, to_target(x), out, signals)
mine = to_host(out)
blocks = lesson.comm.gather(mine[:, 0].tolist(), root=0)
if rank == 0:
    for r in range(tp):
        lesson.say(f"  rank {r} (tokens {r * R}..{min(T, r * R + R) - 1}) holds column 0 = {blocks[r]}")
expect = np.zeros((R, H), np.float32)
rows = max(0, min(R, T - rank * R))
expect[:rows] = (np.arange(rank * R, rank * R + rows)[:, None] + 1) * sum(10.0 ** r for r in range(tp))
lesson.check(np.array_equal(mine, expect), "each rank holds the sum of its token rows; the padding is zero")

# %%
# Against numpy and MPI
# ---------------------
#
# The same with random partials.  Every rank can rebuild every
# rank's partial from its seed, so every rank computes the numpy reference itself.  Two
# MPI baselines: vtnumba's ``mpi_reduce_scatter`` (same contract), and mpi4py's
# ``Reduce_scatter_block`` called by hand -- it needs equal blocks, so ``T`` is padded to
# ``tp * R`` rows with zeros first.  The peer version sums in rank order; MPI may add in
# another order, so for more than two ranks the last bits can differ.
T, H = 37, 24
R = -(-T // tp)
partials = [np.random.default_rng(70 + r).standard_normal((T, H), dtype=np.float32) for r in range(tp)]
reference = np.sum(np.stack(partials).astype(np.float64), axis=0)
ref_block = np.zeros((R, H))
ref_block[:max(0, min(R, T - rank * R))] = reference[rank * R:(rank + 1) * R]

peer_out = to_host(reduce_scatter(pb, to_target(partials[rank]), empty((R, H), np.float32), signals))
mpi_out = to_host(mpi_reduce_scatter(to_target(partials[rank]), empty((R, H), np.float32), group))
padded = np.zeros((tp * R, H), np.float32)
padded[:T] = partials[rank]
raw = np.empty((R, H), np.float32)
group.comm.Reduce_scatter_block(padded, raw, op=MPI.SUM)
err = float(np.max(np.abs(peer_out - ref_block)))
lesson.say(f"reduce-scatter, T={T} on {tp} ranks (R={R}): max |peer - numpy float64| {err:.1e}, "
           f"max |peer - MPI| {np.max(np.abs(peer_out - mpi_out)):.1e}, max |peer - raw mpi4py| "
           f"{np.max(np.abs(peer_out - raw)):.1e}")
lesson.check(err < 1e-5 and np.allclose(peer_out, mpi_out, atol=1e-5) and np.allclose(peer_out, raw, atol=1e-5),
             "peer reduce-scatter == numpy == MPI_Reduce_scatter_block")

# %%
# All-gather
# ----------
#
# Each rank contributes its ``[R, H]`` block; every rank ends with the
# ``[T, H]`` result -- rank j's rows at ``j * R``, the padding rows dropped.  Gathering the
# reduce-scatter's output gives back the whole sum on every rank: reduce-scatter followed
# by all-gather *is* an all-reduce, which is exactly how TPSP splits one.  mpi4py's
# ``Allgather`` again needs ``tp * R`` rows, cut to ``T`` afterwards.
gathered = to_host(all_gather(pb, to_target(peer_out), empty((T, H), np.float32), signals))
mpi_gathered = to_host(mpi_all_gather(to_target(peer_out), empty((T, H), np.float32), group))
raw_all = np.empty((tp * R, H), np.float32)
group.comm.Allgather(peer_out, raw_all)
err = float(np.max(np.abs(gathered - reference)))
lesson.say(f"all-gather of the blocks: max |result - numpy all-reduce| {err:.1e}; identical to MPI_Allgather: "
           f"{np.array_equal(gathered, mpi_gathered) and np.array_equal(gathered, raw_all[:T])}")
lesson.check(err < 1e-5 and np.array_equal(gathered, mpi_gathered) and np.array_equal(gathered, raw_all[:T]),
             "peer all-gather == MPI_Allgather, and RS + AG == all-reduce")

# %%
# Awkward sizes
# -------------
#
# ``T < tp`` leaves some ranks only padding; any ``T`` must work.
for T_small in (1, tp + 1, 3 * tp + 1):
    R_small = -(-T_small // tp)
    part = partials[rank][:T_small, :3].copy()
    blk = reduce_scatter(pb, to_target(part), empty((R_small, 3), np.float32), signals)
    back = to_host(all_gather(pb, blk, empty((T_small, 3), np.float32), signals))
    want = reference[:T_small, :3]
    lesson.check(np.allclose(back, want, atol=1e-5), f"T={T_small} on {tp} ranks: RS + AG == all-reduce")

# %%
# Flags raised by the queue
# -------------------------
#
# Above, the *host* raises and awaits every flag, so inside each call it synchronizes the
# queue twice: my partial must be in my buffer before ``inbox_ready`` goes up, and my sum
# must be done before ``consumed`` does.  ``QueuedSignals`` queues the same waits and
# signals on the queue itself (:class:`~vtnumba.dist.QueueFlags`; on a GPU
# ``cuStreamWaitValue32`` / ``cuStreamWriteValue32``): the host checks that every rank
# called with the same shapes (one handshake), queues the whole step, and waits once at
# the end -- how TPSP's exchange runs between chunks, with no host in between.  The
# results are the same bytes.  (Switching channels on one buffer: the host-flag channel's
# last readers must be done with my buffer first -- ``wait_consumed`` -- and closing the
# queued one is collective, so its readers are done when it is closed.)
#
# .. vt-source:: vtnumba.dist.collectives._exchange_queued
from vtnumba.dist import QueuedSignals  # noqa: E402

signals.wait_consumed()
with QueuedSignals(group, pb.backend) as queued:
    q_out = to_host(reduce_scatter(pb, to_target(partials[rank]), empty((R, H), np.float32), queued))
    q_gathered = to_host(all_gather(pb, to_target(q_out), empty((T, H), np.float32), queued))
    q_steps = queued.epoch
lesson.say(f"queued flags, {q_steps} steps: reduce-scatter identical to the host-flag one: "
           f"{np.array_equal(q_out, peer_out)}; all-gather identical: {np.array_equal(q_gathered, gathered)}")
lesson.check(np.array_equal(q_out, peer_out) and np.array_equal(q_gathered, gathered) and q_steps == 2,
             "reduce-scatter and all-gather with queued flags == with host flags")

# %%
# Time across sizes
# -----------------
#
# From 256 KiB to 16 MiB per rank (``[T, 1024]`` float32, T a multiple of tp).  A
# collective is as slow as its slowest rank, so every round starts with a barrier and
# counts the slowest rank's time; the figure shows the median round and the p10-p90
# spread, as bandwidth: the bytes of one rank's ``[T, H]`` array over the time.  MPI is
# called the plain blocking way (``timeout_s=None``), the stock baseline.  In the
# simulator, device memory is host memory but every kernel is Python threads, so this
# part uses peer buffers in host memory there (a ``CPUBackend``); on a GPU it times device
# memory, and MPI (not CUDA-aware here) has to stage through the host.
if lesson.target == "cuda":
    big_pb, big_sig = pb, signals
else:
    from vtnumba import CPUBackend

    host = CPUBackend()
    big_pb = PeerBuffers(BIG_T * BIG_H * 4, group, host)
    big_sig = PeerSignals(group, backend=host)
    to_target, to_host, empty = np.ascontiguousarray, np.asarray, np.empty


def slowest_rounds(fn, rounds=11):
    """Per round: barrier, time ``fn()``; the slowest rank's time of each round (seconds)."""
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    slowest = np.empty(rounds)
    lesson.comm.Allreduce(np.array(times), slowest, op=MPI.MAX)  # element-wise: the slowest rank per round
    return stats_from_times(slowest)


series = {"reduce_scatter, peer buffers": [], "reduce_scatter, MPI": [], "all_gather, peer buffers": [],
          "all_gather, MPI": []}
for rows in (64, 256, 1024, BIG_T):
    T_t = rows // tp * tp
    R_t = T_t // tp
    bx = to_target(np.random.default_rng(rank).standard_normal((T_t, BIG_H), dtype=np.float32))
    bshard, bfull = empty((R_t, BIG_H), np.float32), empty((T_t, BIG_H), np.float32)
    # The MPI rows time the stock collective alone: the blocking call (timeout_s=None), without
    # the small agreement on shapes that guards everyday calls (agree=False).
    stock = dict(timeout_s=None, agree=False)
    st = {
        "reduce_scatter, peer buffers": slowest_rounds(lambda: reduce_scatter(big_pb, bx, bshard, big_sig)),
        "reduce_scatter, MPI": slowest_rounds(lambda: mpi_reduce_scatter(bx, bshard, group, **stock)),
        "all_gather, peer buffers": slowest_rounds(lambda: all_gather(big_pb, bshard, bfull, big_sig)),
        "all_gather, MPI": slowest_rounds(lambda: mpi_all_gather(bshard, bfull, group, **stock)),
    }
    nbytes = T_t * BIG_H * 4
    for name in series:
        series[name].append((nbytes, as_rate(st[name], nbytes)))
    ms = {name: v.median_s * 1e3 for name, v in st.items()}
    lesson.say(f"{human_bytes(nbytes):>7}: reduce_scatter peer {ms['reduce_scatter, peer buffers']:6.2f} ms, MPI "
               f"{ms['reduce_scatter, MPI']:6.2f} ms; all_gather peer {ms['all_gather, peer buffers']:6.2f} ms, MPI "
               f"{ms['all_gather, MPI']:6.2f} ms (slowest rank, median of 11)")
lesson.perf_plot("collectives.png", "Reduce-scatter and all-gather over peer buffers against MPI, from 256 KiB to "
                 "16 MiB per rank (slowest rank per round).  Both sides move the same bytes through the same memory "
                 "on this machine; which is faster depends on copies and synchronisation, and the ratio is what "
                 "carries over to other machines, not the absolute numbers.", series,
                 xlabel="bytes of one rank's [T, 1024] float32 array", ylabel="GB/s (array bytes / time)",
                 title=f"07: collectives over peer buffers vs MPI, {tp} ranks", logy=True)
big_ms = {name: points[-1][1][0] for name, points in series.items()}

# %%
# All-gather in place
# -------------------
#
# The out-of-place all-gather copies twice: my block into my peer buffer, then every block
# into ``out``.  In place (NCCL's convention) ``out`` *is* my peer buffer, my block already
# sits in my rows of it, and each rank copies only its peers' rows.  Putting the block
# there is a write into my own peer buffer outside a collective, so first
# ``wait_consumed()``: a slower peer may still be reading my buffer from the last call.
# (Zero-copy needs my whole block inside ``out``, hence ``T`` a multiple of ``tp`` here; a
# last rank whose block runs past ``T`` would have its rows staged instead.)
in_place_out = big_pb.views(np.float32, (BIG_T, BIG_H), 0)[rank]
my_rows = in_place_out[rank * R_t:(rank + 1) * R_t]
big_sig.wait_consumed()
if isinstance(my_rows, np.ndarray):
    np.copyto(my_rows, bshard)
else:
    my_rows.copy_to_device(bshard)  # device to device (bshard lives on the GPU too) ...
    cuda.synchronize()              # ... finished before the collective raises its flag
in_place = slowest_rounds(lambda: all_gather(big_pb, my_rows, in_place_out, big_sig))
same = np.array_equal(to_host(in_place_out), to_host(bfull))
gbs_in_place = BIG_T * BIG_H * 4 / in_place.median_s / 1e9
lesson.say(f"16 MiB all_gather in place: {in_place.median_s * 1e3:6.2f} ms ({gbs_in_place:.1f} GB/s) against "
           f"{big_ms['all_gather, peer buffers']:.1f} GB/s out of place and {big_ms['all_gather, MPI']:.1f} GB/s "
           f"for MPI; same result as out of place: {same}")
lesson.check(same and in_place.median_s > 0, "the timed collectives ran; in place == out of place")

# %%
# Teardown
# --------
#
# Flags and buffers are collective to close (synchronize, barrier, unmap,
# barrier, free).
if big_pb is not pb:
    big_sig.close()
    big_pb.close()
signals.close()
pb.close()
destroy_distributed()
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * Rank 0 holds ``[11, 22, 33, 44]``, rank 1 ``[55, 66, 77, 0]``: each rank's rows of the
#   sum, the last block padded with zero.
# * Peer results identical to MPI's (``0.0e+00``) for two ranks, within ``1e-5`` of float64.
# * The figure: four lines from 256 KiB to 16 MiB.  On one machine both sides copy through
#   the same memory, so they are within a small factor of each other; small sizes are
#   dominated by the per-call cost (flags, barriers, Python), large ones by bandwidth.
#   The in-place all-gather skips a copy and is faster than the out-of-place one.
#
# Common issues
# -------------
#
# * Every rank must call each collective with the same shapes.  A mismatch is detected
#   after the flags (each rank publishes its shapes) and raises the same ``ValueError`` on
#   every rank -- but a rank that skips a call entirely makes the others time out.
# * Writing into your own peer buffer *before* a collective (a zero-copy input) races
#   with a slower peer still reading the previous step: call ``signals.wait_consumed()``
#   first.  The collectives guard their own writes.
# * ``MPI_Reduce_scatter_block`` and ``MPI_Allgather`` need ``tp * R`` rows: pad ``T`` with
#   zeros (``mpi_reduce_scatter`` / ``mpi_all_gather`` do it for you).
# * On a laptop both ranks share the cores and the memory bus, so ratios, not absolute
#   times, are what carries over to other machines.
#
# Try next
# --------
#
# 1. Run with ``mpiexec -n 3`` and ``-n 4``: the reduce-scatter's bytes read per rank grow
#    as ``(tp - 1) / tp`` of the array; does the peer line follow?
# 2. Build an all-reduce as ``reduce_scatter`` followed by ``all_gather`` and time it
#    against ``group.comm.Allreduce`` across the same sizes.
