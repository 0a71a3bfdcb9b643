"""Which normalisation a TPSP call fuses: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm).

Upstream: vLLM's ``get_tpsp_norm_type``.  The fused op ends in a norm, and only two are supported --
the ones the kernels implement::

    rms:   out = z * rsqrt(mean(z^2) + eps) * weight
    layer: out = (z - mean(z)) * rsqrt(var(z) + eps) * weight (+ norm_bias)

Callers name the norm as a string (``"rms"``, ``"rmsnorm"``, ``"rms_norm"``, ``"layer"``,
``"layernorm"``, ``"layer_norm"``, any case) or pass the norm module itself: a module
with a ``norm_type`` attribute (the :mod:`vtnumba.nn` norms have one), or one whose class
is called ``RMSNorm`` / ``LayerNorm`` (so modules of other frameworks work too).  Anything
else is refused with the list of what is accepted, instead of silently normalising the
wrong way.

This module deliberately does not import :mod:`vtnumba.nn`: ``nn`` builds on ``tpsp``.
"""

from __future__ import annotations

RMS = "rms"
LAYER = "layer"
NORM_TYPES = (RMS, LAYER)

_ALIASES = {
    "rms": RMS, "rmsnorm": RMS, "rms_norm": RMS,
    "layer": LAYER, "layernorm": LAYER, "layer_norm": LAYER, "ln": LAYER,
}
_CLASS_NAMES = {"RMSNorm": RMS, "LlamaRMSNorm": RMS, "LayerNorm": LAYER}


def get_tpsp_norm_type(norm) -> str:
    """``"rms"`` or ``"layer"`` for a norm given by name or as a module; ValueError otherwise."""
    if isinstance(norm, str):
        key = norm.strip().lower()
        if key in _ALIASES:
            return _ALIASES[key]
        raise ValueError(f"norm={norm!r} is not a TPSP norm; expected one of {sorted(_ALIASES)} "
                         "(TPSP fuses RMSNorm or LayerNorm only)")
    declared = getattr(norm, "norm_type", None)
    if isinstance(declared, str):
        return get_tpsp_norm_type(declared)
    cls = type(norm).__name__
    if cls in _CLASS_NAMES:
        return _CLASS_NAMES[cls]
    raise ValueError(f"norm of type {cls} is not supported by TPSP; expected an RMSNorm or LayerNorm module "
                     f"(or one of the names {sorted(_ALIASES)})")


__all__ = ["get_tpsp_norm_type", "RMS", "LAYER", "NORM_TYPES"]
