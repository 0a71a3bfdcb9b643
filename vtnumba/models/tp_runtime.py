"""A MiniLM encoder on a tensor-parallel process group, with TPSP opened for it.

This is where the model meets the runtime: :class:`TensorParallelEncoder` builds a
:class:`~vtnumba.models.encoder.MiniLMEncoder` on a :mod:`vtnumba.dist` group and, when
asked, opens TPSP (one handle per row-parallel projection: each layer's attention-output
and output projections, 12 in all) through the target's TPSP backend.  The model then
calls :class:`~vtnumba.tpsp.TPSPOp` after every row-parallel projection, which runs the
fused op when the profile says the batch is worth it and the regular forward otherwise.

With one rank there is nothing to exchange, so TPSP is not opened and the regular
forward (a plain matmul + LayerNorm) runs.  If any rank cannot open TPSP (peer buffers
unavailable, say), every rank learns it from the backend's all-ranks agreement and the
encoder runs the regular forward everywhere.
"""

from __future__ import annotations

import warnings

from vtnumba.backend.arrays import check_int
from vtnumba.models.encoder import MiniLMEncoder

# Tokens per forward the TPSP workspaces are sized for.  Batches of 64 typical sentences
# are ~2,000 tokens; a batch above this limit takes the regular forward (TPSPOp checks).
DEFAULT_MAX_BATCHED_TOKENS = 4096


class TensorParallelEncoder:
    """``MiniLMEncoder`` on ``group`` (a :class:`vtnumba.dist.ProcessGroup`), TPSP on or off.

    Use as a context manager, or call :meth:`close` on every rank (closing TPSP is collective).
    """

    def __init__(self, group, *, use_tpsp: bool = True, max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                 search: bool = False, weights=None, **encoder_kwargs):
        from vtnumba.dist.comm import check_group

        check_group(group)  # (None failed on group.size, after the model had loaded)
        self.group = group
        self.encoder = MiniLMEncoder(group, weights=weights, **encoder_kwargs)
        self.max_batched_tokens = check_int("max_batched_tokens", max_batched_tokens, min_value=1)
        self.tpsp_backend = None
        self.context = None
        self.ops = None
        if group.size > 1:
            self._agree_on_options(use_tpsp, search)
        if use_tpsp and group.size > 1:
            self._open_tpsp(search)

    def _agree_on_options(self, use_tpsp, search) -> None:
        """Every rank must have been given the same options before any of them opens TPSP: the
        ranks told use_tpsp=False would skip the (collective) open and meet the others' open
        in their next collective -- a hang, or an error about something else entirely."""
        from vtnumba.dist import allgather_bytes

        mine = f"use_tpsp={bool(use_tpsp)}, search={bool(search)}, max_batched_tokens={self.max_batched_tokens}"
        everyone = [b.decode() for b in allgather_bytes(mine.encode(), self.group, self.encoder.timeout_s)]
        if len(set(everyone)) > 1:
            raise ValueError(f"TensorParallelEncoder: the ranks of group {self.group.name!r} were given different "
                             "options -- " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(everyone))
                             + " (use_tpsp, search and max_batched_tokens must be the same on every rank: a "
                             "program's option such as --no-tpsp goes on every rank's command line or on none)")

    def _open_tpsp(self, search: bool) -> None:
        from vtnumba.backend import default_device
        from vtnumba.tpsp import TPSPOp, TPSPOpsGroup, get_tpsp_backend, profile_tpsp
        from vtnumba.tpsp.profiling import TPSPDisabledWarning

        # The encoder's timeout bounds the fused op's waits too (the backend's own default,
        # the process's, applied while TPSP was on: a hung peer held a rank for 60 s, not timeout_s).
        self.tpsp_backend = get_tpsp_backend(self.group.name, default_device(), timeout_s=self.encoder.timeout_s)
        ops_groups = [TPSPOpsGroup(name, proj, norm) for name, proj, norm in
                      self.encoder.model.row_parallel_projections()]
        with warnings.catch_warnings():
            # A declined profile is reported by tpsp_enabled; no need for a warning per rank.
            warnings.simplefilter("ignore", TPSPDisabledWarning)
            self.context = profile_tpsp(self.tpsp_backend, ops_groups, max_batched_tokens=self.max_batched_tokens,
                                        search=search)
        self.ops = {g.name: TPSPOp(self.context, g.name, norm="layer", group=self.group,
                                   timeout_s=self.encoder.timeout_s) for g in ops_groups}
        self.encoder.use_tpsp(self.ops)

    @property
    def tpsp_enabled(self) -> bool:
        """Did every rank open TPSP (False: one rank, ``use_tpsp=False``, or the profile declined)?"""
        return self.context is not None

    def use_tpsp(self) -> None:
        """From the next forward on, finish each row-parallel projection with the TPSP ops."""
        if self.ops is None:
            raise RuntimeError("TPSP was not opened for this encoder (one rank, or use_tpsp=False)")
        self.encoder.use_tpsp(self.ops)

    def use_regular(self) -> None:
        """From the next forward on, finish each row-parallel projection with the regular forward."""
        self.encoder.use_regular()

    def fused_calls(self) -> int:
        """How many row-parallel projections ran the fused op so far (all 12 ops together)."""
        return sum(op.fused_calls for op in (self.ops or {}).values())

    def close(self) -> None:
        """Close TPSP's handles and backend (collective over the group), and free the model's step arena."""
        try:
            if self.tpsp_backend is not None:
                backend, self.tpsp_backend = self.tpsp_backend, None
                backend.close()
        finally:
            self.encoder.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Close collectively on a normal exit.  Leaving on an exception, only this rank's own
        resources are freed: the TPSP backend stays open until the process exits (its peers may
        never reach a collective close); a caller that catches the error and goes on should
        call :meth:`close` on every rank itself."""
        if exc_type is None:
            self.close()
        else:
            # Failing: the peers may be anywhere (waiting in a forward, or already gone), so a
            # collective close would wait for them until a timeout and hide this error behind
            # its own.  Free what is this rank's alone; the peer segments are unlinked when
            # the process exits (vtnumba.dist.shm's exit hook).
            self.encoder.close()
        return False
