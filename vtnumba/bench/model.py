"""Benchmark: the MiniLM encoder with TPSP vs the regular forward (and sentence-transformers).

Run under ``mpiexec -n 2``.  Encodes random 8-40-word sentences at several batch sizes,
TPSP and regular forward alternating on the same sentences in the same run, and reports
sentences/s and tokens/s.  When sentence-transformers is installed (an optional extra,
never a vtnumba dependency) rank 0 also times it on the same sentences, with torch set to
the same total number of CPU threads as all vtnumba ranks together use -- while the other
ranks wait, so the machine is shared fairly.
"""

from __future__ import annotations

import os
import time

from vtnumba.bench import schema
from vtnumba.bench.timing import stats_from_times


def add_arguments(parser) -> None:
    """The suite's own options (batch sizes, sentences per measurement)."""
    from vtnumba.bench.runner import positive_int

    parser.add_argument("--batches", type=positive_int, nargs="+", default=None,
                        help="batch sizes (default 8 32 64; quick 16 64)")
    parser.add_argument("--sentences", type=positive_int, default=None,
                        help=f"sentences per measurement (default 256; quick 64; at most {MAX_SENTENCES})")


#: The most ``--sentences`` a measurement takes: each is made, tokenized and encoded several
#: times (TPSP and regular, every batch size, every round) -- a typo's extra digits ran for hours.
MAX_SENTENCES = 100_000


def check_arguments(args, world_size: int) -> None:
    """``--sentences`` above :data:`MAX_SENTENCES`, or a ``--batches`` size larger than the
    sentences measured: ValueError naming the flag, before the suite runs."""
    n = getattr(args, "sentences", None)
    if n is not None and n > MAX_SENTENCES:
        raise ValueError(f"--sentences={n}: at most {MAX_SENTENCES} (each is encoded several times per round)")
    sentences = n or (64 if getattr(args, "quick", False) else 256)
    too_big = [b for b in getattr(args, "batches", None) or () if b > sentences]
    if too_big:  # (the rows would say "batch 1000" for batches of the 10 sentences there are)
        raise ValueError(f"--batches {' '.join(map(str, too_big))}: larger than the {sentences} sentences a "
                         f"measurement encodes; pick batch sizes up to {sentences} (or raise --sentences)")


def _sentence_transformers_rate(sentences, batch: int, threads: int, repeat: int):
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    from vtnumba.models.minilm_files import find_minilm_dir

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(find_minilm_dir()), device="cpu")
    model.encode(sentences[:batch], batch_size=batch)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        model.encode(sentences, batch_size=batch)
        times.append(time.perf_counter() - t0)
    return stats_from_times(times)


def run(args) -> dict:
    """Run the suite (collective over the world); the result document of :mod:`vtnumba.bench.schema`."""
    from mpi4py import MPI

    from vtnumba.dist import barrier, init_distributed
    from vtnumba.models.corpus import random_sentences
    from vtnumba.models.tp_runtime import TensorParallelEncoder
    from vtnumba.target import current_target

    group = init_distributed()
    quick = bool(getattr(args, "quick", False))
    batches = args.batches or ([16, 64] if quick else [8, 32, 64])
    n = args.sentences or (64 if quick else 256)  # (check_arguments assumes the same defaults)
    repeat = 2 if quick else 3
    sentences = random_sentences(n, seed=7)
    results, ratios, notes = [], {}, []
    with TensorParallelEncoder(group) as tpe:
        tokens = sum(len(t) for t in tpe.encoder.tokenize(sentences))
        rates = {}
        for batch in batches:
            times = {"tpsp": [], "regular": []}
            for mode in ("tpsp", "regular"):  # warm both paths first
                getattr(tpe, f"use_{mode}")()
                tpe.encoder.encode(sentences[:batch], batch_size=batch)
            for _ in range(repeat):
                for mode in ("tpsp", "regular"):  # interleaved: both see the same machine load
                    getattr(tpe, f"use_{mode}")()
                    group.cpu_comm.Barrier()
                    t0 = time.perf_counter()
                    tpe.encoder.encode(sentences, batch_size=batch)
                    dt = group.cpu_comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                    times[mode].append(dt)
            for mode, ts in times.items():
                st = stats_from_times(ts)
                rates[(mode, batch)] = n / st.median_s
                impl = f"vtnumba tp={group.size} {mode}"
                results.append(schema.row("sentences/s", impl, batch, "batch", "sentences/s", n / st.median_s, st))
                results.append(schema.row("tokens/s", impl, batch, "batch", "tokens/s", tokens / st.median_s, st))
            ratios[f"TPSP / regular sentences/s, batch {batch}"] = rates[("tpsp", batch)] / rates[("regular", batch)]
        if not tpe.tpsp_enabled:
            notes.append("TPSP declined on this group (TensorParallelEncoder.tpsp_enabled is False); both rows ran the "
                         "regular forward")
    st_rate = None
    if group.rank == 0:
        threads = int(os.environ.get("OPENBLAS_NUM_THREADS", "1")) * group.size
        big = max(batches)
        st_stats = _sentence_transformers_rate(sentences, big, threads, repeat)
        if st_stats is None:
            notes.append("sentence-transformers not installed: no comparison (pip install sentence-transformers)")
        else:
            st_rate = n / st_stats.median_s
            results.append(schema.row("sentences/s", f"sentence-transformers ({threads} threads)", big, "batch",
                                      "sentences/s", st_rate, st_stats))
            ratios[f"vtnumba TPSP / sentence-transformers sentences/s, batch {big}"] = rates[("tpsp", big)] / st_rate
    # The other ranks wait for rank 0's sentence-transformers run in a *sleeping* barrier: a
    # plain MPI Barrier spins and would steal a core from the baseline being measured.  Its
    # deadline is the command's --timeout (3600 s by default), as for every other wait.
    barrier(group)
    notes.append(f"{n} random 8-40-word sentences, {tokens} tokens, {repeat} timed passes per mode and batch")
    return schema.suite("model", current_target().name, group.size, results, ratios,
                        {"tokens per pass": tokens}, notes)
