"""The TPSP lifecycle over peer buffers, shared by the host and the CUDA backends.

Everything vLLM's ``CudaTPSPBackend`` checks happens here, once, for both targets:
the backend and the handle must be open, a handle must come from this backend, and the
arguments must fit the handle (hidden size, ``max_batched_tokens``, the residual shard's
shape, the norm, the dtype); a microchunk larger than the shard or a workspace slot is
shrunk to fit.  What differs per target is small and lives in the subclasses: which
:class:`~vtnumba.backend.Backend` owns the memory and queues, which arrays are acceptable
(numpy vs device arrays), how weights reach that memory, and the default exchange mode.

**Agreement.**  ``open`` is collective: argument errors are compared across ranks
(:func:`~vtnumba.dist.agree_errors`: the same exception everywhere), and every reason to
decline -- an unsupported dtype, ``tp_size < 2``, peer memory that one rank cannot map --
goes through :func:`~vtnumba.dist.all_ranks_ready`, so either every rank gets a handle or
every rank gets ``None`` and uses the regular forward.

**A failed call poisons the handle.**  If a fused call fails on one rank (bad arguments,
a peer with different shapes, a timeout), that rank stamps an abort into its flags so the
peers waiting on it fail at once instead of timing out, and every rank marks the handle
unusable: the ranks' chunk counters may no longer agree.  That holds for an argument the
call refuses before queueing anything, too (a peer whose arguments passed is already
waiting on this rank) -- the error says so in a note.  Close it (collective) and open a new
one; :class:`~vtnumba.tpsp.TPSPOp` checks the common case first (a batch past
``max_batched_tokens`` takes the regular forward).
"""

from __future__ import annotations

import abc
import logging
import threading

import numpy as np

from vtnumba import trace
from vtnumba.backend.arrays import cdiv, is_int
from vtnumba.backend.single_caller import SingleCaller
from vtnumba.dist import agree_errors, all_ranks_ready, allgather_bytes, get_group
from vtnumba.dist.comm import DEFAULT, resolve_timeout
from vtnumba.tpsp.backend import TPSPBackend
from vtnumba.tpsp.config import TPSPConfig
from vtnumba.tpsp.pipeline import CallLimits, ChunkStrategy, run_fused
from vtnumba.tpsp.workspace import EXCHANGE_MODES, TPSPWorkspace

_LOG = logging.getLogger("vtnumba.tpsp")


class PreparedWeights:
    """A projection's (or norm's) ``weight`` and ``bias`` in the backend's memory."""

    __slots__ = ("weight", "bias", "key")

    def __init__(self, weight, bias, key):
        #: The weight as a float32 C-contiguous array of the target's kind (the module's own array
        #: where it already is one).
        self.weight = weight
        #: The bias, prepared the same way, or None when the module has none.
        self.bias = bias
        #: The cache key ``(id(backend), id(weight), id(bias))`` taken at preparation; assigning a new
        #: array to the module changes it, so the weights are prepared again.
        self.key = key


class TPSPHandle:
    """What ``open`` returns: one ops group's workspace, queues and config (vLLM: ``CudaTPSPContext``)."""

    def __init__(self, backend: "PeerTPSPBackend", name: str, group, hidden_size: int, max_batched_tokens: int,
                 max_chunk_rows: int, workspace: TPSPWorkspace, compute_queue, exchange_queue, config: TPSPConfig):
        self.backend_id = id(backend)
        self.name = name
        self.group = group
        self.tp = group.size
        self.rank = group.rank
        self.hidden_size = hidden_size
        self.max_batched_tokens = max_batched_tokens
        self.max_chunk_rows = max_chunk_rows
        self.workspace = workspace
        self.scratch = None  # private partial-sum memory (host push mode), see tpsp.host
        self.compute_queue = compute_queue
        self.exchange_queue = exchange_queue
        self.config = config
        self.closed = False
        #: None while usable; after a failed call, what failed and on which rank (every call then
        #: raises: close the handle and open a new one).
        self.broken: str | None = None
        self.calls = 0
        # One call at a time: a call writes the workspace and steps the flags' epochs.
        self.caller = SingleCaller(f"TPSP handle {name!r}", "a call writes its workspace and steps its flags")

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self.broken else "open")
        return (f"<TPSPHandle {self.name!r} group={self.group.name!r} rank {self.rank}/{self.tp} H={self.hidden_size} "
                f"max_tokens={self.max_batched_tokens} chunk={self.config.chunk_tokens_per_rank} "
                f"exchange={self.workspace.exchange} ({state})>")



class PeerTPSPBackend(TPSPBackend):
    """TPSP over :class:`~vtnumba.dist.PeerBuffers` (abstract: see HostTPSPBackend / CudaTPSPBackend)."""

    #: The default exchange mode (see :mod:`vtnumba.tpsp.workspace`).
    default_exchange = "push"

    def __init__(self, group_name: str, device, *, exchange: str | None = None,
                 timeout_s: float = DEFAULT) -> None:
        super().__init__(group_name, device)
        exchange = self.default_exchange if exchange is None else exchange
        if exchange not in EXCHANGE_MODES:
            raise ValueError(f"exchange={exchange!r} must be one of {EXCHANGE_MODES}")
        self.exchange = exchange
        self.timeout_s = resolve_timeout(timeout_s)
        self._handles: dict[int, TPSPHandle] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ target hooks
    @property
    @abc.abstractmethod
    def data_backend(self):
        """The vtnumba Backend whose memory and queues the op uses."""

    @abc.abstractmethod
    def _check_array_kind(self, arrays: dict) -> None:
        """TypeError unless every non-None array is of the kind this backend computes on."""

    @abc.abstractmethod
    def _to_target(self, host: np.ndarray):
        """A copy of a float32 host array in the target's memory."""

    @abc.abstractmethod
    def _empty(self, shape):
        """A new uninitialised float32 array of ``shape`` in the target's memory."""

    def default_config(self, handle) -> TPSPConfig:
        """The config a new handle starts with: here one chunk as large as a workspace slot (no pipelining)."""
        return TPSPConfig(handle.max_chunk_rows)

    def _make_scratch(self, elements: int):
        """Private memory the matmul writes instead of the exchange slots (None: write the slots)."""
        return None

    @abc.abstractmethod
    def chunk_strategy(self, handle: TPSPHandle) -> ChunkStrategy:
        """How this target computes a chunk's partial sums (see :mod:`vtnumba.tpsp.pipeline`)."""

    def _check_sm_count(self, sm_count_target: int) -> None:
        raise ValueError(f"sm_count_target={sm_count_target} applies to GPUs only; {type(self).__name__} has no SMs "
                         "(leave it None)")

    # ------------------------------------------------------------------ open
    def max_chunk_rows_for(self, tp_size: int, max_batched_tokens: int) -> int:
        """Rows per rank one workspace slot holds (vLLM: ``max_chunk_rows``)."""
        cap = max_batched_tokens if self.tpsp_max_microchunk_tokens is None else \
            min(max_batched_tokens, self.tpsp_max_microchunk_tokens)
        return cdiv(cap, tp_size)

    def open(self, *, dtype=np.float32, tp_size: int, hidden_size: int, max_batched_tokens: int,
             group_name: str | None = None, device=None, name: str = "default") -> TPSPHandle | None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} for group {self.group_name!r} is closed; make a new backend")
        group = get_group(self.group_name)  # unknown names raise GroupNotFoundError (a ValueError)
        err = self._open_argument_error(group, tp_size, hidden_size, max_batched_tokens, group_name, device, name)
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            err = err or ValueError(f"dtype={dtype!r} is not a dtype")
        agree_errors(err, group, context=f"{type(self).__name__}.open", default_type=ValueError,
                     timeout_s=self.timeout_s)
        # The same kind of backend everywhere: a cpu rank and a simulator rank (or a push rank and
        # a pull rank) size their peer buffers differently, and would be told only that the sizes
        # differ -- not why.
        # And the same handle: other sizes were refused only later, as peer buffers of
        # different sizes (naming no argument), and max_batched_tokens 8 vs 7 not at all -- the
        # first call of 8 tokens failed on one rank.
        mine = f"{type(self).__name__} (exchange={self.exchange!r}, data on {self.data_backend.name})"
        # (Not the dtype: one that TPSP does not compute in makes every rank decline, below.)
        args = f"hidden_size={hidden_size}, max_batched_tokens={max_batched_tokens}, name={name!r}"
        every = [b.decode().split("\n") for b in allgather_bytes(f"{mine}\n{args}".encode(), group, self.timeout_s)]
        kinds = [k for k, _ in every]
        if len(set(kinds)) > 1:
            raise ValueError(f"{type(self).__name__}.open: the ranks of group {group.name!r} opened different TPSP "
                             "backends -- " + "; ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
                             + "; start every rank with the same target and options")
        if len({a for _, a in every}) > 1:
            raise ValueError(f"{type(self).__name__}.open: the ranks of group {group.name!r} passed different "
                             "arguments -- " + "; ".join(f"rank {r}: {a}" for r, (_, a) in enumerate(every))
                             + "; every rank must open the same handle")
        reason = None
        if dtype != np.float32:
            reason = f"dtype={np.dtype(dtype).name} (TPSP computes in float32)"
        elif tp_size < 2:
            reason = f"tp_size={tp_size} (nothing to exchange with one rank)"
        if not all_ranks_ready(reason is None, group, self.timeout_s):
            if group.rank == 0:  # the decision is the same everywhere: say it once
                _LOG.warning("TPSP unavailable for %r: %s; using the regular forward", name,
                             reason or "another rank declined")
            return None
        rows = self.max_chunk_rows_for(tp_size, max_batched_tokens)
        why: list[str] = []
        with trace.span("tpsp open", "tpsp", f"tpsp:{group.name}", hidden=hidden_size, rows=rows):
            ws = TPSPWorkspace.try_create(group, hidden_size, rows, exchange=self.exchange,
                                          backend=self.data_backend, timeout_s=self.timeout_s, why=why)
        if ws is None:
            if group.rank == 0:
                _LOG.warning("TPSP unavailable for %r: peer buffers could not be mapped on every rank of group %r "
                             "(%s); using the regular forward", name, group.name, "; ".join(why) or "no reason given")
            return None
        be = self.data_backend
        # The exchange queue is of high priority: its kernels are queued after the next chunk's
        # matmul, and at equal priority a GPU would give them SMs only in the matmul's tail --
        # the exchange would follow the matmul instead of running beside it.
        handle = TPSPHandle(self, name, group, hidden_size, max_batched_tokens, rows, ws,
                            be.create_queue(f"tpsp:{name}:compute"),
                            be.create_queue(f"tpsp:{name}:exchange", priority="high"), TPSPConfig(rows))
        handle.config = self.default_config(handle)
        handle.scratch = self._make_scratch(2 * tp_size * rows * hidden_size)
        with self._lock:
            self._handles[id(handle)] = handle
        return handle

    def _open_argument_error(self, group, tp_size, hidden_size, max_batched_tokens, group_name, device, name):
        if group_name is not None and group_name != self.group_name:
            return ValueError(f"open(group_name={group_name!r}) but this backend serves group {self.group_name!r}")
        if device is not None and device != self.device:
            return ValueError(f"open(device={device}) but this backend serves device {self.device}")
        if not is_int(tp_size) or tp_size != group.size:
            return ValueError(f"tp_size={tp_size!r} but group {group.name!r} has {group.size} ranks")
        if not is_int(hidden_size) or hidden_size < 1:
            return ValueError(f"hidden_size={hidden_size!r} must be a positive int")
        if hidden_size % tp_size:
            return ValueError(f"hidden_size={hidden_size} is not divisible by tp_size={tp_size} (vLLM's "
                              "requirement; pick a hidden size that is a multiple of the group size)")
        if not is_int(max_batched_tokens) or max_batched_tokens < 1:
            return ValueError(f"max_batched_tokens={max_batched_tokens!r} must be a positive int")
        if not isinstance(name, str) or not name:
            return ValueError(f"name={name!r} must be a non-empty str (the ops group the handle serves)")
        if any(h.name == name and not h.closed for h in self._handles.values()):
            return RuntimeError(f"a TPSP handle named {name!r} is already open on this backend (open twice?); "
                                "close it first or use another name")
        return None

    # ------------------------------------------------------------------ handle checks
    def _handle(self, handle) -> TPSPHandle:
        if handle is None:
            raise ValueError("TPSP needs a handle from open(); call open() (or profile()) first")
        if not isinstance(handle, TPSPHandle) or handle.backend_id != id(self):
            raise ValueError(f"the TPSP handle {handle!r} belongs to another backend, not to this "
                             f"{type(self).__name__} of group {self.group_name!r}")
        if handle.closed:
            raise RuntimeError(f"TPSP handle {handle.name!r} is closed; open a new one")
        if handle.broken:
            raise RuntimeError(f"TPSP handle {handle.name!r} is unusable after a failed call ({handle.broken}); "
                               "close it and open a new one")
        return handle

    def _resolve_config(self, handle: TPSPHandle, config) -> TPSPConfig:
        if config is None:
            return handle.config
        if is_int(config):  # a plain microchunk keeps the handle's SM budget
            config = TPSPConfig(int(config), sm_count_target=handle.config.sm_count_target)
        if not isinstance(config, TPSPConfig):
            raise TypeError(f"config={config!r} must be a TPSPConfig or an int microchunk size")
        if config.sm_count_target is not None:
            self._check_sm_count(config.sm_count_target)
        return config

    def set_config(self, handle, config) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        h = self._handle(handle)
        h.config = self._resolve_config(h, config)

    # ------------------------------------------------------------------ weights
    def prepare_weights(self, handle, projection) -> PreparedWeights:
        """``projection.weight``/``.bias`` as float32 contiguous arrays in the target's memory.

        Cached on the module (vLLM: ``_tpsp_transposed_weight``), keyed by the identity of
        the weight and bias arrays: assigning a new array to ``.weight`` makes the next call
        prepare it again.  (A weight changed *in place* keeps its stale device copy -- assign
        it anew.)  On the host a float32 C-contiguous weight is used as is, without a copy.
        """
        self._handle(handle)
        weight = getattr(projection, "weight", None)
        if weight is None:
            raise TypeError(f"{type(projection).__name__} has no .weight to prepare")
        bias = getattr(projection, "bias", None)
        key = (id(self), id(weight), id(bias))
        cached = getattr(projection, "_tpsp_prepared", None)
        if isinstance(cached, PreparedWeights) and cached.key == key:
            return cached
        prepared = PreparedWeights(self._as_target(weight, "weight"),
                                   None if bias is None else self._as_target(bias, "bias"), key)
        try:
            projection._tpsp_prepared = prepared
        except AttributeError:  # a module that refuses new attributes just is not cached
            pass
        return prepared

    def _as_target(self, arr, what: str):
        try:
            self._check_array_kind({what: arr})
            if np.dtype(arr.dtype) == np.float32 and (getattr(arr, "flags", None) is None
                                                     or arr.flags["C_CONTIGUOUS"]):
                return arr
        except TypeError:
            pass
        host = np.ascontiguousarray(np.asarray(arr), dtype=np.float32)
        return self._to_target(host)

    # ------------------------------------------------------------------ the fused op
    def tpsp_matmul_rs_norm_ag(self, handle, x, w, bias, residual, norm_weight, eps, norm_bias=None, *, norm="rms",
                               config=None, out=None, new_residual=None):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} for group {self.group_name!r} is closed")
        h = self._handle(handle)
        with h.caller:  # (a second thread is refused before it touches anything: the call in progress goes on)
            return self._call(h, x, w, bias, residual, norm_weight, eps, norm_bias, norm, config, out, new_residual)

    def _call(self, h, x, w, bias, residual, norm_weight, eps, norm_bias, norm, config, out, new_residual):
        ws = h.workspace
        try:
            cfg = self._resolve_config(h, config)
            self._check_array_kind({"x": x, "w": w, "bias": bias, "residual": residual, "norm_weight": norm_weight,
                                    "norm_bias": norm_bias, "out": out, "new_residual": new_residual})
            limits = CallLimits(tp=h.tp, hidden_size=h.hidden_size, max_tokens=h.max_batched_tokens,
                                chunk=cfg.chunk_tokens_per_rank, max_chunk_rows=h.max_chunk_rows,
                                sm_limit=cfg.sm_count_target, empty=self._empty)
            # The call queues waits on the peers' signals, which they queue as they get to
            # them: until every rank has queued its whole call, no free may wait for the
            # streams (a GPU's cuMemFree would -- see Backend.defer_frees).
            with self.data_backend.defer_frees():
                out, new_residual = run_fused(ws, self.data_backend, h.compute_queue, h.exchange_queue,
                                              self.chunk_strategy(h), limits, x, w, bias, residual, norm_weight,
                                              eps, norm_bias, norm=norm, out=out, new_residual=new_residual)
        except BaseException as exc:
            # Peers may be waiting on this rank (in the handshake, or in queued waits): make
            # them fail now, not after a timeout, and leave no queue blocked on a flag.
            h.broken = f"{type(exc).__name__} on rank {h.rank}: {exc}"
            if not ws.closed:
                ws.flags.fail((h.compute_queue, h.exchange_queue))
            # Even an argument refused here, before anything was queued: a peer whose own
            # arguments passed is already in the handshake, and fails on this rank's abort --
            # so no rank may go on with the handle (their chunk counters could disagree).
            # Said on the error itself, where the caller first looks.
            if isinstance(exc, Exception):
                exc.add_note(f"TPSP handle {h.name!r} is now unusable on every rank (a failed fused call leaves "
                             "it so): close it and open a new one")
            raise
        h.calls += 1
        return out, new_residual

    # ------------------------------------------------------------------ close
    def close(self, handle=None) -> None:
        if handle is None:
            with self._lock:
                handles = list(self._handles.values())
            try:
                for h in handles:
                    self._close_handle(h)
            finally:
                self._closed = True
            return
        if not isinstance(handle, TPSPHandle) or handle.backend_id != id(self):
            raise ValueError(f"the TPSP handle {handle!r} belongs to another backend")
        self._close_handle(handle)

    def _close_handle(self, h: TPSPHandle) -> None:
        """Collective (in vLLM's order): finish queued work, barrier, unmap peers, barrier, free.  Idempotent."""
        if h.closed:
            return
        # Not while another thread is inside a call on it: its queues and flags would go away
        # under the call (which then failed with "QueueFlags ... are closed").  Refused at once,
        # as a second caller is; the calling thread itself may close (re-entrant).
        with h.caller:
            self._close_owned_handle(h)

    def _close_owned_handle(self, h: TPSPHandle) -> None:
        if h.closed:
            return
        h.closed = True
        with self._lock:
            self._handles.pop(id(h), None)
        be = self.data_backend
        try:
            for q in (h.compute_queue, h.exchange_queue):
                try:
                    be.destroy_queue(q)  # waits for the queue's work
                except RuntimeError as exc:  # a sticky error from a failed call: already reported
                    _LOG.debug("TPSP close: %s", exc)
        finally:
            h.scratch = None
            h.workspace.close()  # barrier, unmap, barrier, free (PeerSignals and PeerBuffers)


__all__ = ["PeerTPSPBackend", "TPSPHandle", "PreparedWeights"]
