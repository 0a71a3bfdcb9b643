"""Benchmark: the fused TPSP op vs. the unfused mpi4py forward, on the same shapes, in one run.

Run under MPI: ``mpiexec -n 2 python -m vtnumba bench tpsp [--quick] [--json out.json]``.
Per token count ``T`` (full: 64 ... 4096 tokens, ``K = 4096`` split over the ranks,
``H = 4096``, float32; ``--quick``: ``T`` in 64, 256, 1024 with ``K = H = 1024``) three
implementations get the same inputs:

* ``matmul-only``   -- the projection alone, the floor both others stand on:
  ``np.matmul(x, W.T, out=p)`` on the host; on the cuda targets the same matmul kernel the
  fused op launches (:func:`vtnumba.kernels.linear` on device arrays, synchronised);
* ``mpi-baseline``  -- the stock unfused forward: numpy matmul, ``Reduce_scatter_block``,
  numpy bias + residual + RMSNorm, ``Allgather`` (blocking mpi4py calls; receive buffers
  allocated once, as a careful user would);
* ``vtnumba-fused`` -- :meth:`HostTPSPBackend.tpsp_matmul_rs_norm_ag` (``CudaTPSPBackend`` on
  the cuda targets) with preallocated outputs.

Every time is the slowest rank's for one call (barrier first, all-reduce MAX after), the
three measured *interleaved* round by round so a noisy neighbour slows all of them alike;
the value is the median over rounds (p10/p90 kept).  Ratios: ``fused / baseline`` per
``T``, and the headline -- the time each spends *above the matmul*,
``(fused - matmul) / (baseline - matmul)``, each the median of per-round differences (a
busy neighbour slows a whole round, and the difference cancels it) -- at every ``T``, with
the reference shape ``T = 2048`` spelled out in the notes.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import cdiv
from vtnumba.bench import schema
from vtnumba.bench.timing import stats_from_times, time_rounds_on_group

FULL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_TOKENS = (64, 256, 1024)
REFERENCE_T = 2048
EPS = 1e-6


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="token counts T (default 64 128 ... 4096; --quick: 64 256 1024)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size H (default 4096; quick 1024)")
    parser.add_argument("--k-total", type=int, default=None,
                        help="projection input size K over all ranks (default 4096; quick 1024)")
    parser.add_argument("--chunk", type=int, default=None, help="TPSP microchunk rows per rank (default: backend's)")
    parser.add_argument("--exchange", choices=("push", "pull"), default=None, help="TPSP exchange mode")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds per T (default 11; quick 3)")


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
    """Times of the three implementations at ``T`` tokens, and the fused-vs-baseline difference."""
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
    else:
        dx, dw, db, dres, dnw = x, w, bias, residual, norm_w
        dout, dnew = np.empty((T, H), np.float32), np.empty((R, H), np.float32)
        matmul_only = lambda: np.matmul(x, w.T, out=p)  # noqa: E731

    def fused():
        return backend.tpsp_matmul_rs_norm_ag(handle, dx, dw, db, dres, dnw, EPS, out=dout, new_residual=dnew)

    impls = {
        "matmul-only": matmul_only,
        "mpi-baseline": lambda: _baseline(group, x, w, bias, residual, norm_w, p, y_pad, y, gathered),
        "vtnumba-fused": fused,
    }
    times = time_rounds_on_group(group, impls, repeat)
    # Parity while we are here: the fused result must equal the baseline's.
    ref, _ = _baseline(group, x, w, bias, residual, norm_w, p, y_pad, y, gathered)
    got, _ = fused()
    got = got.copy_to_host() if device else got
    err = group.cpu_comm.allreduce(float(np.max(np.abs(got - ref[:T]))), op=MPI.MAX)
    return times, err


def run(args) -> dict:
    from vtnumba.dist import get_tp_group, init_distributed, is_initialized
    from vtnumba.target import current_target
    from vtnumba.tpsp import get_tpsp_backend

    group = init_distributed() if not is_initialized() else get_tp_group()
    tp, rank = group.size, group.rank
    if tp < 2:
        raise RuntimeError("bench tpsp needs at least 2 ranks: run it under mpiexec -n 2")
    quick = bool(getattr(args, "quick", False))
    target = current_target().name
    tokens = getattr(args, "tokens", None) or getattr(args, "sizes", None) or (QUICK_TOKENS if quick else FULL_TOKENS)
    tokens = [int(t) for t in tokens]
    H = getattr(args, "hidden", None) or (1024 if quick else 4096)
    K_total = getattr(args, "k_total", None) or (1024 if quick else 4096)
    repeat = getattr(args, "repeat", None) or (3 if quick else 11)
    if target == "cudasim":  # the simulator runs ~7000 threads/s: keep it tiny
        tokens, H, K_total, repeat = [4, 8], 8 * tp, 16, 1
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
    results, ratios, notes = [], {}, []
    try:
        for T in tokens:
            times, err = _measure(group, backend, handle, T, K, H, w, bias, norm_w, rng, repeat, target != "cpu")
            if err > 1e-3:
                notes.append(f"T={T}: fused output differs from the baseline by {err:.3g}")
            med = {k: float(np.median(v)) for k, v in times.items()}
            for impl, ts in times.items():
                st = stats_from_times(ts)
                results.append(schema.row(f"tpsp T={T}", impl, T, "tokens", "ms", st.median_s * 1e3, st))
            ratios[f"fused / baseline T={T}"] = med["vtnumba-fused"] / med["mpi-baseline"]
            # Time above the matmul from *paired* differences (same round, adjacent in time), so
            # a neighbour's load that slows a whole round cancels out.
            mm = np.asarray(times["matmul-only"])
            over_f = float(np.median(np.asarray(times["vtnumba-fused"]) - mm))
            over_b = float(np.median(np.asarray(times["mpi-baseline"]) - mm))
            if over_b > 0:
                ratios[f"fused above matmul / baseline above matmul T={T}"] = over_f / over_b
            if T == REFERENCE_T or T == tokens[-1]:
                notes.append(f"T={T}: above the matmul the fused op spends {over_f * 1e3:.2f} ms, the baseline "
                             f"{over_b * 1e3:.2f} ms (matmul {med['matmul-only'] * 1e3:.1f} ms)")
    finally:
        backend.close(handle)
        backend.close()
    notes.append(f"shapes: K={K_total} over {tp} ranks, H={H}, float32, RMSNorm; TPSP chunk {chunk} rows/rank, "
                 f"exchange={backend.exchange}; times are the slowest rank's, interleaved rounds")
    return schema.suite("tpsp", target, tp, results, ratios, {}, notes)


__all__ = ["run", "add_arguments"]
