"""all-MiniLM-L6-v2's configuration and weights as float32 numpy arrays (no torch).

The checkpoint is a Hugging Face ``BertModel`` saved as safetensors; ``safetensors.numpy``
reads it straight into numpy.  Names follow Hugging Face's BERT (``embeddings.*``,
``encoder.layer.{i}.attention.self.query.weight`` ...); linear weights are stored
``[out_features, in_features]`` so a linear layer is ``y = x @ W.T + b``.

Two config files matter:

* ``config.json`` -- the architecture (hidden 384, 12 heads, 6 layers, intermediate 1536,
  512 positions, LayerNorm eps 1e-12, GELU);
* ``sentence_bert_config.json`` -- sentence-transformers' ``max_seq_length`` (256 for this
  model): the length it truncates inputs to, although the position table has 512 rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vtnumba.models.minilm_files import INSTALL_HINT, find_minilm_dir


@dataclass(frozen=True)
class MiniLMConfig:
    """The architecture numbers the encoder needs (a subset of Hugging Face's BertConfig)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    #: sentence-transformers' truncation length (``sentence_bert_config.json``), <= max_position_embeddings.
    max_seq_length: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, model_dir: Path) -> MiniLMConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        # Only the plain BERT recipe is implemented; anything else must fail loudly, not silently differ.
        for key, want in (("model_type", "bert"), ("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
            got = raw.get(key, want)
            if got != want:
                raise ValueError(f"config.json {key}={got!r} is not supported; expected {want!r}")
        st_path = model_dir / "sentence_bert_config.json"
        max_seq = json.loads(st_path.read_text()).get("max_seq_length") if st_path.is_file() else None
        cfg = cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            pad_token_id=int(raw.get("pad_token_id", 0)),
            max_seq_length=int(max_seq) if max_seq else int(raw["max_position_embeddings"]),
        )
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(
                f"config.json hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads={cfg.num_attention_heads}"
            )
        if not 2 <= cfg.max_seq_length <= cfg.max_position_embeddings:
            raise ValueError(
                f"sentence_bert_config.json max_seq_length={cfg.max_seq_length} must be in "
                f"[2, max_position_embeddings={cfg.max_position_embeddings}]"
            )
        return cfg


@dataclass(frozen=True)
class LayerWeights:
    """One post-LayerNorm BERT layer, full (unsharded), float32, ``[out, in]`` linear weights."""

    q_w: np.ndarray
    q_b: np.ndarray
    k_w: np.ndarray
    k_b: np.ndarray
    v_w: np.ndarray
    v_b: np.ndarray
    o_w: np.ndarray  # attention output projection [H, H]
    o_b: np.ndarray
    ln1_w: np.ndarray  # attention.output.LayerNorm
    ln1_b: np.ndarray
    i_w: np.ndarray  # intermediate [I, H]
    i_b: np.ndarray
    out_w: np.ndarray  # output projection [H, I]
    out_b: np.ndarray
    ln2_w: np.ndarray  # output.LayerNorm
    ln2_b: np.ndarray


@dataclass(frozen=True)
class MiniLMWeights:
    """The whole checkpoint: embeddings + their LayerNorm, and the layers."""

    config: MiniLMConfig
    word_embeddings: np.ndarray  # [vocab, H]
    position_embeddings: np.ndarray  # [max_positions, H]
    token_type_embeddings: np.ndarray  # [type_vocab, H]
    emb_ln_w: np.ndarray
    emb_ln_b: np.ndarray
    layers: tuple[LayerWeights, ...]
    model_dir: Path


def _import_safetensors():
    try:
        import safetensors.numpy as st_numpy
    except ImportError as exc:  # an optional extra: say how to get it
        raise ImportError(f"reading the MiniLM weights needs the 'safetensors' package; {INSTALL_HINT}") from exc
    return st_numpy


def load_minilm_weights(model_dir: str | os.PathLike | None = None) -> MiniLMWeights:
    """Read ``config.json`` and ``model.safetensors`` into :class:`MiniLMWeights` (float32)."""
    folder = find_minilm_dir(model_dir)
    cfg = MiniLMConfig.from_dir(folder)
    tensors = _import_safetensors().load_file(str(folder / "model.safetensors"))

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        # Some exports prefix every name with "bert."; accept both spellings.
        arr = tensors.get(name, tensors.get("bert." + name))
        if arr is None:
            raise ValueError(f"model.safetensors in {folder} has no tensor {name!r}")
        if tuple(arr.shape) != shape:
            raise ValueError(f"model.safetensors tensor {name!r} has shape {tuple(arr.shape)}; expected {shape}")
        return np.ascontiguousarray(arr, dtype=np.float32)

    H, I = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        layers.append(
            LayerWeights(
                q_w=get(p + "attention.self.query.weight", (H, H)),
                q_b=get(p + "attention.self.query.bias", (H,)),
                k_w=get(p + "attention.self.key.weight", (H, H)),
                k_b=get(p + "attention.self.key.bias", (H,)),
                v_w=get(p + "attention.self.value.weight", (H, H)),
                v_b=get(p + "attention.self.value.bias", (H,)),
                o_w=get(p + "attention.output.dense.weight", (H, H)),
                o_b=get(p + "attention.output.dense.bias", (H,)),
                ln1_w=get(p + "attention.output.LayerNorm.weight", (H,)),
                ln1_b=get(p + "attention.output.LayerNorm.bias", (H,)),
                i_w=get(p + "intermediate.dense.weight", (I, H)),
                i_b=get(p + "intermediate.dense.bias", (I,)),
                out_w=get(p + "output.dense.weight", (H, I)),
                out_b=get(p + "output.dense.bias", (H,)),
                ln2_w=get(p + "output.LayerNorm.weight", (H,)),
                ln2_b=get(p + "output.LayerNorm.bias", (H,)),
            )
        )
    return MiniLMWeights(
        config=cfg,
        word_embeddings=get("embeddings.word_embeddings.weight", (cfg.vocab_size, H)),
        position_embeddings=get("embeddings.position_embeddings.weight", (cfg.max_position_embeddings, H)),
        token_type_embeddings=get("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, H)),
        emb_ln_w=get("embeddings.LayerNorm.weight", (H,)),
        emb_ln_b=get("embeddings.LayerNorm.bias", (H,)),
        layers=tuple(layers),
        model_dir=folder,
    )
