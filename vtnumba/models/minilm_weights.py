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

    #: Word-piece vocabulary size (rows of the word-embedding table; 30522 for MiniLM).
    vocab_size: int
    #: Width of the hidden state, ``H`` (384).
    hidden_size: int
    #: Transformer layers (6).
    num_hidden_layers: int
    #: Attention heads (12); ``tp`` must divide it, so every rank holds whole heads.
    num_attention_heads: int
    #: Width of the FFN's intermediate activations, ``I`` (1536).
    intermediate_size: int
    #: Rows of the position table: the longest input the model can take (512).
    max_position_embeddings: int
    #: Rows of the token-type table (2; single sentences use type 0).
    type_vocab_size: int
    #: LayerNorm epsilon (1e-12, BERT's).
    layer_norm_eps: float
    #: Id of the ``[PAD]`` token (never used: vtnumba packs real tokens only).
    pad_token_id: int
    #: sentence-transformers' truncation length (``sentence_bert_config.json``), <= max_position_embeddings.
    max_seq_length: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``hidden_size // num_attention_heads`` (64)."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, model_dir: Path) -> MiniLMConfig:
        """Read ``config.json`` (and ``sentence_bert_config.json`` if present) from ``model_dir``."""
        raw = _read_json(model_dir / "config.json")
        # Only the plain BERT recipe is implemented; anything else must fail loudly, not silently differ.
        for key, want in (("model_type", "bert"), ("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
            got = raw.get(key, want)
            if got != want:
                raise ValueError(f"config.json {key}={got!r} is not supported; expected {want!r}")
        st_path = model_dir / "sentence_bert_config.json"
        st_raw = _read_json(st_path) if st_path.is_file() else {}

        def whole(key: str, default=None, minimum: int = 1, source: dict = raw, file: str = "config.json") -> int:
            # A count or a size: a JSON integer (not 384.7, not true), at least ``minimum`` -- a 0
            # or negative one failed later as ZeroDivisionError, "math domain error" or IndexError.
            value = source.get(key, default)
            if value is None:
                raise ValueError(f"{model_dir / file} has no {key!r}; it is not a BERT config")
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{model_dir / file} {key}={value!r}; expected a whole number >= {minimum}")
            return value

        sizes = {key: whole(key) for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size", "max_position_embeddings")}
        eps = raw.get("layer_norm_eps", 1e-12)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise ValueError(f"{model_dir / 'config.json'} layer_norm_eps={eps!r}; expected a positive number")
        cfg = cls(
            **sizes,
            type_vocab_size=whole("type_vocab_size", 2),
            layer_norm_eps=float(eps),
            pad_token_id=whole("pad_token_id", 0, minimum=0),
            # (sentence-transformers' truncation length; without the file, the model's positions)
            max_seq_length=whole("max_seq_length", sizes["max_position_embeddings"], minimum=2, source=st_raw,
                                 file="sentence_bert_config.json"),
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

    #: Query projection weight ``[H, H]``.
    q_w: np.ndarray
    #: Query projection bias ``[H]``.
    q_b: np.ndarray
    #: Key projection weight ``[H, H]``.
    k_w: np.ndarray
    #: Key projection bias ``[H]``.
    k_b: np.ndarray
    #: Value projection weight ``[H, H]``.
    v_w: np.ndarray
    #: Value projection bias ``[H]``.
    v_b: np.ndarray
    #: Attention-output projection weight ``[H, H]``.
    o_w: np.ndarray
    #: Attention-output projection bias ``[H]``.
    o_b: np.ndarray
    #: LayerNorm after attention (``attention.output.LayerNorm``): weight ``[H]``.
    ln1_w: np.ndarray
    #: LayerNorm after attention: bias ``[H]``.
    ln1_b: np.ndarray
    #: Intermediate (FFN up) projection weight ``[I, H]``.
    i_w: np.ndarray
    #: Intermediate projection bias ``[I]``.
    i_b: np.ndarray
    #: Output (FFN down) projection weight ``[H, I]``.
    out_w: np.ndarray
    #: Output projection bias ``[H]``.
    out_b: np.ndarray
    #: LayerNorm after the FFN (``output.LayerNorm``): weight ``[H]``.
    ln2_w: np.ndarray
    #: LayerNorm after the FFN: bias ``[H]``.
    ln2_b: np.ndarray


@dataclass(frozen=True)
class MiniLMWeights:
    """The whole checkpoint: embeddings + their LayerNorm, and the layers."""

    #: The architecture (:class:`MiniLMConfig`).
    config: MiniLMConfig
    #: Word-piece embedding table ``[vocab, H]``.
    word_embeddings: np.ndarray
    #: Absolute position embedding table ``[max_positions, H]``.
    position_embeddings: np.ndarray
    #: Token-type embedding table ``[type_vocab, H]``.
    token_type_embeddings: np.ndarray
    #: LayerNorm after the embeddings: weight ``[H]``.
    emb_ln_w: np.ndarray
    #: LayerNorm after the embeddings: bias ``[H]``.
    emb_ln_b: np.ndarray
    #: The transformer layers, first to last.
    layers: tuple[LayerWeights, ...]
    #: The folder the checkpoint was read from (its tokenizer is there too).
    model_dir: Path


def _import_safetensors():
    try:
        import safetensors.numpy as st_numpy
    except ImportError as exc:  # an optional extra: say how to get it
        raise ImportError(f"reading the MiniLM weights needs the 'safetensors' package; {INSTALL_HINT}") from exc
    return st_numpy


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; ValueError naming the file when it is not one."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-download the model files") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object; re-download the model files")
    return raw


def load_minilm_weights(model_dir: str | os.PathLike | None = None) -> MiniLMWeights:
    """Read ``config.json`` and ``model.safetensors`` into :class:`MiniLMWeights` (float32)."""
    folder = find_minilm_dir(model_dir)
    cfg = MiniLMConfig.from_dir(folder)
    try:
        tensors = _import_safetensors().load_file(str(folder / "model.safetensors"))
    except ImportError:
        raise
    except Exception as exc:  # safetensors' own error type: a truncated or foreign file
        raise ValueError(f"{folder / 'model.safetensors'} cannot be read as safetensors ({exc}); the file is "
                         "damaged or incomplete -- re-download it") from None

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        # Some exports prefix every name with "bert."; accept both spellings.
        arr = tensors.get(name, tensors.get("bert." + name))
        if arr is None:
            raise ValueError(f"model.safetensors in {folder} has no tensor {name!r}")
        if tuple(arr.shape) != shape:
            raise ValueError(f"model.safetensors tensor {name!r} has shape {tuple(arr.shape)}; expected {shape}")
        if np.dtype(arr.dtype).kind != "f":  # (complex was cast with a warning, ints silently)
            raise ValueError(f"model.safetensors tensor {name!r} has dtype {np.dtype(arr.dtype).name}; expected "
                             "floating point weights (float16, float32 or float64)")
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
