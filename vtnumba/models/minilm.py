"""all-MiniLM-L6-v2, a 6-layer post-LayerNorm BERT encoder, tensor-parallel over ``tp`` ranks.

This is the capstone's model: the place where TPSP's "row-parallel projection followed by a
norm" meets a real network.  One layer, on rank r of ``tp`` (hidden ``H`` = 384, 12 heads of
64, intermediate ``I`` = 1536; ``h`` is the full hidden state ``[T, H]`` on every rank)::

    qkv   = h @ Wqkv_r.T + b_r              # column-parallel: this rank's 12/tp heads of Q, K, V
    ctx   = attention(qkv)                  # local: a head never needs another head
    h     = reduce_norm(ctx, Wo[:, K_r], bo, residual=h, ln1)   # row-parallel + add + LayerNorm
    inter = gelu(h @ Wi_r.T + bi_r)         # column-parallel: I/tp intermediate features
    h     = reduce_norm(inter, Wout[:, I_r], bout, residual=h, ln2)

``reduce_norm`` is injected (:mod:`vtnumba.models.reduce_norm`): the regular all-reduce
forward, or the TPSP op through its adapter.  The layer is post-LayerNorm (BERT's original
recipe), so the normalised output is both the next layer's input and its residual.

Before the layers: word + position + token-type embeddings, then LayerNorm (replicated: every
rank computes it, it is cheap and saves an exchange).  After them, for sentence embeddings:
mean over the sentence's real tokens, then L2 normalisation (:func:`pool_embedding`).

Everything is float32 numpy: BLAS for the products, fused ``@numba.njit`` loops for the
element-wise parts (:mod:`vtnumba.models.bert_ops`, :func:`vtnumba.kernels.fused_add_layer_norm`).
Tokens are packed without padding (:mod:`vtnumba.models.minilm_batch`).  Intermediate
arrays live in reused scratch buffers (:mod:`vtnumba.models._scratch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from vtnumba.kernels import fused_add_layer_norm
from vtnumba.models._scratch import Scratch
from vtnumba.models.bert_ops import attention, bias_gelu_
from vtnumba.models.minilm_batch import PackedBatch
from vtnumba.models.minilm_weights import LayerWeights, MiniLMConfig, MiniLMWeights
from vtnumba.models.reduce_norm import RegularReduceNorm

#: ``reduce_norm(x_local, w_shard, bias, residual, ln_weight, ln_bias, eps, *, name) -> next_hidden``
ReduceNorm = Callable[..., np.ndarray]


def check_tp_size(tp: int, config: MiniLMConfig) -> int:
    """Validate a tensor-parallel size for this model: a positive int dividing the head count."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp_size={tp!r} must be a positive int")
    tp = int(tp)
    if config.num_attention_heads % tp:
        divisors = [d for d in range(1, config.num_attention_heads + 1) if config.num_attention_heads % d == 0]
        raise ValueError(
            f"tp_size={tp} does not divide the model's {config.num_attention_heads} attention heads; "
            f"expected one of {divisors}"
        )
    if config.intermediate_size % tp:
        raise ValueError(f"tp_size={tp} does not divide intermediate_size={config.intermediate_size}")
    return tp


@dataclass(frozen=True)
class ShardedLayer:
    """One layer's weights as rank r of tp holds them (K_r = 12/tp heads, I_r = I/tp features)."""

    qkv_w: np.ndarray  # [3 * K_r, H]: this rank's Q rows (pre-scaled by 1/sqrt(d)), then K, then V
    qkv_b: np.ndarray  # [3 * K_r]
    o_w: np.ndarray  # [H, K_r]: columns of the attention-output projection (row-parallel)
    o_b: np.ndarray  # [H], added once, after the sum over ranks
    ln1_w: np.ndarray
    ln1_b: np.ndarray
    i_w: np.ndarray  # [I_r, H]: rows of the intermediate projection (column-parallel)
    i_b: np.ndarray  # [I_r]
    out_w: np.ndarray  # [H, I_r]: columns of the output projection (row-parallel)
    out_b: np.ndarray
    ln2_w: np.ndarray
    ln2_b: np.ndarray


def shard_layer(layer: LayerWeights, config: MiniLMConfig, rank: int, tp: int) -> ShardedLayer:
    """Cut rank ``rank``'s shard out of a full layer (column-parallel by heads, row-parallel after)."""
    tp = check_tp_size(tp, config)
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} is out of range for tp_size={tp}")
    k = config.hidden_size // tp  # heads are contiguous column blocks of head_dim, so this is whole heads
    i = config.intermediate_size // tp
    ks, is_ = slice(rank * k, rank * k + k), slice(rank * i, rank * i + i)
    # Folding 1/sqrt(head_dim) into W_q and b_q saves a pass over the scores; for head_dim 64 the
    # factor is 1/8, a power of two, so the folded weights produce bit-identical queries.
    scale = np.float32(1.0 / math.sqrt(config.head_dim))
    c = np.ascontiguousarray
    return ShardedLayer(
        qkv_w=c(np.concatenate([layer.q_w[ks] * scale, layer.k_w[ks], layer.v_w[ks]], axis=0)),
        qkv_b=c(np.concatenate([layer.q_b[ks] * scale, layer.k_b[ks], layer.v_b[ks]])),
        o_w=c(layer.o_w[:, ks]),
        o_b=layer.o_b,
        ln1_w=layer.ln1_w,
        ln1_b=layer.ln1_b,
        i_w=c(layer.i_w[is_]),
        i_b=c(layer.i_b[is_]),
        out_w=c(layer.out_w[:, is_]),
        out_b=layer.out_b,
        ln2_w=layer.ln2_w,
        ln2_b=layer.ln2_b,
    )


def pool_embedding(hidden: np.ndarray) -> np.ndarray:
    """One sentence's embedding from its real tokens' ``[n, H]`` outputs: mean, then L2-normalise.

    sentence-transformers' ``Pooling(mean)`` + ``Normalize``.  Encoder and encoder-cache
    consumers call this same function on the same bytes, so their embeddings agree bit for bit.
    """
    if not isinstance(hidden, np.ndarray) or hidden.ndim != 2 or hidden.shape[0] < 1:
        got = hidden.shape if isinstance(hidden, np.ndarray) else type(hidden).__name__
        raise ValueError(f"hidden must be a [tokens >= 1, H] array; got {got}")
    mean = hidden.astype(np.float64).mean(axis=0)
    norm = max(float(np.sqrt(np.dot(mean, mean))), 1e-12)  # torch.nn.functional.normalize's eps
    return (mean / norm).astype(np.float32)


class MiniLMModel:
    """The encoder on one rank: ``forward(batch) -> last_hidden_state [T, H]`` (replicated).

    ``reduce_norm`` combines the row-parallel partial sums (default: the regular forward,
    which for ``tp == 1`` needs no communicator).  Every rank of the group must call
    :meth:`forward` with the same batch.
    """

    def __init__(self, weights: MiniLMWeights, rank: int = 0, tp: int = 1, reduce_norm: ReduceNorm | None = None):
        cfg = weights.config
        self.config = cfg
        self.tp = check_tp_size(tp, cfg)
        if tp > 1 and reduce_norm is None:
            raise ValueError(f"tp={tp} needs a reduce_norm that combines the ranks' partial sums (e.g. RegularReduceNorm(comm))")
        self.rank = rank
        self.local_heads = cfg.num_attention_heads // self.tp
        self.reduce_norm = RegularReduceNorm(None) if reduce_norm is None else reduce_norm
        self.layers = tuple(shard_layer(layer, cfg, rank, self.tp) for layer in weights.layers)
        self._word = weights.word_embeddings
        # Token type is always 0 for single sentences: fold it into the position table once.
        self._pos_type = weights.position_embeddings + weights.token_type_embeddings[0]
        self._emb_ln = (weights.emb_ln_w, weights.emb_ln_b)
        # Intermediate arrays reuse named buffers (see _scratch: fresh pages are slow).
        self._scratch = Scratch()

    def row_parallel_projections(self) -> list[tuple[str, SimpleNamespace, SimpleNamespace]]:
        """``(name, projection, norm)`` for each row-parallel projection + LayerNorm, in forward order.

        ``projection`` has ``.weight`` (this rank's ``[H, K_local]`` shard) and ``.bias``;
        ``norm`` has ``.weight``, ``.bias``, ``.eps`` and ``.norm_type = "layer"`` -- the attributes
        :class:`vtnumba.tpsp.TPSPOpsGroup` expects, so TPSP can open a handle per projection::

            groups = [TPSPOpsGroup(n, p, nm) for n, p, nm in model.row_parallel_projections()]
        """
        eps = self.config.layer_norm_eps
        out = []
        for i, L in enumerate(self.layers):
            out.append((f"layer{i}.attention_output", SimpleNamespace(weight=L.o_w, bias=L.o_b),
                        SimpleNamespace(weight=L.ln1_w, bias=L.ln1_b, eps=eps, norm_type="layer")))
            out.append((f"layer{i}.output", SimpleNamespace(weight=L.out_w, bias=L.out_b),
                        SimpleNamespace(weight=L.ln2_w, bias=L.ln2_b, eps=eps, norm_type="layer")))
        return out

    def set_reduce_norm(self, reduce_norm: ReduceNorm) -> None:
        """Swap how the row-parallel sums are combined (regular <-> TPSP) between forwards."""
        if not callable(reduce_norm):
            raise TypeError(f"reduce_norm={reduce_norm!r} must be callable")
        self.reduce_norm = reduce_norm

    def embed(self, batch: PackedBatch) -> np.ndarray:
        """Word + position + token-type embeddings, LayerNorm: ``[T, H]`` (a scratch buffer)."""
        if batch.max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"a sentence has {batch.max_len} tokens; the model has only {self.config.max_position_embeddings} positions"
            )
        if batch.ids.min() < 0 or batch.ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got {batch.ids.min()}..{batch.ids.max()}")
        shape = (batch.num_tokens, self.config.hidden_size)
        z = self._scratch.take("emb_sum", shape)
        np.take(self._word, batch.ids, axis=0, out=z)
        z += self._pos_type[batch.positions]
        out = self._scratch.take("emb", shape)
        fused_add_layer_norm(z, None, *self._emb_ln, self.config.layer_norm_eps, out=out, new_residual=z)
        return out

    def layer(self, i: int, h: np.ndarray, batch: PackedBatch) -> np.ndarray:
        """Layer ``i`` on this rank's shard (see the module docstring)."""
        L, eps, T, sc = self.layers[i], self.config.layer_norm_eps, batch.num_tokens, self._scratch
        qkv = np.matmul(h, L.qkv_w.T, out=sc.take("qkv", (T, L.qkv_w.shape[0])))
        ctx = attention(qkv, batch, self.local_heads, self.config.head_dim, bias=L.qkv_b, scratch=sc)
        h = self.reduce_norm(ctx, L.o_w, L.o_b, h, L.ln1_w, L.ln1_b, eps, name=f"layer{i}.attention_output")
        inter = np.matmul(h, L.i_w.T, out=sc.take("inter", (T, L.i_w.shape[0])))
        bias_gelu_(inter, L.i_b)
        return self.reduce_norm(inter, L.out_w, L.out_b, h, L.ln2_w, L.ln2_b, eps, name=f"layer{i}.output")

    def forward_view(self, batch: PackedBatch, num_layers: int | None = None) -> np.ndarray:
        """Like :meth:`forward`, but the result may be a reused buffer, valid until the next call."""
        h = self.embed(batch)
        for i in range(len(self.layers) if num_layers is None else num_layers):
            h = self.layer(i, h, batch)
        return h

    def forward(self, batch: PackedBatch, num_layers: int | None = None) -> np.ndarray:
        """``last_hidden_state`` of the packed batch, ``[T, H]`` float32 (``num_layers``: run only the first n)."""
        return self.forward_view(batch, num_layers).copy()
