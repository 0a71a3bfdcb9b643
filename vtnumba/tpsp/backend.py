"""``TPSPBackend``: the abstract lifecycle every TPSP implementation follows (vLLM: ``TPSPBackend``).

A TPSP backend serves one process group on one device.  Its lifecycle, as in vLLM's ``vllm/platforms/tpsp_cuda.py``::

    backend = get_tpsp_backend("tp", device)        # HostTPSPBackend or CudaTPSPBackend
    handle  = backend.open(dtype=..., tp_size=..., hidden_size=..., max_batched_tokens=...)
              # None on *every* rank if any rank cannot (the regular forward is used then)
    backend.set_config(handle, TPSPConfig(chunk_tokens_per_rank=...))
    w       = backend.prepare_weights(handle, projection)   # weights in the target's memory
    gathered, new_residual = backend.tpsp_matmul_rs_norm_ag(handle, x, w.weight, w.bias, residual,
                                                            norm_weight, eps, norm_bias, norm="rms")
    backend.close(handle)                            # collective: sync, barrier, unmap, barrier, free
    backend.close()                                  # the backend itself

or, for a whole model, ``context = backend.profile(ops_groups, max_batched_tokens)`` opens a
handle per :class:`~vtnumba.tpsp.config.TPSPOpsGroup`, picks the configs (given, or measured
with ``search=True``) and the token threshold, checks parity with the regular forward, and
returns a :class:`~vtnumba.tpsp.config.TPSPContext` (or ``None``: use the regular forward).

Every method that involves peers is collective over the group: all ranks call it, in the
same order, with the same shapes.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from vtnumba.tpsp.config import TPSPConfig, TPSPContext


class TPSPBackend(abc.ABC):
    """Abstract TPSP backend for the process group ``group_name`` on ``device``."""

    #: Microchunk sizes the measured profile tries are this times powers of two, plus the whole
    #: shard (token rows per rank; :func:`vtnumba.tpsp.profiling.chunk_candidates`).
    tpsp_chunk_granularity: int = 64
    #: Largest microchunk in tokens over all ranks (caps the workspace), or None for no cap.
    tpsp_max_microchunk_tokens: int | None = 16_384

    def __init__(self, group_name: str, device) -> None:
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group_name={group_name!r} must be a non-empty str (the name of a vtnumba.dist group)")
        self.group_name = group_name
        self.device = device
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once ``close()`` (without a handle) has closed the backend; ``open`` and calls then raise."""
        return self._closed

    # ------------------------------------------------------------------ lifecycle
    @abc.abstractmethod
    def open(self, *, dtype=np.float32, tp_size: int, hidden_size: int, max_batched_tokens: int,
             group_name: str | None = None, device=None, name: str = "default") -> Any | None:
        """A handle with a peer workspace, or None on every rank (then use the regular forward)."""

    def profile(self, ops_groups, max_batched_tokens: int, *, search: bool = False,
                threshold_tokens: int | None = None, config: TPSPConfig | int | None = None,
                budget_s: float = 60.0, parity_check: bool = True) -> TPSPContext | None:
        """Open a handle per ops group and decide when TPSP runs (see :mod:`vtnumba.tpsp.profiling`)."""
        from vtnumba.tpsp.profiling import profile_tpsp

        return profile_tpsp(self, ops_groups, max_batched_tokens, search=search, threshold_tokens=threshold_tokens,
                            config=config, budget_s=budget_s, parity_check=parity_check)

    @abc.abstractmethod
    def set_config(self, handle, config: TPSPConfig | int) -> None:
        """Use ``config`` (or a plain microchunk size) for later calls on ``handle``."""

    @abc.abstractmethod
    def prepare_weights(self, handle, projection):
        """The projection's weight (and bias) in this backend's memory, cached on the module."""

    @abc.abstractmethod
    def tpsp_matmul_rs_norm_ag(self, handle, x, w, bias, residual, norm_weight, eps, norm_bias=None, *,
                               norm="rms", config: TPSPConfig | int | None = None, out=None, new_residual=None):
        """``(gathered [T, H], new_residual [R, H])`` -- see :mod:`vtnumba.tpsp.pipeline`."""

    def fused_gemm_rs_norm_ag(self, handle, x, projection, residual, norm, *, config=None, out=None,
                              new_residual=None):
        """vLLM's module-level form: weights, bias, eps and norm type come from the modules."""
        from vtnumba.tpsp.norm_type import get_tpsp_norm_type

        prepared = self.prepare_weights(handle, projection)
        norm_type = get_tpsp_norm_type(norm)
        norm_w = self.prepare_weights(handle, norm)
        return self.tpsp_matmul_rs_norm_ag(handle, x, prepared.weight, prepared.bias, residual, norm_w.weight,
                                           norm.eps, norm_w.bias, norm=norm_type, config=config, out=out,
                                           new_residual=new_residual)

    @abc.abstractmethod
    def close(self, handle=None) -> None:
        """Close ``handle`` (collective), or with no argument every open handle and the backend."""


__all__ = ["TPSPBackend"]
