"""The pipeline demo (the README's main job): encode with TPSP, hand outputs over through the encoder cache.

``mpiexec -n N python -m vtnumba demo`` splits the world in two:

* **encoder ranks** (world ranks ``0 .. E-1``, default ``E = N - 1``) run all-MiniLM-L6-v2
  tensor-parallel with tensor-parallel size E, every row-parallel projection finished by the
  fused TPSP op (LayerNorm + bias, post-norm).  Encoder rank 0 is also the encoder cache's
  *producer*: it owns the scheduler-side :class:`~vtnumba.ec.EmbeddingCache` and saves each
  input's token-level outputs (``[tokens, 384]`` float32, one block per token) into the
  shared region ``/dev/shm/vtnumba_ec_<engine_id>.mmap`` with batched copies;
* **consumer ranks** (the rest) load those outputs back through the encoder cache, pool
  them (mean over tokens, then L2 normalisation) and answer semantic-search queries over a
  small corpus shipped with vtnumba.  Extra consumer ranks act as more tensor-parallel ranks
  of the consumer: each loads every entry, and a pin is released once all have.

An input is keyed by an ``mm_hash`` of its token ids.  The consumer asks for inputs by
hash; if the entry is ready in the cache it is served without re-encoding (a *hit*),
otherwise the encoders encode it (a *miss*).  The region is small by default (about 40%
of what the corpus needs), so old entries are evicted to make room -- asking for them
again later is a miss and they are re-encoded.

Correctness is checked as it goes: the producer sends, with every grant, a CRC of the
token-level bytes it saved and the sentence embedding it pooled itself; the consumer's
loaded bytes and its own pooling must match both *byte for byte*, or the run fails.

Failure handling: a rank that raises tells every other rank (an error message on the
control channel, which every wait polls), releases what it owns and exits with code 1;
encoder rank 0 also releases the encoder ranks waiting for work.  Nobody is left waiting
and nothing calls ``MPI_Abort`` (which would leave MPICH's own segments in ``/dev/shm``).
vtnumba's shared-memory files are unlinked as soon as every rank has mapped them, so even
a killed run leaves none of them behind.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import zlib

import numpy as np

TAG_SETUP, TAG_STEP, TAG_TP = 21, 22, 23
_FAILED = "failed"  # broadcast to encoder followers when encoder rank 0 gives up
DEFAULT_QUERIES = [
    "Which animals live in the ocean?",
    "How do I cook pasta?",
    "Tell me about the planets of the solar system.",
    "What helps you stay healthy?",
]
REQUESTS_PER_STEP = 12


def mm_hash_of(token_ids: np.ndarray) -> str:
    """The encoder-cache key of an input: a hash of its token ids (same ids, same entry)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def _crc(arr: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).view(np.uint8))


def _to_host(arr) -> np.ndarray:
    from vtnumba.backend.cuda import to_host_array  # numba.cuda only when a device array shows up

    return to_host_array(arr)


def plan_ranks(world_size: int, encoder_ranks: int | None) -> tuple[int, int]:
    """(encoder ranks, consumer ranks); clear errors for layouts the demo cannot run."""
    if world_size < 2:
        raise ValueError(f"the pipeline demo needs at least 2 ranks (encoder + consumer), got {world_size}; "
                         "run: mpiexec -n 3 python -m vtnumba demo")
    e = world_size - 1 if encoder_ranks is None else encoder_ranks
    if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= world_size:
        raise ValueError(f"--encoder-ranks={encoder_ranks!r} must be an int in 1..{world_size - 1}")
    if e == world_size:
        raise ValueError(f"--encoder-ranks={e} leaves no consumer ranks (world size {world_size}); "
                         "at least one rank must consume the encoder cache")
    if 12 % e:
        raise ValueError(f"--encoder-ranks={e}: the tensor-parallel size must divide MiniLM's 12 attention heads "
                         "(1, 2, 3, 4, 6 or 12)")
    return e, world_size - e


class _Pipeline:
    def __init__(self, args, comm):
        from vtnumba.ec.channel import ECChannel

        self.args = args
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.num_encoders, self.num_consumers = plan_ranks(self.size, args.encoder_ranks)
        self.is_encoder = self.rank < self.num_encoders
        self.producer, self.consumer = 0, self.num_encoders  # world ranks of the two leaders
        self.ch = ECChannel(comm, timeout_s=float(getattr(args, "timeout", 300.0)))
        self.region = self.worker = self.tpe = None
        self.hidden = 384
        self._in_loop = False  # encoder rank 0: followers are waiting in the work broadcast

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from vtnumba.dist import init_distributed, new_group
        from vtnumba.models.corpus import load_corpus

        init_distributed(tp_size=self.size)
        enc_group = new_group("encoder", list(range(self.num_encoders)))
        new_group("consumer", list(range(self.num_encoders, self.size)))
        self.corpus = load_corpus()
        if self.is_encoder:
            from vtnumba.models.tp_runtime import TensorParallelEncoder

            self.tpe = TensorParallelEncoder(enc_group, use_tpsp=not self.args.no_tpsp)
            self.hidden = self.tpe.encoder.hidden_size
        else:
            from vtnumba.models.minilm_tokenizer import MiniLMTokenizer

            self.tokenizer = MiniLMTokenizer()
        self._setup_region()

    def _setup_region(self) -> None:
        from vtnumba.ec import ECRegionConfig, create_ec_shared_region
        from vtnumba.ec.channel import PeerFailure

        block = self.hidden * 4
        consumers = range(self.num_encoders, self.size)
        if self.rank == self.producer:
            ids = self.tpe.encoder.tokenize(self.corpus) if self.num_encoders == 1 else None
            if self.args.region_mib is not None:
                region_bytes = int(self.args.region_mib * (1 << 20))
            else:
                # ~40% of the corpus's token rows (at least one longest input): evictions happen.
                corpus_rows = sum(len(t) for t in ids) if ids is not None else 16 * len(self.corpus)
                region_bytes = max(int(0.4 * corpus_rows), 256) * block
            if region_bytes < 256 * block:
                raise ValueError(f"--region-mib={self.args.region_mib}: the region must hold at least one input of "
                                 f"256 tokens ({256 * block / 2**20:.2f} MiB)")
            engine = f"demo{os.getpid()}_{np.random.default_rng().integers(1 << 30):x}"
            self.region = create_ec_shared_region(ECRegionConfig(engine_id=engine, hidden_size=self.hidden,
                                                                 dtype=np.float32, region_bytes=region_bytes,
                                                                 create=True))
            for r in consumers:
                self.ch.send(engine, r, TAG_SETUP)
            # Hear every consumer out (opened, or failed) before going on or giving up:
            # cleaning up while one is still opening would pull the file from under it.
            failures = []
            for r in consumers:
                try:
                    self.ch.recv(r, TAG_SETUP)
                except PeerFailure as exc:
                    failures.append(exc)
            if failures:
                raise failures[0]
            self.region.unlink()  # every user has mapped it: from now on nothing can leak
        elif not self.is_encoder:
            engine = self.ch.recv(self.producer, TAG_SETUP)
            self.region = create_ec_shared_region(ECRegionConfig(engine_id=engine, hidden_size=self.hidden,
                                                                 dtype=np.float32, create=False,
                                                                 open_timeout_s=60.0))
            self.ch.send("opened", self.producer, TAG_SETUP)

    # ------------------------------------------------------------------ encoder side
    def measure_encoder(self) -> dict:
        """Encoder tokens/s over the corpus, with TPSP and with the regular forward (same run)."""
        from mpi4py import MPI

        enc, group = self.tpe.encoder, self.tpe.group
        ids = enc.tokenize(self.corpus)
        tokens = sum(len(t) for t in ids)
        rates = {}
        modes = ["regular"] + (["tpsp"] if self.tpe.tpsp_enabled else [])
        for mode in modes:
            getattr(self.tpe, f"use_{mode}")()
            enc.encode_ids(ids[:8])  # warm up
            best = float("inf")
            for _ in range(2):
                group.cpu_comm.Barrier()
                t0 = time.perf_counter()
                enc.encode_ids(ids)
                best = min(best, group.cpu_comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            rates[mode] = tokens / best
        if self.tpe.tpsp_enabled:
            self.tpe.use_tpsp()  # the pipeline itself runs with TPSP
        return {"tokens": tokens, "rates": rates}

    def encoder_follower(self) -> None:
        """Encoder ranks 1..E-1: encode whatever encoder rank 0 broadcasts, until told to stop."""
        group_comm = self.tpe.group.comm
        while True:
            msg = group_comm.bcast(None, root=0)
            if msg is None:
                return
            if isinstance(msg, str) and msg == _FAILED:
                raise RuntimeError("encoder rank 0 stopped the pipeline after a failure (see its message)")
            self.tpe.encoder.encode_ids(msg)

    def producer_loop(self) -> dict:
        from vtnumba.backend import default_backend
        from vtnumba.ec import ECScheduler, ECWorker
        from vtnumba.models.minilm import pool_embedding

        backend = default_backend()
        sched = ECScheduler("producer", self.region.num_blocks)
        self.worker = worker = ECWorker(self.region, backend=backend, tp_rank=0)
        group_comm = self.tpe.group.comm
        self._in_loop = True
        waiting: dict[str, np.ndarray] = {}  # requested, not yet granted: mm_hash -> token ids
        checks: dict[str, tuple[int, bytes, int]] = {}  # mm_hash -> (crc, pooled bytes, tokens)
        hits = misses = encoded_tokens = steps = 0
        while True:
            msg = self.ch.recv(self.consumer, TAG_STEP)
            for h in msg["releases"]:
                sched.release_read(h)
            if msg["done"]:
                break
            for h, ids in msg["requests"]:
                if sched.has_cache_item(h):
                    hits += 1
                else:
                    misses += 1
                waiting[h] = np.asarray(ids, dtype=np.int64)
            # Encode (all encoder ranks together) what is neither cached nor being saved, as
            # far as the region has room; the rest waits for the consumer's releases.
            todo = []
            for h, ids in waiting.items():
                if sched.has_cache_item(h):
                    continue
                if sched.request_save(h, len(ids)) is None:
                    if sched.cache.lookup(h) is None:
                        break  # no room even after evicting: wait for releases
                    continue
                todo.append(h)
            if todo:
                id_list = [waiting[h] for h in todo]
                if self.num_encoders > 1:
                    group_comm.bcast(id_list, root=0)
                self._in_loop = False  # inside a collective encode: followers are not in bcast
                hidden = self.tpe.encoder.encode_ids(id_list)
                self._in_loop = True
                encoded_tokens += sum(len(i) for i in id_list)
                outputs, bufs = {}, []
                for h, hs in zip(todo, hidden):
                    # The encoder's output lives in device memory, as in an engine.
                    buf = backend.alloc(hs.nbytes)
                    backend.copy(worker.compute_queue, buf, hs, hs.nbytes)
                    outputs[h] = buf.view(np.float32, hs.shape)
                    bufs.append(buf)
                    checks[h] = (_crc(hs), pool_embedding(hs).tobytes(), len(hs))
                meta = sched.build_connector_meta()
                for h in meta.saves:
                    worker.save_caches(outputs, h, meta)
                worker.flush_saves()
                worker.wait()
                sched.update_connector_output(worker.build_connector_worker_meta())
                outputs.clear()
                for buf in bufs:
                    backend.free(buf)
            grants = {}
            for h in list(waiting):
                ids = sched.grant_read(h) if sched.has_cache_item(h) else None
                if ids is not None:
                    crc, pooled, ntok = checks[h]
                    grants[h] = (ids, crc, pooled, ntok)
                    del waiting[h]
            steps += 1
            self.ch.send({"grants": grants}, self.consumer, TAG_STEP)
        if self.num_encoders > 1:
            group_comm.bcast(None, root=0)
        self._in_loop = False
        st = sched.cache.stats
        return {"hits": hits, "misses": misses, "evictions": st.evictions, "encoded_tokens": encoded_tokens,
                "bytes_saved": worker.stats["save"]["bytes"], "save_copy_ms": worker.stats["save"]["copy_ms"],
                "save_descriptors": worker.stats["save"]["descriptors"], "steps": steps,
                "region_blocks": self.region.num_blocks, "region_mib": self.region.num_blocks * self.hidden * 4 / 2**20}

    # ------------------------------------------------------------------ consumer side
    def consumer_loop(self) -> dict:
        from vtnumba.backend import default_backend
        from vtnumba.ec import ECScheduler, ECWorker, ECWorkerMetadata
        from vtnumba.models.minilm import pool_embedding

        extra = list(range(self.consumer + 1, self.size))
        sched = ECScheduler("consumer", self.region.num_blocks, expected_load_reports=1 + len(extra))
        self.worker = worker = ECWorker(self.region, backend=default_backend(), tp_rank=0)
        queries = list(self.args.queries or DEFAULT_QUERIES)
        # Rounds of requests: the corpus, the queries, then repeats (cache hits, or misses
        # for entries evicted meanwhile) -- every round's answers are checked the same way.
        texts = self.corpus + queries + [queries[0], self.corpus[-1], self.corpus[0]]
        ids = self.tokenizer.encode(texts)
        hashes = [mm_hash_of(t) for t in ids]
        embeddings: dict[str, np.ndarray] = {}
        pending = list(dict.fromkeys(range(len(texts)), None))  # indices still to request
        outstanding: set[str] = set()
        releases: list[str] = []
        encoder_cache: dict = {}
        expected: dict[str, tuple] = {}
        step = 0
        while True:
            if self.args.fail_at is not None and step == self.args.fail_at:
                raise RuntimeError(f"injected consumer failure at step {step} (--fail-at {self.args.fail_at})")
            requests = []
            while pending and len(requests) < REQUESTS_PER_STEP:
                i = pending[0]
                if hashes[i] in outstanding:
                    break  # a repeat of an input still in flight: ask again next step
                pending.pop(0)
                requests.append((hashes[i], ids[i].tolist()))
                outstanding.add(hashes[i])
            done = not pending and not outstanding
            self.ch.send({"requests": requests, "releases": releases, "done": done}, self.producer, TAG_STEP)
            releases = []
            if done:
                break
            reply = self.ch.recv(self.producer, TAG_STEP)
            for h, (block_ids, crc, pooled, ntok) in reply["grants"].items():
                sched.request_load(h, block_ids)
                expected[h] = (crc, pooled, ntok)
            meta = sched.build_connector_meta()
            for r in extra:
                self.ch.send(meta, r, TAG_TP)
            worker.start_load_caches(encoder_cache, meta)
            worker.wait()
            reports = [worker.build_connector_worker_meta()] + [self.ch.recv(r, TAG_TP) for r in extra]
            update = sched.update_connector_output(ECWorkerMetadata.aggregate_all(reports))
            for h in update.released:
                crc, pooled, ntok = expected.pop(h)
                got = _to_host(encoder_cache.pop(h))
                if got.shape != (ntok, self.hidden) or _crc(got) != crc:
                    raise RuntimeError(f"consumer: the token-level outputs of {h} differ from what the encoder saved")
                emb = pool_embedding(np.array(got))
                if emb.tobytes() != pooled:
                    raise RuntimeError(f"consumer: the embedding pooled from {h} differs from the encoder's")
                embeddings[h] = emb
                outstanding.discard(h)
                releases.append(h)
            step += 1
        for r in extra:
            self.ch.send(None, r, TAG_TP)
        corpus_emb = np.stack([embeddings[h] for h in hashes[:len(self.corpus)]])
        answers = []
        for q in queries:
            qe = embeddings[hashes[texts.index(q)]]
            scores = corpus_emb @ qe
            top = np.argsort(-scores)[:3]
            answers.append((q, [(self.corpus[i], float(scores[i])) for i in top]))
        return {"answers": answers, "verified": len(texts), "bytes_loaded": worker.stats["load"]["bytes"],
                "load_copy_ms": worker.stats["load"]["copy_ms"], "load_descriptors": worker.stats["load"]["descriptors"],
                "steps": step, "extra_ranks": len(extra)}

    def consumer_follower(self) -> None:
        """Consumer ranks after the first: load every entry too, report each transfer."""
        from vtnumba.backend import default_backend
        from vtnumba.ec import ECWorker

        self.worker = worker = ECWorker(self.region, backend=default_backend(), tp_rank=self.rank - self.consumer)
        encoder_cache: dict = {}
        while True:
            meta = self.ch.recv(self.consumer, TAG_TP)
            if meta is None:
                return
            worker.start_load_caches(encoder_cache, meta)
            worker.wait()
            encoder_cache.clear()
            self.ch.send(worker.build_connector_worker_meta(), self.consumer, TAG_TP)

    # ------------------------------------------------------------------ teardown
    def fail(self, exc: BaseException) -> None:
        """After an error here: tell every other rank, release encoder followers, clean up."""
        from vtnumba.ec.channel import PeerFailure

        try:
            if not isinstance(exc, PeerFailure):  # a peer's own failure needs no echo
                for r in range(self.size):
                    if r != self.rank:
                        self.ch.send_error(r, f"{type(exc).__name__}: {exc}", timeout_s=1.0)
            if self.rank == self.producer and self.tpe is not None and self.num_encoders > 1 and self._in_loop:
                self.tpe.group.comm.bcast(_FAILED, root=0)  # followers wait in bcast between batches
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        try:
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            if self.region is not None:
                self.region.cleanup()


def _print_report(measure: dict, prod: dict, cons: dict, args, sizes, memcpy_gbs: float, target) -> None:
    e, c = sizes
    print(f"vtnumba pipeline demo: all-MiniLM-L6-v2 on {e} encoder rank(s) (tensor-parallel, "
          f"{'TPSP' if 'tpsp' in measure['rates'] else 'regular forward'}) -> encoder cache -> {c} consumer rank(s); "
          f"target {target.name}")
    print()
    for q, top in cons["answers"]:
        print(f"query: {q}")
        for text, score in top:
            print(f"   {score:.3f}  {text}")
    print()
    rates = measure["rates"]
    print(f"encoder throughput over the corpus ({measure['tokens']} tokens):")
    for mode in ("tpsp", "regular"):
        if mode in rates:
            print(f"   {mode:<8} {rates[mode]:10.0f} tokens/s")
    if "tpsp" in rates:
        print(f"   TPSP / regular: {rates['tpsp'] / rates['regular']:.2f}")
    elif e == 1:
        print("   (TPSP needs >= 2 encoder ranks: nothing to exchange with one)")
    save_gbs = prod["bytes_saved"] / (prod["save_copy_ms"] / 1e3) / 1e9 if prod["save_copy_ms"] else 0.0
    load_gbs = cons["bytes_loaded"] / (cons["load_copy_ms"] / 1e3) / 1e9 if cons["load_copy_ms"] else 0.0
    print(f"encoder cache (region {prod['region_blocks']} blocks = {prod['region_mib']:.2f} MiB, one block per token):")
    print(f"   requests {prod['hits'] + prod['misses']}: hits {prod['hits']}, misses {prod['misses']} "
          f"(encoded {prod['encoded_tokens']} tokens), evictions {prod['evictions']}")
    print(f"   saved {prod['bytes_saved'] / 2**20:.2f} MiB in {prod['save_descriptors']} descriptors "
          f"({save_gbs:.2f} GB/s), loaded {cons['bytes_loaded'] / 2**20:.2f} MiB per consumer rank in "
          f"{cons['load_descriptors']} descriptors ({load_gbs:.2f} GB/s); host memcpy {memcpy_gbs:.2f} GB/s")
    print(f"   every one of {cons['verified']} answers verified byte for byte against the encoder's outputs"
          f"{' on ' + str(1 + cons['extra_ranks']) + ' consumer ranks' if cons['extra_ranks'] else ''}")
    print("RESULT: PASS")
    sys.stdout.flush()


def run_pipeline_demo(args) -> int:
    from mpi4py import MPI

    from vtnumba.target import current_target

    comm = MPI.COMM_WORLD
    try:
        sizes = plan_ranks(comm.Get_size(), args.encoder_ranks)
    except ValueError as exc:
        if comm.Get_rank() == 0:
            print(f"vtnumba demo: {exc}", file=sys.stderr)
        return 2
    p = _Pipeline(args, comm.Dup())
    try:
        p.setup()
        measure = prod = cons = None
        if p.is_encoder:
            measure = p.measure_encoder()
            if p.rank == p.producer:
                prod = p.producer_loop()
            else:
                p.encoder_follower()
        elif p.rank == p.consumer:
            cons = p.consumer_loop()
        else:
            p.consumer_follower()
        # The leaders' reports meet at world rank 0, which prints them.
        if p.rank == p.consumer:
            p.ch.send(cons, p.producer, TAG_STEP)
        if p.rank == p.producer:
            cons = p.ch.recv(p.consumer, TAG_STEP)
            from vtnumba.bench.timing import memcpy_bandwidth_gbs

            _print_report(measure, prod, cons, args, sizes, memcpy_bandwidth_gbs(16 << 20), current_target())
    except BaseException as exc:  # noqa: BLE001 - one rank's failure must end every rank
        print(f"[rank {comm.Get_rank()}] vtnumba demo failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        p.fail(exc)
        return 1
    p.cleanup()
    if p.tpe is not None:
        p.tpe.close()
    from vtnumba.dist import destroy_distributed

    destroy_distributed()
    return 0
