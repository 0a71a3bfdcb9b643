"""all-MiniLM-L6-v2, a 6-layer post-LayerNorm BERT encoder, tensor-parallel over ``tp`` ranks.

This is the capstone's model: the place where TPSP's "row-parallel projection followed by a
norm" meets a real network.  It is built from the :mod:`vtnumba.nn` layers.  One layer, on
rank r of ``tp`` (hidden ``H`` = 384, 12 heads of 64, intermediate ``I`` = 1536; ``h`` is the
full hidden state ``[T, H]`` on every rank)::

    qkv   = qkv(h)                          # ColumnParallelLinear: this rank's 12/tp heads of Q, K, V
    ctx   = attention(qkv)                  # local: a head never needs another head
    h     = reduce_norm(attention_output, ln1; ctx, residual=h)   # RowParallelLinear + LayerNorm
    inter = gelu(intermediate(h))           # ColumnParallelLinear: I/tp intermediate features
    h     = reduce_norm(output, ln2; inter, residual=h)           # RowParallelLinear + LayerNorm

``reduce_norm`` finishes a row-parallel projection -- the sum over ranks, the bias, the
residual and the LayerNorm -- and is swappable (:mod:`vtnumba.models.reduce_norm`): the
regular all-reduce forward of :mod:`vtnumba.tpsp.regular`, or the TPSP op.  The layer is
post-LayerNorm (BERT's original recipe), so the normalised output is both the next layer's
input and its residual.

**Heads stay whole on a rank.**  A :class:`~vtnumba.nn.ColumnParallelLinear` gives rank r a
contiguous slice of the output features.  The checkpoint stores Q, K and V as three
``[H, H]`` matrices, so :func:`shard_layer` stacks them as ``[Q_0; K_0; V_0; Q_1; K_1; V_1; ...]``
(``X_r`` = the rows of rank r's heads): rank r's contiguous third of that is exactly its
heads' queries, keys and values, in the ``[q | k | v]`` column order attention expects.  The
attention-output projection is split by *input* columns the same way, so each rank's
context columns meet the matching weight columns.

Before the layers: word + position + token-type embeddings, then LayerNorm (replicated: every
rank computes it, it is cheap and saves an exchange).  After them, for sentence embeddings:
mean over the sentence's real tokens, then L2 normalisation (:func:`pool_embedding`).

**Where the arithmetic runs.**  The model computes on a :class:`vtnumba.backend.Backend` (the
target's by default): numpy arrays with the host kernels on ``cpu``, device arrays with the
``@cuda.jit`` kernels on ``cuda``/``cudasim``.  On a device, the embedding rows are gathered
on the host and uploaded once per batch, the weights once per model (the nn layers' own
cache), and the hidden states stay on the device from the embedding LayerNorm to the last
layer; :meth:`MiniLMModel.forward` downloads the result once.  Every array of a forward comes
from a step arena (:mod:`vtnumba.models.step_buffers`).  Tokens are packed without padding
(:mod:`vtnumba.models.minilm_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vtnumba.backend.arrays import check_int, is_int
from vtnumba.backend.single_caller import SingleCaller
from vtnumba.kernels import activation, attention, gather_rows
from vtnumba.models.minilm_batch import PackedBatch
from vtnumba.models.minilm_weights import LayerWeights, MiniLMConfig, MiniLMWeights
from vtnumba.models.reduce_norm import ReduceNormBuffers, RegularReduceNorm, as_process_group
from vtnumba.models.step_buffers import Step, StepBuffers
from vtnumba.nn import ColumnParallelLinear, LayerNorm, RowParallelLinear

#: ``reduce_norm(x_local, w_shard, bias, residual, ln_weight, ln_bias, eps, *, name, out, buffers) -> next_hidden``
ReduceNorm = Callable[..., object]


def check_tp_size(tp: int, config: MiniLMConfig) -> int:
    """Validate a tensor-parallel size for this model: a positive int dividing the head count."""
    if not is_int(tp) or tp < 1:
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
    """One layer as rank r of tp holds it: nn layers over its 12/tp heads and I/tp features."""

    #: Q, K, V of this rank's heads: ``3 * K_r`` outputs, the queries pre-scaled by ``1/sqrt(d)``.
    qkv: ColumnParallelLinear
    #: Attention-output projection: inputs ``K_r`` (its heads' context columns); bias ``[H]`` added once.
    attention_output: RowParallelLinear
    #: The LayerNorm after attention.
    ln1: LayerNorm
    #: FFN up-projection: ``I_r`` of the ``I`` intermediate features.
    intermediate: ColumnParallelLinear
    #: FFN down-projection: inputs ``I_r``; bias ``[H]`` added once.
    output: RowParallelLinear
    #: The LayerNorm after the FFN.
    ln2: LayerNorm

    # The layer's arrays under the checkpoint's short names ([out, in] weights, this rank's slices).
    qkv_w = property(lambda self: self.qkv.weight, doc="``qkv.weight``: ``[3 * K_r, H]``, rows Q_r, K_r, V_r.")
    qkv_b = property(lambda self: self.qkv.bias, doc="``qkv.bias``: ``[3 * K_r]``.")
    o_w = property(lambda self: self.attention_output.weight, doc="``attention_output.weight``: ``[H, K_r]``.")
    o_b = property(lambda self: self.attention_output.bias, doc="``attention_output.bias``: ``[H]``.")
    ln1_w = property(lambda self: self.ln1.weight, doc="``ln1.weight``: ``[H]``.")
    ln1_b = property(lambda self: self.ln1.bias, doc="``ln1.bias``: ``[H]``.")
    i_w = property(lambda self: self.intermediate.weight, doc="``intermediate.weight``: ``[I_r, H]``.")
    i_b = property(lambda self: self.intermediate.bias, doc="``intermediate.bias``: ``[I_r]``.")
    out_w = property(lambda self: self.output.weight, doc="``output.weight``: ``[H, I_r]``.")
    out_b = property(lambda self: self.output.bias, doc="``output.bias``: ``[H]``.")
    ln2_w = property(lambda self: self.ln2.weight, doc="``ln2.weight``: ``[H]``.")
    ln2_b = property(lambda self: self.ln2.bias, doc="``ln2.bias``: ``[H]``.")


def shard_layer(layer: LayerWeights, config: MiniLMConfig, rank: int, tp: int) -> ShardedLayer:
    """Rank ``rank``'s nn layers for one full layer (column-parallel by heads, row-parallel after)."""
    tp = check_tp_size(tp, config)
    rank = check_int("rank", rank)
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} is out of range for tp_size={tp}")
    H, I, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
    k = H // tp  # rows of whole heads per rank (heads are contiguous blocks of head_dim rows)
    # Folding 1/sqrt(head_dim) into W_q and b_q saves a pass over the scores; for head_dim 64 the
    # factor is 1/8, a power of two, so the folded weights produce bit-identical queries.
    scale = np.float32(1.0 / math.sqrt(config.head_dim))
    blocks = [slice(r * k, r * k + k) for r in range(tp)]
    # [Q_0; K_0; V_0; Q_1; ...]: a contiguous split into tp parts gives each rank its own heads.
    qkv_w = np.concatenate([w for s in blocks for w in (layer.q_w[s] * scale, layer.k_w[s], layer.v_w[s])])
    qkv_b = np.concatenate([b for s in blocks for b in (layer.q_b[s] * scale, layer.k_b[s], layer.v_b[s])])
    split = dict(tp_size=tp, tp_rank=rank)
    return ShardedLayer(
        qkv=ColumnParallelLinear(H, 3 * H, weight=qkv_w, bias=qkv_b, **split),
        attention_output=RowParallelLinear(H, H, weight=layer.o_w, bias=layer.o_b, **split),
        ln1=LayerNorm(H, eps, weight=layer.ln1_w, bias=layer.ln1_b),
        intermediate=ColumnParallelLinear(H, I, weight=layer.i_w, bias=layer.i_b, **split),
        output=RowParallelLinear(I, H, weight=layer.out_w, bias=layer.out_b, **split),
        ln2=LayerNorm(H, eps, weight=layer.ln2_w, bias=layer.ln2_b),
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

    ``group`` (a :class:`vtnumba.dist.ProcessGroup`, or a bare mpi4py communicator) gives
    ``rank`` and ``tp`` and the default ``reduce_norm``, the regular all-reduce forward over
    it; without a group, ``rank``/``tp`` say which shard to hold and ``tp > 1`` needs a
    ``reduce_norm`` that combines the ranks' partial sums.  ``backend`` (default: the
    target's) is where the model computes.  Every rank of the group must call
    :meth:`forward` with the same batch.
    """

    def __init__(self, weights: MiniLMWeights, rank: int = 0, tp: int = 1, reduce_norm: ReduceNorm | None = None,
                 *, group=None, backend=None):
        cfg = weights.config
        self.config = cfg
        group = as_process_group(group)
        if group is not None:
            rank, tp = group.rank, group.size
        self.tp = check_tp_size(tp, cfg)
        if reduce_norm is None:
            if self.tp > 1 and group is None:
                raise ValueError(f"tp={tp} needs a reduce_norm that combines the ranks' partial sums "
                                 "(e.g. RegularReduceNorm(group)), or group=")
            reduce_norm = RegularReduceNorm(group)
        self.set_reduce_norm(reduce_norm)
        self.rank = rank
        self.group = group
        if backend is None:
            from vtnumba.backend import default_backend

            backend = default_backend()
        self.backend = backend
        self.local_heads = cfg.num_attention_heads // self.tp
        self.layers = tuple(shard_layer(layer, cfg, rank, self.tp) for layer in weights.layers)
        self.embeddings_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, weight=weights.emb_ln_w,
                                         bias=weights.emb_ln_b)
        self._word = weights.word_embeddings
        # Token type is always 0 for single sentences: fold it into the position table once.
        self._pos_type = weights.position_embeddings + weights.token_type_embeddings[0]
        self._dims = {"hidden": cfg.hidden_size, "local_heads": self.local_heads, "head_dim": cfg.head_dim,
                      "local_width": self.local_heads * cfg.head_dim,
                      "local_intermediate": self.layers[0].intermediate.output_size_per_partition}
        self.buffers = StepBuffers(backend)
        self._caller = SingleCaller("this MiniLMModel", "its forwards share one step arena")

    def row_parallel_projections(self) -> list[tuple[str, RowParallelLinear, LayerNorm]]:
        """``(name, projection, norm)`` for each row-parallel projection + LayerNorm, in forward order.

        ``projection`` is the layer's :class:`~vtnumba.nn.RowParallelLinear` (``.weight`` is this
        rank's ``[H, K_local]`` shard) and ``norm`` its :class:`~vtnumba.nn.LayerNorm` -- what
        :class:`vtnumba.tpsp.TPSPOpsGroup` expects, so TPSP can open a handle per projection::

            groups = [TPSPOpsGroup(n, p, nm) for n, p, nm in model.row_parallel_projections()]
        """
        out = []
        for i, L in enumerate(self.layers):
            out.append((f"layer{i}.attention_output", L.attention_output, L.ln1))
            out.append((f"layer{i}.output", L.output, L.ln2))
        return out

    def set_reduce_norm(self, reduce_norm: ReduceNorm) -> None:
        """Swap how the row-parallel sums are combined (regular <-> TPSP) between forwards."""
        if not callable(reduce_norm):
            raise TypeError(f"reduce_norm={reduce_norm!r} must be callable")
        self.reduce_norm = reduce_norm

    # -- the forward ----------------------------------------------------------------------
    def _check_batch(self, batch: PackedBatch) -> None:
        if not isinstance(batch, PackedBatch):  # (a list of ids failed on a missing .max_len)
            raise TypeError(f"batch must be a PackedBatch (pack_batch(token_ids)), got {type(batch).__name__}")
        if batch.max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"a sentence has {batch.max_len} tokens; the model has only {self.config.max_position_embeddings} positions"
            )
        if batch.ids.min() < 0 or batch.ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got {batch.ids.min()}..{batch.ids.max()}")

    def _embed(self, batch: PackedBatch, step: Step) -> int:
        """Word + position + token-type embeddings, LayerNorm, into hidden buffer 0 (returned)."""
        T = batch.num_tokens
        # The gather runs on the host (numpy's take); on a device its result is uploaded once.
        z = step.new_residual if not self.buffers.on_device else np.empty((T, self.config.hidden_size), np.float32)
        np.take(self._word, batch.ids, axis=0, out=z)
        z += self._pos_type[batch.positions]
        if self.buffers.on_device:
            z = self.backend.asarray(z)
        self.embeddings_norm(z, out=step.rows(0), new_residual=z)
        return 0

    def _reduce_norm(self, name: str, x, projection: RowParallelLinear, norm: LayerNorm, step: Step, cur: int) -> int:
        """Finish a row-parallel projection of ``x`` with residual = hidden buffer ``cur``; the
        result goes to the other hidden buffer, whose index is returned."""
        nxt = 1 - cur
        out = step.rows(nxt)
        buffers = ReduceNormBuffers(step.shard(cur), step.new_residual, step.new_residual_shard)
        result = self.reduce_norm(x, projection.param("weight", x), projection.param("bias", x), step.rows(cur),
                                  norm.param("weight", x), norm.param("bias", x), norm.eps, name=name, out=out,
                                  buffers=buffers)
        if result is not out:  # a strategy that returned its own array (a test's stand-in, say)
            gather_rows(result[:step.num_tokens], [out], 0)
        return nxt

    def _layer(self, i: int, cur: int, step: Step) -> int:
        """Layer ``i`` on this rank's shard (see the module docstring); returns the new hidden buffer."""
        L, d = self.layers[i], self.config.head_dim
        # Q, K, V of this rank's heads.  Their bias is added inside attention, on the way into the
        # heads, instead of in a separate pass over qkv.
        qkv = L.qkv(step.rows(cur), out=step.qkv, add_bias=False)
        ctx = attention(qkv, step.offsets, self.local_heads, d, bias=L.qkv.param("bias", qkv), out=step.ctx,
                        max_len=step.max_len, workspace=step.attention)
        cur = self._reduce_norm(f"layer{i}.attention_output", ctx, L.attention_output, L.ln1, step, cur)
        inter = L.intermediate(step.rows(cur), out=step.inter, add_bias=False)
        activation(inter, "gelu_erf", out=inter, bias=L.intermediate.param("bias", inter))  # bias + GELU, one pass
        return self._reduce_norm(f"layer{i}.output", inter, L.output, L.ln2, step, cur)

    def forward_view(self, batch: PackedBatch, num_layers: int | None = None):
        """Like :meth:`forward`, but the result stays in the backend's memory (a device array on
        ``cuda``/``cudasim``) in the model's step arena: valid until the next forward."""
        self._check_batch(batch)
        n = len(self.layers) if num_layers is None else check_int("num_layers", num_layers, min_value=0,
                                                                   max_value=len(self.layers))
        with self._caller:
            step = self.buffers.start(batch, self._dims, self.tp, self.rank)
            cur = self._embed(batch, step)
            for i in range(n):
                cur = self._layer(i, cur, step)
            return step.rows(cur)

    def forward(self, batch: PackedBatch, num_layers: int | None = None) -> np.ndarray:
        """``last_hidden_state`` of the packed batch, ``[T, H]`` float32 numpy in memory of its own
        (``num_layers``: run only the first n).  On a device this is the forward's one download."""
        with self._caller:  # (until the result is out of the step arena)
            host = self.backend.to_host(self.forward_view(batch, num_layers))
            return host.copy() if self.backend.capabilities.host_addressable else host

    def close(self) -> None:
        """Give the step arena back to the backend (the next forward makes a new one)."""
        self.buffers.close()
