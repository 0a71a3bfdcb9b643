"""Benchmark: the fused TPSP op vs. the matmul alone and the unfused mpi4py forward, in one run.

Run under MPI: ``mpiexec -n 2 python -m vtnumba bench tpsp [--quick] [--json] [--plot]``.
Per token count ``T`` (full: 64 ... 4096 tokens, ``K = 4096`` split over the ranks,
``H = 4096``, float32; ``--quick``: ``T`` from 64 to 1024 with ``K = H = 1024``) three
implementations get the same inputs:

* ``matmul-only``   -- the projection alone, the floor both others stand on:
  ``np.matmul(x, W.T, out=p)`` on the host; on the cuda targets the same matmul kernel the
  fused op launches (:func:`vtnumba.kernels.linear` on device arrays, synchronised);
* ``mpi-baseline``  -- the regular (unfused) forward written with stock parts: numpy
  matmul, ``Reduce_scatter_block``, numpy bias + residual + RMSNorm, ``Allgather``
  (blocking mpi4py calls; receive buffers allocated once, as a careful user would).  On
  the cuda targets it is :func:`vtnumba.tpsp.regular_matmul_rs_norm_ag` on the same device
  arrays (what :class:`~vtnumba.tpsp.TPSPOp` falls back to), so that both sides start
  from device memory;
* ``vtnumba-fused`` -- :meth:`HostTPSPBackend.tpsp_matmul_rs_norm_ag` (``CudaTPSPBackend`` on
  the cuda targets) with preallocated outputs: the call :class:`vtnumba.tpsp.TPSPOp` makes.

**How it is timed.**  Every time is the slowest rank's for one call (barrier first,
all-reduce MAX after).  The three run in *rounds*, one call of each per round, the matmul
always in the middle (``baseline, matmul, fused`` then ``fused, matmul, baseline``): each
of the other two runs right beside the matmul, before it in one round and after it in
the next.  The rows report each implementation's median over rounds with p10/p90.

**Time above the matmul.**  What fusing can save is what the fused op spends *beyond*
its matmul.  It is measured per round, ``fused[i] - matmul[i]`` (and ``baseline[i] -
matmul[i]``), then summarised as the median and p10/p90 of those differences
(:func:`vtnumba.bench.timing.paired_differences`).  The difference of two separately
taken medians would carry the noise of the large matmul into the small overhead, and
came out negative on a busy machine; the paired difference cancels what slows a whole
round.  Nothing is clamped: where the p10..p90 of the differences includes 0, a note says
the overhead is within noise.  The ratios ``fused / matmul`` and ``fused / baseline`` are
paired the same way (median of per-round ratios, with p10/p90 in the ``paired`` rows).
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import cdiv
from vtnumba.bench import schema
from vtnumba.bench.timing import (
    measure,
    paired_differences,
    paired_ratios,
    progress_step,
    stats_from_times,
    time_rounds_on_group,
)

FULL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_TOKENS = (64, 128, 256, 512, 1024)
REFERENCE_T = 2048
EPS = 1e-6

MATMUL, BASELINE, FUSED = "matmul-only", "mpi-baseline", "vtnumba-fused"
#: Round orders: the matmul in the middle, so each other impl runs right beside it, on alternating sides.
ORDERS = [[BASELINE, MATMUL, FUSED], [FUSED, MATMUL, BASELINE]]
TIME_GROUP = "time per call"
ABOVE_GROUP = "time above the matmul (paired in each round)"
RATIO_GROUP = "time ratio (paired in each round)"


def add_arguments(parser) -> None:
    """The suite's own flags: ``--tokens``, ``--hidden``, ``--k-total``, ``--chunk``, ``--exchange``, ``--repeat``."""
    from vtnumba.bench.runner import positive_int

    parser.add_argument("--tokens", type=positive_int, nargs="+", default=None,
                        help="token counts T (default 64 128 ... 4096; --quick: 64 128 ... 1024)")
    parser.add_argument("--hidden", type=positive_int, default=None,
                        help="hidden size H, a multiple of the rank count (default 4096; quick 1024; rounded up to a "
                             "multiple of 8 x ranks)")
    parser.add_argument("--k-total", type=positive_int, default=None,
                        help="projection input size K over all ranks (default 4096; quick 1024)")
    parser.add_argument("--chunk", type=positive_int, default=None, help="TPSP microchunk rows per rank (default: backend's)")
    parser.add_argument("--exchange", choices=("push", "pull"), default=None,
                        help="TPSP exchange mode (default: pull on the cpu target, push on cudasim and cuda)")
    parser.add_argument("--repeat", type=positive_int, default=None, help="timed rounds per T (default 11; quick 7)")


def _settings(args, tp: int, target: str) -> tuple[list[int], int, int, int]:
    """``(tokens, H, K_total, rounds)`` from the flags, the defaults and the target."""
    from vtnumba.bench.runner import default_hidden_size

    quick = bool(getattr(args, "quick", False))
    given_tokens = getattr(args, "tokens", None)
    given = (given_tokens, getattr(args, "hidden", None), getattr(args, "k_total", None), getattr(args, "repeat", None))
    # np.percentile interpolates: with n rounds the p10 lies 0.1 * (n - 1) of the way from the
    # fastest round to the next, so --quick takes seven rounds: one odd round cannot set p10/p90 alone.
    # The hidden size is split over the ranks: the default is rounded up to a multiple of 8 x the
    # rank count (4096 on 2 and 4 ranks, 4104 on 3 -- which failed every rank's open before).
    defaults = ((QUICK_TOKENS if quick else FULL_TOKENS), default_hidden_size(1024 if quick else 4096, tp),
                (1024 if quick else 4096), (7 if quick else 11))
    if target == "cudasim":  # the simulator runs ~7000 threads/s: tiny defaults (the flags given still count)
        defaults = ([4, 8], 8 * tp, 16, 2)
    tokens, H, K_total, repeat = (g if g else d for g, d in zip(given, defaults))
    return [int(t) for t in tokens], H, K_total, repeat


def check_arguments(args, world_size: int) -> None:
    """The hidden size is split over the ranks: ValueError naming ``--hidden`` unless they divide it;
    and a token count whose arrays cannot fit in memory is named too (it was a MemoryError inside
    the suite).  A rank holds x [T, K], out and the residuals [T, H] and its weight share."""
    from vtnumba.bench.runner import check_hidden_split, check_sizes_fit

    H = getattr(args, "hidden", None)
    if H is not None:
        check_hidden_split(H, world_size)
    K = getattr(args, "k_total", None) or 4096
    H = H or 4096
    for T in getattr(args, "tokens", None) or ():
        check_sizes_fit([4 * T * (K + 3 * H)], f"--tokens {T} (with H={H}, K={K})")


def estimate_s(args, ranks: int):
    """A lower bound on the suite's time on the cpu target: the matmul work alone.

    Each round makes three calls that each contain this rank's ``T x K/tp x H`` matmul;
    a test matmul measured now gives the rate.  The exchange and the norm come on top, so
    the real run takes longer.  Returns ``(seconds, how it was estimated)`` or None."""
    from vtnumba.target import current_target

    if current_target().name != "cpu":
        return None  # device matmul rates are not what the host measures
    tokens, H, K_total, repeat = _settings(args, ranks, "cpu")
    K = cdiv(K_total, ranks)
    m, k, n = 128, min(K, 2048), min(H, 2048)
    a = np.ones((m, k), np.float32)
    b = np.ones((n, k), np.float32)
    out = np.empty((m, n), np.float32)
    st = measure(lambda: np.matmul(a, b.T, out=out), repeat=3, warmup=1)
    flops_per_s = 2.0 * m * k * n / st.median_s
    calls = (repeat + 1) * 3 + 2  # warm-up round, timed rounds, and the parity check's two calls
    seconds = sum(calls * 2.0 * T * K * H for T in tokens) / flops_per_s
    return seconds, f"at least: the matmuls alone at {flops_per_s / 1e9:.0f} GFLOP/s, measured just now"


def _baseline(group, x, w, bias, residual, norm_w, p, y_pad, y, gathered):
    """The stock unfused forward (numpy + blocking mpi4py), RMSNorm."""
    from mpi4py import MPI

    np.matmul(x, w.T, out=p)
    send = p
    if y_pad is not None:  # Reduce_scatter_block needs tp equal blocks: pad T up to tp*R
        y_pad[:p.shape[0]] = p
        send = y_pad
    group.comm.Reduce_scatter_block(send, y, op=MPI.SUM)
    z = y + bias
    z += residual
    normed = z * (1.0 / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + EPS)) * norm_w
    normed = normed.astype(np.float32, copy=False)
    group.comm.Allgather(normed, gathered)
    return gathered, z


def _measure(group, backend, handle, T, K, H, w, bias, norm_w, rng, repeat, device):
    """Per-round times of the three implementations at ``T`` tokens, and the fused-vs-baseline difference."""
    from mpi4py import MPI

    tp = group.size
    R = cdiv(T, tp)
    x = rng.standard_normal((T, K), dtype=np.float32)
    residual = rng.standard_normal((R, H), dtype=np.float32)
    p = np.empty((T, H), np.float32)
    y = np.empty((R, H), np.float32)
    y_pad = np.zeros((tp * R, H), np.float32) if tp * R != T else None
    gathered = np.empty((tp * R, H), np.float32)
    if device:
        from numba import cuda

        from vtnumba.kernels import linear

        dx, dw, db, dres, dnw = (cuda.to_device(a) for a in (x, w, bias, residual, norm_w))
        dout, dnew = cuda.device_array((T, H), np.float32), cuda.device_array((R, H), np.float32)
        dp = cuda.device_array((T, H), np.float32)
        matmul_only = lambda: linear(dx, dw, out=dp)  # noqa: E731  (no queue: finished on return)
        # On a device the regular forward must start from the same device arrays: vtnumba's
        # regular path (device matmul and norm, MPI through host memory), not a host matmul
        # that would compare a CPU with a GPU.
        from vtnumba.tpsp import regular_matmul_rs_norm_ag

        dreg, dreg_res = cuda.device_array((T, H), np.float32), cuda.device_array((R, H), np.float32)
        regular = lambda: regular_matmul_rs_norm_ag(group, dx, dw, db, dres, dnw, EPS, out=dreg,  # noqa: E731
                                                    new_residual=dreg_res, timeout_s=None, agree=False)
    else:
        dx, dw, db, dres, dnw = x, w, bias, residual, norm_w
        dout, dnew = np.empty((T, H), np.float32), np.empty((R, H), np.float32)
        matmul_only = lambda: np.matmul(x, w.T, out=p)  # noqa: E731
        regular = lambda: _baseline(group, x, w, bias, residual, norm_w, p, y_pad, y, gathered)  # noqa: E731

    def fused():
        return backend.tpsp_matmul_rs_norm_ag(handle, dx, dw, db, dres, dnw, EPS, out=dout, new_residual=dnew)

    impls = {MATMUL: matmul_only, BASELINE: regular, FUSED: fused}
    times = time_rounds_on_group(group, impls, repeat, orders=ORDERS)
    # Parity while we are here: the fused result must equal the baseline's.
    ref, _ = _baseline(group, x, w, bias, residual, norm_w, p, y_pad, y, gathered)
    got, _ = fused()
    got = got.copy_to_host() if device else got
    err = group.cpu_comm.allreduce(float(np.max(np.abs(got - ref[:T]))), op=MPI.MAX)
    return times, err


def _ms(x: float) -> str:
    return f"{schema.format_number(x * 1e3, 3)} ms"


def _span(ps, fmt) -> str:
    return f"{fmt(ps.median)} (p10 {fmt(ps.p10)}, p90 {fmt(ps.p90)})"


def _list(ts: list[int]) -> str:
    return ", ".join(str(t) for t in ts)


def run(args) -> dict:
    """Measure every ``T`` on every rank of the group; returns the suite result (see the module docstring)."""
    from vtnumba.dist import distributed

    # The groups are freed at the end only if this call created them (run alone, not from the runner).
    with distributed() as group:
        return _run_on(group, args)


def _run_on(group, args) -> dict:
    from vtnumba.target import current_target
    from vtnumba.tpsp import get_tpsp_backend

    tp, rank = group.size, group.rank
    if tp < 2:
        raise RuntimeError("bench tpsp needs at least 2 ranks: run it under mpiexec -n 2")
    target = current_target().name
    tokens, H, K_total, repeat = _settings(args, tp, target)
    K = K_total // tp + (1 if rank < K_total % tp else 0)

    kwargs = {} if getattr(args, "exchange", None) is None else {"exchange": args.exchange}
    backend = get_tpsp_backend("tp", **kwargs)
    handle = backend.open(tp_size=tp, hidden_size=H, max_batched_tokens=max(tokens), name="bench")
    if handle is None:
        raise RuntimeError("TPSP could not be opened on every rank (no peer memory?); nothing to benchmark")
    if getattr(args, "chunk", None):
        backend.set_config(handle, int(args.chunk))
    chunk = handle.config.chunk_tokens_per_rank

    rng = np.random.default_rng(1234 + rank)
    shared = np.random.default_rng(99)
    w = rng.standard_normal((H, K), dtype=np.float32) / np.float32(np.sqrt(K_total))
    bias = shared.standard_normal(H, dtype=np.float32)
    norm_w = (1 + 0.1 * shared.standard_normal(H)).astype(np.float32)
    results, paired, ratios, notes = [], [], {}, []
    noisy_above, faster, slower, even = [], [], [], []
    summary = None
    try:
        for i, T in enumerate(tokens, 1):
            progress_step(f"T={T}", i, len(tokens))
            times, err = _measure(group, backend, handle, T, K, H, w, bias, norm_w, rng, repeat, target != "cpu")
            if err > 1e-3:
                notes.append(f"T={T}: fused output differs from the baseline by {err:.3g}")
            for impl in (MATMUL, FUSED, BASELINE):
                st = stats_from_times(times[impl])
                # The case keeps its per-T name (older readers of the JSON use it); the group
                # puts every T on one line per implementation in the plots.
                results.append(schema.row(f"tpsp T={T}", impl, T, "tokens", "ms", st.median_s * 1e3, st,
                                          group=TIME_GROUP))
            above_f = paired_differences(times[FUSED], times[MATMUL])
            above_b = paired_differences(times[BASELINE], times[MATMUL])
            f_over_m = paired_ratios(times[FUSED], times[MATMUL])
            f_over_b = paired_ratios(times[FUSED], times[BASELINE])
            for impl, ps in ((f"{FUSED} - {MATMUL}", above_f), (f"{BASELINE} - {MATMUL}", above_b)):
                paired.append(schema.paired_row("tpsp above the matmul", impl, T, "tokens", "ms", ps, scale=1e3,
                                                group=ABOVE_GROUP))
            for impl, ps in ((f"{FUSED} / {MATMUL}", f_over_m), (f"{FUSED} / {BASELINE}", f_over_b)):
                paired.append(schema.paired_row("tpsp time ratio", impl, T, "tokens", "ratio", ps, group=RATIO_GROUP))
            ratios[f"fused / baseline T={T}"] = f_over_b.median
            ratios[f"fused / matmul T={T}"] = f_over_m.median
            if above_f.contains(0.0):
                noisy_above.append(T)
            (even if f_over_b.contains(1.0) else faster if f_over_b.median < 1 else slower).append(T)
            if T == REFERENCE_T or summary is None or (T == tokens[-1] and REFERENCE_T not in tokens):
                summary = (f"T={T}: above the matmul ({_ms(np.median(times[MATMUL]))}) the fused op spends "
                           f"{_span(above_f, _ms)} per call, the regular forward {_span(above_b, _ms)}; "
                           f"fused / regular = {_span(f_over_b, lambda v: schema.format_number(v, 3))}")
    finally:
        backend.close(handle)
        backend.close()
    notes.append(summary)
    verdict = []
    if faster:
        verdict.append(f"faster than the regular forward at T = {_list(faster)}")
    if slower:
        verdict.append(f"slower than the regular forward at T = {_list(slower)}")
    if even:
        verdict.append(f"within noise of the regular forward at T = {_list(even)} (the p10..p90 of the per-round "
                       "fused / regular includes 1)")
    notes.append("the fused op is " + "; ".join(verdict))
    if noisy_above:
        notes.append(f"T = {_list(noisy_above)}: the fused op's time above the matmul is within noise (the p10..p90 "
                     "of the per-round differences includes 0): the rounds disagree on its sign, so its median is "
                     "neither an overhead nor a saving; more --repeat or a quieter machine can settle it")
    notes.append("above the matmul = fused - matmul (and baseline - matmul) in the same round, median and p10/p90 "
                 "over rounds; never the difference of two separately noisy medians")
    if target == "cudasim":
        notes.append("cudasim: these times measure numba's simulator (a Python loop per GPU thread), not a GPU; "
                     "they show that the code path runs, and compare nothing")
    notes.append(f"shapes: K={K_total} over {tp} ranks, H={H}, float32, RMSNorm; TPSP chunk {chunk} rows/rank, "
                 f"exchange={backend.exchange}; times are the slowest rank's, {repeat} interleaved rounds per T")
    if target != "cpu":
        from vtnumba.kernels.matmul import VARIANT_ENV, default_variant

        notes.append(f"matmul kernel: {default_variant()} for the fused op, the matmul alone and the baseline alike "
                     f"(${VARIANT_ENV} picks another rung for all three)")
    return schema.suite("tpsp", target, tp, results, ratios, {}, notes, paired=paired)


__all__ = ["run", "add_arguments", "estimate_s"]
