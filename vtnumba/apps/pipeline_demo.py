"""The pipeline demo (the README's main job): encode with TPSP, hand outputs over through the encoder cache.

``mpiexec -n N python -m vtnumba demo`` splits the world in two:

* **encoder ranks** (world ranks ``0 .. E-1``, default ``E = N - 1``) run all-MiniLM-L6-v2
  tensor-parallel with tensor-parallel size E, every row-parallel projection finished by the
  fused TPSP op (LayerNorm + bias, post-norm).  Encoder rank 0 is also the encoder cache's
  *producer* (an :class:`~vtnumba.ec.ECProducer`): it owns the block cache and saves each
  input's token-level outputs (``[tokens, 384]`` float32, one block per token) into the
  shared region with batched copies;
* **consumer ranks** (the rest, each an :class:`~vtnumba.ec.ECConsumer`) load those outputs
  back through the encoder cache, pool them (mean over tokens, then L2 normalisation) and
  answer semantic-search queries over a small corpus shipped with vtnumba.  Extra consumer
  ranks act as more tensor-parallel ranks of the consumer: each loads every entry, and a pin
  is released once all have.

An input is keyed by an ``mm_hash`` of its token ids.  The consumer asks for inputs by
hash; if the entry is ready in the cache it is served without re-encoding (a *hit*),
otherwise the encoders encode it (a *miss*).  The region is small by default (about 40%
of what the corpus needs), so old entries are evicted to make room -- asking for them
again later is a miss and they are re-encoded.

Correctness is checked as it goes: the producer sends, with every grant, a CRC of the
token-level bytes it saved and the sentence embedding it pooled itself; the consumer's
loaded bytes and its own pooling must match both *byte for byte*, or the run fails.

Failures end the job (``docs/failure_model``): a rank that raises tells every other rank
(the endpoints' channel, and :mod:`vtnumba.dist.failures` for the encoder ranks waiting for
their next batch), and each prints which rank failed and what it was doing; a killed rank
takes the job down with it (mpiexec); a stopped one makes the others give up after
``--timeout`` seconds (default :data:`vtnumba.dist.DEFAULT_TIMEOUT_S`).  The region never
has a name in ``/dev/shm``, so no fault leaves a file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import pickle
import sys
import time
import warnings
import zlib

import numpy as np

TAG_TP = 23  # nothing but the endpoints' own messages otherwise
DEFAULT_QUERIES = [
    "Which animals live in the ocean?",
    "How do I cook pasta?",
    "Tell me about the planets of the solar system.",
    "What helps you stay healthy?",
]
REQUESTS_PER_STEP = 12
HIDDEN = 384        # all-MiniLM-L6-v2's hidden size: one block = one token row of float32
MAX_TOKENS = 256    # its longest input: the region must hold at least one


def mm_hash_of(token_ids: np.ndarray) -> str:
    """The encoder-cache key of an input: a hash of its token ids (same ids, same entry)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


def _crc(arr: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).view(np.uint8))


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
        fits = [d for d in (1, 2, 3, 4, 6, 12) if d < world_size]
        given = f"--encoder-ranks={e}" if encoder_ranks is not None else \
            f"--encoder-ranks (not given: all ranks but one, {e} of {world_size})"
        choices = ", ".join(map(str, fits[:-1])) + f" or {fits[-1]}" if len(fits) > 1 else str(fits[0])
        raise ValueError(f"{given}: the tensor-parallel size must divide MiniLM's 12 attention heads "
                         f"(1, 2, 3, 4, 6 or 12); pass --encoder-ranks {choices}, or run mpiexec -n "
                         f"{fits[-1] + 1} ({fits[-1]} encoder ranks + 1 consumer)")
    return e, world_size - e


def check_options(args, world_size: int) -> tuple[float, object, list[str]]:
    """(timeout in seconds, fault injection or None, warnings for rank 0 to print); ValueError
    naming the flag for bad values.

    Every rank checks the same command line, so every rank refuses it alike -- before any
    rank waits for another.
    """
    from vtnumba.dist.comm import DEFAULT_TIMEOUT_S
    from vtnumba.ec.endpoints import FaultInjection, points_passed

    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"--timeout={args.timeout}: expected a positive, finite number of seconds")
    if args.region_mib is not None:
        if not (args.region_mib > 0 and math.isfinite(args.region_mib)):
            raise ValueError(f"--region-mib={args.region_mib}: expected a positive, finite number of MiB")
        need = MAX_TOKENS * HIDDEN * 4
        if args.region_mib * (1 << 20) < need:
            raise ValueError(f"--region-mib={args.region_mib}: the region must hold at least one input of "
                             f"{MAX_TOKENS} tokens ({need / 2**20:.2f} MiB)")
        from vtnumba.ec.region import check_fits_in_memory

        check_fits_in_memory(args.region_mib * (1 << 20), f"--region-mib={args.region_mib}")
    from vtnumba.models.minilm_tokenizer import invalid_text

    for i, query in enumerate(args.queries or ()):
        bad = invalid_text(query)
        if bad:
            raise ValueError(f"--queries: query {i + 1} ({query!r}) {bad}")
    if args.queries:
        # A query of control characters or zero-width spaces only has no word piece: only the
        # tokenizer can tell (it failed on the consumer, after loading, naming an internal index).
        from vtnumba.models import find_minilm_dir
        from vtnumba.models.minilm_tokenizer import NO_PIECES, MiniLMTokenizer, first_without_pieces_in

        try:
            tokenizer = MiniLMTokenizer(find_minilm_dir())
        except (OSError, ValueError):
            tokenizer = None  # (the run says so, on the ranks that load the model)
        counts = tokenizer.token_counts(args.queries) if tokenizer is not None else []
        empty = first_without_pieces_in(counts)
        if empty is not None:
            raise ValueError(f"--queries: query {empty + 1} ({args.queries[empty]!r}) {NO_PIECES}")
        # Said here, by query number (the consumer's tokenizer warning counted in its own list).
        notes = [f"--queries: query {i + 1} has {n} tokens; only its first {tokenizer.max_seq_length} are embedded, "
                 "as sentence-transformers does" for i, n in enumerate(counts) if n > tokenizer.max_seq_length]
    else:
        notes = []
    inject = None
    if args.inject:
        # Encoder rank 0 is the producer, the first consumer rank the leader; the other encoder
        # ranks have no endpoint, so a fault there (at an encoder-cache point) would never fire.
        encoders, _ = plan_ranks(world_size, args.encoder_ranks)
        inject = FaultInjection.parse(args.inject).check_fires(
            world_size, lambda r: points_passed(r, 0, range(encoders, world_size)))
    return timeout, inject, notes


class _Pipeline:
    def __init__(self, args, comm, timeout: float, inject):
        self.args = args
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.num_encoders, self.num_consumers = plan_ranks(self.size, args.encoder_ranks)
        self.is_encoder = self.rank < self.num_encoders
        self.producer, self.consumer = 0, self.num_encoders  # world ranks of the two leaders
        self.consumers = list(range(self.num_encoders, self.size))
        self.timeout = timeout
        self.on_point = inject.on_point(self.rank) if inject else None
        # A wait's deadline covers the waits the awaited rank may itself be in, so that the rank
        # that times out first is the one waiting *directly* for a stopped rank, and names it
        # (vtnumba.ec.endpoints explains the rule).  Encoder rank 0 answers the consumer after
        # a forward with the other encoder ranks; the consumer leader answers encoder rank 0
        # after waiting for its other consumer ranks.
        self.wait_for_encoder = timeout * (2 if self.num_encoders > 1 else 1)
        self.wait_for_consumer = timeout * (2 if self.num_consumers > 1 else 1)
        self.tpe = None
        self.hidden = HIDDEN

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from vtnumba.dist import init_distributed, new_group
        from vtnumba.models.corpus import load_corpus

        init_distributed(tp_size=self.size)
        enc_group = new_group("encoder", list(range(self.num_encoders)))
        new_group("consumer", self.consumers)
        self.corpus = load_corpus()
        if self.is_encoder:
            from vtnumba.models.tp_runtime import TensorParallelEncoder

            self.tpe = TensorParallelEncoder(enc_group, use_tpsp=not self.args.no_tpsp)
            self.hidden = self.tpe.encoder.hidden_size
        else:
            from vtnumba.models.minilm_tokenizer import MiniLMTokenizer

            self.tokenizer = MiniLMTokenizer()

    def endpoint(self):
        """This rank's side of the encoder cache (the other encoder ranks have none)."""
        from vtnumba.ec import ECConsumer, ECProducer

        common = dict(hidden_size=self.hidden, dtype=np.float32, consumers=self.consumers, timeout_s=self.timeout,
                      on_point=self.on_point)
        if self.rank == self.producer:
            block = self.hidden * 4
            if self.args.region_mib is not None:
                region_bytes = int(self.args.region_mib * (1 << 20))
            else:
                # ~40% of the corpus's token rows (at least one longest input): evictions happen.
                ids = self.tpe.encoder.tokenize(self.corpus) if self.num_encoders == 1 else None
                corpus_rows = sum(len(t) for t in ids) if ids is not None else 16 * len(self.corpus)
                region_bytes = max(int(0.4 * corpus_rows), MAX_TOKENS) * block
            return ECProducer(self.comm, region_bytes=region_bytes, name="demo", **common)
        if not self.is_encoder:
            # Encoder rank 0 makes the region after loading the model with the other encoder
            # ranks: waiting for its handle spans its waits for them (a stopped encoder rank is
            # named by rank 0, not blamed on it).
            return ECConsumer(self.comm, producer=self.producer, handle_timeout_s=self.wait_for_encoder, **common)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ encoder side
    def measure_encoder(self, rounds: int = 3) -> dict:
        """Encoder tokens/s over the corpus with TPSP and with the regular forward, interleaved.

        Each round times the regular forward and then TPSP (the slowest encoder rank's time),
        so both see the same machine at nearly the same moment; the ratio is taken per round
        and reported as its median and range -- on a busy machine the range says whether the
        difference is real.
        """
        from mpi4py import MPI

        from vtnumba.dist.comm import barrier, wait_request

        enc, group = self.tpe.encoder, self.tpe.group
        # Encoder rank 0 gets here only once the consumer has answered its region (the
        # endpoint's setup, a wait of up to wait_for_consumer): the other encoder ranks wait that
        # long plus one timeout, so that a stopped consumer is named by rank 0, which times out
        # first, and not rank 0 by them.
        barrier(group, self.wait_for_consumer + self.timeout)
        ids = enc.tokenize(self.corpus)
        tokens = sum(len(t) for t in ids)
        modes = ["regular"] + (["tpsp"] if self.tpe.tpsp_enabled else [])
        for mode in modes:  # warm up both paths first (the first call compiles kernels)
            getattr(self.tpe, f"use_{mode}")()
            enc.encode_ids(ids[:8])
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds):
            for mode in modes:
                getattr(self.tpe, f"use_{mode}")()
                barrier(group)  # non-blocking underneath, with the process's timeout
                t0 = time.perf_counter()
                enc.encode_ids(ids)
                mine, slowest = np.array([time.perf_counter() - t0]), np.zeros(1)
                wait_request(group.cpu_comm.Iallreduce(mine, slowest, op=MPI.MAX), group, "encoder timing")
                times[mode].append(float(slowest[0]))
        if self.tpe.tpsp_enabled:
            self.tpe.use_tpsp()  # the pipeline itself runs with TPSP
        rates = {m: tokens / float(np.median(t)) for m, t in times.items()}
        out = {"tokens": tokens, "rates": rates, "rounds": rounds}
        if "tpsp" in times:
            # tokens/s ratio per round = regular time / TPSP time of that round.
            out["speedups"] = sorted(r / t for r, t in zip(times["regular"], times["tpsp"], strict=True))
        return out

    def _bcast_work(self, batch=None):
        """Encoder rank 0 -> the other encoder ranks: the next batch of token ids (None: no more).

        A non-blocking broadcast waited for with the process's timeout: an encoder rank whose
        rank 0 stopped answering gives up instead of waiting inside MPI forever, and a
        failure any rank reports ends the wait at once (:mod:`vtnumba.dist.failures`).
        """
        from vtnumba.dist.comm import wait_request

        group = self.tpe.group
        comm = group.cpu_comm
        payload = np.frombuffer(pickle.dumps(batch), np.uint8) if comm.Get_rank() == 0 else None
        size = np.array([0 if payload is None else payload.size], np.int64)
        # Waiting for the next batch spans encoder rank 0's own wait for the consumer leader
        # (see wait_for_consumer): allow one timeout more, so that a stopped *consumer* is
        # named by rank 0, which times out first, instead of this rank blaming rank 0.
        wait_request(comm.Ibcast(size, root=0), group, "waiting for encoder rank 0's next batch",
                     self.wait_for_consumer + self.timeout)
        buf = payload.copy() if payload is not None else np.empty(int(size[0]), np.uint8)
        wait_request(comm.Ibcast(buf, root=0), group, "receiving encoder rank 0's next batch")
        return pickle.loads(buf.tobytes())

    def encoder_follower(self) -> None:
        """Encoder ranks 1..E-1: encode whatever encoder rank 0 broadcasts, until told to stop."""
        while (batch := self._bcast_work()) is not None:
            self.tpe.encoder.encode_ids(batch)

    def producer_loop(self, ep) -> dict:
        from vtnumba.models.minilm import pool_embedding

        backend = ep.worker.backend
        waiting: dict[str, np.ndarray] = {}  # requested, not yet granted: mm_hash -> token ids
        checks: dict[str, tuple[int, bytes, int]] = {}  # mm_hash -> (crc, pooled bytes, tokens)
        hits = misses = encoded_tokens = steps = 0
        while True:
            msg = ep.recv(what="the consumer's next requests and releases", timeout_s=self.wait_for_consumer)
            for h in msg["releases"]:
                ep.release(h)
            if msg["done"]:
                break
            for h, ids in msg["requests"]:
                if ep.is_ready(h):
                    hits += 1
                else:
                    misses += 1
                waiting[h] = np.asarray(ids, dtype=np.int64)
            # Encode (all encoder ranks together) what is neither cached nor being saved, as
            # far as the region has room; the rest waits for the consumer's releases.
            todo = []
            for h, ids in waiting.items():
                if ep.is_ready(h):
                    continue
                if ep.request_save(h, len(ids)) is None:
                    if ep.cache.lookup(h) is None:
                        break  # no room even after evicting: wait for releases
                    continue
                todo.append(h)
            if todo:
                id_list = [waiting[h] for h in todo]
                if self.num_encoders > 1:
                    self._bcast_work(id_list)
                hidden = self.tpe.encoder.encode_ids(id_list)
                encoded_tokens += sum(len(i) for i in id_list)
                outputs, bufs = {}, []
                for h, hs in zip(todo, hidden):
                    # The encoder's output lives in device memory, as in an engine.
                    buf = backend.alloc(hs.nbytes)
                    backend.copy(ep.compute_queue, buf, hs, hs.nbytes)
                    outputs[h] = buf.view(np.float32, hs.shape)
                    bufs.append(buf)
                    checks[h] = (_crc(hs), pool_embedding(hs).tobytes(), len(hs))
                ep.save(outputs)
                ep.wait_saves()
                outputs.clear()
                for buf in bufs:
                    backend.free(buf)
            grants = {}
            for h in list(waiting):
                ids = ep.grant(h) if ep.is_ready(h) else None
                if ids is not None:
                    crc, pooled, ntok = checks[h]
                    grants[h] = (ids, crc, pooled, ntok)
                    del waiting[h]
            steps += 1
            ep.send({"grants": grants}, what="this step's grants")
        if self.num_encoders > 1:
            self._bcast_work(None)
        st, w = ep.cache.stats, ep.worker.stats["save"]
        return {"hits": hits, "misses": misses, "evictions": st.evictions, "encoded_tokens": encoded_tokens,
                "bytes_saved": w["bytes"], "save_copy_ms": w["copy_ms"], "save_descriptors": w["descriptors"],
                "steps": steps, "region_blocks": ep.region.num_blocks,
                "region_mib": ep.region.num_blocks * self.hidden * 4 / 2**20}

    # ------------------------------------------------------------------ consumer side
    def consumer_loop(self, ep) -> dict:
        from vtnumba.backend.arrays import to_host
        from vtnumba.models.minilm import pool_embedding
        from vtnumba.models.minilm_tokenizer import TruncationWarning

        queries = list(self.args.queries or DEFAULT_QUERIES)
        # Rounds of requests: the corpus, the queries, then repeats (cache hits, or misses
        # for entries evicted meanwhile) -- every round's answers are checked the same way.
        texts = self.corpus + queries + [queries[0], self.corpus[-1], self.corpus[0]]
        with warnings.catch_warnings():  # (rank 0 said which queries are truncated, by their number)
            warnings.simplefilter("ignore", TruncationWarning)
            ids = self.tokenizer.encode(texts)
        hashes = [mm_hash_of(t) for t in ids]
        embeddings: dict[str, np.ndarray] = {}
        pending = list(range(len(texts)))  # indices still to request
        outstanding: set[str] = set()
        releases: list[str] = []
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
            ep.send({"requests": requests, "releases": releases, "done": done}, what="this step's requests")
            releases = []
            if done:
                break
            grants = ep.recv(what="the encoder's grants", timeout_s=self.wait_for_encoder)["grants"]
            # Every consumer rank loads the granted entries; when load() returns, all have them.
            loaded = ep.load({h: g[0] for h, g in grants.items()})
            for h, arr in loaded.items():
                _, crc, pooled, ntok = grants[h]
                got = to_host(arr)
                if got.shape != (ntok, self.hidden) or _crc(got) != crc:
                    raise RuntimeError(f"consumer: the token-level outputs of {h} differ from what the encoder saved")
                emb = pool_embedding(np.array(got))
                if emb.tobytes() != pooled:
                    raise RuntimeError(f"consumer: the embedding pooled from {h} differs from the encoder's")
                embeddings[h] = emb
                outstanding.discard(h)
                releases.append(h)
            step += 1
        if self.args.fail_at is not None:  # (past the last step: a fault test that would test nothing)
            raise RuntimeError(f"--fail-at {self.args.fail_at} never fired: the consumer finished after {step} "
                               f"step(s); pick a step below {step + 1}")
        corpus_emb = np.stack([embeddings[h] for h in hashes[:len(self.corpus)]])
        answers = []
        for q in queries:
            qe = embeddings[hashes[texts.index(q)]]
            scores = corpus_emb @ qe
            top = np.argsort(-scores)[:3]
            answers.append((q, [(self.corpus[i], float(scores[i])) for i in top]))
        w = ep.worker.stats["load"]
        return {"answers": answers, "verified": len(texts), "distinct": len(set(hashes)),
                "bytes_loaded": w["bytes"], "load_copy_ms": w["copy_ms"],
                "load_descriptors": w["descriptors"], "steps": step, "extra_ranks": len(ep.followers)}


def explain_speedup(ratio: float, speedups: list[float], target: str, label: str = "TPSP / regular") -> list[str]:
    """Two lines on TPSP vs the regular forward: the measured ratio with its spread, and why.

    ``ratio`` is TPSP's speed over the regular forward's (medians: tokens/s, or the inverse
    of the times); ``speedups`` are the same ratio per interleaved round (> 1: TPSP faster),
    whose range shows the noise.  ``label`` starts the first line (``mpi/tpsp_model.py``
    says "speed-up of TPSP", because it also prints the *time* ratio).
    """
    lo, hi = min(speedups), max(speedups)
    if lo > 1:
        verdict = "TPSP was faster in every round"
    elif hi < 1:
        verdict = "TPSP was slower in every round"
    else:
        verdict = "the rounds disagree: the difference is within this machine's noise"
    lines = [f"{label}: {ratio:.2f} (per round {lo:.2f}-{hi:.2f} over {len(speedups)} interleaved rounds); "
             f"{verdict}"]
    if target == "cpu":
        lines.append("why: on the cpu target both forwards do the same matmuls; TPSP saves the all-reduce's copies "
                     "and normalises only this rank's share of the tokens, but its exchange runs on the same cores "
                     "through shared memory, so nothing overlaps and the gain is small (a GPU hides the exchange "
                     "behind the next chunk's matmul)")
    elif target == "cudasim":
        lines.append("why: in numba's CUDA simulator every GPU thread is a Python thread: these times say nothing "
                     "about a GPU")
    else:
        lines.append("why: on a GPU TPSP overlaps the exchange of one chunk with the next chunk's matmul and moves "
                     "the data peer to peer, where the regular forward waits for a staged MPI all-reduce")
    return lines


def _print_report(measure: dict, prod: dict, cons: dict, args, sizes, memcpy_gbs: float, target) -> None:
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
        for line in explain_speedup(rates["tpsp"] / rates["regular"], measure["speedups"], target.name):
            print(f"   {line}")
    elif sizes[0] == 1:
        print("   (TPSP needs >= 2 encoder ranks: nothing to exchange with one)")
    save_gbs = prod["bytes_saved"] / (prod["save_copy_ms"] / 1e3) / 1e9 if prod["save_copy_ms"] else 0.0
    load_gbs = cons["bytes_loaded"] / (cons["load_copy_ms"] / 1e3) / 1e9 if cons["load_copy_ms"] else 0.0
    print(f"encoder cache (region {prod['region_blocks']} blocks = {prod['region_mib']:.2f} MiB, one block per token):")
    print(f"   requests {prod['hits'] + prod['misses']}: hits {prod['hits']}, misses {prod['misses']} "
          f"(encoded {prod['encoded_tokens']} tokens), evictions {prod['evictions']}")
    requests, repeats = prod["hits"] + prod["misses"], prod["hits"] + prod["misses"] - cons["distinct"]
    # A first request misses whatever the region's size; only a repeat can hit, if its entry
    # was not evicted meanwhile.
    print(f"   ({cons['distinct']} of the {requests} requests ask for a text the first time: misses at any region "
          f"size; of the {repeats} repeats {prod['hits']} hit and {repeats - prod['hits']} missed (evicted meanwhile)"
          + (" -- the region is small on purpose, about 40% of what the corpus needs; --region-mib 2 holds "
             "everything)" if args.region_mib is None else ")"))
    print(f"   saved {prod['bytes_saved'] / 2**20:.2f} MiB in {prod['save_descriptors']} descriptors "
          f"({save_gbs:.2f} GB/s), loaded {cons['bytes_loaded'] / 2**20:.2f} MiB per consumer rank in "
          f"{cons['load_descriptors']} descriptors ({load_gbs:.2f} GB/s); host memcpy {memcpy_gbs:.2f} GB/s")
    print(f"   (an entry here is one sentence, ~{prod['bytes_saved'] / max(prod['misses'], 1) / 1024:.0f} KiB: "
          "per-step costs, not bandwidth, set these rates; `vtnumba bench ec` measures them across sizes)")
    print(f"   every one of {cons['verified']} answers verified byte for byte against the encoder's outputs"
          f"{' on ' + str(1 + cons['extra_ranks']) + ' consumer ranks' if cons['extra_ranks'] else ''}")
    print("RESULT: PASS")
    sys.stdout.flush()


def refuse_the_simulator() -> None:
    """ValueError on the ``cudasim`` target: the demo's model cannot run there in useful time.

    Every GPU thread of numba's simulator is a Python thread (~7000 a second): encoding the
    corpus -- TPSP's opening profile first -- takes hours, and the consumer, which waits
    ``--timeout`` for the encoder's first outputs, gave up long before, blaming a rank that
    was only busy.  The GPU code does run in the simulator elsewhere, at sizes made for it.
    """
    from vtnumba.target import current_target

    if current_target().name == "cudasim":
        raise ValueError("the pipeline demo runs all-MiniLM-L6-v2 over its whole corpus, which in numba's CUDA "
                         "simulator (~7000 GPU threads/s) takes hours; run it with --target cpu (or on a GPU), and "
                         "see the GPU code in the simulator with 'vtnumba demo runtime --target cudasim', "
                         "'mpi/ec_disagg.py --target cudasim', 'mpi/tpsp_model.py --target cudasim --layers 1 "
                         "--tokens 32 --hidden 64 --ffn 64 --repeat 1' or the tutorials")


def run_pipeline_demo(args) -> int:
    """``vtnumba demo``: run the pipeline on every rank of the world; returns the exit status."""
    from mpi4py import MPI

    from vtnumba.dist import run_collectively
    from vtnumba.dist.comm import set_default_timeout

    comm = MPI.COMM_WORLD
    try:
        refuse_the_simulator()
        sizes = plan_ranks(comm.Get_size(), args.encoder_ranks)
        timeout, inject, notes = check_options(args, comm.Get_size())
    except ValueError as exc:
        if comm.Get_rank() == 0:
            print(f"vtnumba demo: {exc}", file=sys.stderr)
        return 2
    if comm.Get_rank() == 0:
        for note in notes:
            print(f"vtnumba demo: warning: {note}", file=sys.stderr, flush=True)
    set_default_timeout(timeout)  # every wait for another rank, in vtnumba too (TPSP, groups, ...)
    # A rank that fails tells the others and says what it was doing; a rank that stops
    # answering makes the others give up after --timeout; either way the job ends.
    return run_collectively(lambda: _run(args, comm, sizes, timeout, inject), timeout_s=timeout)


class _Progress:
    """Rank 0's running commentary: what the demo is doing now, and how long it has run."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.t0:5.1f} s] {what}", flush=True)


def _run(args, world, sizes, timeout: float, inject) -> int:
    from vtnumba.dist import destroy_distributed
    from vtnumba.dist.comm import dup_comm
    from vtnumba.target import current_target

    e, c = sizes
    target = current_target()
    say = _Progress(world.Get_rank() == 0)
    tpsp = not args.no_tpsp and e > 1  # (one encoder rank has nothing to exchange)
    if world.Get_rank() == 0:
        print(f"vtnumba pipeline demo: all-MiniLM-L6-v2 on {e} encoder rank(s) (tensor-parallel, "
              f"{'TPSP' if tpsp else 'regular forward'}) -> encoder cache -> {c} consumer "
              f"rank(s); target {target.name}", flush=True)
    say(f"loading the model (weights, tokenizer){' and opening TPSP on the encoder ranks' if tpsp else ''} ...")
    p = _Pipeline(args, dup_comm(world, "the demo's setup", timeout), timeout, inject)
    p.setup()
    measure = prod = cons = None
    say("creating the encoder-cache region and handing it to the consumer ...")
    with p.endpoint() as ep:
        if p.is_encoder:
            say(f"measuring the encoder on the corpus, {'TPSP and regular forward interleaved' if tpsp else 'regular forward'}"
                " (the first call compiles the kernels; numba caches them on disk for the next run) ...")
            measure = p.measure_encoder()
            say("serving the consumer's requests through the encoder cache ...")
            if p.rank == p.producer:
                prod = p.producer_loop(ep)
            else:
                p.encoder_follower()
        elif p.rank == p.consumer:
            cons = p.consumer_loop(ep)
        else:
            # Waiting for the leader's next loads spans the leader's wait for encoder rank 0.
            ep.serve(timeout_s=p.wait_for_encoder + timeout)
        # The leaders' reports meet at world rank 0, which prints them.
        if p.rank == p.consumer:
            ep.send(cons, what="the consumer's report")
        if p.rank == p.producer:
            cons = ep.recv(what="the consumer's report")
    if p.rank == p.producer:
        from vtnumba.bench.timing import memcpy_bandwidth_gbs

        say("done")
        _print_report(measure, prod, cons, args, sizes, memcpy_bandwidth_gbs(16 << 20), target)
    if p.tpe is not None:
        p.tpe.close()
    destroy_distributed()
    return 0
