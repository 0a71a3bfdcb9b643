"""The encoder's per-forward memory: every array of one forward, carved from one StepArena.

A forward over a packed batch of ``T`` tokens needs the same handful of arrays in every
layer -- the hidden state, the Q/K/V projection, the attention context, the FFN's
intermediate activations, scratch for the un-normalised residual sums, and (host only)
attention's padded per-head blocks.  None of them outlives the forward, which is exactly
what a :class:`~vtnumba.memory.StepArena` is for: one slab from the backend, bump-allocated,
reset at the start of the next forward.  Reusing the slab matters on both kinds of
memory: a fresh multi-megabyte host array is fresh pages (the first write to each page is a
page fault, as slow as the arithmetic that fills it), and a fresh device array is a
``cuMemAlloc``.  When a batch needs more than the arena holds, it is replaced by one 25 %
larger than needed, so slowly growing batches do not reallocate every time.

**The hidden state is padded for sequence parallelism.**  TPSP shards the residual by token
rows: with ``R = ceil(T / tp)`` rows per rank, rank ``r`` owns rows ``r*R .. r*R+R-1``, the
last shards zero-padded (:mod:`vtnumba.tpsp.sharding`).  The two hidden-state buffers (the
model alternates between them: one is the residual of a projection, the other its output)
therefore have ``tp * R`` rows, and their rows past ``T`` are zeroed once per forward.  Every
writer writes rows ``[0, T)`` only, so the padding stays zero, and this rank's residual shard
is simply a *view* of rows ``r*R .. r*R+R-1`` -- no copy, on the host or on a GPU.

Arrays are valid until the next :meth:`StepBuffers.start`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vtnumba.backend.arrays import cdiv
from vtnumba.kernels import AttentionWorkspace, gather_rows
from vtnumba.memory import StepArena
from vtnumba.memory.arena import ALIGN

#: A new arena is this much larger than the forward that needed it (slowly growing batches).
HEADROOM = 1.25
_F32 = np.dtype(np.float32)


def _nbytes(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * _F32.itemsize


def _aligned(nbytes: int) -> int:
    return cdiv(nbytes, ALIGN) * ALIGN


class Step:
    """The arrays of one forward (see the module docstring); made by :meth:`StepBuffers.start`.

    ``hidden`` is a pair of padded ``[tp * R, H]`` buffers; :meth:`rows` and :meth:`shard`
    are views of one of them.  ``offsets`` and ``max_len`` describe the packed sentences
    for attention (``offsets`` in the backend's memory).
    """

    def __init__(self, arrays: dict[str, Any], *, num_tokens: int, tp: int, rank: int, offsets, max_len: int,
                 attention: AttentionWorkspace | None):
        self.num_tokens = num_tokens
        self.rows_per_rank = cdiv(num_tokens, tp)
        self.tp, self.rank = tp, rank
        self.hidden = (arrays["hidden0"], arrays["hidden1"])
        self.qkv, self.ctx, self.inter = arrays["qkv"], arrays["ctx"], arrays["inter"]
        self.new_residual, self.new_residual_shard = arrays["z"], arrays["z_shard"]
        self.offsets, self.max_len = offsets, max_len
        self.attention = attention

    def rows(self, k: int):
        """The real ``[T, H]`` rows of hidden buffer ``k`` (0 or 1)."""
        return self.hidden[k][:self.num_tokens]

    def shard(self, k: int):
        """This rank's zero-padded ``[R, H]`` token rows of hidden buffer ``k``: a view, no copy."""
        R = self.rows_per_rank
        return self.hidden[k][self.rank * R:(self.rank + 1) * R]


class StepBuffers:
    """Owns the :class:`~vtnumba.memory.StepArena` of a model on ``backend``; one :class:`Step` per forward."""

    def __init__(self, backend):
        self.backend = backend
        self.on_device = backend.capabilities.kernel_arrays == "device"
        #: The arena of the current forward's arrays (None before the first forward, after close).
        self.arena: StepArena | None = None
        self._zeros = None  # [rows, H] of zeros in the backend's memory: the padding rows' source

    def _shapes(self, batch, dims: dict, tp: int) -> dict[str, tuple[int, ...]]:
        T, H = batch.num_tokens, dims["hidden"]
        R = cdiv(T, tp)
        shapes = {"hidden0": (tp * R, H), "hidden1": (tp * R, H), "qkv": (T, 3 * dims["local_width"]),
                  "ctx": (T, dims["local_width"]), "inter": (T, dims["local_intermediate"]), "z": (T, H),
                  "z_shard": (R, H)}
        if not self.on_device:  # the CUDA attention kernel keeps its scores in shared memory instead
            shapes.update({f"attn_{name}": shape for name, shape in AttentionWorkspace.shapes(
                batch.num_sentences, batch.max_len, dims["local_heads"], dims["head_dim"]).items()})
        return shapes

    def _reserve(self, nbytes: int) -> StepArena:
        if self.arena is None or self.arena.capacity < nbytes:
            if self.arena is not None:
                self.arena.close()  # nothing of the previous forward is still in use (see Step)
            self.arena = StepArena(self.backend, int(nbytes * HEADROOM))
        return self.arena

    def _zero_rows(self, rows: int, hidden: int):
        if self._zeros is None or self._zeros.shape[0] < rows or self._zeros.shape[1] != hidden:
            self._zeros = self.backend.asarray(np.zeros((max(rows, 1), hidden), np.float32))
        return self._zeros[:rows]

    def start(self, batch, dims: dict, tp: int, rank: int) -> Step:
        """Reset the arena and carve the arrays of a forward over ``batch`` (a PackedBatch).

        ``dims``: ``hidden``, ``local_width`` (this rank's heads x head_dim), ``local_heads``,
        ``head_dim``, ``local_intermediate``.
        """
        shapes = self._shapes(batch, dims, tp)
        arena = self._reserve(sum(_aligned(_nbytes(s)) for s in shapes.values()))
        arena.reset()
        arrays = {name: arena.alloc(_nbytes(shape), np.float32, shape) for name, shape in shapes.items()}
        attention = None
        if not self.on_device:
            attention = AttentionWorkspace(**{name: arrays[f"attn_{name}"] for name in AttentionWorkspace._fields})
        T, padded = batch.num_tokens, shapes["hidden0"][0]
        if padded > T:  # zero the padding rows of both hidden buffers (see the module docstring)
            gather_rows(self._zero_rows(padded - T, dims["hidden"]), [arrays["hidden0"], arrays["hidden1"]], T)
        # Attention's sentence boundaries: uploaded once per forward on a device.
        offsets = self.backend.asarray(batch.offsets) if self.on_device else batch.offsets
        return Step(arrays, num_tokens=T, tp=tp, rank=rank, offsets=offsets, max_len=batch.max_len,
                    attention=attention)

    def close(self) -> None:
        """Give the arena's slab back to the backend (a later :meth:`start` makes a new one)."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._zeros = None


__all__ = ["Step", "StepBuffers", "HEADROOM"]
