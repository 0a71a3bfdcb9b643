"""Encoder-cache endpoints: a producer and a consumer, each owning everything its side needs.

Upstream: the two faces of vLLM's encoder-cache connector -- the encoder process's (producer)
and the prefill process's (consumer) -- each with its scheduler-side state, its worker and
its end of the control plane.  Every program built on the parts alone repeats one
skeleton: create the region, tell the consumers how to open it, wait until each has, stop
sharing it, and on any failure tell the others and release everything.  The endpoints are
that skeleton, written once; a program on top of them says only *what* it moves.

* :class:`ECProducer` creates the region and owns the producer's
  :class:`~vtnumba.ec.ECScheduler` (its :class:`~vtnumba.ec.EmbeddingCache` says which
  blocks hold what) and an :class:`~vtnumba.ec.ECWorker` that saves;
* :class:`ECConsumer` opens the producer's region and owns a worker that loads.  The lowest
  consumer rank is the consumer *leader*: it talks to the producer, keeps the consumer
  scheduler (which counts every rank's load reports), and hands each step's loads to the
  other consumer ranks -- the consumer's tensor-parallel ranks -- which :meth:`~ECConsumer.serve`.

Both run on an mpi4py communicator (a ``Dup()`` of your world: the endpoints' messages
must not meet anyone else's -- one ``Dup()`` per producer/consumer pair, because ``close()``
makes no final handshake: a failure a peer reports after this rank closed stays queued on
the communicator, and a next pair on the same one would receive it) or a
:class:`vtnumba.dist.ProcessGroup` (its control communicator).  Other ranks of the communicator may exist -- the demo's other encoder
ranks -- they take no part, but they are told when an endpoint fails.  ``comm=None`` keeps
everything in this process (a benchmark; a consumer in another process that gets the
handle some other way).

Setup, in the constructors (collective over the producer and its consumers):

1. the producer creates an *anonymous* region (``memfd_create``): memory that never has a
   name in ``/dev/shm``;
2. it sends each consumer the region's :class:`~vtnumba.ec.ECRegionHandle` (its pid, the
   descriptor number, the inode);
3. each consumer opens ``/proc/<pid>/fd/<fd>``, checks it (same inode, this user, mode
   0600, a header that matches its own model config) and answers -- or reports its failure;
4. the producer hears *every* consumer out, then stops sharing: it closes its descriptor
   (the "unlink after map"), so no other process can open the region; the mappings stay.

No name ever exists, so a process killed at any moment -- even by ``SIGKILL``, when none
of its code runs -- leaves nothing behind in ``/dev/shm``: the memory is freed with the
last mapping, by the kernel.

Failure: an endpoint used as a context manager (or whose :meth:`~ECProducer.fail` is
called) reports the failure to every other rank of the communicator, saying what it was
doing, then releases what it owns.  Every wait of every endpoint polls for such reports
(see :mod:`vtnumba.ec.channel`), so the others raise :class:`~vtnumba.ec.PeerFailure` at
once.  Every wait also has one deadline, ``timeout_s`` (default: the process's default
timeout, :func:`vtnumba.dist.comm.default_timeout`, which a program's ``--timeout`` sets),
so a rank that stops answering -- stopped, hung -- is named in a
:class:`~vtnumba.ec.ChannelTimeout` instead of leaving the others waiting.  How a program
then ends every rank is :func:`vtnumba.dist.run_collectively`'s job.

Naming the *right* rank takes one more rule: a wait's deadline covers the waits the
awaited rank may itself be in.  The producer waiting for the consumer leader's next
message also waits, through it, for the leader's wait on its other consumer ranks; if one
of those stops, the leader must time out first (and name it), not the producer (which
would name the innocent leader).  So the producer waits for the leader twice the timeout
when the leader has other ranks, and those ranks wait for the leader's next loads twice
the timeout (the leader may be waiting for the producer meanwhile).  Programs whose ranks
wait on more (the demo's encoder ranks) pass longer deadlines the same way.

``on_point(point)`` is called as an endpoint passes each named point of its setup and of
a transfer -- ``created`` (producer: region made, nobody told), ``opened`` (consumer:
mapped, producer not told), ``shared`` (producer: every consumer mapped, its descriptor
still open), ``saving`` (producer: a batched save in flight), ``loading`` (any consumer
rank: a batched load in flight), ``loaded`` (leader: every rank's report in).  The demos'
fault tests use it to kill or stop a rank at an exact moment.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping

import numpy as np

from vtnumba.backend.arrays import check_int, check_seconds, is_int
from vtnumba.backend.base import Buffer
from vtnumba.ec.errors import PeerFailure
from vtnumba.ec.metadata import ECWorkerMetadata
from vtnumba.ec.region import (
    ECRegionConfig,
    ECRegionHandle,
    ECSharedRegion,
    create_ec_shared_region,
    open_ec_shared_region,
)
from vtnumba.ec.scheduler import ECScheduler
from vtnumba.ec.worker import ECWorker
from vtnumba.faults import FaultInjection as _FaultInjection
from vtnumba.faults import failure_text

__all__ = ["ECProducer", "ECConsumer", "POINTS", "FaultInjection", "points_passed"]

TAG_USER, TAG_SETUP, TAG_LOAD = 1, 2, 3  # the program's own messages, setup, leader <-> other consumer ranks
#: The points of setup and transfer where an endpoint calls ``on_point`` (see the module docstring).
POINTS = ("created", "opened", "shared", "saving", "loading", "loaded")


def points_passed(rank: int, producer: int, consumers, steps: int | None = None) -> tuple[str, dict]:
    """What ``rank`` is in a job with this producer and these consumer ranks, and which of the
    :data:`POINTS` it passes how often at most -- for :meth:`FaultInjection.check_fires`, so
    that a demo refuses ``--inject kill:1:saving`` when rank 1 is a consumer, or
    ``raise:0:created@2`` (the setup points are passed once): faults that could never fire.
    ``steps`` bounds the per-step points (None: unknown)."""
    consumers = sorted(consumers)
    if rank == producer:
        return "the producer", {"created": 1, "shared": 1, "saving": steps}
    if consumers and rank == consumers[0]:
        return "the consumer leader", {"opened": 1, "loading": steps, "loaded": steps}
    if rank in consumers:
        return "a consumer rank (not the leader)", {"opened": 1, "loading": steps}
    return "a rank without an endpoint", {}


_BETWEEN = "the program's own work, between encoder-cache calls"  # what a failure report says then
# An endpoint's name, before the pid (up to 7 digits) and 17 random characters: the engine id
# it starts must stay within the region's 128.
_NAME_MAX = 100
_NAME = re.compile(rf"[A-Za-z0-9_.-]{{1,{_NAME_MAX}}}")


class FaultInjection(_FaultInjection):
    """The fault tests' hook for the endpoints: ``how:rank:point[@n]`` with ``point`` one of
    :data:`POINTS` (see :class:`vtnumba.faults.FaultInjection`).  The demos take it as a hidden
    ``--inject`` flag."""

    @classmethod
    def parse(cls, text: str, points=POINTS) -> "FaultInjection":
        """Read ``how:rank:point[@n]`` against the endpoints' :data:`POINTS`."""
        return super().parse(text, points)


# ----------------------------------------------------------------------------- the common part
class _Endpoint:
    """What both sides share: the communicator, the channel, the region, the worker, the teardown."""

    role = "endpoint"

    def __init__(self, comm, *, producer: int | None, consumers, timeout_s: float | None, on_point=None):
        if on_point is not None and not callable(on_point):
            raise TypeError(f"on_point must be callable (point name -> None), got {type(on_point).__name__}")
        self._on_point = on_point
        self.region: ECSharedRegion | None = None
        self.worker: ECWorker | None = None
        self.scheduler: ECScheduler | None = None
        self.activity = "setting up"
        self._closed = self._failed = False
        self._channel = None
        if comm is None:
            # Everything in this process: no messages, so no deadlines to keep either.
            self.comm, self.rank, self.size = None, 0, 1
            self.producer = 0
            self.consumers: list[int] = []
            self.timeout_s = None if timeout_s is None else check_seconds("timeout_s", timeout_s)
            return
        from vtnumba.dist.groups import ProcessGroup
        from vtnumba.ec.channel import ECChannel

        if isinstance(comm, ProcessGroup):
            comm = comm.cpu_comm  # the group's control communicator: never matched by data traffic
        self._channel = ECChannel(comm, timeout_s)
        self.comm, self.rank, self.size = comm, self._channel.rank, self._channel.size
        self.timeout_s = self._channel.timeout_s
        self.producer = self.rank if producer is None else check_int("producer", producer, min_value=0,
                                                                      max_value=self.size - 1)
        if consumers is None:
            consumers = [r for r in range(self.size) if r != self.producer]
        consumers = list(consumers)
        if not consumers or any(not is_int(r) or not 0 <= r < self.size or r == self.producer for r in consumers) \
                or len(set(consumers)) != len(consumers):
            raise ValueError(f"consumers={consumers!r} must be distinct ranks of this {self.size}-rank communicator, "
                             f"other than the producer's rank {self.producer}")
        self.consumers = sorted(int(r) for r in consumers)

    # -- who is who
    @property
    def leader(self) -> int:
        """The consumer rank that talks to the producer (the lowest consumer rank)."""
        return self.consumers[0] if self.consumers else self.rank

    @property
    def followers(self) -> list[int]:
        """The other consumer ranks: they load what the leader hands them."""
        return self.consumers[1:]

    @property
    def compute_queue(self):
        """The queue the worker's copies are ordered after (where the model's work runs)."""
        return self.worker.compute_queue

    @property
    def role_name(self) -> str:
        """What this rank is, in failure reports ("producer", "consumer leader", ...)."""
        return self.role

    # -- messages: every one with a deadline, every wait listening for failures
    def _need_comm(self, op: str) -> None:
        if self._channel is None:
            raise RuntimeError(f"{type(self).__name__}.{op}: this endpoint has no communicator (comm=None)")

    def _peer(self) -> int:
        raise NotImplementedError

    def send(self, obj, dest: int | None = None, *, what: str = "a message", tag: int = TAG_USER) -> None:
        """Send a picklable object to ``dest`` (default: the other side's leader)."""
        self._need_comm("send")
        dest = self._peer() if dest is None else dest
        self._channel.send(obj, dest, tag, what=what)

    def recv(self, source: int | None = None, *, what: str = "a message", tag: int = TAG_USER,
             timeout_s: float | None = None):
        """Receive the next object from ``source`` (default: the other side's leader), within
        ``timeout_s`` (default: the endpoint's deadline for that rank, see the module docstring)."""
        self._need_comm("recv")
        source = self._peer() if source is None else source
        before = self.activity
        self.activity = f"waiting for rank {source} ({what})"
        payload = self._channel.recv(source, tag, what=what, timeout_s=timeout_s or self._deadline(source))
        self.activity = before
        return payload

    def _deadline(self, source: int) -> float:
        """How long to wait for ``source``: the timeout, doubled if ``source`` may itself be
        waiting for other ranks (the consumer leader for its other consumer ranks)."""
        spans_more = source == self.leader and bool(self.followers) and self.rank == self.producer
        return self.timeout_s * (2 if spans_more else 1)

    def _passing(self, point: str) -> None:
        if self._on_point is not None:
            self._on_point(point)

    # -- teardown
    def _release(self) -> None:
        self._closed = True
        try:
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            if self.region is not None:
                self.region.cleanup()

    def _before_close(self) -> None:
        pass

    def _check_open(self, op: str) -> None:
        if self._closed:
            # (The scheduler outlives the region: without this, a closed producer would
            # still hand out blocks of memory it has unmapped.)
            raise RuntimeError(f"{type(self).__name__}.{op}() after close(): this endpoint has released its region")

    def close(self) -> None:
        """Release what this endpoint owns: drain the worker, unmap the region.  Safe to call twice."""
        if self._closed:
            return
        try:
            if not self._failed:
                self._before_close()
        finally:
            self._release()

    def fail(self, exc: BaseException) -> None:
        """After an error on this rank: tell every other rank of the communicator, then release.

        A :class:`PeerFailure` is not echoed (its rank told everyone already); anything else --
        a timeout included -- is, so that no rank keeps waiting for this one.
        """
        self._failed = True
        if self._channel is not None and not isinstance(exc, PeerFailure):
            self._channel.report_failure(f"{self.role_name}, while {self.activity}: {failure_text(exc)}")
        if not self._closed:
            try:
                self._release()
            except Exception:  # noqa: BLE001 - the error being reported is the one that matters;
                pass           # the region is unmapped in any case (_release's finally)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.fail(exc)
        else:
            self.close()

    def _engine_id(self, name: str) -> str:
        # Random bits, not only the pid: a name (or memfd label) nobody can predict.  The
        # name is checked here, as given: the engine id's error named an argument nobody
        # passed, with the pid and the random suffix in it.
        if not isinstance(name, str):
            raise TypeError(f"name={name!r} must be a str, got {type(name).__name__}")
        if not _NAME.fullmatch(name):
            raise ValueError(f"name={name!r} must be a str of 1-{_NAME_MAX} characters of [A-Za-z0-9_.-] (it prefixes "
                             "the region's engine id, which adds the process id and random characters)")
        return f"{name}{os.getpid()}_{secrets.token_hex(8)}"


# ----------------------------------------------------------------------------- producer
class ECProducer(_Endpoint):
    """The encoder side: creates the region, owns the block cache (scheduler) and a saving worker.

    ``region_bytes`` sizes the region (one block per row of ``hidden_size`` x ``dtype``).
    ``consumers`` are the consumer ranks (default: every other rank of ``comm``).  ``name``
    (1-100 characters of ``[A-Za-z0-9_.-]``) starts the region's engine id, which adds the
    process id and random characters.  ``pin_memory`` (True or False): page-lock the region
    for a GPU's copy engine.  See the module docstring for the setup and the failure rules.
    """

    role = "producer"  #: this side, in failure reports

    def __init__(self, comm=None, *, hidden_size: int, dtype="float32", region_bytes: int, consumers=None,
                 name: str = "ec", backend=None, compute_queue=None, timeout_s: float | None = None,
                 pin_memory: bool = True, on_point=None):
        super().__init__(comm, producer=None, consumers=consumers, timeout_s=timeout_s, on_point=on_point)
        try:
            self.activity = "creating the region"
            self.region = create_ec_shared_region(ECRegionConfig(
                engine_id=self._engine_id(name), hidden_size=hidden_size, dtype=dtype, region_bytes=region_bytes,
                create=True, anonymous=True))
            self._passing("created")
            if self._channel is not None:
                self._share_region()
            self.activity = "making the scheduler and the worker"
            self.scheduler = ECScheduler("producer", self.region.num_blocks)
            self.worker = ECWorker(self.region, backend=backend, compute_queue=compute_queue, tp_rank=0,
                                   pin_memory=pin_memory)
            self.activity = _BETWEEN
        except BaseException as exc:
            self.fail(exc)
            raise

    def _share_region(self) -> None:
        handle = self.region.handle
        for c in self.consumers:
            self.activity = f"sending the region's handle to consumer rank {c}"
            self._channel.send(("region", handle), c, TAG_SETUP, what="the region's handle")
        # Hear every consumer out -- opened, or failed -- before going on or giving up:
        # closing the descriptor while one is still opening would pull it from under it.
        pending, failures = list(self.consumers), {}
        while pending:
            c = pending[0]
            self.activity = f"waiting for consumer rank {c} to open the region"
            try:
                self._channel.recv(c, TAG_SETUP, what="its answer: region opened")
                pending.pop(0)
            except PeerFailure as exc:
                if exc.rank not in pending:  # not a consumer still opening: the whole job is failing
                    raise
                failures[exc.rank] = exc
                pending.remove(exc.rank)
        if failures:
            raise failures[min(failures)]
        self.activity = "sharing the region (every consumer has opened it)"  # (waiting for no one now)
        self._passing("shared")
        self.activity = "closing the region's descriptor"
        self.region.unlink()  # every consumer has mapped it: from now on nobody else can open it

    def _peer(self) -> int:
        return self.leader

    @property
    def handle(self) -> ECRegionHandle:
        """Until :meth:`stop_sharing`: how another process opens the region (``comm=None`` use)."""
        return self.region.handle

    def stop_sharing(self) -> None:
        """``comm=None`` use: every consumer has opened the region; close the way in."""
        self.region.unlink()

    # -- the scheduler side
    @property
    def cache(self):
        """The :class:`~vtnumba.ec.EmbeddingCache`: which blocks hold what, pins, evictions."""
        return self.scheduler.cache

    def is_ready(self, mm_hash: str) -> bool:
        """Is ``mm_hash`` saved and readable?"""
        return self.scheduler.has_cache_item(mm_hash)

    def request_save(self, mm_hash: str, num_rows: int) -> np.ndarray | None:
        """Allocate blocks for a new output (evicting if that makes room); None: cached, in flight, or no room."""
        self._check_open("request_save")
        return self.scheduler.request_save(mm_hash, num_rows)

    def grant(self, mm_hash: str) -> np.ndarray | None:
        """Pin a ready entry for a consumer and return its block ids; None if it is not ready (or gone)."""
        self._check_open("grant")
        return self.scheduler.grant_read(mm_hash)

    def release(self, mm_hash: str) -> None:
        """Unpin an entry the consumer has finished loading."""
        self._check_open("release")
        self.scheduler.release_read(mm_hash)

    # -- the worker side
    def save(self, outputs: Mapping) -> list[str]:
        """Issue this step's scheduled saves from ``outputs`` (mm_hash -> device array) as one batched
        copy; returns the hashes sent.  Their completion comes from :meth:`poll`.

        An output the region cannot hold (another dtype or row width, more or fewer rows
        than were requested, missing) is refused with the worker's error -- after the step's
        other saves went out, and with its blocks given back to the cache, so nothing is left
        half-scheduled.  (Fewer rows: the consumer loads every requested row, and the missing
        ones would be whatever an evicted entry left in their blocks.)
        """
        self._check_open("save")
        if not isinstance(outputs, Mapping):
            raise TypeError(f"outputs must be a mapping mm_hash -> device array, got {type(outputs).__name__}")
        meta = self.scheduler.build_connector_meta()
        if not meta.saves:
            return []
        self.activity = f"saving {len(meta.saves)} entries"
        sent, refused = [], None
        for h in meta.saves:
            try:
                self._check_all_rows(outputs, h, len(meta.saves[h]))
                self.worker.save_caches(outputs, h, meta)
                sent.append(h)
            except Exception as exc:  # noqa: BLE001 - any refusal (a freed Buffer raises RuntimeError)
                self.scheduler.cache.discard(h)
                refused = refused or exc
        self.worker.flush_saves()
        self._passing("saving")
        self.activity = _BETWEEN
        if refused is not None:
            raise refused
        return sent

    def _check_all_rows(self, outputs: Mapping, mm_hash: str, requested: int) -> None:
        out = outputs.get(mm_hash)
        if isinstance(out, Buffer):
            rows = int(out.nbytes) // self.region.block_size_bytes
        else:
            shape = getattr(out, "shape", None)
            rows = int(shape[0]) if shape is not None and len(shape) == 2 else None
        if rows is not None and rows < requested:  # (other shapes: the worker says what is wrong)
            raise ValueError(f"save: outputs[{mm_hash!r}] has {rows} rows, but request_save({mm_hash!r}, "
                             f"{requested}) reserved {requested}; the consumer loads all {requested}, and the "
                             "missing rows would hold an evicted entry's bytes -- save exactly the rows requested")

    def poll(self) -> list[str]:
        """The saves whose copies have finished since the last poll: now ready (never blocks)."""
        self._check_open("poll")
        return self.scheduler.update_connector_output(self.worker.build_connector_worker_meta()).ready

    def wait_saves(self) -> list[str]:
        """Wait for every save in flight; returns the hashes that became ready."""
        self._check_open("wait_saves")
        self.activity = "waiting for saves to finish"
        self.worker.wait()
        self.activity = _BETWEEN
        return self.poll()


# ----------------------------------------------------------------------------- consumer
class ECConsumer(_Endpoint):
    """The prefill side: opens the producer's region and owns a loading worker.

    On the leader (the lowest consumer rank) it also owns the consumer scheduler:
    :meth:`load` loads granted entries on *every* consumer rank and returns this rank's
    views of them.  The other consumer ranks call :meth:`serve`.  ``handle`` is for
    ``comm=None`` (a consumer given the producer's handle directly).  ``handle_timeout_s``
    (default: ``timeout_s``) bounds the wait for the producer's handle: make it longer where
    the producer itself first waits for other ranks -- so that the rank waiting directly for
    a stopped one times out first, and names it (see the module docstring).
    """

    role = "consumer"  #: this side, in failure reports

    def __init__(self, comm=None, *, hidden_size: int, dtype="float32", producer: int = 0, consumers=None,
                 handle: ECRegionHandle | None = None, backend=None, compute_queue=None,
                 timeout_s: float | None = None, pin_memory: bool = True, on_point=None,
                 handle_timeout_s: float | None = None):
        if handle_timeout_s is not None:  # (checked before the endpoint takes anything)
            handle_timeout_s = check_seconds("handle_timeout_s", handle_timeout_s)
        super().__init__(comm, producer=producer, consumers=consumers, timeout_s=timeout_s, on_point=on_point)
        self._followers_stopped = False
        answered = False  # has the producer heard from this rank ("opened")?
        try:
            if self._channel is None:
                if handle is None:
                    raise ValueError("ECConsumer(comm=None) needs the producer's handle=")
                self.consumers = [0]
            else:
                if self.rank not in self.consumers:
                    raise ValueError(f"rank {self.rank} is not one of the consumers {self.consumers}")
                self.activity = "waiting for the region's handle from the producer"
                _, handle = self._channel.recv(self.producer, TAG_SETUP, what="the region's handle",
                                               timeout_s=handle_timeout_s)
            self.activity = "opening the region"
            self.region = open_ec_shared_region(handle, hidden_size=hidden_size, dtype=dtype)
            self._passing("opened")
            if self._channel is not None:
                self.activity = "telling the producer the region is open"
                self._channel.send("opened", self.producer, TAG_SETUP, what="'region opened'")
            answered = True
            self.activity = "making the worker"
            if self.is_leader:
                # Every consumer rank loads each entry; its pin is released once all have.
                self.scheduler = ECScheduler("consumer", self.region.num_blocks,
                                             expected_load_reports=len(self.consumers))
            tp_rank = self.consumers.index(self.rank) if self._channel is not None else 0
            self.worker = ECWorker(self.region, backend=backend, compute_queue=compute_queue, tp_rank=tp_rank,
                                   pin_memory=pin_memory)
            self.activity = _BETWEEN
        except BaseException as exc:
            if self._channel is not None and not answered and isinstance(exc, PeerFailure) \
                    and exc.rank != self.producer:
                # The producer hears every consumer out before it closes the region's descriptor,
                # and a PeerFailure is not echoed (fail() below): without this word it would wait
                # out its timeout for a consumer that stopped -- because of another consumer --
                # before it could answer.
                self._channel.send_error(self.producer, f"{self.role_name}, while {self.activity}: stopped "
                                                        f"because {exc}")
            self.fail(exc)
            raise

    @property
    def is_leader(self) -> bool:
        """Is this the consumer rank that talks to the producer (and calls :meth:`load`)?"""
        return self.rank == self.leader

    @property
    def role_name(self) -> str:
        """What this rank is, in failure reports."""
        if self._channel is None or self.is_leader:
            return "consumer leader" if self.followers else "consumer"
        return f"consumer rank {self.consumers.index(self.rank)}"

    def _peer(self) -> int:
        return self.producer if self.is_leader else self.leader

    def load(self, grants: Mapping) -> dict:
        """Leader: load every granted entry (mm_hash -> block ids the producer pinned) on every
        consumer rank, as one batched copy each; returns this rank's views
        (mm_hash -> ``[rows, hidden]`` array).  When it returns, every rank has its copy:
        the producer may unpin them."""
        if not self.is_leader:
            raise RuntimeError(f"load() is for the consumer leader (rank {self.leader}); rank {self.rank} "
                               "calls serve()")
        if not isinstance(grants, Mapping):
            raise TypeError(f"grants must be a mapping mm_hash -> block ids (the producer's grant()), "
                            f"got {type(grants).__name__}")
        self._check_open("load")
        if self._followers_stopped:
            raise RuntimeError("load() after stop_followers(): the other consumer ranks have stopped serving, "
                               "and would never load these entries")
        scheduled = []
        try:
            for h, ids in grants.items():
                if self.scheduler.request_load(h, ids) is None:
                    raise ValueError(f"load: {h!r} is already being loaded")
                scheduled.append(h)
        except BaseException:
            # All of the step's grants or none: the ones scheduled before the bad one are taken
            # back (they would have been loaded by the next call, asked or not, and could never
            # be asked for again).
            for h in scheduled:
                self.scheduler.cancel_load(h)
            raise
        meta = self.scheduler.build_connector_meta()
        if not meta.loads:
            return {}
        self.activity = f"loading {len(meta.loads)} entries"
        for r in self.followers:
            self._channel.send(("load", meta), r, TAG_LOAD, what="this step's loads")
        loaded: dict = {}
        self.worker.start_load_caches(loaded, meta)
        self._passing("loading")
        self.worker.wait()
        reports = [self.worker.build_connector_worker_meta()]
        for r in self.followers:
            self.activity = f"waiting for consumer rank {r}'s load report"
            reports.append(self._channel.recv(r, TAG_LOAD, what="its load report"))
        # (Every report is in: a failure from here on is not a wait for rank r.)
        self.activity = f"checking the {len(reports)} load reports of {len(meta.loads)} entries"
        update = self.scheduler.update_connector_output(ECWorkerMetadata.aggregate_all(reports))
        if len(update.released) != len(meta.loads):
            raise RuntimeError(f"load: {len(meta.loads)} entries loaded but {len(update.released)} reported by "
                               f"all {len(self.consumers)} consumer ranks")
        self.activity = f"returning {len(update.released)} loaded entries"
        self._passing("loaded")
        self.activity = _BETWEEN
        return {h: loaded[h] for h in update.released}

    def serve(self, on_load=None, *, timeout_s: float | None = None) -> int:
        """The other consumer ranks: load what the leader hands out until it stops; returns the
        number of entries loaded.  ``on_load(mm_hash, array)`` sees each entry before it is
        reported (e.g. to verify it).  ``timeout_s`` bounds each wait for the leader's next
        loads (default: twice the timeout -- see the module docstring)."""
        if self.is_leader:
            raise RuntimeError("serve() is for the consumer ranks other than the leader; the leader calls load()")
        self._check_open("serve")
        count = 0
        while True:
            self.activity = "waiting for the consumer leader's next loads"
            # This wait spans the leader's own wait for the producer (up to timeout_s): give it
            # twice as long, so that if the *producer* stops answering, the leader is the one
            # that times out first and names it -- instead of this rank blaming the leader.
            kind, meta = self._channel.recv(self.leader, TAG_LOAD, what="the next step's loads",
                                            timeout_s=timeout_s or 2 * self.timeout_s)
            if kind == "stop":
                self.activity = _BETWEEN
                return count
            self.activity = f"loading {len(meta.loads)} entries"
            loaded: dict = {}
            self.worker.start_load_caches(loaded, meta)
            self._passing("loading")
            self.worker.wait()
            report = self.worker.build_connector_worker_meta()
            if on_load is not None:
                for h, arr in loaded.items():
                    on_load(h, arr)
            count += len(loaded)
            self._channel.send(report, self.leader, TAG_LOAD, what="this rank's load report")

    def stop_followers(self) -> None:
        """Leader: tell the other consumer ranks there is nothing more to load (their serve() returns)."""
        if self._followers_stopped or self._channel is None or not self.is_leader:
            return
        self._followers_stopped = True
        self.activity = "stopping the other consumer ranks"
        for r in self.followers:
            self._channel.send(("stop", None), r, TAG_LOAD, what="'stop'")

    def _before_close(self) -> None:
        self.stop_followers()
