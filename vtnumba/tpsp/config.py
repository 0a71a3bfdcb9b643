"""The small value types of TPSP: ops groups, the activation profile, contexts, tuning configs.

Upstream: vLLM's ``vllm/model_executor/tpsp.py``.  An engine that turns TPSP on does it per *ops
group* -- a row-parallel projection and the norm right after it (``o_proj`` with the
post-attention layernorm, ``down_proj`` with the next layer's input layernorm) -- and keeps
one decision for the whole model:

* :class:`TPSPOpsGroup` -- ``(name, projection, norm)``: what one fused call replaces;
* :class:`TPSPProfile`  -- ``(enabled, threshold_tokens, max_batched_tokens)``: TPSP runs for
  a batch of ``T`` tokens only when it is enabled and ``threshold_tokens <= T`` (below the
  threshold the regular forward is faster: too little work to hide the exchange);
* :class:`TPSPContext`  -- the profile, the backend and one *handle* per ops group name
  (what ``open`` returned: the peer workspace of that group);
* :class:`TPSPConfig`   -- the tuning knobs one handle runs with: the microchunk size
  (token rows of *each* rank's shard per pipeline step) and, on a GPU, how many SMs the
  exchange kernels may occupy at once.

All of them validate their fields on construction, so a bad value fails where it is
written, with a message naming the field, the value and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vtnumba.backend.arrays import is_int


@dataclass(frozen=True)
class TPSPConfig:
    """Tuning of one TPSP handle: the microchunk size and, on a GPU, the exchange's share of SMs."""

    #: Microchunk size ``c`` -- each pipeline step handles ``c`` rows of *every* rank's token shard
    #: (``tp * c`` tokens).  Smaller chunks overlap more (chunk i+1's matmul runs while chunk i is
    #: exchanged) but pay more per-step overhead; a chunk at least as large as the shard means one
    #: step (no pipelining) -- as long as the handle's workspace slot holds the shard: a step never
    #: moves more than a slot's ``max_chunk_rows``, so a larger chunk takes the slot's size.
    chunk_tokens_per_rank: int
    #: On GPUs only, the most streaming multiprocessors the exchange kernels (reduce + norm, gather) may
    #: occupy at once, leaving the rest to the next chunk's matmul.  ``None`` = no limit.  The host
    #: backend rejects it.
    sm_count_target: int | None = None

    def __post_init__(self) -> None:
        c = self.chunk_tokens_per_rank
        if not is_int(c):
            raise TypeError(f"TPSPConfig.chunk_tokens_per_rank={c!r} must be an int, got {type(c).__name__}")
        if c < 1:
            raise ValueError(f"TPSPConfig.chunk_tokens_per_rank={c} must be >= 1 (token rows per rank per step)")
        object.__setattr__(self, "chunk_tokens_per_rank", int(c))
        s = self.sm_count_target
        if s is not None:
            if not is_int(s):
                raise TypeError(f"TPSPConfig.sm_count_target={s!r} must be an int or None, got {type(s).__name__}")
            if s < 1:
                raise ValueError(f"TPSPConfig.sm_count_target={s} must be >= 1 (or None for no limit)")
            object.__setattr__(self, "sm_count_target", int(s))


@dataclass(frozen=True)
class TPSPProfile:
    """The shared on/off decision: TPSP runs for ``T`` tokens iff enabled and ``T >= threshold_tokens``."""

    #: Whether TPSP runs at all; False makes every call take the regular forward.
    enabled: bool
    #: The smallest batch (in tokens) that runs fused, an int in 1..max_batched_tokens when enabled;
    #: may be None when disabled.
    threshold_tokens: int | None
    #: The largest batch the handles were opened for; :meth:`is_active` refuses more.
    max_batched_tokens: int
    #: How the decision was made, for humans (e.g. ``"static profile"``, ``"measured profile"``), or
    #: why TPSP is disabled.
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, (bool, np.bool_)):
            raise TypeError(f"TPSPProfile.enabled={self.enabled!r} must be a bool")
        m = self.max_batched_tokens
        if not is_int(m) or m < 1:
            raise ValueError(f"TPSPProfile.max_batched_tokens={m!r} must be an int >= 1")
        t = self.threshold_tokens
        if self.enabled:
            if not is_int(t) or not 1 <= t <= m:
                raise ValueError(f"TPSPProfile.threshold_tokens={t!r} must be an int in 1..max_batched_tokens={m} "
                                 "when enabled")
        elif t is not None and (not is_int(t) or t < 1):
            raise ValueError(f"TPSPProfile.threshold_tokens={t!r} must be None or an int >= 1")

    def is_active(self, num_tokens: int) -> bool:
        """Should a batch of ``num_tokens`` tokens use TPSP?  Raises for counts outside 1..max_batched_tokens."""
        if not is_int(num_tokens):
            raise TypeError(f"num_tokens={num_tokens!r} must be an int")
        if not 1 <= num_tokens <= self.max_batched_tokens:
            raise ValueError(f"num_tokens={num_tokens} is outside the profiled range 1..max_batched_tokens="
                             f"{self.max_batched_tokens}")
        if not self.enabled:
            return False
        return num_tokens >= self.threshold_tokens

    @classmethod
    def disabled(cls, max_batched_tokens: int, reason: str) -> "TPSPProfile":
        """A profile that never runs TPSP (``enabled=False``, no threshold), saying ``reason`` why."""
        return cls(False, None, max_batched_tokens, reason)


@dataclass(frozen=True)
class TPSPOpsGroup:
    """A row-parallel ``projection`` followed by ``norm``: one fused TPSP call.

    The :mod:`vtnumba.nn` modules have exactly the attributes both fields need.
    """

    #: The ops group's name (non-empty, unique in a profile); its handle is kept under it.
    name: str
    #: The row-parallel projection, with ``.weight`` ``[H, K_local]`` (and ``.bias`` ``[H]`` or None).
    projection: Any
    #: The norm after it, with ``.weight`` ``[H]``, ``.eps`` and, for LayerNorm, ``.bias``.
    norm: Any

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TPSPOpsGroup.name={self.name!r} must be a non-empty str (handles are kept by name)")
        for what, obj in (("projection", self.projection), ("norm", self.norm)):
            if getattr(obj, "weight", None) is None:
                raise TypeError(f"TPSPOpsGroup {self.name!r}: {what}={type(obj).__name__} has no .weight")


def check_ops_groups(ops_groups) -> list[TPSPOpsGroup]:
    """A non-empty list of TPSPOpsGroup with unique names and one hidden size (vLLM's checks)."""
    if isinstance(ops_groups, TPSPOpsGroup):
        ops_groups = [ops_groups]
    try:
        groups = list(ops_groups)
    except TypeError:
        raise TypeError(f"ops_groups must be a list of TPSPOpsGroup, got {type(ops_groups).__name__}") from None
    if not groups:
        raise ValueError("ops_groups is empty; TPSP profiling needs at least one TPSPOpsGroup")
    for k, g in enumerate(groups):
        if not isinstance(g, TPSPOpsGroup):
            raise TypeError(f"ops_groups[{k}] is a {type(g).__name__}; expected TPSPOpsGroup")
    names = [g.name for g in groups]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"TPSP ops group names must be unique; duplicated: {dupes}")
    hidden = {g.name: int(np.prod(g.norm.weight.shape)) for g in groups}
    if len(set(hidden.values())) != 1:
        raise ValueError(f"TPSP ops groups must share one hidden size; norm weights have {hidden}")
    return groups


@dataclass
class TPSPContext:
    """The profile, the backend, and one handle per ops group name (vLLM: ``TPSPContext``)."""

    #: The shared on/off decision every :class:`~vtnumba.tpsp.op.TPSPOp` of this context asks.
    profile: TPSPProfile
    #: The TPSP backend the handles were opened on (e.g. :class:`~vtnumba.tpsp.cuda.CudaTPSPBackend`).
    backend: Any
    #: One open handle per ops group name (what ``backend.open`` returned).
    handles: dict[str, object] = field(default_factory=dict)
    #: What the profile measured (a :class:`~vtnumba.tpsp.profiling.ProfileReport`), or None.
    report: Any = None

    def handle(self, name: str):
        """The handle of ops group ``name``; KeyError listing the known names otherwise."""
        try:
            return self.handles[name]
        except KeyError:
            raise KeyError(f"no TPSP handle named {name!r}; this context has {sorted(self.handles)}") from None

    def is_active(self, num_tokens: int) -> bool:
        """Should a batch of ``num_tokens`` tokens run fused?  Same as :meth:`TPSPProfile.is_active`."""
        return self.profile.is_active(num_tokens)

    def close(self) -> None:
        """Close every handle (collective; the backend itself stays open for other contexts)."""
        for h in list(self.handles.values()):
            self.backend.close(h)
        self.handles.clear()


__all__ = ["TPSPConfig", "TPSPProfile", "TPSPOpsGroup", "TPSPContext", "check_ops_groups"]
