"""Named float32 scratch buffers that are reused from layer to layer and batch to batch.

Why bother: a fresh multi-megabyte numpy array is fresh pages, and the first write to each
page is a page fault.  On small virtual machines that costs as much as the arithmetic that
fills the array (copying 17 MB into new memory measured ~2x slower than into memory already
touched).  The encoder's intermediate arrays have the same few shapes every layer, so each
gets one named buffer that only grows.

Rule for callers: a buffer taken under a name is valid until the next ``take`` of the same
name -- so a value that must survive (the hidden state, which is also the next residual)
alternates between two names.
"""

from __future__ import annotations

import numpy as np


class Scratch:
    """``take(name, shape) -> float32 array`` backed by a per-name buffer that only grows."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.size < n:
            # Grow by a quarter more than asked, so slowly rising batch sizes do not reallocate each time.
            buf = np.empty(max(n, int(n * 1.25)), dtype=np.float32)
            self._bufs[name] = buf
        return buf[:n].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())
