"""The README's main job and the embed command, run as a user runs them (mpiexec subprocesses).

Both load the real MiniLM checkpoint: the tests that run them take the ``weights`` fixture,
which fails without it -- or skips, on a GPU run (see tests/minilm_weights.py).
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import shm_files
from minilm_weights import minilm_dir, minilm_reference

from vtnumba.apps.pipeline_demo import mm_hash_of, plan_ranks


def vt(*args, ranks=3, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "vtnumba", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def weights():
    """The checkpoint the subprocesses will load, looked up here first for a clear failure (or skip)."""
    return minilm_dir()


def said(proc, rank: int, pattern: str) -> bool:
    """Did ``rank`` print a message matching ``pattern``?  (mpiexec may run two ranks' lines
    together, so a message is taken to end where the next ``[rank`` begins.)"""
    return any(re.search(pattern, m) for m in re.findall(rf"\[rank {rank}\]([^\[]*)", proc.stderr))


def test_pipeline_demo_three_ranks_hits_evictions_and_verification(weights):
    before = shm_files()
    proc = vt("demo", "--target", "cpu")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "RESULT: PASS" in out
    assert "on 2 encoder rank(s)" in out and "1 consumer rank(s)" in out
    # A sensible search answer: the pasta question finds the pasta-sauce sentence first.
    lines = out.splitlines()
    i = lines.index("query: How do I cook pasta?")
    assert "pasta sauce" in lines[i + 1]
    stats = next(l for l in lines if l.strip().startswith("requests"))
    hits = int(stats.split("hits ")[1].split(",")[0])
    evictions = int(stats.split("evictions ")[1])
    assert hits >= 1, stats  # repeated inputs are served from the cache
    assert evictions >= 1, stats  # the default region is smaller than the corpus
    assert "verified byte for byte" in out
    assert "tpsp" in out and "regular" in out
    # Output that explains itself: progress from the start, the ratio with its spread and why,
    # and why the cache misses so often.
    assert lines[1].startswith("[  0.0 s] loading the model"), lines[:3]
    assert any(l.strip().startswith("TPSP / regular:") and "interleaved rounds" in l for l in lines), out
    assert any(l.strip().startswith("why: on the cpu target") for l in lines), out
    assert "the region is small on purpose" in out
    # ... and the misses add up: every first request misses, a repeat misses only if evicted.
    m = re.search(r"\((\d+) of the (\d+) requests ask for a text the first time: misses at any region size; "
                  r"of the (\d+) repeats (\d+) hit and (\d+) missed \(evicted meanwhile\)", out)
    assert m, out
    first, requests, repeats, repeat_hits, repeat_misses = map(int, m.groups())
    misses = int(stats.split("misses ")[1].split(" ")[0])
    assert first + repeats == requests == hits + misses and repeat_hits == hits
    assert misses == first + repeat_misses, stats
    assert shm_files() <= before


def test_pipeline_demo_one_encoder_rank_two_consumers_and_own_queries(weights):
    proc = vt("demo", "--target", "cpu", "--encoder-ranks", "1", "--queries", "How do I cook pasta?", "a small cat")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "on 1 encoder rank(s)" in out and "2 consumer rank(s)" in out, out
    assert "TPSP needs >= 2 encoder ranks" in out, out
    lines = out.splitlines()
    queries = [line for line in lines if line.startswith("query: ")]
    assert queries == ["query: How do I cook pasta?", "query: a small cat"]
    assert "cat" in lines[lines.index("query: a small cat") + 1]  # the cat sentence first
    assert "verified byte for byte against the encoder's outputs on 2 consumer ranks" in out
    assert "RESULT: PASS" in out


@pytest.mark.parametrize("speedups, verdict", [
    ([1.1, 1.2, 1.3], "faster in every round"),
    ([0.7, 0.8, 0.9], "slower in every round"),
    ([0.8, 1.0, 1.4], "within this machine's noise"),
])
def test_the_speedup_comes_with_its_spread_and_a_reason(speedups, verdict):
    from vtnumba.apps.pipeline_demo import explain_speedup

    first, why = explain_speedup(1.05, speedups, "cpu")
    assert first.startswith("TPSP / regular: 1.05 (per round") and verdict in first
    assert why.startswith("why: on the cpu target")
    assert "say nothing about a GPU" in explain_speedup(1.0, speedups, "cudasim")[1]


def test_pipeline_demo_consumer_failure_ends_every_rank_cleanly(weights):
    before = shm_files()
    proc = vt("demo", "--target", "cpu", "--fail-at", "2", timeout=120)
    assert proc.returncode != 0
    assert said(proc, 2, "failed while running: RuntimeError: injected consumer failure at step 2"), proc.stderr
    assert said(proc, 0, "rank 2 failed"), proc.stderr
    # The other encoder rank, waiting for its next batch, is told at once -- not left waiting.
    assert said(proc, 1, "because rank [02] failed"), proc.stderr
    assert "gave up" not in proc.stderr and "timed out" not in proc.stderr
    assert shm_files() <= before


def test_pipeline_demo_stopped_consumer_ends_within_the_timeout(weights):
    # Before --timeout existed the encoder waited 300 s for a stopped consumer.
    before = shm_files()
    t0 = time.monotonic()
    proc = vt("demo", "--target", "cpu", "--timeout", "3", "--inject", "stop:2:loading@2", timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert said(proc, 0, r"rank 0 gave up waiting for rank 2 after 3 s \(the consumer's next requests"), proc.stderr
    assert said(proc, 1, "because rank 0 failed"), proc.stderr  # told, not blaming rank 0 itself
    assert said(proc, 0, "ending the job without MPI_Finalize"), proc.stderr
    assert elapsed < 2 * 3 + 30, f"took {elapsed:.0f} s"
    assert shm_files() <= before


def test_pipeline_demo_consumer_stopped_in_setup_is_named_by_the_producer(weights):
    # The other encoder rank used to wait for encoder rank 0 no longer than rank 0 waited for
    # the consumer, and timed out at the same moment, blaming rank 0 for the consumer's stop.
    proc = vt("demo", "--target", "cpu", "--timeout", "3", "--inject", "stop:2:opened", timeout=120)
    assert proc.returncode != 0
    assert said(proc, 0, "rank 0 gave up waiting for rank 2 after 3 s"), proc.stderr
    assert said(proc, 1, "because rank 0 failed"), proc.stderr
    assert not said(proc, 1, "timed out"), proc.stderr


def test_pipeline_demo_killed_producer_leaves_nothing(weights):
    before = shm_files()
    # The kill ends the job at once; --timeout only bounds the consumer's wait for the region's
    # handle, which starts before the producer reaches 'shared'.  3 s lost that race once on a
    # loaded machine (the consumer gave up first, and the job ended the other way).
    proc = vt("demo", "--target", "cpu", "--timeout", "15", "--inject", "kill:0:shared", timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "KILLED BY SIGNAL: 9" in out or "Killed (signal 9)" in out, out  # MPICH ends the others at once
    assert shm_files() <= before


@pytest.mark.parametrize("flags, words", [
    (["--timeout", "0"], "--timeout=0.0: expected a positive, finite number of seconds"),
    (["--timeout", "inf"], "--timeout=inf: expected a positive, finite number of seconds"),
    (["--region-mib", "nan"], "--region-mib=nan: expected a positive, finite number of MiB"),
    (["--region-mib", "1e12"], "--region-mib=1000000000000.0: more than this machine has free"),  # (the OOM killer)
    (["--inject", "bogus"], "--inject='bogus' must look like"),
    (["--inject", "raise:0:loading"], "rank 0 is the producer, which never passes 'loading'"),
    (["--queries", "fine", "  "], "--queries: query 2 ('  ') is empty; expected a text with at least one word"),
    (["--inject", "kill:2:created"], "rank 2 does not exist; the job has ranks 0..1"),
])
def test_pipeline_demo_bad_flags_are_clear_errors(flags, words):
    proc = vt("demo", "--target", "cpu", *flags, ranks=2, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_pipeline_demo_refuses_a_query_without_word_pieces_before_it_starts(weights):
    # It failed on the consumer, after loading and measuring, naming texts[42] (an internal index).
    proc = vt("demo", "--target", "cpu", "--queries", "fine", "\u200b\x07", ranks=2, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("--queries: query 2 ('\\u200b\\x07') has no word pieces") == 1, proc.stderr


def test_pipeline_demo_says_a_truncated_query_by_its_number_once(weights):
    # The consumer's tokenizer warned "truncated texts[42]": an index into the demo's own list.
    proc = vt("demo", "--target", "cpu", "--queries", "pasta " * 300, ranks=2, timeout=120)
    assert proc.returncode == 0 and "RESULT: PASS" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("warning") == 1 and "texts[" not in proc.stderr, proc.stderr
    assert "vtnumba demo: warning: --queries: query 1 has 302 tokens; only its first 256" in proc.stderr


def test_pipeline_demo_refuses_a_fault_on_an_encoder_rank_without_an_endpoint():
    # With 3 ranks, encoder ranks 0 and 1 run the model; only rank 0 owns the producer endpoint.
    proc = vt("demo", "--target", "cpu", "--inject", "stop:1:saving", ranks=3, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("rank 1 is a rank without an endpoint, which never passes 'saving' "
                             "(it passes none of the points)") == 1, proc.stderr


def test_pipeline_demo_refuses_layouts_it_cannot_run():
    proc = vt("demo", "--target", "cpu", "--encoder-ranks", "2", ranks=2, timeout=60)
    assert proc.returncode == 2 and "leaves no consumer ranks" in proc.stderr
    with pytest.raises(ValueError, match=r"^--encoder-ranks=5: the tensor-parallel size must divide MiniLM's 12 "
                                         r"attention heads .*; pass --encoder-ranks 1, 2, 3 or 4, or run mpiexec -n 5 "):
        plan_ranks(6, 5)
    # (The default named what it was: the flag was never passed.)
    with pytest.raises(ValueError, match=r"^--encoder-ranks \(not given: all ranks but one, 5 of 6\): the "):
        plan_ranks(6, None)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        plan_ranks(1, None)
    assert plan_ranks(3, None) == (2, 1) and plan_ranks(4, 3) == (3, 1)


def test_pipeline_demo_without_tpsp_and_with_room_for_everything(weights):
    proc = vt("demo", "--target", "cpu", "--no-tpsp", "--region-mib", "2")
    out = proc.stdout
    assert proc.returncode == 0 and "RESULT: PASS" in out, out + proc.stderr
    progress = [l for l in out.splitlines() if l.startswith("[")]
    assert "(tensor-parallel, regular forward)" in out and not any("TPSP" in l for l in progress), progress
    # Nothing evicted: every repeat hits; only first requests miss.
    assert "evictions 0" in out and "missed (evicted meanwhile)" in out and " 0 missed" in out, out
    assert "small on purpose" not in out


def test_pipeline_demo_region_too_small_is_a_clear_error(weights):
    before = shm_files()
    proc = vt("demo", "--target", "cpu", "--region-mib", "0.05", ranks=2, timeout=120)
    assert proc.returncode != 0 and "must hold at least one input of 256 tokens" in proc.stderr
    assert shm_files() <= before


def test_mm_hash_is_a_function_of_token_ids():
    a = mm_hash_of(np.array([101, 2023, 102]))
    assert a == mm_hash_of([101, 2023, 102]) and a != mm_hash_of([101, 2024, 102]) and len(a) == 32


@pytest.mark.parametrize("extra", [[], ["--no-tpsp"]])
def test_embed_json_matches_sentence_transformers(weights, extra):
    ref = minilm_reference()
    texts = ref["texts"]
    proc = vt("embed", "--target", "cpu", "--json", *extra, *texts, ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Rank 0 says what takes the time before the first text: TPSP's opening profile, unless skipped.
    assert ("opening TPSP: a fused and a regular forward of each of the model's 12 row-parallel projections"
            in proc.stderr) == (not extra), proc.stderr
    data = json.loads(proc.stdout)
    assert [d["text"] for d in data] == texts
    emb = np.array([d["embedding"] for d in data], dtype=np.float32)
    assert np.abs(emb - ref["emb"]).max() <= 1e-5


def test_the_pipeline_demo_is_refused_in_the_simulator_said_once():
    # It ran there: the consumer gave up after --timeout waiting for the encoder's first
    # outputs (hours away in the simulator), blaming an encoder rank that was only busy.
    proc = vt("demo", "--target", "cudasim", ranks=3, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("vtnumba demo: the pipeline demo runs all-MiniLM-L6-v2 over its whole corpus, which in "
                             "numba's CUDA simulator") == 1, proc.stderr
    assert "vtnumba demo runtime --target cudasim" in proc.stderr and "Traceback" not in proc.stderr
    assert "embed" not in proc.stderr  # (the whole model in the simulator: minutes for one text)


def test_embed_refuses_bad_input_on_every_rank(weights):
    proc = vt("embed", "--target", "cpu", "fine", "   ", ranks=2, timeout=60)
    assert proc.returncode != 0 and "empty" in (proc.stderr + proc.stdout).lower()
    proc = vt("embed", "--target", "cpu", "hello", ranks=5, timeout=120)
    assert proc.returncode != 0 and "12" in proc.stderr
