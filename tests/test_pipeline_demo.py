"""The README's main job and the embed command, run as a user runs them (mpiexec subprocesses).

Both load the real MiniLM checkpoint: the tests that run them take the ``weights`` fixture,
which fails without it -- or skips, on a GPU run (see tests/minilm_weights.py).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minilm_weights import minilm_dir
from vtnumba.apps.pipeline_demo import mm_hash_of, plan_ranks

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "minilm_reference.npz")


def vt(*args, ranks=3, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "vtnumba", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def weights():
    """The checkpoint the subprocesses will load, looked up here first for a clear failure (or skip)."""
    return minilm_dir()


def vtnumba_shm():
    return {f for f in os.listdir("/dev/shm") if f.startswith("vtnumba")}


def test_pipeline_demo_three_ranks_hits_evictions_and_verification(weights):
    before = vtnumba_shm()
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
    assert vtnumba_shm() == before


def test_pipeline_demo_consumer_failure_ends_every_rank_cleanly(weights):
    before = vtnumba_shm()
    proc = vt("demo", "--target", "cpu", "--fail-at", "2", timeout=120)
    assert proc.returncode != 0
    assert "injected consumer failure" in proc.stderr
    assert "stopped the pipeline" in proc.stderr  # the other encoder rank was released, not left waiting
    assert vtnumba_shm() == before


def test_pipeline_demo_refuses_layouts_it_cannot_run():
    proc = vt("demo", "--target", "cpu", "--encoder-ranks", "2", ranks=2, timeout=60)
    assert proc.returncode == 2 and "leaves no consumer ranks" in proc.stderr
    with pytest.raises(ValueError, match="must divide MiniLM's 12 attention heads"):
        plan_ranks(6, 5)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        plan_ranks(1, None)
    assert plan_ranks(3, None) == (2, 1) and plan_ranks(4, 3) == (3, 1)


def test_pipeline_demo_region_too_small_is_a_clear_error(weights):
    before = vtnumba_shm()
    proc = vt("demo", "--target", "cpu", "--region-mib", "0.05", ranks=2, timeout=120)
    assert proc.returncode != 0 and "must hold at least one input of 256 tokens" in proc.stderr
    assert vtnumba_shm() == before


def test_mm_hash_is_a_function_of_token_ids():
    a = mm_hash_of(np.array([101, 2023, 102]))
    assert a == mm_hash_of([101, 2023, 102]) and a != mm_hash_of([101, 2024, 102]) and len(a) == 32


@pytest.mark.parametrize("extra", [[], ["--no-tpsp"]])
def test_embed_json_matches_sentence_transformers(weights, extra):
    ref = np.load(REFERENCE)
    texts = [str(t) for t in ref["texts"]]
    proc = vt("embed", "--target", "cpu", "--json", *extra, *texts, ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [d["text"] for d in data] == texts
    emb = np.array([d["embedding"] for d in data], dtype=np.float32)
    assert np.abs(emb - ref["sentence_embeddings"]).max() <= 1e-5


def test_embed_refuses_bad_input_on_every_rank(weights):
    proc = vt("embed", "--target", "cpu", "fine", "   ", ranks=2, timeout=60)
    assert proc.returncode != 0 and "empty" in (proc.stderr + proc.stdout).lower()
    proc = vt("embed", "--target", "cpu", "hello", ranks=5, timeout=120)
    assert proc.returncode != 0 and "12" in proc.stderr
