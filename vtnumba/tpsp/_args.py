"""Argument checks shared by the fused op and the regular forward (one contract, one set of messages).

Both entry points take the same arrays::

    x [T, K_local]  w [H, K_local]  bias [H] | None  residual [R, H]  norm_weight [H]
    eps > 0         norm_bias [H] | None (LayerNorm only)   out [T, H] | None   new_residual [R, H] | None

with ``R = ceil(T / tp)``.  Checks look only at ``shape``/``dtype``/contiguity, so they work
on numpy arrays and on numba device arrays alike, and they never communicate: every rank
checks its own arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtnumba.backend.arrays import cdiv
from vtnumba.tpsp.norm_type import LAYER, get_tpsp_norm_type


@dataclass(frozen=True)
class CallShape:
    T: int
    K: int
    H: int
    R: int
    norm: str


def _contiguous(arr) -> bool:
    flags = getattr(arr, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            pass
    fn = getattr(arr, "is_c_contiguous", None)
    return bool(fn()) if fn is not None else False


def check_array(name: str, arr, shape: tuple) -> None:
    """float32, C-contiguous, ``shape`` (entries None are free)."""
    got = getattr(arr, "shape", None)
    if got is None or not hasattr(arr, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(arr).__name__}")
    got = tuple(int(s) for s in got)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape, strict=True)):
        want = tuple("?" if s is None else s for s in shape)
        raise ValueError(f"{name} has shape {got}; expected {want}")
    if np.dtype(arr.dtype) != np.float32:
        raise TypeError(f"{name} has dtype {np.dtype(arr.dtype).name}; TPSP computes in float32")
    if not _contiguous(arr):
        raise ValueError(f"{name} (shape {got}) must be C-contiguous; pass a contiguous copy")


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"eps={eps!r} must be a float")
    eps = float(eps)
    if not (eps > 0 and np.isfinite(eps)):
        raise ValueError(f"eps={eps} must be a positive finite float")
    return eps


def check_call(x, w, bias, residual, norm_weight, eps, norm_bias, norm, tp: int, *, hidden_size: int | None = None,
               max_tokens: int | None = None, out=None, new_residual=None) -> tuple[CallShape, float]:
    """Validate one call; returns the shapes and ``eps`` as a float."""
    norm = get_tpsp_norm_type(norm)
    check_array("x", x, (None, None))
    T, K = (int(s) for s in x.shape)
    if T < 1:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected at least one token row")
    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"x has T={T} token rows, more than max_batched_tokens={max_tokens} this TPSP handle "
                         "was opened for (its workspace is sized for that)")
    check_array("w", w, (None, K))
    H = int(w.shape[0])
    if hidden_size is not None and H != hidden_size:
        raise ValueError(f"w has shape {tuple(w.shape)}: H={H}, but this TPSP handle was opened for "
                         f"hidden_size={hidden_size}")
    R = cdiv(T, tp)
    if bias is not None:
        check_array("bias", bias, (H,))
    try:
        check_array("residual", residual, (R, H))
    except ValueError as exc:
        raise ValueError(f"{exc} -- the residual is this rank's token shard: R = ceil(T={T} / tp={tp}) = {R} "
                         "rows (use shard_residual() to cut it from the full [T, H] residual)") from None
    check_array("norm_weight", norm_weight, (H,))
    eps = check_eps(eps)
    if norm_bias is not None:
        if norm != LAYER:
            raise ValueError(f"norm_bias is given but norm={norm!r}: only LayerNorm has a bias; pass norm='layer' "
                             "or norm_bias=None")
        check_array("norm_bias", norm_bias, (H,))
    if out is not None:
        check_array("out", out, (T, H))
    if new_residual is not None:
        check_array("new_residual", new_residual, (R, H))
        if out is not None and new_residual is out:
            raise ValueError("out and new_residual must be different arrays")
    return CallShape(T, K, H, R, norm), eps


__all__ = ["CallShape", "check_call", "check_array", "check_eps"]
