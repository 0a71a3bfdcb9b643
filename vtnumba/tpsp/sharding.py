"""Sequence-parallel sharding of the residual stream: which token rows each rank owns.

With TPSP the residual is not replicated on every rank any more: the ``T`` token rows are
split into ``tp`` equal blocks of ``R = ceil(T / tp)`` rows, rank ``r`` owns rows
``r*R .. r*R + R - 1``, and the last blocks are zero-padded when ``T % tp != 0`` (a rank
may own only padding when ``T < tp``).  Every rank's shard has the same shape, which is
what lets the exchange use fixed-size slots.

Upstream: vLLM's ``tpsp_shard_residual``.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import cdiv, is_int


def shard_rows(num_tokens: int, tp: int) -> int:
    """``R = ceil(T / tp)``: rows per rank (at least 1)."""
    if not is_int(num_tokens) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 1")
    if not is_int(tp) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an int >= 1")
    return cdiv(num_tokens, tp)


def token_range(num_tokens: int, tp: int, rank: int) -> tuple[int, int]:
    """The real (not padding) token rows ``[start, stop)`` that ``rank`` owns; may be empty."""
    R = shard_rows(num_tokens, tp)
    if not is_int(rank) or not 0 <= rank < tp:
        raise ValueError(f"rank={rank!r} must be an int in 0..{tp - 1}")
    # Python ints from here: numpy's int64 would wrap silently for a huge num_tokens * rank.
    num_tokens, rank = int(num_tokens), int(rank)
    start = min(rank * R, num_tokens)
    return start, min(start + R, num_tokens)


def shard_residual(residual, tp: int, rank: int | None = None) -> np.ndarray:
    """This rank's padded shard ``[R, H]`` of a full residual ``[T, H]`` (a new array).

    ``rank`` defaults to this process's rank in the tensor-parallel group
    (:func:`vtnumba.dist.get_tp_group`), which must have ``tp`` ranks.
    """
    shape = getattr(residual, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"residual must be a 2-D [T, H] array, got shape {shape}")
    if shape[0] < 1:
        raise ValueError(f"residual has shape {tuple(shape)}; expected at least one token row (T >= 1)")
    if rank is None:
        from vtnumba.dist import get_tp_group

        group = get_tp_group()
        if group.size != tp:
            raise ValueError(f"tp={tp} but the tensor-parallel group has {group.size} ranks")
        rank = group.rank
    T, H = int(shape[0]), int(shape[1])
    R = shard_rows(T, tp)
    start, stop = token_range(T, tp, rank)
    host = np.asarray(residual) if isinstance(residual, np.ndarray) else None
    if host is None:
        raise TypeError(f"residual must be a numpy array (shard device data with the backend's copies), "
                        f"got {type(residual).__name__}")
    shard = np.zeros((R, H), dtype=host.dtype)
    shard[: stop - start] = host[start:stop]
    return shard


def unshard_residual(shards, num_tokens: int) -> np.ndarray:
    """Rebuild the full ``[T, H]`` residual from every rank's shard (index = rank); drops padding.

    Every shard is ``[R, H]`` with ``R = ceil(num_tokens / len(shards))`` (:func:`shard_residual`
    pads the last ones): shards of other sizes would put rows at the wrong token positions."""
    arrays = [np.asarray(s) for s in shards]
    if not arrays:
        raise ValueError("shards is empty; expected one [R, H] shard per rank")
    R = shard_rows(num_tokens, len(arrays))  # (checks num_tokens: an int >= 1)
    for r, a in enumerate(arrays):
        if a.ndim != 2:
            raise ValueError(f"shards[{r}] has shape {a.shape}; expected a 2-D [R, H] shard with R = "
                             f"ceil(num_tokens={num_tokens} / {len(arrays)} shards) = {R}")
    for r, a in enumerate(arrays):
        if a.shape != (R, arrays[0].shape[1]):
            raise ValueError(f"shards[{r}] has shape {a.shape}; expected [R, H] = [{R}, {arrays[0].shape[-1]}] "
                             f"(R = ceil(num_tokens={num_tokens} / {len(arrays)} shards)) like every shard")
    return np.concatenate(arrays, axis=0)[:num_tokens]


__all__ = ["shard_rows", "token_range", "shard_residual", "unshard_residual"]
