"""Encoder -> prefill disaggregation through the encoder cache, as MPI ranks.

    mpiexec -n 2 python mpi/ec_disagg.py [--target cpu] [--entries 48] [--max-rows 3000]
    mpiexec -n 3 python mpi/ec_disagg.py          # rank 2 = a second consumer TP rank

Rank 0 is the *encoder* (producer): it "encodes" multimodal inputs -- random ``mm_hash``
keys with 1 .. ``--max-rows`` rows of embeddings each -- into device buffers, and saves
them into the shared region ``/dev/shm/vtnumba_ec_<engine>.mmap`` it created.  Rank 1 is
the *prefill* process (consumer): it learns which entries are ready, asks the encoder to
pin them, loads them into its device encoder cache, verifies every byte against what the
encoder produced, and releases the pin.  Ranks 2.. are more consumer tensor-parallel
ranks: each loads every entry too, and a pin is released only after *all* of them
reported the transfer (the scheduler's exactly-once counting).

The region is deliberately small (``--region-fraction`` of all the data), so the encoder
must evict old ready entries to make room, must wait when everything is pinned or still
being saved, and some entries are evicted before the consumer gets to them (the consumer
is slower: ``--loads-per-step`` < ``--saves-per-step``).

Control messages (ready announcements, pin requests and grants, releases) travel over
mpi4py on a duplicated communicator, one message each way per step, every wait with a
timeout; the bytes themselves never leave shared memory.  If any rank fails (try
``--fail-at 5``: the consumer raises at step 5), it tells the others, every rank cleans up
in ``finally``, and no file is left in /dev/shm; a rank that gets no answer at all aborts
the job with a message.  The region's name is unlinked as soon as every rank has mapped it,
so even a killed run leaves nothing behind.

Printed: entries, bytes, evictions, and save/load throughput (from the copies' events)
against host memcpy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque

from vtnumba.apps.processes import share_cores_between_local_ranks

share_cores_between_local_ranks()  # before numpy loads its BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

PRODUCER, CONSUMER = 0, 1
TAG_STEP, TAG_TP, TAG_SETUP = 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpiexec -n 2 python mpi/ec_disagg.py",
        description="Encoder (rank 0) hands embeddings to prefill (rank 1, + extra TP ranks) through the "
                    "encoder-cache region in /dev/shm, with eviction pressure; every load is verified.")
    p.add_argument("--target", choices=("auto", "cuda", "cudasim", "cpu"), default=None,
                   help="execution target (default: $VTNUMBA_TARGET or auto)")
    p.add_argument("--queues", choices=("sync", "threaded"), default=None,
                   help="cpu target: synchronous or threaded queues (default: $VTNUMBA_CPU_QUEUES or sync)")
    p.add_argument("--entries", type=int, default=48, help="number of mm_hash entries the encoder produces")
    p.add_argument("--max-rows", type=int, default=3000, help="rows per entry are random in 1..max-rows")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (one block = one row)")
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="embedding dtype")
    p.add_argument("--region-fraction", type=float, default=0.06,
                   help="region size as a fraction of all entries' bytes (small = eviction pressure)")
    p.add_argument("--region-mib", type=float, default=None, help="region size in MiB (overrides the fraction)")
    p.add_argument("--saves-per-step", type=int, default=3, help="entries the encoder tries to save per step")
    p.add_argument("--loads-per-step", type=int, default=2, help="entries the consumer asks for per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any rank waits for a peer")
    p.add_argument("--max-steps", type=int, default=100000, help="safety limit on engine steps")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument("--fail-at", type=int, default=None, help=argparse.SUPPRESS)         # test: consumer raises
    p.add_argument("--consumer-hidden", type=int, default=None, help=argparse.SUPPRESS)  # test: config mismatch
    return p


# ----------------------------------------------------------------------------- data
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


def to_host(arr) -> np.ndarray:
    from vtnumba.backend.cuda import to_host_array  # numba.cuda only when a device array shows up

    return to_host_array(arr)


# ----------------------------------------------------------------------------- ranks
class _Run:
    def __init__(self, args, comm):
        from vtnumba.backend.default import default_backend
        from vtnumba.ec.channel import ECChannel

        self.args = args
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ch = ECChannel(comm, timeout_s=args.timeout)
        self.dtype = np.dtype(args.dtype)
        self.block = args.hidden * self.dtype.itemsize
        self.entries = make_entries(args)
        if args.queues is not None and self._target() == "cpu":
            from vtnumba.backend.cpu import CPUBackend

            self.backend = CPUBackend(threaded=args.queues == "threaded")
        else:
            self.backend = default_backend()
        self.region = None
        self.worker = None
        self.log = (lambda *a: None) if args.quiet else (lambda *a: print(f"[rank {self.rank}]", *a, flush=True))

    @staticmethod
    def _target() -> str:
        from vtnumba.target import current_target

        return current_target().name

    # -- setup: create, open, validate, unlink early -------------------------------
    def setup(self) -> None:
        from vtnumba.ec import ECRegionConfig, create_ec_shared_region
        from vtnumba.ec.channel import PeerFailure

        a = self.args
        total = sum(r for _, _, r in self.entries) * self.block
        region_bytes = int(a.region_mib * (1 << 20)) if a.region_mib else int(total * a.region_fraction)
        region_bytes = max(region_bytes, a.max_rows * self.block)  # the largest entry must fit
        if self.rank == PRODUCER:
            engine_id = f"disagg{os.getpid()}_{np.random.default_rng().integers(1 << 30):x}"
            cfg = ECRegionConfig(engine_id=engine_id, hidden_size=a.hidden, dtype=self.dtype,
                                 region_bytes=region_bytes, create=True)
            self.region = create_ec_shared_region(cfg)
            for r in range(1, self.size):
                self.ch.send({"engine_id": engine_id}, r, TAG_SETUP)
            # "opened" from every consumer -- or its failure.  Hear everyone out before giving
            # up: cleaning up while a consumer is still opening would pull the file from under it.
            failures = []
            for r in range(1, self.size):
                try:
                    self.ch.recv(r, TAG_SETUP)
                except PeerFailure as exc:
                    failures.append(exc)
            if failures:
                raise failures[0]
            # Every rank has mapped it: the name is no longer needed.  From here on even a
            # killed process cannot leave a file behind.
            self.region.unlink()
            self.log(f"created {self.region.path}: {self.region.num_blocks} blocks x {self.block} B "
                     f"({self.region.total_bytes / 2**20:.1f} MiB for {total / 2**20:.1f} MiB of entries); "
                     "unlinked once every rank had mapped it")
        else:
            msg = self.ch.recv(PRODUCER, TAG_SETUP)
            hidden = a.consumer_hidden or a.hidden
            # The consumer brings its own model config; the region's header must agree.
            cfg = ECRegionConfig(engine_id=msg["engine_id"], hidden_size=hidden, dtype=self.dtype,
                                 region_bytes=None, create=False, open_timeout_s=a.timeout)
            self.region = create_ec_shared_region(cfg)
            self.ch.send("opened", PRODUCER, TAG_SETUP)

    # -- rank 0: the encoder ----------------------------------------------------------
    def producer(self) -> dict:
        from vtnumba.ec import ECScheduler, ECWorker

        be, a = self.backend, self.args
        sched = ECScheduler("producer", self.region.num_blocks)
        self.worker = w = ECWorker(self.region, backend=be, tp_rank=0)
        todo = deque(self.entries)
        encoder_cache: dict = {}
        outputs: dict = {}  # mm_hash -> device Buffer, freed once its save completed
        msg = {"requests": [], "releases": [], "done": False}
        step = stalls = 0
        announced = 0
        while True:
            # 1. the consumer's releases and read requests
            for h in msg["releases"]:
                sched.release_read(h)
            if msg["done"]:
                break  # the consumer has everything it wanted and sends no more steps
            grants, refused = {}, []
            for h in msg["requests"]:
                ids = sched.grant_read(h)
                if ids is None:
                    refused.append(h)
                else:
                    grants[h] = np.asarray(ids)
            # 2. encode new entries and schedule their saves, oldest first
            for _ in range(a.saves_per_step):
                if not todo:
                    break
                h, idx, rows = todo[0]
                if sched.request_save(h, rows) is None:
                    stalls += 1  # no room: everything is pinned or still being saved
                    break
                todo.popleft()
                buf = be.alloc(rows * self.block)
                host = entry_data(a.seed, idx, rows, a.hidden, self.dtype)
                be.copy(w.compute_queue, buf, host, host.nbytes)  # "the encoder ran" on the compute queue
                encoder_cache[h] = buf.view(self.dtype, (rows, a.hidden))
                outputs[h] = (buf, idx, rows)
            # 3. one batched save per step
            meta = sched.build_connector_meta()
            for h in meta.saves:
                w.save_caches(encoder_cache, h, meta)
            w.flush_saves()
            # 4. completions -> ready -> announce
            update = sched.update_connector_output(w.build_connector_worker_meta())
            ready = []
            for h in update.ready:
                buf, idx, rows = outputs.pop(h)
                del encoder_cache[h]
                be.free(buf)  # the worker dropped its reference when the save completed
                ready.append((h, idx, rows))
            announced += len(ready)
            producer_done = not todo and not outputs
            self.ch.send({"ready": ready, "grants": grants, "refused": refused, "producer_done": producer_done},
                         CONSUMER, TAG_STEP)
            step += 1
            if step > a.max_steps:
                raise RuntimeError(f"producer: no progress after {a.max_steps} steps")
            msg = self.ch.recv(CONSUMER, TAG_STEP)
        summary = self.ch.recv(CONSUMER, TAG_STEP)
        cache = sched.cache
        return {"role": "producer", "steps": step, "entries": len(self.entries), "announced": announced,
                "evictions": cache.stats.evictions, "evicted_blocks": cache.stats.evicted_blocks,
                "no_room_stalls": stalls, "bytes_saved": w.stats["save"]["bytes"],
                "save_copy_ms": w.stats["save"]["copy_ms"], "save_descriptors": w.stats["save"]["descriptors"],
                "reads_granted": sched.stats["reads_granted"], "reads_refused": sched.stats["reads_refused"],
                "consumer": summary}

    # -- rank 1: the prefill scheduler (and consumer TP rank 0) ----------------------------
    def consumer(self) -> dict:
        from vtnumba.ec import ECScheduler, ECWorker, ECWorkerMetadata

        a = self.args
        extra = list(range(2, self.size))
        sched = ECScheduler("consumer", self.region.num_blocks, expected_load_reports=1 + len(extra))
        self.worker = w = ECWorker(self.region, backend=self.backend, tp_rank=0)
        wanted: deque = deque()
        info: dict = {}  # mm_hash -> (index, rows)
        inflight: dict = {}  # mm_hash -> transfer id, requested or loading
        encoder_cache: dict = {}
        verified = refused = step = 0
        producer_done = False
        while True:
            if a.fail_at is not None and step == a.fail_at:
                raise RuntimeError(f"injected failure at consumer step {step} (--fail-at {a.fail_at})")
            msg = self.ch.recv(PRODUCER, TAG_STEP)
            producer_done = msg["producer_done"]
            for h, idx, rows in msg["ready"]:
                info[h] = (idx, rows)
                wanted.append(h)
            for h in msg["refused"]:
                inflight.pop(h)
                refused += 1  # evicted before we asked: prefill would recompute it
            for h, ids in msg["grants"].items():
                inflight[h] = sched.request_load(h, ids)
            meta = sched.build_connector_meta()
            for r in extra:  # the other TP ranks load the same blocks
                self.ch.send({"meta": meta, "stop": False}, r, TAG_TP)
            w.start_load_caches(encoder_cache, meta)
            reports = [w.build_connector_worker_meta()] + [self.ch.recv(r, TAG_TP) for r in extra]
            update = sched.update_connector_output(ECWorkerMetadata.aggregate_all(reports))
            # Released = every rank's copy finished: verify ours, then let the encoder unpin.
            for h in update.released:
                idx, rows = info[h]
                expect = entry_data(a.seed, idx, rows, a.hidden, self.dtype)
                got = to_host(encoder_cache.pop(h))
                if got.shape != expect.shape or got.dtype != expect.dtype or \
                        not np.array_equal(got.view(np.uint8), expect.view(np.uint8)):
                    raise RuntimeError(f"consumer: entry {h} (index {idx}, {rows} rows) differs from what the "
                                       "encoder produced")
                verified += 1
                del inflight[h]
            requests = []
            while wanted and len(requests) < a.loads_per_step:
                h = wanted.popleft()
                requests.append(h)
                inflight[h] = None
            done = producer_done and not wanted and not inflight
            step += 1
            if step > a.max_steps:
                raise RuntimeError(f"consumer: no progress after {a.max_steps} steps")
            self.ch.send({"requests": requests, "releases": update.released, "done": done}, PRODUCER, TAG_STEP)
            if done:
                break
        for r in extra:
            self.ch.send({"meta": None, "stop": True}, r, TAG_TP)
        tp_summaries = [self.ch.recv(r, TAG_TP) for r in extra]
        summary = {"role": "consumer", "steps": step, "verified": verified, "evicted_before_load": refused,
                   "bytes_loaded": w.stats["load"]["bytes"], "load_copy_ms": w.stats["load"]["copy_ms"],
                   "load_descriptors": w.stats["load"]["descriptors"], "tp_ranks": tp_summaries,
                   "stale_reports": sched.stats["stale_reports"]}
        self.ch.send(summary, PRODUCER, TAG_STEP)
        return summary

    # -- ranks 2..: more consumer TP ranks ------------------------------------------------
    def consumer_tp(self) -> dict:
        from vtnumba.ec import ECWorker

        a = self.args
        self.worker = w = ECWorker(self.region, backend=self.backend, tp_rank=self.rank - 1)
        encoder_cache: dict = {}
        by_tid: dict = {}
        verified = 0
        while True:
            msg = self.ch.recv(CONSUMER, TAG_TP)
            if msg["stop"]:
                break
            meta = msg["meta"]
            for h, (tid, ids) in meta.loads.items():
                by_tid[tid] = h
            w.start_load_caches(encoder_cache, meta)
            report = w.build_connector_worker_meta()
            if report is not None:
                for tid in report.completed_loads:  # our copy of this entry is complete: check it
                    h = by_tid.pop(tid)
                    got = to_host(encoder_cache.pop(h))
                    idx = next(i for hh, i, _ in self.entries if hh == h)
                    expect = entry_data(a.seed, idx, got.shape[0], a.hidden, self.dtype)
                    if not np.array_equal(got.view(np.uint8), expect.view(np.uint8)):
                        raise RuntimeError(f"consumer TP rank {self.rank - 1}: entry {h} differs from the encoder's")
                    verified += 1
            self.ch.send(report, CONSUMER, TAG_TP)
        summary = {"rank": self.rank, "verified": verified, "bytes_loaded": w.stats["load"]["bytes"]}
        self.ch.send(summary, CONSUMER, TAG_TP)
        return summary

    # -- teardown ---------------------------------------------------------------------------
    def cleanup(self) -> None:
        try:
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            if self.region is not None:
                self.region.cleanup()


def run(args, comm) -> dict:
    """Run the demo on ``comm`` (>= 2 ranks); returns this rank's summary, raises on failure.

    Every rank cleans up its region and worker on the way out, and a failing rank tells
    the others first, so nobody waits for it.
    """
    if comm.Get_size() < 2:
        raise RuntimeError("ec_disagg needs at least 2 ranks: mpiexec -n 2 python mpi/ec_disagg.py")
    for name in ("entries", "max_rows", "hidden", "saves_per_step", "loads_per_step"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    comm = comm.Dup()  # a private context: our messages cannot meet anyone else's
    run_ = _Run(args, comm)
    failed = True
    try:
        run_.setup()
        if run_.rank == PRODUCER:
            result = run_.producer()
        elif run_.rank == CONSUMER:
            result = run_.consumer()
        else:
            result = run_.consumer_tp()
        result["region_path"] = run_.region.path
        failed = False
        return result
    except BaseException as exc:
        # Tell everyone, so no rank waits for us; then clean up (finally) and re-raise.
        for r in range(run_.size):
            if r != run_.rank:
                run_.ch.send_error(r, f"{type(exc).__name__}: {exc}", timeout_s=1.0)
        raise
    finally:
        try:
            run_.cleanup()
        finally:
            if failed:
                _discard_leftovers(comm)
            else:
                comm.Free()


def _discard_leftovers(comm, timeout_s: float = 5.0) -> None:
    """After a failure: wait for the others (with a deadline), then receive and drop whatever
    messages are still addressed to us -- error reports that crossed, a step the failed peer
    never read.  The communicator is then left alone rather than freed: MPI reuses a freed
    communicator's context, and a stray message could otherwise surface in the next one."""
    _settle(comm, timeout_s)
    from mpi4py import MPI

    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 0.05:
        if comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
            comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            quiet_since = time.monotonic()
        else:
            time.sleep(0.001)


def _settle(comm, timeout_s: float = 10.0) -> bool:
    """A barrier with a deadline: give every rank time to finish its cleanup before exit."""
    req = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def report(res: dict, args, backend_name: str, memcpy_gbs: float, size: int) -> None:
    c = res["consumer"]
    gb = lambda b, ms: (b / (ms / 1e3) / 1e9) if ms > 0 else float("nan")  # noqa: E731
    save_gbs = gb(res["bytes_saved"], res["save_copy_ms"])
    load_gbs = gb(c["bytes_loaded"], c["load_copy_ms"])
    print(f"ec_disagg: target {_Run._target()} ({backend_name}), {size} ranks: encoder rank 0, "
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from vtnumba.target import select_target

    select_target(args.target)  # before anything imports numba.cuda
    from mpi4py import MPI

    from vtnumba.bench.timing import memcpy_bandwidth_gbs
    from vtnumba.ec.channel import ChannelTimeout

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    code = 0
    try:
        memcpy = memcpy_bandwidth_gbs(64 << 20, repeat=5) if rank == 0 else 0.0
        res = run(args, comm)
        path = res["region_path"]
        if rank == 0:
            from vtnumba.backend.default import default_backend

            report(res, args, default_backend().name, memcpy, size)
            print(f"  /dev/shm:  {path} left behind: {os.path.exists(path)}")
            print("OK")
    except ChannelTimeout as exc:
        print(f"[rank {rank}] FAILED: {exc}", file=sys.stderr, flush=True)
        # A peer that does not answer at all may be hung: end the job rather than wait.
        comm.Abort(1)
    except Exception as exc:
        print(f"[rank {rank}] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        _settle(comm)  # let every rank finish its cleanup before any exits
    return code


if __name__ == "__main__":
    sys.exit(main())
