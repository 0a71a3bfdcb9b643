"""The MiniLM encoder's pieces against float64 numpy references, and the model on the device target.

erf / GELU, packed attention (odd lengths, padding), batch packing, the regular
reduce + add + LayerNorm on one rank, the TPSP adapter's argument checks, the QKV layout
that keeps heads whole on a rank, and a small random MiniLM-shaped model computed on the
device target (numba's simulator here, the GPU under ``VTNUMBA_TARGET=cuda``) against the
same model on the host.  No checkpoint needed.
"""

import math

import numpy as np
import pytest
from attention_reference import attention64

from vtnumba.backend import CPUBackend
from vtnumba.backend.arrays import is_device_array
from vtnumba.models import (
    LayerWeights,
    MiniLMConfig,
    MiniLMModel,
    MiniLMWeights,
    PackedBatch,
    RegularReduceNorm,
    TPSPReduceNorm,
    attention,
    bias_gelu_,
    fast_erf,
    pack_batch,
    shard_layer,
)

ODD = (1, 7, 33, 65)


def test_fast_erf_matches_math_erf_to_float32_precision():
    x = np.concatenate([np.linspace(-6, 6, 20001), [0.0, -0.0, 1e-8, -1e-8, 3.999, 4.0, 4.5, 40.0, -40.0]])
    got = np.array([fast_erf(np.float32(v)) for v in x], dtype=np.float64)
    want = np.array([math.erf(float(np.float32(v))) for v in x])
    assert np.abs(got - want).max() < 1e-7  # about 1.5 float32 ulp of 1


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (33, 65), (65, 7)])
def test_bias_gelu_matches_float64_erf_gelu(rng, shape):
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    v = x.astype(np.float64) + b
    want = 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0)))
    got = x.copy()
    bias_gelu_(got, b)
    assert np.abs(got - want).max() <= 2e-6 * max(1.0, np.abs(want).max())


def _ln64(z, w, b, eps):
    z = z.astype(np.float64)
    mu = z.mean(axis=1, keepdims=True)
    var = ((z - mu) ** 2).mean(axis=1, keepdims=True)
    return (z - mu) / np.sqrt(var + eps) * w + b


def test_pack_batch_offsets_and_positions():
    ids = [np.array([101, 5, 102]), np.array([101, 102]), np.arange(7)]
    b = pack_batch(ids)
    assert isinstance(b, PackedBatch)
    assert b.offsets.tolist() == [0, 3, 5, 12] and b.max_len == 7 and b.num_tokens == 12
    assert b.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]
    assert [p.tolist() for p in b.split(b.ids)] == [t.tolist() for t in ids]
    with pytest.raises(ValueError, match="empty"):
        pack_batch([])
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        pack_batch([np.array([1]), np.array([], np.int64)])


@pytest.mark.parametrize("lengths", [(1,), (7, 1, 33), (65, 7, 33, 1)])
@pytest.mark.parametrize("nh,d", [(1, 8), (3, 64)])
def test_attention_matches_per_sentence_reference(rng, lengths, nh, d):
    b = pack_batch([np.zeros(n, np.int64) for n in lengths])
    qkv = rng.standard_normal((b.num_tokens, 3 * nh * d)).astype(np.float32)
    bias = rng.standard_normal(3 * nh * d).astype(np.float32)
    got = attention(qkv, b, nh, d, bias=bias)
    assert got.shape == (b.num_tokens, nh * d)
    # float32 rounds each score q.k to ~1 ulp of |q| |k| (its largest possible size); softmax
    # passes that error on to the output, scaled by |v|.  So the tolerance is a float32 ulp of
    # max|q| max|k| max|v|: with d = 64 and these unscaled scores that is ~1e-4, where a fixed
    # 2e-5 failed for some seeds; a padded key leaking into a row would be off by O(|v|).
    x = qkv.astype(np.float64) + bias
    K = nh * d
    q, k = (np.linalg.norm(x[:, p * K:(p + 1) * K].reshape(-1, nh, d), axis=2).max() for p in (0, 1))
    tol = np.finfo(np.float32).eps * q * k * np.abs(x[:, 2 * K:]).max()
    assert np.abs(got - attention64(qkv, lengths, nh, d, bias)).max() < tol


def test_attention_padding_never_reaches_real_rows(rng):
    # The same sentence alone, and next to a much longer one (so it gets padded): same rows.
    nh, d = 2, 16
    short = rng.standard_normal((5, 3 * nh * d)).astype(np.float32)
    other = rng.standard_normal((33, 3 * nh * d)).astype(np.float32)
    alone = attention(short, pack_batch([np.zeros(5, np.int64)]), nh, d).copy()
    both = attention(np.concatenate([other, short]), pack_batch([np.zeros(33, np.int64), np.zeros(5, np.int64)]), nh, d)
    # Padding must not *leak* into real rows (that would be an O(1) error); it may change the
    # order of float32 sums (a longer, masked row vectorises differently), which moves results
    # by a few units in the last place -- so the tolerance is a few ulps of the values' scale.
    ulp = np.finfo(np.float32).eps * np.abs(alone).max()
    np.testing.assert_allclose(both[33:], alone, rtol=0, atol=8 * ulp)


def test_attention_rejects_bad_shapes(rng):
    b = pack_batch([np.zeros(4, np.int64)])
    with pytest.raises(ValueError, match="qkv"):
        attention(np.ones((4, 10), np.float32), b, 1, 4)
    with pytest.raises(ValueError, match="bias"):
        attention(np.ones((4, 12), np.float32), b, 1, 4, bias=np.ones(5, np.float32))


def test_regular_reduce_norm_single_rank_and_buffers(rng):
    T, K, H = 7, 33, 16
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = rng.standard_normal((H, K)).astype(np.float32)
    bias, lw, lb = (rng.standard_normal(H).astype(np.float32) for _ in range(3))
    res = rng.standard_normal((T, H)).astype(np.float32)
    rn = RegularReduceNorm(None)
    with pytest.raises(ValueError, match="residual has shape"):
        rn(x, w, bias, res[:3], lw, lb, 1e-12)
    want = _ln64(x.astype(np.float64) @ w.T.astype(np.float64) + bias + res, lw, lb, 1e-12)
    first = rn(x, w, bias, res, lw, lb, 1e-12)
    assert np.abs(first - want).max() < 2e-5
    kept = first.copy()
    second = rn(x, w, bias, first, lw, lb, 1e-12)  # the previous output as the residual
    assert np.array_equal(first, kept) and not np.shares_memory(first, second)
    third = rn(x, w, bias, first, lw, lb, 1e-12)  # a caller holding an older result: not clobbered
    assert np.array_equal(first, kept) and np.array_equal(third, second)


def test_tpsp_adapter_validates(rng):
    with pytest.raises(TypeError, match="callable"):
        TPSPReduceNorm("not an op", 0, 2)
    with pytest.raises(ValueError, match="rank"):
        TPSPReduceNorm(lambda *a, **k: None, 2, 2)
    bad = TPSPReduceNorm(lambda *a, **k: (np.zeros((2, 4), np.float32), None), 0, 1)
    with pytest.raises(RuntimeError, match="gathered"):
        bad(np.ones((3, 2), np.float32), np.ones((4, 2), np.float32), None, np.ones((3, 4), np.float32), None, None, 1e-12)


# -- a small random MiniLM-shaped model --------------------------------------------------


def _random_weights(rng, hidden=16, heads=4, layers=2, intermediate=40, vocab=50, positions=40):
    cfg = MiniLMConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=intermediate, max_position_embeddings=positions, type_vocab_size=2,
                       layer_norm_eps=1e-12, pad_token_id=0, max_seq_length=positions)

    def mat(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def ln():
        return (1 + mat(hidden, scale=0.1)), mat(hidden, scale=0.1)

    H, I = hidden, intermediate
    layer_list = []
    for _ in range(layers):
        (l1w, l1b), (l2w, l2b) = ln(), ln()
        layer_list.append(LayerWeights(q_w=mat(H, H), q_b=mat(H), k_w=mat(H, H), k_b=mat(H), v_w=mat(H, H),
                                       v_b=mat(H), o_w=mat(H, H), o_b=mat(H), ln1_w=l1w, ln1_b=l1b, i_w=mat(I, H),
                                       i_b=mat(I), out_w=mat(H, I), out_b=mat(H), ln2_w=l2w, ln2_b=l2b))
    ew, eb = ln()
    return MiniLMWeights(config=cfg, word_embeddings=mat(vocab, H, scale=1.0),
                         position_embeddings=mat(positions, H, scale=1.0), token_type_embeddings=mat(2, H),
                         emb_ln_w=ew, emb_ln_b=eb, layers=tuple(layer_list), model_dir=None)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_layout_gives_each_rank_whole_heads(rng, tp):
    # The column-parallel QKV layer's contiguous slice on rank r is [Q_r; K_r; V_r] (its heads).
    w = _random_weights(rng, layers=1)
    layer, cfg = w.layers[0], w.config
    k = cfg.hidden_size // tp
    for r in range(tp):
        s = shard_layer(layer, cfg, r, tp)
        rows = slice(r * k, r * k + k)
        scale = np.float32(1 / math.sqrt(cfg.head_dim))
        np.testing.assert_array_equal(s.qkv.weight, np.concatenate([layer.q_w[rows] * scale, layer.k_w[rows],
                                                                     layer.v_w[rows]]))
        np.testing.assert_array_equal(s.attention_output.weight, layer.o_w[:, rows])
        assert s.qkv.out_range == (3 * r * k, 3 * (r + 1) * k)


def test_model_on_the_device_target_matches_the_host_and_stays_there(device_backend, rng):
    # Tiny, because numba's simulator runs every GPU thread as a Python thread (and the norms'
    # block reductions as thread barriers): one layer, hidden 8, two sentences (3 and 1 tokens).
    weights = _random_weights(rng, hidden=8, heads=2, layers=1, intermediate=12)
    batch = pack_batch([rng.integers(0, 50, n) for n in (3, 1)])
    want = MiniLMModel(weights, backend=CPUBackend()).forward(batch)
    model = MiniLMModel(weights, backend=device_backend)
    kinds, downloads = [], []
    regular = model.reduce_norm

    def watched(x, w, bias, residual, lw, lb, eps, **lent):
        kinds.append(all(is_device_array(a) for a in (x, w, bias, residual, lw, lb, lent["out"])))
        return regular(x, w, bias, residual, lw, lb, eps, **lent)

    def counted_to_host(arr, _real=device_backend.to_host):
        downloads.append(tuple(arr.shape))
        return _real(arr)

    model.set_reduce_norm(watched)
    device_backend.to_host = counted_to_host
    try:
        got = model.forward(batch)
    finally:
        del device_backend.to_host
    assert kinds == [True] * 2  # both row-parallel finishes ran on device arrays
    assert downloads == [(batch.num_tokens, 8)]  # one download: the result
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    model.close()


def test_step_arena_is_reused_and_grows_only_when_needed(rng):
    weights = _random_weights(rng)
    model = MiniLMModel(weights, backend=CPUBackend())
    big = pack_batch([rng.integers(0, 50, n) for n in (33, 7)])
    first = model.forward(big)
    arena = model.buffers.arena
    model.forward(pack_batch([rng.integers(0, 50, 5)]))
    assert model.buffers.arena is arena and arena.steps == 2  # a smaller batch: the same slab, reset
    np.testing.assert_array_equal(model.forward(big), first)  # nothing leaks between forwards
    model.forward(pack_batch([rng.integers(0, 50, 39)] * 3))
    assert model.buffers.arena is not arena and arena.closed  # a bigger one: a new, larger slab
