"""Benchmark: reduce-scatter and all-gather over peer buffers vs. mpi4py's collectives.

Run under MPI (``mpiexec -n 2 python -m vtnumba bench peer [--json out.json]``).  For each
total size ``S`` (1-64 MiB; ``--quick``: 1 and 16 MiB) the same float32 data goes through

* ``reduce_scatter`` -- each rank holds ``x [T, H]`` (``S`` bytes) and keeps its summed
  ``[T/n, H]`` block:

    - ``peer-in-buffer``: :func:`vtnumba.dist.reduce_scatter` with ``x`` already in the
      local peer buffer (where a producer such as TPSP's matmul writes it);
    - ``peer-staged``: the same with ``x`` in ordinary memory, staged into the peer buffer
      by the call (only the blocks peers read are copied);
    - ``mpi4py``: ``comm.Reduce_scatter_block`` (the stock baseline);
* ``all_gather`` -- each rank holds a ``[T/n, H]`` shard, everyone gets ``[T, H]`` (``S`` bytes):

    - ``peer-in-buffer`` / ``peer-staged`` as above (``out`` in ordinary memory);
    - ``peer-in-place``: ``out`` itself lives in the peer buffer and the shard is already in
      its own rows (NCCL's in-place convention): each rank copies only its peers' rows;
    - ``mpi4py``: ``comm.Allgather``, and ``mpi4py-in-place``: ``comm.Allgather(MPI.IN_PLACE, out)``
      (the fair partner of ``peer-in-place``: MPI then also skips the own-shard copy).

* ``peer-in-buffer-queued`` (reduce-scatter) and ``peer-in-place-queued`` (all-gather): the
  same calls with their flags raised and awaited in queue order
  (:class:`vtnumba.dist.QueuedSignals`; on a GPU, stream memory operations), so the host
  does not synchronize the queue between a call's steps.  Their ratio to the host-flag
  call says what that saves; on the cpu target's synchronous queues the two do the same
  work, in the same order.

Metric: bus bandwidth as nccl-tests defines it -- ``algbw = S / t``, ``busbw = algbw *
(n-1)/n`` -- in GB/s, where ``t`` is the slowest rank's time for one call.  The
implementations are measured *interleaved* (one call of each per round, rounds repeated)
so a noisy neighbour on the machine slows all of them alike, and every round starts with
a barrier (not timed).  Ratios are peer / mpi4py busbw per size, plus their geometric mean.

**How far from the limit.**  Every peer implementation's busbw is also reported as a
fraction of the copy ceiling measured in the same run (``... busbw / copy traffic``), the
aim of issue 17 being >= 0.6 at 64 MiB: on a GPU a warmed 1 GiB device-to-device copy
(:func:`vtnumba.bench.timing.device_copy_rate`), on the cpu target a 64 MiB memcpy;
both counted as traffic (bytes read + bytes written), measured by rank 0 alone while the
other ranks wait (ranks that share a GPU or a memory bus would otherwise halve it).  Ranks
that share one memory -- two processes on one GPU, or on one host -- must move several
times ``S`` through it per call (:func:`traffic_factor`), so there busbw stays well below
that ceiling even for a perfect collective; ``... memory traffic / copy traffic`` is the
fraction of the memory's limit a call actually reaches.
"""

from __future__ import annotations

import numpy as np

from vtnumba.bench import schema
from vtnumba.bench.timing import device_copy_rate, memcpy_bandwidth_gbs, stats_from_times, time_rounds_on_group

MIB = 1 << 20
FULL_SIZES_MIB = (1, 2, 4, 8, 16, 32, 64)
QUICK_SIZES_MIB = (1, 16)
H = 4096  # row width in float32 elements (16 KiB rows, a typical hidden size)


def add_arguments(parser) -> None:
    """``--sizes``, ``--repeat`` and the suite's other options (see ``vtnumba bench peer --help``)."""
    from vtnumba.bench.runner import positive_int, positive_number

    parser.add_argument("--sizes", type=positive_number, nargs="+", default=None,
                        help="total sizes S in MiB (default 1 2 4 8 16 32 64; --quick: 1 16)")

    parser.add_argument("--repeat", type=positive_int, default=None, help="timed rounds per size (default 15, quick 5)")


def _busbw_gbs(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds / 1e9 * (n - 1) / n if n > 1 else nbytes / seconds / 1e9


def traffic_factor(case: str, impl: str, n: int) -> int:
    """The bytes all ``n`` ranks together read and write in memory for one call, in units of ``S``.

    Bus bandwidth is NCCL's measure of a collective against the *links* between GPUs.  When
    the ranks share one memory (two processes on one GPU, or on one host), the limit is that
    memory instead, and what a call must move through it is (each rank's own share, summed):

    * reduce-scatter, input in the buffer: read my block from all n buffers (S), write it (S/n): (n+1) S;
      staged: each rank first copies into its buffer the n-1 blocks its peers read: + 2(n-1) S;
    * all-gather out of place, shard in the buffer: read all n shards (S), write them to out (S): 2n S;
      staged: + each rank copies its shard (S/n) into its buffer: + 2 S;
      in place: only the n-1 peers' shards move: 2(n-1) S.

    So with the ranks on one memory even a perfect collective's busbw is a small fraction of
    the copy rate -- (n-1) / (n * factor): 1/6 for an in-buffer reduce-scatter at n = 2 --
    and the fraction of the limit actually reached is ``factor * algbw / copy traffic``.
    """
    impl = impl.removesuffix("-queued")  # the same bytes move, whoever raises the flags
    if case == "reduce_scatter":
        return (n + 1) + (2 * (n - 1) if impl == "peer-staged" else 0)
    if case == "all_gather":
        if impl == "peer-in-place":
            return 2 * (n - 1)
        return 2 * n + (2 if impl == "peer-staged" else 0)
    raise ValueError(f"case={case!r}; expected 'reduce_scatter' or 'all_gather'")


def _copy_ceiling(group, backend, on_device: bool) -> tuple[float, str]:
    """(copy traffic GB/s, what was copied), measured on rank 0 while the others wait; same on every rank."""
    import pickle

    from vtnumba.dist import barrier
    from vtnumba.dist.comm import allgather_bytes

    value = None
    if group.rank == 0:
        if on_device:
            rate = device_copy_rate(backend, nbytes=1 << 30, repeat=5)
            value = (rate.traffic_gbs, f"device copy traffic GB/s ({rate.nbytes / MIB:.0f} MiB, {rate.impl})")
        else:
            value = (2 * memcpy_bandwidth_gbs(64 * MIB, repeat=5), "memcpy traffic GB/s (64 MiB, rank 0 alone)")
    # Rank 0's figure to every rank, with a deadline (a plain bcast would wait forever for a
    # rank 0 that stopped): an all-gather of which only rank 0's entry is used.
    value = pickle.loads(allgather_bytes(pickle.dumps(value), group)[0])
    barrier(group)
    return value


def _measure_size(group, backend, size_mib: float, repeat: int, to_target, on_device: bool):
    """Time every implementation on the same data of ``size_mib``; returns (S, times by impl)."""
    from mpi4py import MPI

    from vtnumba import dist

    n, me = group.size, group.rank
    S = int(size_mib * MIB)
    T = max(n, (S // (H * 4)) // n * n)  # rows: a multiple of n (Reduce_scatter_block needs it)
    S = T * H * 4
    R = T // n
    rng = np.random.default_rng(1234 + me)
    x_host = rng.standard_normal((T, H), dtype=np.float32)
    shard_host = rng.standard_normal((R, H), dtype=np.float32)
    # Each rank's peer buffer: [0, S) the reduce-scatter input / all-gather shard,
    # [S, 2S) the in-place all-gather output.
    with dist.PeerBuffers(2 * S, group, backend) as pb, dist.PeerSignals(group, backend=backend) as sig, \
            dist.QueuedSignals(group, backend) as qsig:
        q = pb.queue
        x, shard = to_target(x_host), to_target(shard_host)
        out = to_target(np.zeros((R, H), np.float32))
        gathered = to_target(np.zeros((T, H), np.float32))
        x_in = pb.views(np.float32, (T, H))[me]              # produced in place (e.g. by a matmul)
        shard_in = pb.views(np.float32, (R, H))[me]
        g_inplace = pb.views(np.float32, (T, H), offset=S)[me]
        shard_inplace = g_inplace[me * R:(me + 1) * R]
        backend.order_after_default_stream(q)  # to_target's copies went through the GPU's legacy stream
        for dst, src, nbytes in ((x_in, x, S), (shard_in, shard, R * H * 4), (shard_inplace, shard, R * H * 4)):
            backend.copy(q, dst, src, nbytes)
        backend.synchronize(q)
        g_mpi_inplace = np.zeros((T, H), np.float32)
        g_mpi_inplace[me * R:(me + 1) * R] = shard_host
        stock = dict(timeout_s=None, agree=False)  # the MPI baselines: the stock collectives alone
        impls = {
            ("reduce_scatter", "peer-in-buffer"): lambda: dist.reduce_scatter(pb, x_in, out, sig),
            ("reduce_scatter", "peer-staged"): lambda: dist.reduce_scatter(pb, x, out, sig),
            ("reduce_scatter", "mpi4py"): lambda: dist.mpi_reduce_scatter(x, out, group, **stock),
            ("all_gather", "peer-in-buffer"): lambda: dist.all_gather(pb, shard_in, gathered, sig),
            ("all_gather", "peer-staged"): lambda: dist.all_gather(pb, shard, gathered, sig),
            ("all_gather", "peer-in-place"): lambda: dist.all_gather(pb, shard_inplace, g_inplace, sig, offset=S),
            ("all_gather", "mpi4py"): lambda: dist.mpi_all_gather(shard, gathered, group, **stock),
            # The same in-buffer and in-place calls with their flags queued (QueuedSignals): no
            # host synchronization between the steps of a call.  (Each call starts at a barrier,
            # so no rank writes a buffer a peer is still reading in the other protocol.)
            ("reduce_scatter", "peer-in-buffer-queued"): lambda: dist.reduce_scatter(pb, x_in, out, qsig),
            ("all_gather", "peer-in-place-queued"): lambda: dist.all_gather(pb, shard_inplace, g_inplace, qsig,
                                                                            offset=S),
        }
        if not on_device:  # MPI_IN_PLACE on host memory (the pip mpich is not CUDA-aware)
            impls[("all_gather", "mpi4py-in-place")] = lambda: group.comm.Allgather(MPI.IN_PLACE, g_mpi_inplace)
        return S, time_rounds_on_group(group, impls, repeat)



def check_arguments(args, world_size: int) -> None:
    """``--sizes`` (MiB) must fit in memory (:func:`vtnumba.bench.runner.check_sizes_fit`)."""
    from vtnumba.bench.runner import check_sizes_fit

    check_sizes_fit([mib * (1 << 20) for mib in getattr(args, "sizes", None) or ()])

def run(args) -> dict:
    """Measure the peer-buffer reduce-scatter and all-gather beside mpi4py's collectives on every rank."""
    from mpi4py import MPI

    from vtnumba import dist
    from vtnumba.backend.default import default_backend
    from vtnumba.target import current_target

    target = current_target().name
    if target == "cudasim":
        raise RuntimeError("bench peer measures bandwidth; the CUDA simulator runs ~7000 threads/s, so its numbers "
                           "would mean nothing. Use --target cpu (or cuda on a GPU machine).")
    quick = bool(getattr(args, "quick", False))
    sizes = getattr(args, "sizes", None) or (QUICK_SIZES_MIB if quick else FULL_SIZES_MIB)
    repeat = getattr(args, "repeat", None) or (5 if quick else 15)

    # The groups are freed at the end only if this call created them (run alone, not from the runner).
    with dist.distributed() as group:
        n = group.size
        backend = default_backend()
        results, ratios, notes = [], {}, []
        if n == 1:
            notes.append("ran on 1 rank: there is nothing to exchange, so busbw is reported as algbw; "
                         "run under mpiexec -n 2 for meaningful numbers")
        if target == "cuda":
            notes.append("mpi4py baseline stages through host memory (the pip mpich is not CUDA-aware)")
        on_device = target == "cuda"

        def to_target(a: np.ndarray):
            if not on_device:
                return a
            from numba import cuda

            return cuda.to_device(a)

        per_pair: dict[str, list[float]] = {}
        ceiling_gbs, ceiling_name = _copy_ceiling(group, backend, on_device)
        for size_mib in sizes:
            S, times = _measure_size(group, backend, size_mib, repeat, to_target, on_device)
            # The size measured: S rounded to whole rows (at least one per rank), which busbw
            # uses -- so the rows and ratio keys name it, not the size asked for.
            size_mib = S / MIB
            # The ratios name the size as the table's rows print it ("1008KiB" for the whole rows
            # of 1 MiB over 3 ranks, not "0.984375MiB").
            at = "@" + schema.format_bytes(S).replace(" ", "")
            bw = {}
            for (case, impl), ts in times.items():
                st = stats_from_times(ts)
                bw[(case, impl)] = _busbw_gbs(S, st.median_s, n)
                results.append(schema.row(case, impl, size_mib, "MiB", "busbw GB/s", bw[(case, impl)], st))
            pairs = [("reduce_scatter", "peer-in-buffer", "mpi4py"), ("reduce_scatter", "peer-staged", "mpi4py"),
                     ("all_gather", "peer-in-buffer", "mpi4py"), ("all_gather", "peer-staged", "mpi4py"),
                     ("all_gather", "peer-in-place", "mpi4py"), ("all_gather", "peer-in-place", "mpi4py-in-place"),
                     ("reduce_scatter", "peer-in-buffer-queued", "mpi4py"),
                     ("all_gather", "peer-in-place-queued", "mpi4py-in-place"),
                     # what queuing the flags saves: the same call with host-raised flags
                     ("reduce_scatter", "peer-in-buffer-queued", "peer-in-buffer"),
                     ("all_gather", "peer-in-place-queued", "peer-in-place")]
            for case, impl, base in pairs:
                if (case, base) in bw and (case, impl) in bw:
                    r = bw[(case, impl)] / bw[(case, base)]
                    ratios[f"{case} {impl}/{base} {at}"] = r
                    per_pair.setdefault(f"{case} {impl}/{base} geomean", []).append(r)
            for (case, impl), value in bw.items():
                if impl.startswith("peer"):
                    ratios[f"{case} {impl} busbw / copy traffic {at}"] = value / ceiling_gbs
                    if n > 1:  # the memory traffic the call moved per second, against the copy's
                        algbw = value * n / (n - 1)
                        ratios[f"{case} {impl} memory traffic / copy traffic {at}"] = \
                            traffic_factor(case, impl, n) * algbw / ceiling_gbs
        for key, values in per_pair.items():
            ratios[key] = float(np.exp(np.mean(np.log(values))))
    baselines = {ceiling_name: ceiling_gbs}
    notes.append(f"float32 rows of H={H}; S = total bytes of the reduce-scatter input / all-gather output "
                 "per rank; busbw = S/t*(n-1)/n (nccl-tests); t = slowest rank per call, median over rounds")
    notes.append(f"MPI library: {MPI.Get_library_version().splitlines()[0].strip()}")
    notes.append(f"'memory traffic / copy traffic' = the bytes a call moves through memory (all ranks, "
                 f"traffic_factor x S) per second, against the copy ceiling: how close to the limit the ranks, "
                 f"sharing one memory, come.  Where the ceiling is the memory's limit (a GPU's device copy), busbw / "
                 f"copy traffic cannot exceed (n-1)/(n x factor) -- on the cpu target it is one core's memcpy, which "
                 f"n ranks copying at once can beat: "
                 f"{(n - 1) / (n * traffic_factor('reduce_scatter', 'peer-in-buffer', n)):.3g} for the in-buffer "
                 f"reduce-scatter, {(n - 1) / (n * traffic_factor('all_gather', 'peer-in-place', n)):.3g} for the "
                 f"in-place all-gather at n={n}" if n > 1 else "one rank: no exchange")
    return schema.suite("peer", target, n, results, ratios, baselines, notes)


__all__ = ["run", "add_arguments", "traffic_factor"]
