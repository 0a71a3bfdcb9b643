"""Encoder -> prefill disaggregation through the encoder cache, as MPI ranks.

    mpiexec -n 2 python mpi/ec_disagg.py [--target cpu] [--entries 48] [--max-rows 3000]
    mpiexec -n 3 python mpi/ec_disagg.py          # rank 2 = a second consumer TP rank

Rank 0 is the *encoder* (producer): it "encodes" multimodal inputs -- random ``mm_hash``
keys with 1 .. ``--max-rows`` rows of embeddings each -- into device buffers and saves them
into the encoder-cache region.  Rank 1 is the *prefill* process (consumer): it learns which
entries are ready, asks the encoder to pin them, loads them into its device encoder cache,
verifies every byte against what the encoder produced, and releases the pin.  Ranks 2..
are more consumer tensor-parallel ranks: each loads every entry too, and a pin is released
only after *all* of them have their copy.

The region is deliberately small (``--region-fraction`` of all the data), so the encoder
must evict old ready entries to make room, must wait when everything is pinned or still
being saved, and some entries are evicted before the consumer gets to them (the consumer
is slower: ``--loads-per-step`` < ``--saves-per-step``).

Everything about *how* the region is shared lives in :class:`vtnumba.ec.ECProducer` and
:class:`vtnumba.ec.ECConsumer`: the region is anonymous (no file in ``/dev/shm``, ever),
the consumers open it through the producer's descriptor, and every message has a
deadline.  This program only says what moves: one message each way per step (ready
entries, grants and refusals one way; requests, releases and "done" the other).

Failures end the job (``docs/failure_model``): a rank that raises (try ``--fail-at 5``: the
consumer raises at step 5) tells the others, which stop at once and say which rank failed
and what it was doing; a rank that is killed takes the job down with it (mpiexec), and one
that is stopped makes the others give up after ``--timeout`` seconds.  Nothing is ever left
in ``/dev/shm``.

Printed: entries, bytes, evictions, and save/load throughput (from the copies' events)
against host memcpy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from vtnumba.apps.processes import RankZeroErrorsParser, choose_target, share_cores_between_local_ranks
from vtnumba.bench.runner import non_negative_int, positive_int, positive_number

share_cores_between_local_ranks()  # before numpy loads its BLAS

import numpy as np  # noqa: E402

PRODUCER, CONSUMER = 0, 1
MAX_ENTRIES = 100_000  # (a bound on --entries: the sizes of all of them are drawn up front)


# ----------------------------------------------------------------------------- arguments
def _inject(text: str):
    from vtnumba.ec.endpoints import FaultInjection

    try:
        return FaultInjection.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroErrorsParser(  # a usage error is printed by rank 0 only
        prog="mpiexec -n N python mpi/ec_disagg.py",  # (N >= 2: one producer, the rest consumers)
        description="Encoder (rank 0) hands embeddings to prefill (rank 1, + extra TP ranks) through the "
                    "encoder-cache region, with eviction pressure; every load is verified.")
    p.add_argument("--target", choices=("auto", "cuda", "cudasim", "cpu"), default=None,
                   help="execution target (default: $VTNUMBA_TARGET or auto)")
    p.add_argument("--queues", choices=("sync", "threaded"), default=None,
                   help="cpu target: synchronous or threaded queues (default: $VTNUMBA_CPU_QUEUES or sync)")
    p.add_argument("--entries", type=positive_int, default=48, help="number of mm_hash entries the encoder produces (default 48)")
    p.add_argument("--max-rows", type=positive_int, default=3000, help="rows per entry are random in 1..max-rows (default 3000)")
    p.add_argument("--hidden", type=positive_int, default=256, help="hidden size (one block = one row) (default 256)")
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="embedding dtype (default float16)")
    p.add_argument("--region-fraction", type=positive_number, default=0.06,
                   help="region size as a fraction of all entries' bytes (small = eviction pressure) (default 0.06)")
    p.add_argument("--region-mib", type=positive_number, default=None,
                   help="region size in MiB (overrides the fraction; at least the largest entry: "
                        "max-rows x hidden x dtype)")
    p.add_argument("--saves-per-step", type=positive_int, default=3, help="entries the encoder tries to save per step (default 3)")
    p.add_argument("--loads-per-step", type=positive_int, default=2, help="entries the consumer asks for per step (default 2)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the entries' sizes and contents (default 0)")
    p.add_argument("--timeout", type=positive_number, default=60.0,
                   help="seconds any wait for another rank may take before this rank gives up (default 60)")
    p.add_argument("--max-steps", type=positive_int, default=100000, help="safety limit on engine steps (default 100000)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument("--fail-at", type=non_negative_int, default=None, help=argparse.SUPPRESS)  # test: consumer raises
    p.add_argument("--consumer-hidden", type=int, default=None, help=argparse.SUPPRESS)  # test: config mismatch
    # Test hook (vtnumba.ec.endpoints.FaultInjection): how:rank:point[@n], e.g. kill:0:created,
    # stop:1:loading@2 -- that rank raises / is killed / stops at that point of an endpoint.
    p.add_argument("--inject", type=_inject, default=None, help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------------- data
def region_size(args, entries) -> tuple[int, str]:
    """The region's bytes, and the flags that set them (for messages): ``--region-mib``, else
    ``--region-fraction`` of all entries' bytes -- but never less than the largest entry
    could be (``--max-rows`` rows), which must fit."""
    block = args.hidden * np.dtype(args.dtype).itemsize
    if args.region_mib:
        nbytes, what = int(args.region_mib * (1 << 20)), f"--region-mib={args.region_mib:g}"
    else:
        total = sum(r for _, _, r in entries) * block
        nbytes = int(total * args.region_fraction)
        what = (f"--region-fraction={args.region_fraction:g} of the entries' {total / 2**20:.4g} MiB (--entries="
                f"{args.entries} of 1 to --max-rows={args.max_rows} rows of --hidden={args.hidden} x {args.dtype})")
    largest = args.max_rows * block
    if largest > nbytes:
        nbytes = largest
        what = f"the largest entry (--max-rows={args.max_rows} rows of --hidden={args.hidden} x {args.dtype})"
    return nbytes, what


def entry_data(seed: int, index: int, rows: int, hidden: int, dtype) -> np.ndarray:
    """What the 'encoder' outputs for entry ``index``; the consumer recomputes it to verify."""
    rng = np.random.default_rng([seed, index])
    return rng.standard_normal((rows, hidden), dtype=np.float32).astype(dtype)


def make_entries(args) -> list[tuple[str, int, int]]:
    rng = np.random.default_rng([args.seed, 12345])
    hashes = {f"{int(x):016x}" for x in rng.integers(0, 2**63, size=args.entries * 2)}
    hashes = sorted(hashes)[: args.entries]
    rng.shuffle(hashes)
    rows = rng.integers(1, args.max_rows + 1, size=args.entries)
    return [(h, i, int(r)) for i, (h, r) in enumerate(zip(hashes, rows))]


def verify(args, h: str, index: int, rows: int, got_device, who: str) -> None:
    """Byte-exact comparison of a loaded entry with what the encoder produced: all ``rows``
    of it (every rank derives the entries from the seed, so each knows how many there are)."""
    from vtnumba.backend.arrays import to_host

    got = to_host(got_device)
    if tuple(got.shape) != (rows, args.hidden):
        # (The data of a prefix matches: the generator's rows do not depend on the count.)
        raise RuntimeError(f"{who}: entry {h} (index {index}) loaded with shape {tuple(got.shape)}; the encoder "
                           f"produced ({rows}, {args.hidden})")
    expect = entry_data(args.seed, index, rows, args.hidden, np.dtype(args.dtype))
    if got.dtype != expect.dtype or not np.array_equal(got.view(np.uint8), expect.view(np.uint8)):
        raise RuntimeError(f"{who}: entry {h} (index {index}, {got.shape[0]} rows) differs from what the encoder "
                           "produced")


# ----------------------------------------------------------------------------- rank 0: the encoder
def producer(ep, args, entries, backend, log) -> dict:
    dtype, block = np.dtype(args.dtype), args.hidden * np.dtype(args.dtype).itemsize
    todo = deque(entries)
    outputs: dict = {}   # mm_hash -> device array being saved
    buffers: dict = {}   # mm_hash -> (Buffer, index, rows), freed once its save completed
    msg = {"requests": [], "releases": [], "done": False}
    step = stalls = announced = 0
    log(f"region: {ep.region.num_blocks} blocks x {block} B ({ep.region.total_bytes / 2**20:.1f} MiB), "
        "anonymous: never a file in /dev/shm")
    while True:
        # 1. the consumer's releases and read requests
        for h in msg["releases"]:
            ep.release(h)
        if msg["done"]:
            break  # the consumer has everything it wanted and sends no more steps
        grants, refused = {}, []
        for h in msg["requests"]:
            ids = ep.grant(h)
            if ids is None:
                refused.append(h)
            else:
                grants[h] = np.asarray(ids)
        # 2. encode new entries and schedule their saves, oldest first
        for _ in range(args.saves_per_step):
            if not todo:
                break
            h, idx, rows = todo[0]
            if ep.request_save(h, rows) is None:
                stalls += 1  # no room: everything is pinned or still being saved
                break
            todo.popleft()
            buf = backend.alloc(rows * block)
            host = entry_data(args.seed, idx, rows, args.hidden, dtype)
            backend.copy(ep.compute_queue, buf, host, host.nbytes)  # "the encoder ran" on the compute queue
            outputs[h] = buf.view(dtype, (rows, args.hidden))
            buffers[h] = (buf, idx, rows)
        # 3. one batched save per step; 4. completions -> ready -> announce
        ep.save(outputs)
        ready = []
        for h in ep.poll():
            buf, idx, rows = buffers.pop(h)
            del outputs[h]
            backend.free(buf)  # the worker dropped its reference when the save completed
            ready.append((h, idx, rows))
        announced += len(ready)
        producer_done = not todo and not buffers
        ep.send({"ready": ready, "grants": grants, "refused": refused, "producer_done": producer_done},
                what="this step's ready entries and grants")
        step += 1
        if step > args.max_steps:
            raise RuntimeError(f"producer: not done after --max-steps={args.max_steps} steps ({announced} of "
                               f"{len(entries)} entries saved and announced)")
        msg = ep.recv(what="the consumer's next requests and releases")
    summary = ep.recv(what="the consumer's summary")
    st, w = ep.cache.stats, ep.worker.stats["save"]
    return {"role": "producer", "steps": step, "entries": len(entries), "announced": announced,
            "evictions": st.evictions, "evicted_blocks": st.evicted_blocks, "no_room_stalls": stalls,
            "bytes_saved": w["bytes"], "save_copy_ms": w["copy_ms"], "save_descriptors": w["descriptors"],
            "reads_granted": ep.scheduler.stats["reads_granted"], "reads_refused": ep.scheduler.stats["reads_refused"],
            "consumer": summary}


# ----------------------------------------------------------------------------- rank 1: the prefill scheduler
def consumer(ep, args, entries) -> dict:
    index = {h: (i, rows) for h, i, rows in entries}
    wanted: deque = deque()
    pending: set = set()  # requested, not yet granted or refused
    verified = refused = step = 0
    while True:
        if args.fail_at is not None and step == args.fail_at:
            raise RuntimeError(f"injected failure at consumer step {step} (--fail-at {args.fail_at})")
        msg = ep.recv(what="the encoder's ready entries and grants")
        wanted.extend(h for h, _, _ in msg["ready"])
        for h in msg["refused"]:
            pending.discard(h)
            refused += 1  # evicted before we asked: prefill would recompute it
        # Every consumer rank loads the granted entries; when load() returns, all have them.
        loaded = ep.load(msg["grants"])
        for h, arr in loaded.items():
            verify(args, h, *index[h], arr, "consumer")
            verified += 1
            pending.discard(h)
        requests = []
        while wanted and len(requests) < args.loads_per_step:
            h = wanted.popleft()
            requests.append(h)
            pending.add(h)
        done = msg["producer_done"] and not wanted and not pending
        step += 1
        if step > args.max_steps:
            raise RuntimeError(f"consumer: not done after --max-steps={args.max_steps} steps ({verified} entries "
                               "loaded and verified)")
        ep.send({"requests": requests, "releases": list(loaded), "done": done},
                what="this step's requests and releases")
        if done:
            break
    if args.fail_at is not None:  # (past the last step: a fault test that would test nothing)
        raise RuntimeError(f"--fail-at {args.fail_at} never fired: the consumer finished after {step} step(s); "
                           f"pick a step below {step}")
    ep.stop_followers()
    tp_summaries = [ep.recv(r, what="its summary") for r in ep.followers]
    w = ep.worker.stats["load"]
    summary = {"role": "consumer", "steps": step, "verified": verified, "evicted_before_load": refused,
               "bytes_loaded": w["bytes"], "load_copy_ms": w["copy_ms"], "load_descriptors": w["descriptors"],
               "tp_ranks": tp_summaries, "stale_reports": ep.scheduler.stats["stale_reports"]}
    ep.send(summary, what="the consumer's summary")
    return summary


# ----------------------------------------------------------------------------- ranks 2..: more consumer TP ranks
def consumer_tp(ep, args, entries) -> dict:
    index = {h: (i, rows) for h, i, rows in entries}
    who = f"consumer TP rank {ep.rank - 1}"
    verified = ep.serve(on_load=lambda h, arr: verify(args, h, *index[h], arr, who))
    summary = {"rank": ep.rank, "verified": verified, "bytes_loaded": ep.worker.stats["load"]["bytes"]}
    ep.send(summary, what="this rank's summary")
    return summary


# ----------------------------------------------------------------------------- one run
def run(args, comm) -> dict:
    """Run the demo on ``comm`` (>= 2 ranks); returns this rank's summary, raises on failure.

    The endpoints release the region and the worker on the way out, and a failing rank
    tells the others first, so nobody waits for it.
    """
    from vtnumba.dist.comm import dup_comm
    from vtnumba.ec import ECConsumer, ECProducer

    if comm.Get_size() < 2:
        raise RuntimeError("ec_disagg needs at least 2 ranks: mpiexec -n 2 python mpi/ec_disagg.py")
    comm = dup_comm(comm, "ec_disagg's setup", args.timeout)  # a private context: our messages meet nobody else's
    rank = comm.Get_rank()
    entries = make_entries(args)
    dtype = np.dtype(args.dtype)
    region_bytes, _ = region_size(args, entries)
    backend = _backend(args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(f"[rank {rank}]", *a, flush=True))
    on_point = args.inject.on_point(rank) if args.inject else None
    common = dict(dtype=dtype, backend=backend, timeout_s=args.timeout, on_point=on_point)
    if rank == PRODUCER:
        endpoint = ECProducer(comm, hidden_size=args.hidden, region_bytes=region_bytes, name="disagg", **common)
    else:
        # The consumer brings its own model config; the region's header must agree.
        endpoint = ECConsumer(comm, hidden_size=args.consumer_hidden or args.hidden, producer=PRODUCER, **common)
    with endpoint as ep:
        if rank == PRODUCER:
            result = producer(ep, args, entries, backend, log)
        elif rank == CONSUMER:
            result = consumer(ep, args, entries)
        else:
            result = consumer_tp(ep, args, entries)
    if on_point is not None:
        on_point.check_fired()  # (an @N past this run's steps: a fault test that tested nothing)
    # Success: nothing is left in flight on our communicator, so it may be freed.  (After a
    # failure it is not: MPI reuses a freed communicator's context, and a failure report
    # still in flight could then surface in someone else's communicator.)
    comm.Free()
    return result


def _backend(args):
    from vtnumba.backend.default import default_backend
    from vtnumba.target import current_target

    if args.queues is not None and current_target().name == "cpu":
        from vtnumba.backend.cpu import CPUBackend

        return CPUBackend(threaded=args.queues == "threaded")
    return default_backend()


def report(res: dict, args, backend_name: str, target: str, memcpy_gbs: float, size: int) -> None:
    c = res["consumer"]
    gb = lambda b, ms: (b / (ms / 1e3) / 1e9) if ms > 0 else float("nan")  # noqa: E731
    save_gbs = gb(res["bytes_saved"], res["save_copy_ms"])
    load_gbs = gb(c["bytes_loaded"], c["load_copy_ms"])
    print(f"ec_disagg: target {target} ({backend_name}), {size} ranks: encoder rank 0, "
          f"prefill ranks 1..{size - 1}")
    print(f"  entries:   {res['entries']} produced (1..{args.max_rows} rows of {args.hidden} x {args.dtype}), "
          f"{c['verified']} loaded and verified byte-exact on rank 1"
          + "".join(f", {t['verified']} on rank {t['rank']}" for t in c["tp_ranks"])
          + f"; {c['evicted_before_load']} evicted before the consumer asked")
    print(f"  bytes:     saved {res['bytes_saved'] / 2**20:.1f} MiB, loaded {c['bytes_loaded'] / 2**20:.1f} MiB "
          f"per consumer rank")
    print(f"  evictions: {res['evictions']} entries ({res['evicted_blocks']} blocks); the encoder waited for room "
          f"{res['no_room_stalls']} times")
    print(f"  copies:    {res['save_descriptors']} save and {c['load_descriptors']} load descriptors (block runs)")
    print(f"  throughput (copy time between the start/end events): save {save_gbs:.2f} GB/s, load {load_gbs:.2f} GB/s;"
          f" host memcpy {memcpy_gbs:.2f} GB/s -> {save_gbs / memcpy_gbs:.0%} / {load_gbs / memcpy_gbs:.0%}")
    print("  region:    anonymous (memfd), opened through the encoder's descriptor: no file in /dev/shm at any time")


def _main(args) -> int:
    from mpi4py import MPI

    from vtnumba.backend.default import default_backend
    from vtnumba.bench.timing import memcpy_bandwidth_gbs
    from vtnumba.target import current_target

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    memcpy = memcpy_bandwidth_gbs(64 << 20, repeat=5) if rank == 0 else 0.0
    res = run(args, comm)
    if rank == 0:
        report(res, args, default_backend().name, current_target().name, memcpy, size)
        print("OK", flush=True)
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() < 2:  # (a usage error, said once: not a failure of rank 0)
        parser.error("needs at least 2 ranks (an encoder and a consumer): mpiexec -n 2 python mpi/ec_disagg.py")
    largest = args.max_rows * args.hidden * np.dtype(args.dtype).itemsize
    from vtnumba.ec.region import check_fits_in_memory

    if args.region_mib is not None:
        try:
            check_fits_in_memory(args.region_mib * (1 << 20), f"--region-mib={args.region_mib:g}")
        except ValueError as exc:
            parser.error(str(exc))
    if args.region_mib is not None and args.region_mib * (1 << 20) < largest:
        parser.error(f"--region-mib={args.region_mib:g} is smaller than the largest entry ({largest / 2**20:.3g} MiB: "
                     f"--max-rows={args.max_rows} rows of --hidden={args.hidden} x {args.dtype}), which could never "
                     "be saved")
    if args.entries > MAX_ENTRIES:
        parser.error(f"--entries={args.entries}: at most {MAX_ENTRIES} (each entry is produced, saved, loaded and "
                     "verified in turn)")
    # The region the fraction (or the largest entry) makes must fit too: it failed on a rank, later.
    try:
        check_fits_in_memory(*region_size(args, make_entries(args)))
    except ValueError as exc:
        parser.error(str(exc))
    if args.inject is not None:
        # Only now is the job's size known: refuse a fault whose rank never passes its point
        # (rank 0 is the producer, rank 1 the consumer leader, the rest its other consumer ranks).
        from vtnumba.ec.endpoints import points_passed

        size = MPI.COMM_WORLD.Get_size()
        try:
            # (Each step saves or loads at least one entry: at most --entries steps.)
            args.inject.check_fires(size, lambda r: points_passed(r, PRODUCER, range(1, size), args.entries))
        except ValueError as exc:
            parser.error(str(exc))  # printed by rank 0; every rank exits 2
    choose_target(parser, args.target)  # before anything imports numba.cuda
    from vtnumba.dist import run_collectively
    from vtnumba.dist.comm import set_default_timeout

    set_default_timeout(args.timeout)  # every wait for another rank, in vtnumba too
    # A rank that fails tells the others and says what it was doing; a rank that stops
    # answering makes the others give up after --timeout; either way the job ends.
    return run_collectively(lambda: _main(args), timeout_s=args.timeout)


if __name__ == "__main__":
    from vtnumba.apps.processes import exit_quietly_when_interrupted

    sys.exit(exit_quietly_when_interrupted(main))
