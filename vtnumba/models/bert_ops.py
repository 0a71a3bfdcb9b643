"""BERT's element-wise numerics under the model's names: bias + erf-GELU, erf, and packed attention.

The kernels themselves live with every other kernel, each a host reference with a CUDA
twin behind the one launch pattern:

* bias + GELU (erf form) -- :func:`vtnumba.kernels.bias_gelu_` (:mod:`vtnumba.kernels.activation`,
  which also explains :func:`fast_erf`, the vectorisable float32-exact erf the host uses);
* multi-head self-attention over packed sentences -- :func:`vtnumba.kernels.attention`
  (:mod:`vtnumba.kernels.attention`).

What this module adds is the model's view of attention: a :class:`~vtnumba.models.minilm_batch.PackedBatch`
instead of raw offsets.  (The third element-wise piece of a BERT layer, residual add +
LayerNorm, is :func:`vtnumba.kernels.fused_add_layer_norm`, shared with TPSP.)
"""

from __future__ import annotations

import numpy as np

from vtnumba.kernels import AttentionWorkspace, bias_gelu_, fast_erf
from vtnumba.kernels import attention as _packed_attention
from vtnumba.models.minilm_batch import PackedBatch


def attention(qkv: np.ndarray, batch: PackedBatch, num_heads: int, head_dim: int, bias: np.ndarray | None = None,
              out: np.ndarray | None = None, workspace: AttentionWorkspace | None = None) -> np.ndarray:
    """Multi-head self-attention of the packed sentences of ``batch``, each attending only to itself.

    ``qkv`` is ``[T, 3 * num_heads * head_dim]`` host float32 -- this rank's query, key and
    value columns (heads contiguous, queries already scaled by ``1/sqrt(head_dim)``), ``bias``
    their bias (added on the way into the heads).  Returns the context
    ``[T, num_heads * head_dim]`` in the same head order (into ``out`` when given).  See
    :func:`vtnumba.kernels.attention` for device arrays (the offsets must then be on the device too).
    """
    return _packed_attention(qkv, batch.offsets, num_heads, head_dim, bias=bias, out=out, max_len=batch.max_len,
                             workspace=workspace)


__all__ = ["attention", "bias_gelu_", "fast_erf"]
