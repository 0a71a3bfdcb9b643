"""Reference collectives over peer buffers -- reduce-scatter and all-gather -- and their MPI baselines.

Upstream concept: the exchange of vLLM's TPSP is a reduce-scatter over tokens followed by an all-gather,
done by *reading peers' memory directly* instead of sending messages.  These two
functions are that exchange on its own, the way the tutorials teach it before fusing it
with the matmul and the norm.

Shapes (``tp`` = group size, ``R = ceil(T / tp)``; rank ``r`` owns token rows
``[r*R, r*R + R)``, and the rows past ``T`` are zero padding):

* ``reduce_scatter(pb, x [T, H], out [R, H], signals)`` -- ``out = (sum over ranks of x)[r*R : r*R+R]``;
* ``all_gather(pb, x_shard [R, H], out [T, H], signals)`` -- ``out[j*R : j*R+R] = x_shard of rank j``
  (``out`` may have any ``T <= tp*R`` rows; rows past it are dropped).

Protocol of one step (``e = signals.next_epoch()``, the same on every rank)::

    1. wait  consumed     >= e-1 from every peer   # they finished reading my buffer last step
    2. write my contribution into my peer buffer    # skipped if it is already there (see below)
    3. set   inbox_ready/gather_ready = e on peers  # release: data before flag
    4. wait  inbox_ready/gather_ready >= e from every peer
    5. read peers' buffers: sum my row block / copy every shard
    6. set   consumed = e on peers                  # their buffers are free again

Step 1 is lazy -- it guards the *next* write, not the current read -- so a rank never
waits at the end of a step, and the two collectives can share one buffer region and one
``consumed`` counter.  Each rank also publishes its shapes with its flag
(``signals.set_meta``); after step 4 every rank compares all of them, so a shape mismatch
raises the same ValueError on every rank instead of reading garbage.  A rank that fails
its own argument checks stamps ``signals.abort(epoch)`` before raising, so peers fail
fast instead of timing out, and the next step works again.

Zero-copy input: if ``x`` *is* the local peer buffer at ``offset`` (e.g.
``x = pb.views(dtype, (T, H), offset)[pb.group.rank]``, which a matmul can write into
directly), step 2 is skipped.  That is the point of symmetric memory: the producer writes
where the consumers read.  ``all_gather`` also has an in-place form (``out`` itself in the
peer buffer): then a rank's own rows never move and it copies only its peers' rows.
**Hazard:** a producer writing into its own peer buffer *before* the call must first wait
until every peer has finished reading the previous step from it --
``signals.wait_consumed()`` -- because step 1 above only guards the collective's own
write.

Device work (copies, the row-sum kernels of :mod:`vtnumba.kernels.reduce`) is submitted to
``queue`` (default: ``pb.queue``) and the queue is synchronized before a flag is raised, so
the flags are always host-side and correct on every target.

**Queued signals** (``signals`` a :class:`QueuedSignals` instead of a :class:`PeerSignals`):
the same six steps, but steps 1, 3, 4 and 6 are *queued* on ``queue`` as
:class:`~vtnumba.dist.QueueFlags` waits and signals -- on a GPU, stream memory operations --
so the host never synchronizes the queue between the steps: it checks the ranks agree
(one handshake), queues the whole step, and waits once at the end
(:meth:`QueueFlags.finish <vtnumba.dist.QueueFlags.finish>`), as TPSP's exchange does.
What that saves is the host round trips inside a call (two queue synchronizations and a
flag poll between them); what remains per call is the handshake, the queuing and the final
wait.  A failed queued call (an error on any rank, or a deadline) releases every queued
wait and raises -- on every rank that had not finished its part yet, and on every rank at
the next call -- and leaves the :class:`QueuedSignals` unusable: close them and open new
ones.  A producer that writes its input into its own peer buffer on the queue first queues
:meth:`QueuedSignals.wait_consumed` (the hazard above, in queue order).

The MPI baselines ``mpi_reduce_scatter`` (``Reduce_scatter_block``) and
``mpi_all_gather`` (``Allgather``) take the same shapes: they are what the benchmark
compares against, and what callers use when a group has no peer access.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from vtnumba import trace
from vtnumba.backend.arrays import (
    DEVICE,
    HOST,
    array_kind,
    cdiv,
    check_outputs_apart,
    check_seconds,
    host_view,
    is_c_contiguous,
    is_int,
    to_host,
)
from vtnumba.backend.polling import WaitTimeout
from vtnumba.dist.comm import DEFAULT, agree_on_call, check_group, wait_request
from vtnumba.dist.peer_buffers import PeerBuffers
from vtnumba.dist.queue_flags import QueueFlags, QueueFlagsError
from vtnumba.dist.signals import PeerSignals
from vtnumba.kernels.reduce import sum_rows

# The first number of a call's meta: which collective -- or, in a queued call's handshake,
# that this rank refuses the call.
_OP_REFUSED = 0  # its arguments were refused
_OP_REDUCE_SCATTER = 1
_OP_ALL_GATHER = 2
_OP_BROKEN = 3   # its QueuedSignals were left unusable by a failed call


class QueuedSignals:
    """The flags of :func:`reduce_scatter` / :func:`all_gather` raised and awaited *in queue
    order* (:class:`~vtnumba.dist.QueueFlags`) instead of by the host: see the module docstring.

    Collective constructor, like :class:`PeerSignals`; ``backend`` must be the peer buffers'
    (its queues carry the waits), default :func:`vtnumba.default_backend`.  ``timeout_s``
    bounds a call that waits for a peer (a call's own ``timeout_s`` replaces it for that call,
    its handshake included).  Its ``consumed`` flags guard only its own calls: on buffers a
    :class:`PeerSignals` channel also uses, put a barrier (or ``wait_consumed`` of the other
    channel) between the two.
    """

    #: The flags the protocol uses, as in :class:`PeerSignals`.
    NAMES = ("consumed", "inbox_ready", "gather_ready")

    def __init__(self, group, backend=None, *, timeout_s: float = DEFAULT):
        if backend is None:
            from vtnumba.backend.default import default_backend

            backend = default_backend()
        self.group = group
        self.backend = backend
        self.flags = QueueFlags(group, self.NAMES, backend, timeout_s=timeout_s)
        #: The last step queued (the same on every rank): step e waits for ``consumed >= e-1``.
        self.epoch = 0
        #: None while usable; after a failed call, what failed (every later call refuses).
        self.broken: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The flag names (what :func:`reduce_scatter` checks a signals object for)."""
        return self.NAMES

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self.flags.closed

    def check_usable(self) -> None:
        """RuntimeError if closed or poisoned by a failed call (its released waits would pass at once)."""
        if self.closed:
            raise RuntimeError(f"QueuedSignals on group {self.group.name!r} are closed")
        if self.broken:
            raise RuntimeError(f"QueuedSignals on group {self.group.name!r} are unusable after a failed call "
                               f"({self.broken}); close them and open new ones (collectively)")

    def poison(self, why: str, queue=None) -> None:
        """Mark the channel unusable (``why``) and release every queued wait of this rank (and
        drain ``queue``): after a failure its call counter may no longer match the peers'."""
        self.broken = self.broken or why
        if not self.flags.closed:
            self.flags.fail([queue] if queue is not None else [])

    def wait_consumed(self, queue) -> None:
        """Queue on ``queue``: later work waits until every peer has finished reading this rank's
        peer buffer for the last call -- queue it before *writing* into that buffer on ``queue``."""
        self.check_usable()
        self.flags.wait(queue, "consumed", self.epoch)

    def close(self) -> None:
        """Collective: release the flags (idempotent)."""
        if not self.flags.closed:
            self.flags.close()

    def __enter__(self) -> "QueuedSignals":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self.broken else f"epoch {self.epoch}")
        return f"<QueuedSignals on group {self.group.name!r} via {self.backend.name}, {state}>"


# ---------------------------------------------------------------------------- array plumbing
def _already_in_buffer(pb, x, offset: int) -> bool:
    return pb.is_local_view(x, offset)


def _check_clear_of_staging(pb, name: str, arr, offset: int, nbytes: int, staged: str, hint: str) -> None:
    """ValueError if ``arr`` shares memory with bytes ``offset .. offset + nbytes`` of this rank's
    peer buffer, where ``staged`` waits for the peers to read it.

    The call writes ``arr`` while the peers are still reading those bytes: they would read
    rows this rank had already overwritten -- wrong sums or rows on *their* side, and no error
    anywhere.  Refused with the other local checks, so every rank refuses together.
    """
    region = pb.views(np.uint8, (nbytes,), offset)[pb.group.rank]
    try:
        check_outputs_apart({name: arr}, {"staged": region})
    except ValueError:
        raise ValueError(f"{name} shares memory with bytes {offset}..{offset + nbytes} of this rank's peer buffer, "
                         f"where {staged} is staged for the peers to read during the call; expected {hint}") from None


def _check_2d(name: str, arr) -> tuple[int, int]:
    shape = getattr(arr, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be a 2-D array, got {type(arr).__name__}")
    if len(shape) != 2:
        raise ValueError(f"{name} must be a 2-D array, got shape {tuple(shape)}")
    if not is_c_contiguous(arr):
        raise ValueError(f"{name} (shape {tuple(shape)}) must be C-contiguous")
    return int(shape[0]), int(shape[1])


def _check_kernel_output(pb, name: str, arr) -> None:
    """TypeError unless ``arr`` is the kind of array ``pb``'s kernels write (the kind of its
    buffers): a numpy ``out`` beside GPU peer buffers would fail only inside the step -- after a
    queued call's handshake, which leaves its :class:`QueuedSignals` unusable -- so it is
    refused with the other argument checks, before any rank has started."""
    kinds = {HOST: "numpy array", DEVICE: "numba device array"}
    want, got = array_kind("pb's buffers", pb.local), array_kind(name, arr)
    if got != want:
        raise TypeError(f"{name} is a {kinds[got]}, but the row-sum kernel that writes it runs on backend "
                        f"{pb.backend.name}, whose arrays (pb's buffers) are {kinds[want]}s: "
                        f"pass a {kinds[want]} as {name}")


def _check_pair(pb, signals):
    if not isinstance(pb, PeerBuffers):
        raise TypeError(f"pb must be a PeerBuffers, got {type(pb).__name__}")
    if not isinstance(signals, (PeerSignals, QueuedSignals)):
        raise TypeError(f"signals must be a PeerSignals or a QueuedSignals, got {type(signals).__name__}")
    if isinstance(signals, QueuedSignals):
        if signals.closed:
            raise RuntimeError(f"QueuedSignals on group {signals.group.name!r} are closed")
        if signals.backend is not pb.backend:  # (the waits are queued on pb's queues)
            raise ValueError(f"signals (backend {signals.backend.name}) and pb (backend {pb.backend.name}) must "
                             "use the same backend")
    if signals.group is not pb.group:
        raise ValueError(f"signals (group {signals.group.name!r}) and pb (group {pb.group.name!r}) "
                         "must belong to the same ProcessGroup")
    for name in ("consumed", "inbox_ready", "gather_ready"):
        if name not in signals.names:
            raise ValueError(f"signals needs a flag named {name!r}; it has {list(signals.names)}")


def _host_sync(pb) -> bool:
    """A synchronous host backend: queue work would run inline anyway, so do it directly."""
    caps = pb.backend.capabilities
    return caps.kernel_arrays == "numpy" and not caps.async_queues


def _copy(pb, q, dst, src, nbytes: int, dst_offset: int = 0, src_offset: int = 0) -> None:
    """``backend.copy`` in queue order; on a synchronous cpu backend a direct ``np.copyto``
    of the same bytes (same semantics, minus the per-call queue bookkeeping that dominates
    at small sizes)."""
    if _host_sync(pb):
        d = dst.reshape(-1).view(np.uint8)[dst_offset:dst_offset + nbytes]
        np.copyto(d, src.reshape(-1).view(np.uint8)[src_offset:src_offset + nbytes])
    else:
        pb.backend.copy(q, dst, src, nbytes, dst_offset=dst_offset, src_offset=src_offset)


def _finish(pb, q) -> None:
    if not _host_sync(pb):
        pb.backend.synchronize(q)


# ---------------------------------------------------------------------------- the shared protocol
def _exchange(pb, signals, ready: str, meta: tuple, write_fn, read_fn, queue, timeout_s, what: str) -> None:
    """Steps 1-6 of the module docstring; ``write_fn(q)``/``read_fn(q)`` submit the work."""
    if isinstance(signals, QueuedSignals):
        return _exchange_queued(pb, signals, ready, meta, write_fn, read_fn, queue, timeout_s, what)
    g = pb.group
    e = signals.next_epoch()
    track = f"mpi:{g.name}"
    with trace.span(f"{what}:wait_consumed", "peer", track, epoch=e):
        signals.wait("consumed", e - 1, timeout_s=timeout_s)
    with trace.span(f"{what}:write", "peer", track, epoch=e):
        if not _host_sync(pb):
            # The input may come from the caller's default-stream copies or launches, which a
            # GPU queue (a non-blocking stream) is not ordered after: wait for them first.
            pb.backend.order_after_default_stream(queue)
        write_fn(queue)
        _finish(pb, queue)  # the data must be complete before the flag goes up
    signals.set_meta(meta)
    signals.set_all(ready, e)
    with trace.span(f"{what}:wait_ready", "peer", track, epoch=e):
        try:
            signals.wait(ready, e, timeout_s=timeout_s)
        except RuntimeError:
            signals.set_all("consumed", e)  # a peer gave up: this step reads nothing
            raise
    metas = [signals.meta(r) for r in range(g.size)]
    if any(m != metas[0] for m in metas):
        signals.set_all("consumed", e)  # keep the channel usable: nobody reads this step
        raise _mismatch(what, g, metas)
    try:
        with trace.span(f"{what}:read", "peer", track, epoch=e):
            read_fn(queue)
            _finish(pb, queue)
    finally:
        signals.set_all("consumed", e)  # even on failure: peers may reuse their buffers


def _mismatch(what: str, g, metas) -> ValueError:
    shown = "; ".join(f"rank {r}: {m[1:7]}" for r, m in enumerate(metas))
    return ValueError(f"{what}: ranks of group {g.name!r} called it with different arguments "
                      f"(rows, H, dtype number, offset[, T, in place]): {shown}")


def _exchange_queued(pb, sigs: QueuedSignals, ready: str, meta: tuple, write_fn, read_fn, queue, timeout_s,
                     what: str) -> None:
    """Steps 1-6 with the flags queued on ``queue`` (module docstring), then one wait for the queue."""
    g, flags = pb.group, sigs.flags
    track = f"mpi:{g.name}"
    try:
        with trace.span(f"{what}:handshake", "peer", track):
            # Host, collective: nothing is queued unless every rank agrees.
            metas = flags.handshake(meta, timeout_s)
    except BaseException as exc:
        # A peer aborted, or missed the handshake: the ranks' call counters may no longer agree.
        sigs.poison(f"{what}: the handshake failed on rank {g.rank}: {type(exc).__name__}: {exc}", queue)
        raise
    broken = [r for r, m in enumerate(metas) if m[0] == _OP_BROKEN]
    if broken:
        sigs.broken = f"rank {', '.join(map(str, broken))}'s signals were left unusable by a failed call"
        raise RuntimeError(f"{what}: the QueuedSignals of rank {', '.join(map(str, broken))} of group {g.name!r} are "
                           "unusable after a failed call; close them and open new ones (collectively)")
    refused = [r for r, m in enumerate(metas) if m[0] == _OP_REFUSED]
    if refused:
        raise RuntimeError(f"{what}: rank {', '.join(map(str, refused))} of group {g.name!r} refused its arguments "
                           "(see its error); nothing was exchanged")
    if any(m != metas[0] for m in metas):
        raise _mismatch(what, g, metas)
    e = sigs.epoch + 1
    default_timeout = flags.timeout_s
    if timeout_s is not None:
        flags.timeout_s = timeout_s  # (read by the waits as they are queued, and by finish)
    # Until the queue has passed the whole step, a free must not wait for it (a GPU's cuMemFree
    # would, and the queue may be waiting for a peer that is gone): see Backend.defer_frees.
    try:
        with pb.backend.defer_frees():
            try:
                with trace.span(f"{what}:queue", "peer", track, epoch=e):
                    flags.wait(queue, "consumed", e - 1)  # peers finished reading my buffer (the last step)
                    if not _host_sync(pb):
                        pb.backend.order_after_default_stream(queue)
                    write_fn(queue)
                    flags.signal(queue, ready, e)  # after the write, in queue order: data before flag
                    flags.wait(queue, ready, e)
                    read_fn(queue)
                    flags.signal(queue, "consumed", e)
            except WaitTimeout as exc:  # an inline (synchronous-queue) wait ran out of time
                flags.fail([queue])
                raise QueueFlagsError(f"rank {g.rank} of group {g.name!r}: {what}: {exc}; missing flags: "
                                      f"{flags.missing()}") from exc
            except BaseException:
                flags.fail([queue])
                raise
            sigs.epoch = e
            with trace.span(f"{what}:finish", "peer", track, epoch=e):
                flags.finish([queue], what=what)
    except BaseException as exc:
        sigs.broken = f"{what} failed on rank {g.rank}: {type(exc).__name__}: {exc}"
        raise
    finally:
        flags.timeout_s = default_timeout


def _validated(pb, signals, check, queue, timeout_s=None):
    """Run the local argument checks.  On failure this rank still takes part in the step's
    bookkeeping -- it uses up the epoch, marks it consumed and stamps an abort -- so peers
    that passed their checks fail fast instead of timing out, and the channel stays usable
    for the next call whether one rank or every rank failed.  (Queued signals: it takes
    part in the call's handshake instead, saying it refused.)"""
    if isinstance(signals, QueuedSignals) and not signals.closed:
        return _validated_queued(pb, signals, check, queue, timeout_s)
    _check_pair(pb, signals)
    try:
        result = check()
    except BaseException:
        e = signals.next_epoch()
        signals.set_all("consumed", e)
        signals.abort(e)
        raise
    return result, (queue if queue is not None else pb.queue)


def _validated_queued(pb, sigs: QueuedSignals, check, queue, timeout_s=None):
    """:func:`_validated` for queued signals: a rank that refuses the call -- its arguments,
    its pairing, or a channel a failed call left unusable -- still joins the call's handshake
    and says so, so every peer refuses too at once (also a peer whose part of a failed call
    had finished), and no rank's call counter runs ahead of the others'.  Its handshake waits
    the call's ``timeout_s``, unless that is what was refused (then the channel's)."""
    code = _OP_BROKEN if sigs.broken else _OP_REFUSED
    try:
        sigs.check_usable()
        _check_pair(pb, sigs)
        result = check()
    except BaseException:
        try:
            wait = check_seconds("timeout_s", timeout_s) if timeout_s is not None else None
        except (TypeError, ValueError):
            wait = None
        try:
            sigs.flags.handshake((code,), wait)
        except Exception as exc:  # noqa: BLE001 - our own error is the one to report
            sigs.poison(f"the handshake of a refused call failed on rank {sigs.group.rank}: "
                        f"{type(exc).__name__}: {exc}")
        raise
    return result, (queue if queue is not None else pb.queue)


def reduce_scatter(pb, x, out, signals, *, offset: int = 0, queue=None, timeout_s: float | None = None):
    """Sum ``x [T, H]`` over the ranks of ``pb.group`` and keep this rank's row block in ``out [R, H]``.

    ``R = ceil(T / tp)``; rows of the block past ``T`` are zero.  ``x`` is staged at byte
    ``offset`` of the local peer buffer (no copy if it already lives there); ``out`` must not
    share memory with those staged bytes, which the peers read while ``out`` is written
    (ValueError).  Collective: every rank calls it with the same shapes.  Returns ``out``.
    """
    def check():
        if timeout_s is not None:
            check_seconds("timeout_s", timeout_s)  # (NaN never compares: a wait would never end)
        T, H = _check_2d("x", x)
        if T < 1 or H < 1:
            raise ValueError(f"x has shape ({T}, {H}); expected at least one row and one column")
        R = cdiv(T, pb.group.size)
        oR, oH = _check_2d("out", out)
        _check_kernel_output(pb, "out", out)
        if (oR, oH) != (R, H):
            raise ValueError(f"out has shape ({oR}, {oH}); expected (R, H) = ({R}, {H}) with "
                             f"R = ceil(T={T} / tp={pb.group.size})")
        dt = np.dtype(x.dtype)
        if np.dtype(out.dtype) != dt:
            raise TypeError(f"out has dtype {np.dtype(out.dtype).name}; expected x's {dt.name}")
        if not is_int(offset) or offset < 0 \
                or offset % dt.itemsize:
            raise ValueError(f"offset={offset!r} must be a non-negative multiple of {dt.itemsize}")
        need = offset + T * H * dt.itemsize
        if need > pb.nbytes:
            raise ValueError(f"x [{T}, {H}] {dt.name} at offset={offset} needs {need} bytes of peer buffer; "
                             f"pb has nbytes={pb.nbytes}")
        _check_clear_of_staging(pb, "out", out, offset, T * H * dt.itemsize, "x",
                                "an out outside them (memory of its own, or the peer buffer past x)")
        # Nor x itself: this rank's rows are summed from x while out is written (refused here,
        # with the other checks -- inside the step it named an internal sources[k] and left
        # the signals unusable).
        check_outputs_apart({"out": out}, {"x": x})
        return T, H, R, dt

    (T, H, R, dt), q = _validated(pb, signals, check, queue, timeout_s)
    g = pb.group
    nbytes = T * H * dt.itemsize
    nrows = max(0, min(R, T - g.rank * R))  # 0 for a rank whose whole block is padding (T < tp)
    row0 = g.rank * R if nrows else 0

    in_buffer = _already_in_buffer(pb, x, offset)
    # Staging x: peers only ever read *their* row blocks of my buffer, so when my own block
    # can be read straight from x (same kind of array as the buffers) it is not copied.
    own_from_x = not in_buffer and nrows > 0 and type(x) is type(pb.local)
    row_bytes = H * dt.itemsize

    def write(q):
        if in_buffer:
            return
        if not own_from_x:
            _copy(pb, q, pb.local, x, nbytes, dst_offset=offset)
            return
        head, tail = row0 * row_bytes, (row0 + nrows) * row_bytes
        if head:
            _copy(pb, q, pb.local, x, head, dst_offset=offset)
        if nbytes > tail:
            _copy(pb, q, pb.local, x, nbytes - tail, dst_offset=offset + tail, src_offset=tail)

    def read(q):
        sources = pb.views(dt, (T, H), offset)
        if own_from_x:
            sources[g.rank] = x
        sum_rows(out, sources, row0, nrows, backend=pb.backend, queue=q)

    _exchange(pb, signals, "inbox_ready", (_OP_REDUCE_SCATTER, T, H, dt.num, offset), write, read, q,
              timeout_s, "reduce_scatter")
    return out


def all_gather(pb, x_shard, out, signals, *, offset: int = 0, queue=None, timeout_s: float | None = None):
    """Gather every rank's ``x_shard [R, H]`` into ``out [T, H]`` (rank ``j``'s rows at ``j*R``).

    ``T`` may be anything in ``1 .. tp*R``: rows past it (padding) are not copied.
    Collective.  Returns ``out``.  Two layouts:

    * out of place (``out`` is ordinary memory): the shard is staged at byte ``offset`` of
      the local peer buffer (no copy if it already lives there) and every rank copies all
      ``tp`` shards into ``out`` -- so ``out`` must not share memory with the staged
      shard (ValueError);
    * in place (NCCL's convention; ``out`` *is* the local peer buffer at ``offset``, e.g.
      ``pb.views(dtype, (T, H), offset)[rank]``): each rank's shard sits in its own rows of
      its own ``out`` (staged there, or already ``out[r*R : r*R+R]``), and each rank copies
      only its peers' rows -- its own never move.  Every rank must use the same layout.
    """
    def check():
        if timeout_s is not None:
            check_seconds("timeout_s", timeout_s)  # (NaN never compares: a wait would never end)
        R, H = _check_2d("x_shard", x_shard)
        if R < 1 or H < 1:
            raise ValueError(f"x_shard has shape ({R}, {H}); expected at least one row and one column")
        T, oH = _check_2d("out", out)
        tp = pb.group.size
        if oH != H or not 1 <= T <= tp * R:
            raise ValueError(f"out has shape ({T}, {oH}); expected (T, {H}) with 1 <= T <= tp*R = {tp * R}")
        dt = np.dtype(x_shard.dtype)
        if np.dtype(out.dtype) != dt:
            raise TypeError(f"out has dtype {np.dtype(out.dtype).name}; expected x_shard's {dt.name}")
        if not is_int(offset) or offset < 0:
            raise ValueError(f"offset={offset!r} must be a non-negative int")
        in_place = _already_in_buffer(pb, out, offset)
        need = offset + (T if in_place else R) * H * dt.itemsize
        if need > pb.nbytes:
            raise ValueError(f"x_shard [{R}, {H}] {dt.name} at offset={offset} needs {need} bytes of peer "
                             f"buffer; pb has nbytes={pb.nbytes}")
        if not in_place:
            _check_clear_of_staging(pb, "out", out, offset, R * H * dt.itemsize, "x_shard",
                                    "an out outside them, or for the in-place layout an out that starts exactly "
                                    f"at offset={offset} (pb.views(dtype, (T, H), offset)[rank])")
        return R, H, T, dt, in_place

    (R, H, T, dt, in_place), q = _validated(pb, signals, check, queue, timeout_s)
    g = pb.group
    row_bytes = H * dt.itemsize
    mine = max(0, min(R, T - g.rank * R))  # my rows that land in out (the rest is padding)

    def slot(j: int) -> int:
        """Byte offset of rank j's shard inside rank j's peer buffer."""
        return offset + j * R * row_bytes if in_place else offset

    def write(q):
        if _already_in_buffer(pb, x_shard, slot(g.rank)):
            return
        nbytes = (mine if in_place else R) * row_bytes
        if nbytes:
            _copy(pb, q, pb.local, x_shard, nbytes, dst_offset=slot(g.rank))

    def read(q):
        for j in range(g.size):
            rows = max(0, min(R, T - j * R))
            if rows and not (in_place and j == g.rank):
                _copy(pb, q, out, pb.peer(j), rows * row_bytes, dst_offset=j * R * row_bytes,
                                src_offset=slot(j))

    _exchange(pb, signals, "gather_ready", (_OP_ALL_GATHER, R, H, dt.num, offset, T, int(in_place)), write, read,
              q, timeout_s, "all_gather")
    return out


# ---------------------------------------------------------------------------- MPI baselines
_MPI_DTYPES = (np.float32, np.float64, np.int32, np.int64)


def _to_host(arr) -> np.ndarray:
    return to_host(arr)  # a real device array is copied: the pip mpich is not CUDA-aware


def _back_to(dst, host: np.ndarray) -> None:
    if host_view(dst) is not None:
        if host_view(dst) is not host:
            np.copyto(host_view(dst), host)
        return
    dst.copy_to_device(host)


def _run_mpi(group, what: str, blocking, nonblocking, timeout_s) -> None:
    with trace.span(what, "mpi", f"mpi:{group.name}"):
        if timeout_s is None:
            blocking()
        else:
            wait_request(nonblocking(), group, what, timeout_s)


def mpi_reduce_scatter(x, out, group, *, timeout_s: float | None = DEFAULT, agree: bool = True):
    """Same contract as :func:`reduce_scatter`, with ``MPI_Reduce_scatter_block`` on ``group.comm``.

    ``timeout_s=None`` makes the plain blocking call; a number uses the non-blocking call and
    raises RuntimeError after it.  MPI cannot tell that ranks passed different shapes -- each
    gets *some* rows back -- so the ranks first agree on ``T``, ``H`` and the dtype, and on
    whether every rank's arguments passed (:func:`~vtnumba.dist.comm.agree_on_call`: one small
    allgather).  ``agree=False`` skips that: the stock baseline a benchmark times, or a caller
    that agreed already.
    """
    check_group(group)

    def check():
        T, H = _check_2d("x", x)
        R = cdiv(T, group.size)
        if _check_2d("out", out) != (R, H):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected (R, H) = ({R}, {H})")
        dt = np.dtype(x.dtype)
        if dt not in [np.dtype(d) for d in _MPI_DTYPES] or np.dtype(out.dtype) != dt:
            raise TypeError(f"mpi_reduce_scatter supports float32/float64/int32/int64 with out of x's dtype; "
                            f"got x {dt.name}, out {np.dtype(out.dtype).name}")
        return (T, H, R, dt), (T, H, dt.name)

    T, H, R, dt = agree_on_call(group, "mpi_reduce_scatter", check, ("T", "H", "dtype"), timeout_s, agree)
    tp = group.size
    xh = _to_host(x)
    if T == tp * R:
        send = xh
    else:  # Reduce_scatter_block needs equal blocks: pad with zero rows
        send = np.zeros((tp * R, H), dtype=dt)
        send[:T] = xh
    recv = host_view(out)
    if recv is None or np.shares_memory(recv, send):  # (MPI forbids a receive buffer inside the send buffer)
        recv = np.empty((R, H), dtype=dt)
    _run_mpi(group, "mpi_reduce_scatter",
             lambda: group.comm.Reduce_scatter_block(send, recv, op=MPI.SUM),
             lambda: group.comm.Ireduce_scatter_block(send, recv, op=MPI.SUM), timeout_s)
    _back_to(out, recv)
    return out


def mpi_all_gather(x_shard, out, group, *, timeout_s: float | None = DEFAULT, agree: bool = True):
    """Same contract as :func:`all_gather`, with ``MPI_Allgather`` on ``group.comm``; the ranks
    first agree on ``R``, ``H``, ``T`` and the dtype, unless ``agree=False`` (see
    :func:`mpi_reduce_scatter`)."""
    check_group(group)

    def check():
        R, H = _check_2d("x_shard", x_shard)
        T, oH = _check_2d("out", out)
        tp = group.size
        if oH != H or not 1 <= T <= tp * R:
            raise ValueError(f"out has shape ({T}, {oH}); expected (T, {H}) with 1 <= T <= tp*R = {tp * R}")
        dt = np.dtype(x_shard.dtype)
        if dt not in [np.dtype(d) for d in _MPI_DTYPES] or np.dtype(out.dtype) != dt:
            raise TypeError(f"mpi_all_gather supports float32/float64/int32/int64 with out of x_shard's dtype; "
                            f"got x_shard {dt.name}, out {np.dtype(out.dtype).name}")
        return (R, H, T, dt), (R, H, T, dt.name)

    R, H, T, dt = agree_on_call(group, "mpi_all_gather", check, ("R", "H", "T", "dtype"), timeout_s, agree)
    tp = group.size
    xh = _to_host(x_shard)
    out_h = host_view(out)
    recv = out_h if (out_h is not None and T == tp * R) else np.empty((tp * R, H), dtype=dt)
    if np.shares_memory(xh, recv):
        xh = xh.copy()  # the shard lives inside out (in place): MPI forbids aliased buffers
    _run_mpi(group, "mpi_all_gather",
             lambda: group.comm.Allgather(xh, recv),
             lambda: group.comm.Iallgather(xh, recv), timeout_s)
    if recv is not out_h:
        _back_to(out, np.ascontiguousarray(recv[:T]))
    return out


__all__ = ["reduce_scatter", "all_gather", "mpi_reduce_scatter", "mpi_all_gather", "QueuedSignals"]
