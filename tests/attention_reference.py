"""The float64 reference the attention tests compare with: textbook softmax(q k^T) v, per
sentence and head, over packed rows ``qkv [T, 3K]`` (Q, K, V blocks; ``K = nh * d``)."""

import numpy as np


def attention64(qkv, lengths, nh, d, bias):
    """Per sentence and head, in float64: the textbook softmax(q k^T) v (``bias`` may be None)."""
    K = nh * d
    out, s = [], 0
    for n in lengths:
        blk = qkv[s:s + n].astype(np.float64) + (0.0 if bias is None else bias)
        s += n
        ctx = np.empty((n, K))
        for h in range(nh):
            q, k, v = (blk[:, p * K + h * d:p * K + (h + 1) * d] for p in range(3))
            sc = q @ k.T
            p_ = np.exp(sc - sc.max(axis=1, keepdims=True))
            ctx[:, h * d:(h + 1) * d] = (p_ / p_.sum(axis=1, keepdims=True)) @ v
        out.append(ctx)
    return np.concatenate(out)
