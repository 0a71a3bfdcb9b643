"""The host numerics of the MiniLM encoder against float64 numpy references.

erf / GELU, packed attention (odd lengths, padding), batch packing, the regular
reduce + add + LayerNorm on one rank, and the TPSP adapter's argument checks.
No checkpoint needed.
"""

import math

import numpy as np
import pytest

from vtnumba.models import (
    PackedBatch,
    RegularReduceNorm,
    TPSPReduceNorm,
    attention,
    bias_gelu_,
    fast_erf,
    pack_batch,
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


def _attention64(qkv, lengths, nh, d, bias):
    K = nh * d
    out, s = [], 0
    for n in lengths:
        blk = qkv[s : s + n].astype(np.float64) + bias
        s += n
        ctx = np.empty((n, K))
        for h in range(nh):
            q, k, v = (blk[:, p * K + h * d : p * K + (h + 1) * d] for p in range(3))
            sc = q @ k.T
            p_ = np.exp(sc - sc.max(axis=1, keepdims=True))
            ctx[:, h * d : (h + 1) * d] = (p_ / p_.sum(axis=1, keepdims=True)) @ v
        out.append(ctx)
    return np.concatenate(out)


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
    assert np.abs(got - _attention64(qkv, lengths, nh, d, bias)).max() < tol


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
