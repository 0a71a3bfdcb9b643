"""A step arena: bump allocation from one slab, reset once per step.

Many buffers of an inference step live exactly one step: activations, scratch for a fused
op, staging for a copy.  Allocating each from a general allocator costs a lookup and a
free; an arena costs an addition.  :class:`StepArena` takes one 64-byte-aligned slab from
the backend, hands out consecutive 64-byte-aligned views of it, and forgets them all at
``reset()`` -- the engine calls it at the start of every step.

The catch is the same as the caching allocator's: ``reset`` makes the memory reusable
*now*.  Work of the previous step that is still queued must be on the queue that will
reuse the memory (queue order protects it), or be waited for before ``reset``.
"""

from __future__ import annotations

import math

import numpy as np

from vtnumba.backend.arrays import cdiv, check_shape, numeric_dtype
from vtnumba.backend.base import Backend, check_nbytes

ALIGN = 64  # cache line on the host; >= what any vector load on the GPU needs


class ArenaOverflowError(MemoryError):
    """An allocation did not fit in what is left of the arena's slab this step."""


def _align(n: int) -> int:
    return cdiv(n, ALIGN) * ALIGN


class StepArena:
    """Bump allocator over one slab of ``capacity`` bytes from ``backend.alloc``."""

    def __init__(self, backend: Backend, capacity: int):
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a vtnumba Backend, got {type(backend).__name__}")
        self.capacity = check_nbytes("capacity", capacity, allow_zero=False)
        self.backend = backend
        self._slab = backend.alloc(self.capacity)  # the backend aligns it to 64 bytes
        self.used = 0
        self.peak_used = 0
        self.steps = 0
        self.allocations = 0

    @property
    def remaining(self) -> int:
        """The largest allocation that still fits (after aligning the next offset)."""
        return max(self.capacity - _align(self.used), 0)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has given the slab back; allocating then raises RuntimeError."""
        return self._slab is None

    def alloc(self, nbytes: int, dtype=None, shape=None):
        """A view of ``nbytes`` bytes at the next 64-byte-aligned offset.

        ``dtype`` (default ``uint8``) and ``shape`` (default: 1-D) type the view; a given
        ``shape`` must cover exactly ``nbytes``.  The view is valid until the next ``reset``.
        """
        self._check_open()
        nbytes = check_nbytes("nbytes", nbytes)
        dtype = numeric_dtype("dtype", np.uint8 if dtype is None else dtype)
        if shape is None:
            if nbytes % dtype.itemsize:
                raise ValueError(f"nbytes={nbytes} is not a multiple of dtype {dtype.name}'s itemsize "
                                 f"{dtype.itemsize}")
            shape = (nbytes // dtype.itemsize,)
        else:
            shape = check_shape("shape", shape)  # ("ab" or (2.5,) are errors, not int()-ed)
            need = math.prod(shape) * dtype.itemsize  # (Python ints: no int64 wrap)
            if need != nbytes:
                raise ValueError(f"shape={shape} of {dtype.name} is {need} bytes, but nbytes={nbytes}")
        offset = _align(self.used)
        if offset + nbytes > self.capacity:
            raise ArenaOverflowError(
                f"StepArena overflow: alloc(nbytes={nbytes}) requested {nbytes} bytes but only {self.remaining} "
                f"bytes remain (capacity {self.capacity}, used {self.used}, next aligned offset {offset}); "
                "reset() at each step boundary, or create the arena with a larger capacity")
        view = self._slab.view(dtype, shape, offset)
        self.used = offset + nbytes
        self.peak_used = max(self.peak_used, self.used)
        self.allocations += 1
        return view

    def reset(self) -> None:
        """Start a new step: every earlier view may now be overwritten."""
        self._check_open()
        self.used = 0
        self.steps += 1

    def close(self) -> None:
        """Give the slab back to the backend (idempotent)."""
        if self._slab is not None:
            self.backend.free(self._slab)
            self._slab = None

    def __enter__(self) -> "StepArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._slab is None:
            raise RuntimeError("StepArena was closed; create a new one")
        if self.backend.closed:  # (its slab would still hand out views: refuse as the backend does)
            raise RuntimeError(f"StepArena's backend {self.backend.name} on {self.backend.device} was closed; make "
                               "a new backend and arena")

    def __repr__(self) -> str:
        return f"<StepArena {self.used}/{self.capacity} B used, step {self.steps}>"
