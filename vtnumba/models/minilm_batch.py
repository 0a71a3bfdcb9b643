"""Packing a batch of variable-length sentences into one token stream.

The dense layers of a transformer treat every token alike, so a batch of sentences is one
matrix ``[T, H]`` with ``T`` = the total number of *real* tokens -- no padding rows, so no
FLOPs are spent on padding (sentence-transformers pads every sentence to the longest one).
Only attention needs to know where each sentence starts and ends (``offsets``).  On the
host it copies the packed rows into padded per-head blocks ``[B, heads, L, d]`` (``L`` = the
longest sentence), gives padded keys zero weight (``-inf`` before the exponential), and
copies the real rows back; padded *queries* produce rows that are never copied back, so
padding cannot touch a real output.  The CUDA kernel reads each sentence's packed rows
directly, with no padding at all (:mod:`vtnumba.kernels.attention`).

The token-parallel exchanges (all-reduce, or TPSP's reduce-scatter over token rows) see
the same packed ``[T, H]`` on every rank, so ``T`` here is the ``T`` of the TPSP op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackedBatch:
    """B sentences' token ids concatenated, with what attention needs to undo the packing."""

    #: ``[T]`` int64 token ids, sentence after sentence.
    ids: np.ndarray
    #: ``[T]`` int64 positions ``0 .. len-1`` within each sentence (BERT's absolute positions).
    positions: np.ndarray
    #: ``[B + 1]`` int64: sentence ``b`` is rows ``offsets[b] : offsets[b+1]``.
    offsets: np.ndarray
    #: ``L``, the longest sentence's length.
    max_len: int

    @property
    def num_sentences(self) -> int:
        """``B``, the number of sentences."""
        return int(self.offsets.size - 1)

    @property
    def num_tokens(self) -> int:
        """``T``, the number of real tokens of all sentences together."""
        return int(self.ids.size)

    def split(self, rows: np.ndarray) -> list[np.ndarray]:
        """Per-sentence views of a packed ``[T, ...]`` array."""
        return [rows[self.offsets[b] : self.offsets[b + 1]] for b in range(self.num_sentences)]


def check_token_ids(token_ids) -> list[np.ndarray]:
    """``token_ids`` as a list of non-empty 1-D int64 arrays, one per text; TypeError or
    ValueError naming the first that is not (a float id was truncated, a NaN became
    -2**63, a 2-D array failed deep in the embedding gather).  Not the ids' range: the
    model checks that against its vocabulary."""
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
        raise TypeError("token_ids must be a list of 1-D id arrays (one per text), not one array; wrap it in a list")
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise TypeError(f"token_ids must be a list of 1-D id arrays (one per text), got {type(token_ids).__name__}")
    ids = []
    for i, t in enumerate(token_ids):
        try:
            ids.append(np.asarray(t))
        except ValueError:  # (numpy's "inhomogeneous shape" for a ragged nested list)
            raise ValueError(f"token_ids[{i}] is not a flat sequence of ids") from None
    if not ids:
        raise ValueError("token_ids is empty; expected at least one text's ids")
    for i, t in enumerate(ids):
        if t.ndim != 1 or t.size < 1 or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"token_ids[{i}] is a {t.dtype} array of shape {t.shape}; expected a non-empty 1-D int array")
    return [t.astype(np.int64, copy=False) for t in ids]


def pack_batch(token_ids: list[np.ndarray]) -> PackedBatch:
    """Pack a list of 1-D id arrays (each ``[CLS] ... [SEP]``, non-empty) into a :class:`PackedBatch`
    (checked by :func:`check_token_ids`)."""
    token_ids = check_token_ids(token_ids)
    lengths = np.asarray([t.size for t in token_ids], dtype=np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    max_len = int(lengths.max())
    sentence = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)  # which sentence each token is in
    positions = np.arange(total, dtype=np.int64) - offsets[sentence]
    return PackedBatch(
        ids=np.concatenate(token_ids),
        positions=positions,
        offsets=offsets,
        max_len=max_len,
    )
