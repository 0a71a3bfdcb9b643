"""Packing a batch of variable-length sentences into one token stream.

The dense layers of a transformer treat every token alike, so a batch of sentences is one
matrix ``[T, H]`` with ``T`` = the total number of *real* tokens -- no padding rows, so no
FLOPs are spent on padding (sentence-transformers pads every sentence to the longest one).
Only attention needs to know where each sentence starts and ends (``offsets``): it copies
the packed rows into padded per-head blocks ``[B, heads, L, d]`` (``L`` = the longest
sentence), gives padded keys zero weight (``-inf`` before the exponential), and copies the
real rows back.  Padded *queries* produce rows that are never copied back, so padding
cannot touch a real output.

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

    @property
    def lengths(self) -> np.ndarray:
        """``[B]`` tokens per sentence."""
        return np.diff(self.offsets)

    def split(self, rows: np.ndarray) -> list[np.ndarray]:
        """Per-sentence views of a packed ``[T, ...]`` array."""
        return [rows[self.offsets[b] : self.offsets[b + 1]] for b in range(self.num_sentences)]


def pack_batch(token_ids: list[np.ndarray]) -> PackedBatch:
    """Pack a list of 1-D id arrays (each ``[CLS] ... [SEP]``, non-empty) into a :class:`PackedBatch`."""
    if not token_ids:
        raise ValueError("token_ids is empty; expected at least one sentence")
    lengths = np.asarray([len(t) for t in token_ids], dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError(f"token_ids[{int(np.argmin(lengths))}] is empty; every sentence needs at least one token")
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    max_len = int(lengths.max())
    sentence = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)  # which sentence each token is in
    positions = np.arange(total, dtype=np.int64) - offsets[sentence]
    return PackedBatch(
        ids=np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids]),
        positions=positions,
        offsets=offsets,
        max_len=max_len,
    )
