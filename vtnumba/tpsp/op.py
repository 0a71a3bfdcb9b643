"""``TPSPOp``: one callable with the fused op's signature that picks TPSP or the regular forward per call.

A model should not care whether a batch runs fused: it calls ::

    gathered, new_residual = op(x, W, bias, residual_shard, norm_weight, eps, norm_bias=None)

and the op asks :meth:`TPSPOp.uses_tpsp` whether ``T`` tokens run fused: a batch above the
profile's ``max_batched_tokens``, which the fused op's workspace is sized for, never does;
below that the context's :class:`~vtnumba.tpsp.config.TPSPProfile` says whether ``T`` tokens
are worth fusing (``profile.is_active(T)``).  If so it runs the backend's fused call on the
ops group's handle, otherwise :func:`~vtnumba.tpsp.regular.regular_matmul_rs_norm_ag` --
same inputs, same outputs, same sharded residual.  With no context at all (``profile``
declined on every rank) every call takes the regular path.  Every rank sees the same ``T``
and the same profile, so every rank takes the same path.
"""

from __future__ import annotations

from vtnumba.backend.arrays import is_int
from vtnumba.backend.polling import WaitTimeout
from vtnumba.dist.comm import DEFAULT
from vtnumba.dist.queue_flags import QueueFlagsError
from vtnumba.tpsp.config import TPSPContext
from vtnumba.tpsp.norm_type import get_tpsp_norm_type
from vtnumba.tpsp.regular import regular_matmul_rs_norm_ag


def _tokens(x) -> int | None:
    """``T``, the number of rows of ``x``; None when ``x`` has no rows to count (None, a list, a scalar)."""
    shape = getattr(x, "shape", None)
    if not isinstance(shape, tuple) or not shape:
        return None
    return int(shape[0])


class TPSPOp:
    """``op(x, w, bias, residual, norm_weight, eps, norm_bias=None, *, out=None, new_residual=None)``."""

    def __init__(self, context: TPSPContext | None, name: str, *, norm="rms", group=None,
                 timeout_s: float | None = DEFAULT):
        self.context = context
        self.name = name
        self.norm = get_tpsp_norm_type(norm)
        self.handle = context.handle(name) if context is not None else None
        if group is None:
            if self.handle is not None:
                group = self.handle.group
            else:
                from vtnumba.dist import get_tp_group

                group = get_tp_group()
        self.group = group
        self.timeout_s = timeout_s
        self.fused_calls = 0
        self.regular_calls = 0

    def uses_tpsp(self, num_tokens: int) -> bool:
        """Will a call with ``num_tokens`` rows of ``x`` run fused?  False without a context, and
        for a batch above the profile's ``max_batched_tokens`` (the fused op's workspace holds no
        more: such a call runs the regular forward); otherwise the profile's answer
        (:meth:`~vtnumba.tpsp.TPSPProfile.is_active`, which refuses a count below 1 or not an int)."""
        if self.context is None:
            return False
        profile = self.context.profile
        if is_int(num_tokens) and num_tokens > profile.max_batched_tokens:
            return False
        return profile.is_active(num_tokens)

    def __call__(self, x, w, bias, residual, norm_weight, eps, norm_bias=None, *, out=None, new_residual=None):
        T = _tokens(x)
        # Something that is not an array takes the regular path, whose argument check names it
        # (TypeError) and -- unlike an error raised here -- tells the other ranks, which are
        # already waiting in that path's first collective.
        # A batch larger than the handle's workspace (max_batched_tokens) cannot run fused: it
        # takes the regular forward, which has no such limit (and agrees on T with the other
        # ranks first) -- it raised here, and later broke the handle in the fused call.
        fused = T is not None and self.uses_tpsp(T)
        try:
            if fused:
                self.fused_calls += 1
                return self.context.backend.tpsp_matmul_rs_norm_ag(self.handle, x, w, bias, residual, norm_weight,
                                                                   eps, norm_bias, norm=self.norm, out=out,
                                                                   new_residual=new_residual)
            self.regular_calls += 1
            return regular_matmul_rs_norm_ag(self.group, x, w, bias, residual, norm_weight, eps, norm_bias,
                                             norm=self.norm, out=out, new_residual=new_residual,
                                             timeout_s=self.timeout_s)
        except (WaitTimeout, QueueFlagsError) as exc:
            if self.context is None:
                raise
            # Ranks called with different T may stand on different sides of the threshold: one
            # waits for the fused path's flags, the other in the regular path's collective, and
            # each sees only a peer that "never came".  Say which side this rank was on.
            threshold = self.context.profile.threshold_tokens
            when = f"fused from {threshold} tokens" if threshold else "TPSP disabled"
            raise type(exc)(f"{exc} [TPSPOp {self.name!r}: this rank was called with T={T} tokens and took the "
                            f"{'fused' if fused else 'regular'} path ({when}); every rank of the group must be "
                            "called with the same T -- or, if they were, the peer is stopped or hung]") from exc

    def __repr__(self) -> str:
        mode = "regular only" if self.context is None else \
            f"TPSP from {self.context.profile.threshold_tokens} tokens"
        return f"<TPSPOp {self.name!r} norm={self.norm} {mode}>"


__all__ = ["TPSPOp"]
