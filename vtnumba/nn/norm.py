"""RMSNorm and LayerNorm modules: weights plus the fused residual-add + norm of :mod:`vtnumba.kernels`.

A module call does what a transformer does after each sub-block::

    out, new_residual = norm(y, residual)     # z = y + residual; out = norm(z); new_residual = z
    out               = norm(x)               # plain normalisation

Each module says which norm it is (``norm_type`` = ``"rms"`` / ``"layer"``), which is how
:func:`vtnumba.tpsp.get_tpsp_norm_type` recognises it, and carries ``weight``, ``eps`` and
(LayerNorm) ``bias`` -- everything TPSP needs to fuse the norm into the exchange.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import check_eps, check_int, is_int
from vtnumba.kernels import fused_add_layer_norm, fused_add_rms_norm
from vtnumba.nn._params import Params, check_input, float32_array


def _seed(seed) -> int | None:
    """None, or a non-negative int (as the linear layers take it: True and 1.5 are refused)."""
    if seed is not None and (isinstance(seed, (bool, np.bool_)) or not is_int(seed) or seed < 0):
        raise ValueError(f"seed={seed!r} must be a non-negative int (or None)")
    return None if seed is None else int(seed)


def _vector(value, hidden: int, default: float, name: str, seed: int | None) -> np.ndarray:
    if value is None:
        if seed is None:
            return np.full(hidden, default, dtype=np.float32)
        rng = np.random.default_rng(seed)
        return (np.float32(default) + np.float32(0.1) * rng.standard_normal(hidden, dtype=np.float32))
    v = float32_array(name, value)
    if v.shape != (hidden,):
        raise ValueError(f"{name} has shape {v.shape}; expected (hidden_size,) = ({hidden},)")
    return np.ascontiguousarray(v)


class RMSNorm(Params):
    """``out = z * rsqrt(mean(z^2) + eps) * weight``; ``seed`` draws a random weight near 1 (for tests)."""

    #: Which norm this is, as :func:`vtnumba.tpsp.get_tpsp_norm_type` names it.
    norm_type = "rms"

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight=None, *, seed: int | None = None):
        self.hidden_size = check_int("hidden_size", hidden_size, min_value=1)
        self.eps = check_eps(eps)
        self.weight = _vector(weight, self.hidden_size, 1.0, "weight", _seed(seed))
        self.bias = None  # RMSNorm has no bias (TPSP refuses a norm bias with RMSNorm)

    def __call__(self, x, residual=None, *, out=None, new_residual=None):
        check_input(self, "x", x, self.hidden_size, "hidden_size")
        out_, new_res = fused_add_rms_norm(x, residual, self.param("weight", x), self.eps, out=out,
                                           new_residual=new_residual)
        return out_ if residual is None else (out_, new_res)

    def __repr__(self) -> str:
        return f"RMSNorm({self.hidden_size}, eps={self.eps:g})"


class LayerNorm(Params):
    """``out = (z - mean) * rsqrt(var + eps) * weight + bias``; ``seed`` draws random weight/bias."""

    #: Which norm this is, as :func:`vtnumba.tpsp.get_tpsp_norm_type` names it.
    norm_type = "layer"

    def __init__(self, hidden_size: int, eps: float = 1e-5, weight=None, bias=None, *, seed: int | None = None):
        self.hidden_size = check_int("hidden_size", hidden_size, min_value=1)
        self.eps = check_eps(eps)
        seed = _seed(seed)
        self.weight = _vector(weight, self.hidden_size, 1.0, "weight", seed)
        self.bias = _vector(bias, self.hidden_size, 0.0, "bias", None if seed is None else seed + 1)

    def __call__(self, x, residual=None, *, out=None, new_residual=None):
        check_input(self, "x", x, self.hidden_size, "hidden_size")
        out_, new_res = fused_add_layer_norm(x, residual, self.param("weight", x), self.param("bias", x), self.eps,
                                             out=out, new_residual=new_residual)
        return out_ if residual is None else (out_, new_res)

    def __repr__(self) -> str:
        return f"LayerNorm({self.hidden_size}, eps={self.eps:g})"


def make_norm(kind: str, hidden_size: int, eps: float | None = None, *, seed: int | None = None):
    """An RMSNorm (``"rms"``) or LayerNorm (``"layer"``) of ``hidden_size``."""
    from vtnumba.tpsp.norm_type import LAYER, get_tpsp_norm_type

    if get_tpsp_norm_type(kind) == LAYER:
        return LayerNorm(hidden_size, 1e-5 if eps is None else eps, seed=seed)
    return RMSNorm(hidden_size, 1e-6 if eps is None else eps, seed=seed)


__all__ = ["RMSNorm", "LayerNorm", "make_norm"]
