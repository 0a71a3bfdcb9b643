"""Timeline tracing of queue work and MPI exchanges (Chrome trace-event JSON).

When ``VTNUMBA_TRACE=<path>`` is set (or :func:`enable` is called), every queue operation
the backends run -- kernel launches, copies, memsets, event records and waits, host
synchronisations -- and every MPI exchange in :mod:`vtnumba.dist` is recorded with start
and end timestamps and the queue ("track") it ran on.  :func:`flush` writes one JSON file
per rank that Perfetto / ``chrome://tracing`` load; :mod:`vtnumba.apps.trace_tools` merges the
ranks and draws a PNG.

When tracing is off, :data:`RECORDER` is ``None`` and the hot paths pay one global lookup
and one ``is None`` test -- nothing measurable.

Two conventions in an event's ``args`` let the timeline draw arrows between operations:

* ``event``: the backend's event id on ``record_event`` and ``wait_event`` queue operations
  (the cpu backend records them); the timeline draws an arrow from each recording to the
  wait that it released.
* ``flow_out`` / ``flow_in``: any span may name a flow key, e.g. ``span("set flag", "peer",
  "flags", flow_out="mail:1:3")`` on the writer and ``flow_in="mail:1:3"`` on the reader's
  wait; the timeline draws an arrow from the end of the first to the end of the second,
  across ranks too.

:func:`recording` records one block of a program into memory (tutorials draw their
timelines from it) without touching a ``VTNUMBA_TRACE`` recording that may be running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time


def _json_scalar(v):
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0:
        v = v.item()  # a numpy scalar (np.int64(3) was recorded as the text '3'); numpy itself not imported here
    if isinstance(v, (int, str, bool)) or v is None or (isinstance(v, float) and math.isfinite(v)):
        return v
    return str(v)


class Recorder:
    """Collects complete ("X") events for one process."""

    def __init__(self, path: str, rank: int | None = None):
        self.path = path
        self.rank = rank
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._tracks: dict[str, int] = {}
        self._deferred: list = []  # settle(final) callables of events whose times come later
        self._settling = threading.Lock()  # one settle at a time (a to_json meanwhile would miss a batch)
        self._settle_at = 4096  # pending count that makes defer() settle (doubles while none can be)
        self.pid = os.getpid()

    def track_id(self, track: str) -> int:
        """The thread id (``tid``) of a track name: 1, 2, ... in the order tracks first finish an operation."""
        with self._lock:
            if track not in self._tracks:
                self._tracks[track] = len(self._tracks) + 1
            return self._tracks[track]

    def add(self, name: str, cat: str, track: str, start_ns: int, end_ns: int, args: dict | None = None) -> None:
        """Record one complete event (``perf_counter_ns`` timestamps); ``args`` are kept as JSON scalars."""
        ev = {"name": name, "cat": cat, "ph": "X", "ts": start_ns / 1000.0,
              "dur": max(end_ns - start_ns, 0) / 1000.0, "tid": self.track_id(track), "track": track}
        if args:
            # JSON scalars only; NaN and infinities as text (json.dump would write NaN, which a
            # strict parser -- a browser's JSON.parse -- refuses); numpy's numbers as Python's.
            ev["args"] = {k: _json_scalar(v) for k, v in args.items()}
        with self._lock:
            self.events.append(ev)

    def defer(self, settle) -> None:
        """Add an event whose times are known only later -- a GPU launch, timed by CUDA events
        that fire when the GPU gets there.  ``settle(final)`` adds it (with :meth:`add`) and
        returns True once it can; with ``final`` (the trace is being written) it adds what it
        knows now.  Settled at the backend's synchronize and by :meth:`to_json`."""
        with self._lock:
            self._deferred.append(settle)
            crowded = len(self._deferred) >= self._settle_at
        if crowded:  # a program that traces many launches and never synchronizes
            self.settle()
            with self._lock:  # (still crowded -- a held queue: next time at twice as many, not every call)
                self._settle_at = max(4096, 2 * len(self._deferred))

    def settle(self, final: bool = False) -> None:
        """Add the deferred events that can be added now (all of them with ``final``).  A settle
        callable that raises is dropped, and the others go on."""
        with self._settling:
            with self._lock:
                pending, self._deferred = self._deferred, []
            left = []
            for s in pending:  # (outside self._lock: a settle callable calls add)
                try:
                    if not s(final):
                        left.append(s)
                except Exception:  # noqa: BLE001 (one event's times cannot be read: the rest still can)
                    pass
            with self._lock:
                self._deferred[:0] = left

    def to_json(self) -> dict:
        """This process's trace as a Chrome trace-event document (the rank as ``pid``)."""
        self.settle(final=True)
        rank = self.rank if self.rank is not None else world_rank()
        pid = rank if rank is not None else self.pid
        with self._lock:
            events = [dict(e, pid=pid) for e in self.events]
            tracks = dict(self._tracks)
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": f"rank {rank}" if rank is not None else f"pid {self.pid}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
                 for track, tid in tracks.items()]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"rank": rank, "clock": "time.perf_counter_ns (CLOCK_MONOTONIC)"}}

    def rank_path(self) -> str:
        """``<path>.rank<R>.json``: where :meth:`flush` writes."""
        rank = self.rank if self.rank is not None else world_rank()
        base = self.path[:-5] if self.path.endswith(".json") else self.path
        return f"{base}.rank{rank if rank is not None else 0}.json"

    def flush(self) -> str:
        """Write :meth:`to_json` to :meth:`rank_path`; returns the path."""
        out = self.rank_path()
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(self.to_json(), f)
        return out


def world_rank() -> int | None:
    """This process's rank in MPI's world: from MPI once it runs, else from the environment
    ``mpiexec`` starts each rank with (so it is known before MPI is initialized); None outside
    ``mpiexec``."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return None


RECORDER: Recorder | None = None
_flush_registered = False
now_ns = time.perf_counter_ns


def enable(path: str, rank: int | None = None) -> Recorder:
    """Start recording; events are written to ``<path>.rank<R>.json`` by :func:`flush`."""
    global RECORDER
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str) or not path or path.endswith(os.sep) or os.path.isdir(path):
        raise ValueError(f"path={path!r} must be a file prefix such as 'out/trace' (its rank files are "
                         "<path>.rank<R>.json), not empty and not a folder")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank={rank!r} must be None (MPI's world rank) or an int >= 0")
    RECORDER = Recorder(path, rank)
    global _flush_registered
    if not _flush_registered:  # (flush: "also done automatically at exit" -- for enable() too, not only the variable)
        atexit.register(flush)
        _flush_registered = True
    return RECORDER


def disable() -> None:
    """Stop recording (what was recorded is dropped unless flushed first)."""
    global RECORDER
    RECORDER = None


@contextlib.contextmanager
def recording(rank: int | None = None, path: str = "vtnumba-trace"):
    """Record the operations of a ``with`` block into a fresh :class:`Recorder` (yielded).

    Whatever recorder was active before (e.g. one started by ``VTNUMBA_TRACE``) is put back
    afterwards and receives nothing from the block; ``recorder.to_json()`` gives the block's
    trace.  Queue operations still running on worker threads when the block ends are
    recorded only if they finish before the recorder is read, so synchronize first.
    """
    global RECORDER
    previous = RECORDER
    rec = Recorder(path, rank)
    RECORDER = rec
    try:
        yield rec
    finally:
        RECORDER = previous


def record(name: str, cat: str, track: str, start_ns: int, end_ns: int, **args) -> None:
    """Record one complete event if tracing is on (a no-op otherwise)."""
    rec = RECORDER
    if rec is not None:
        rec.add(name, cat, track, start_ns, end_ns, args)


class span:
    """``with span("allgather", "mpi", "mpi:tp"):`` records the block's duration when tracing.

    One ``span`` object may be entered again while it is open (a recursive helper reusing
    it): each ``with`` keeps its own start, so every exit draws its own block's duration.
    """

    __slots__ = ("name", "cat", "track", "args", "_starts")
    #: The event's name, category (``queue``, ``host``, ``peer``, ``mpi``, ...) and track (its row).
    name: str
    #: The category (see ``name``).
    cat: str
    #: The track (row) the span is drawn on.
    track: str
    #: Extra event arguments (``flow_out`` / ``flow_in`` draw arrows, see the module docstring).
    args: dict

    def __init__(self, name: str, cat: str, track: str, **args):
        self.name, self.cat, self.track, self.args = name, cat, track, args
        self._starts: list[int] = []  # a stack: the open ``with`` blocks' start times, innermost last

    @property
    def t0(self) -> int:
        """The innermost open block's start time (``perf_counter_ns``; 0 when tracing was off)."""
        return self._starts[-1] if self._starts else 0

    def __enter__(self):
        self._starts.append(now_ns() if RECORDER is not None else 0)
        return self

    def __exit__(self, *exc):
        t0 = self._starts.pop()
        rec = RECORDER
        if rec is not None and t0:  # (t0 == 0: entered before tracing was on -- no start to draw)
            rec.add(self.name, self.cat, self.track, t0, now_ns(), self.args)
        return False


def flush() -> str | None:
    """Write this process's trace file (also done automatically at exit)."""
    return RECORDER.flush() if RECORDER is not None else None


def _enable_from_env() -> None:
    path = os.environ.get("VTNUMBA_TRACE")
    if path and RECORDER is None:
        # Say now if the trace cannot be written, not at exit (an ignored atexit traceback,
        # exit status 0 and no trace).
        try:
            enable(path)
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            # Asked by trying: as root, os.access says yes to nearly anything (/proc included).
            try:
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as exc:
                raise OSError(f"no file can be created in {folder}: {exc.strerror or exc}") from None
        except (ValueError, OSError) as exc:
            disable()
            print(f"vtnumba: VTNUMBA_TRACE={path!r} cannot be written ({exc}); this run records no trace",
                  file=sys.stderr)
            return


_enable_from_env()
