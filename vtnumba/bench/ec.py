"""``vtnumba bench ec``: encoder-cache save and load throughput against memcpy, in one run.

What is measured, per entry size (4 KiB .. 64 MiB by default):

* **save** -- :meth:`ECWorker.save_caches` + :meth:`~ECWorker.flush_saves` of one entry from a
  device buffer into the shared region, until :meth:`~ECWorker.build_connector_worker_meta`
  reports it complete (the time a producer pays before the entry can be marked ready);
* **load** -- :meth:`~ECWorker.start_load_caches` of that entry into a device buffer, until
  its completion is reported;
* **memcpy** -- ``np.copyto`` of the same number of bytes (the stock baseline), and the
  machine's large-copy memcpy bandwidth (:func:`vtnumba.bench.timing.memcpy_bandwidth_gbs`).
  On a GPU the saves are D2H and the loads H2D copies: the baseline is then the driver's copy
  between the same buffers, and the bandwidth beside it the host link's -- a large pinned
  D2H and H2D copy (:func:`link_bandwidths`), not the host's memcpy.

The parts are set up as a program sets them up: an :class:`~vtnumba.ec.ECProducer` owns the
region and the saving worker, an :class:`~vtnumba.ec.ECConsumer` opens the same region through
the producer's handle -- a mapping of its own, as in a prefill process -- and owns the
loading worker (both in this process: ``comm=None``).  What is timed is the workers'
copies, fed one entry at a time.

* **several entries per step** (``--entries-per-step``, 4 by default, entries of up to 4 MiB):
  a step that saves -- and later loads -- that many entries at once, as an engine step does
  when its batch holds several images.  The step still issues *one* batched copy per
  direction, so what a step costs in Python is paid once for all of them; the baseline is
  one ``np.copyto`` of the step's bytes between the same buffers.

* **thread hand-off** (cpu target): one message to another thread and back, the cost the
  pipelined rows' threaded queues pay at every crossing (:func:`~vtnumba.bench.timing.thread_round_trip`).

Entries rotate through four slots of a region sized for them, so every save writes blocks
another entry just left (as under eviction).  The ``fragmented`` case lays an entry out in
runs of 8 blocks with gaps between, to show what the descriptor count costs.  The
"descriptors" rows report how many copy descriptors each entry needed; the benchmark
checks that this equals the number of block runs (:func:`vtnumba.ec.coalesce_runs`).
"""

from __future__ import annotations

import time

import numpy as np

from vtnumba.bench import schema
from vtnumba.bench.timing import (Stats, call_after_copy, measure_interleaved, memcpy_bandwidth_gbs, stats_from_times,
                                  thread_round_trip)

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES = (4 * KiB, 1 * MiB, 16 * MiB)
HIDDEN, DTYPE = 1024, np.float16  # one block = one row = 2 KiB
SLOTS = 4
ENTRIES_PER_STEP = 4
BATCHED_MAX = 4 * MiB  # entry sizes that also get the several-entries-per-step rows
AIM = 0.8  # the fraction of memcpy a step should reach (issue 17): the 'step size for' rows solve for it


def _entry_bytes(text: str) -> int:
    """``--sizes``' argparse type: a whole number of the region's blocks, in bytes."""
    import argparse

    block = HIDDEN * np.dtype(DTYPE).itemsize
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if value <= 0 or value % block:
        raise argparse.ArgumentTypeError(f"{value} is not a positive multiple of the {block}-byte block "
                                         f"(one row of {HIDDEN} x {np.dtype(DTYPE).name})")
    return value


def _entries_per_step(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of entries from 1 to 64")
    return value


def add_arguments(parser) -> None:
    """``--sizes``: the entry sizes to measure; ``--entries-per-step``: the batched steps' entries."""
    parser.add_argument("--sizes", nargs="+", type=_entry_bytes, default=None,
                        help="entry sizes in bytes (multiples of 2048; default 4 KiB .. 64 MiB; "
                             "quick 4 KiB, 1 MiB, 16 MiB)")
    parser.add_argument("--entries-per-step", type=_entries_per_step, default=ENTRIES_PER_STEP,
                        help=f"entries a batched step saves and loads together, for entries up to "
                             f"{BATCHED_MAX // MiB} MiB (default {ENTRIES_PER_STEP}; 1: no batched rows)")


def _label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


class _Case:
    """One entry size: a producer and a consumer on one region with rotating slots, the
    source entries on the device.  ``entries``: how many entries a step saves and loads
    (each ``nbytes``; a slot holds one step's entries side by side)."""

    def __init__(self, backend, nbytes: int, fragmented: bool, tag: str, entries: int = 1):
        from vtnumba.ec import ECConnectorMetadata, ECConsumer, ECProducer

        self.backend = backend
        self.device_copy = not backend.capabilities.host_addressable  # a real GPU's memory
        self.dst_buf = None   # the GPU baseline's device buffer for loads
        self.loaded: dict = {}  # (set before anything can fail: close() reads both)
        block = HIDDEN * np.dtype(DTYPE).itemsize
        self.entry_rows = max(nbytes // block, 1)
        self.rows = rows = self.entry_rows * entries  # a step's rows
        self.nbytes = rows * block                    # a step's bytes
        if fragmented:
            # Runs of 8 blocks with an 8-block gap after each: the region needs twice the rows.
            run = 8
            ids = np.array([s + k for s in range(0, 2 * rows, 2 * run) for k in range(run)][:rows], np.int64)
            self.slot_ids = [ids]
            num_blocks = 2 * rows + run
        else:
            self.slot_ids = [np.arange(s * rows, (s + 1) * rows, dtype=np.int64) for s in range(SLOTS)]
            num_blocks = SLOTS * rows
        self.producer = ECProducer(hidden_size=HIDDEN, dtype=DTYPE, region_bytes=num_blocks * block,
                                   name=f"bench_{tag}_", backend=backend)
        try:
            self.consumer = ECConsumer(hidden_size=HIDDEN, dtype=DTYPE, handle=self.producer.handle, backend=backend)
            self.producer.stop_sharing()  # the one consumer has mapped it
        except BaseException:
            self.producer.close()
            raise
        try:
            # On a GPU the fair baseline is the driver's own copy between the same device
            # buffer and the same (pinned) region slot: a plain cudaMemcpy D2H / H2D,
            # synchronized.  On the host it is np.copyto between the same buffers.
            if self.device_copy:
                self.dst_buf = backend.alloc(self.nbytes)
            self.src_buf = backend.alloc(self.nbytes)
            self.src = self.src_buf.view(DTYPE, (rows, HIDDEN))
            self.host = np.random.default_rng(nbytes).standard_normal((rows, HIDDEN)).astype(DTYPE)
            backend.copy(self.producer.compute_queue, self.src_buf, self.host, self.host.nbytes)
            backend.synchronize(self.producer.compute_queue)
        except BaseException:
            self.close()
            raise
        # The step's entries: consecutive rows of one device buffer, as a batch's encoder
        # outputs are; each has its own blocks, consecutive in the slot.
        er = self.entry_rows
        self.names = [f"e{j}" for j in range(entries)]
        self.enc = {h: self.src[j * er:(j + 1) * er] for j, h in enumerate(self.names)}
        # Block ids as int64 arrays, as ECScheduler sends them.
        self.save_metas = [ECConnectorMetadata(saves={h: ids[j * er:(j + 1) * er] for j, h in enumerate(self.names)})
                           for ids in self.slot_ids]
        self.load_metas = [ECConnectorMetadata(loads={h: (i * entries + j, ids[j * er:(j + 1) * er])
                                                      for j, h in enumerate(self.names)})
                           for i, ids in enumerate(self.slot_ids)]
        self._turn = {"save": 0, "load": 0, "memcpy_save": 2, "memcpy_load": 2}  # each rotates on its own; the
        # baselines run two slots apart, so neither finds the bytes the other just touched in cache
        # The baselines' byte views, cut once: a memcpy pays for the copy alone (cutting them on
        # every call cost 3-17 us of Python, which flattered the EC path's ratio).
        flat = _host_bytes(self.src).view(np.int8).reshape(-1) if not self.device_copy else None
        self._slots = {side: [w.region.blocks[ids[0]:ids[0] + self.rows].reshape(-1) for ids in self.slot_ids]
                       for side, w in (("producer", self.producer), ("consumer", self.consumer))}
        self._src_bytes = flat

    def _next(self, what: str, items: list):
        k = self._turn[what]
        self._turn[what] = k + 1
        return items[k % len(items)]

    # -- one step, waited for: latency
    @staticmethod
    def _complete(w) -> None:
        while w.build_connector_worker_meta() is None:  # poll like an engine loop
            w.wait()

    def save(self) -> None:
        w = self.producer.worker
        meta = self._next("save", self.save_metas)
        for h in self.names:
            w.save_caches(self.enc, h, meta)
        w.flush_saves()
        self._complete(w)

    def load(self) -> None:
        self.loaded.clear()  # drop the previous views: their buffer goes back to the allocator
        w = self.consumer.worker
        meta = self._next("load", self.load_metas)
        w.start_load_caches(self.loaded, meta)
        self._complete(w)

    # -- the same bytes moved by np.copyto between the same buffers: the fair baseline
    def memcpy_save(self) -> None:
        slot = self._next("memcpy_save", self._slots["producer"])
        if self.device_copy:
            _driver_copy(self.producer.compute_queue, slot.ctypes.data, self.src_buf.ptr, self.nbytes)  # D2H
        else:
            np.copyto(slot, self._src_bytes)

    def memcpy_load(self, out) -> None:
        slot = self._next("memcpy_load", self._slots["consumer"])
        if self.device_copy:
            _driver_copy(self.consumer.compute_queue, self.dst_buf.ptr, slot.ctypes.data, self.nbytes)  # H2D
        else:
            np.copyto(out, slot)

    # -- many steps back to back, at most SLOTS-1 copies in flight: throughput
    def pipelined(self, direction: str, steps: int) -> float:
        w = self.producer.worker if direction == "save" else self.consumer.worker
        live: list = []
        t0 = time.perf_counter()
        for k in range(steps):
            if direction == "save":
                for h in self.names:
                    w.save_caches(self.enc, h, self.save_metas[k % len(self.save_metas)])
                w.flush_saves()
            else:
                out: dict = {}
                w.start_load_caches(out, self.load_metas[k % len(self.load_metas)])
                live.append(out)
            w.wait(SLOTS - 2)
            if w.build_connector_worker_meta() is not None and len(live) > SLOTS:
                del live[:-SLOTS]  # the consumer is done with old entries
        w.wait()
        w.build_connector_worker_meta()
        return time.perf_counter() - t0

    def check_loaded(self) -> None:
        er = self.entry_rows
        for j, h in enumerate(self.names):
            got = _host_bytes(self.loaded[h])
            if not np.array_equal(got.view(np.uint8), self.host[j * er:(j + 1) * er].view(np.uint8)):
                raise RuntimeError(f"bench ec: loaded bytes of {h} differ from the saved entry "
                                   f"({_label(self.nbytes // len(self.names))})")

    def descriptors_per_save(self) -> float:
        """Copy descriptors per saved entry."""
        st = self.producer.worker.stats["save"]
        return st["descriptors"] / max(st["entries"], 1)

    def close(self) -> None:
        self.loaded.clear()
        if self.dst_buf is not None:
            self.backend.free(self.dst_buf)
            self.dst_buf = None
        try:
            self.consumer.close()
        finally:
            self.producer.close()


def _bench_size(backend, nbytes: int, repeat: int, fragmented: bool, tag: str, pipelined_backend=None,
                entries: int = 1) -> dict:
    """Measure one entry size (``entries`` of it per step); returns Stats per implementation
    plus descriptor counts.

    The implementations are timed *interleaved* (:func:`~vtnumba.bench.timing.measure_interleaved`:
    ec save, memcpy save, ec load, memcpy load, in an order that rotates from round to round),
    so a busy machine slows all of them alike, and none always runs right after the one whose
    bytes are still in the CPU's caches (a memcpy save right after an ec save found its source
    there: 14 us faster at 1 MiB).
    """
    from vtnumba.ec import coalesce_runs

    out = {}
    case = _Case(backend, nbytes, fragmented, tag, entries)
    try:
        dst = np.empty(case.nbytes, np.int8)
        fns = {"ec save": case.save, "ec load": case.load}
        if not fragmented:  # memcpy_save writes each slot as one contiguous range
            fns = {"ec save": case.save, "memcpy save": case.memcpy_save, "ec load": case.load,
                   "memcpy load": lambda: case.memcpy_load(dst)}
        # (warm-up: queues, events, the allocator, the caches)
        out.update(measure_interleaved(fns, rounds=repeat, warmup=2))
        case.check_loaded()
        out["descriptors"] = case.descriptors_per_save()
        out["runs"] = len(coalesce_runs(case.slot_ids[0][:case.entry_rows])[0])  # an entry's block runs
        # Whether each side's mapping of the region is page-locked: on a GPU the copies (and the
        # driver baseline beside them) are only what they claim to be if both are.
        out["pinned"] = {"producer": case.producer.region.pin_status, "consumer": case.consumer.region.pin_status}
    finally:
        case.close()
    if pipelined_backend is not None:
        case = _Case(pipelined_backend, nbytes, False, tag + "p")
        try:
            steps = 8
            dst = np.empty(case.nbytes, np.int8)
            memcpy = {"save": case.memcpy_save, "load": lambda: case.memcpy_load(dst)}
            for d in ("save", "load"):
                case.pipelined(d, steps)  # warm up: queues, events, the allocator's segments
                pipe, ref = [], []
                for _ in range(max(repeat // 3, 3)):  # interleaved with its own memcpy reference
                    pipe.append(case.pipelined(d, steps) / steps)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        memcpy[d]()
                    ref.append((time.perf_counter() - t0) / steps)
                out[f"ec {d} pipelined"] = stats_from_times(pipe)
                out[f"memcpy {d} beside pipelined"] = stats_from_times(ref)
        finally:
            case.close()
    return out


def pin_notes(pin_statuses: dict) -> list[str]:
    """One note per side (``{"producer": {pin_status, ...}, "consumer": ...}``, the region's
    :attr:`~vtnumba.ec.ECSharedRegion.pin_status` over the run's cases): pinned, or NOT PINNED
    and why -- a GPU figure measured on pageable memory is not the one the aim is about."""
    notes = []
    for side, statuses in pin_statuses.items():
        unpinned = sorted(st for st in statuses if not st.startswith("registered"))
        notes.append(f"region memory, {side} mapping: " + (
            f"NOT PINNED ({'; '.join(unpinned)}): its copies and their baseline are pageable, not the pinned ceiling"
            if unpinned else "pinned (cuMemHostRegister)"))
    return notes


def _batched_rows(backend, n: int, per_step: int, repeat: int, results: list, ratios: dict) -> None:
    """The rows of steps carrying ``per_step`` entries of ``n`` bytes each: throughput, the
    fixed cost per entry, and the ratios against one memcpy of the step's bytes."""
    r = _bench_size(backend, n, repeat, False, f"b{n}", entries=per_step)
    if r["descriptors"] != r["runs"]:
        raise RuntimeError(f"bench ec: {r['descriptors']} descriptors per entry but {r['runs']} block runs "
                           f"({per_step} x {_label(n)} per step)")
    step = per_step * n
    case = f"ec transfer, {per_step} entries/step"
    for impl, st in r.items():
        if isinstance(st, Stats):
            results.append(schema.row(case, impl, n, "bytes", "GB/s", step / st.median_s / 1e9, st))
    for d in ("save", "load"):
        # The step's cost above its copy, shared by its entries.
        fixed_us = (r[f"ec {d}"].median_s - r[f"memcpy {d}"].median_s) * 1e6 / per_step
        results.append(schema.row("ec fixed cost per entry, batched", f"ec {d}", n, "bytes", "us", fixed_us,
                                  stats_from_times([0.0])))
        ratios[f"{d} {per_step} x {_label(n)} per step / memcpy same buffers"] = \
            r[f"memcpy {d}"].median_s / r[f"ec {d}"].median_s


def break_even_bytes(fixed_us: float, memcpy_s: float, nbytes: int, aim: float) -> float:
    """The smallest step (bytes) whose copy hides ``fixed_us`` well enough to reach ``aim`` x memcpy.

    A step of ``b`` bytes takes ``fixed + b / bw`` against the copy's ``b / bw``, so the ratio
    is ``(b / bw) / (fixed + b / bw)``; it reaches ``aim`` once ``b >= fixed * bw * aim / (1 - aim)``
    (for 0.8: four times the bytes the copy moves in the fixed cost).  ``bw`` is the memcpy's
    bandwidth at ``nbytes`` between the same buffers.  0 when the fixed cost is not positive.
    """
    if not 0 < aim < 1:
        raise ValueError(f"aim={aim!r}; expected a fraction of memcpy between 0 and 1")
    if fixed_us <= 0:
        return 0.0
    return fixed_us * 1e-6 * (nbytes / memcpy_s) * aim / (1 - aim)


def link_bandwidths(backend, nbytes: int = 256 * MiB) -> dict[str, float]:
    """The host link's rates on a CUDA backend, GB/s of bytes copied: a large pinned D2H copy (the
    ceiling of a save) and H2D copy (of a load), keyed ``"save"`` / ``"load"``.  In the
    simulator the copies are tiny host copies, which only show that the path works."""
    from vtnumba.bench.timing import device_copy_rate

    return {d: device_copy_rate(backend, nbytes=nbytes, direction=way, repeat=5, inner=3).copied_gbs
            for d, way in (("save", "d2h"), ("load", "h2d"))}


def _driver_copy(q, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    """The GPU baseline: one ``cuMemcpyAsync`` between the same pointers on ``q``'s stream, then
    ``cuStreamSynchronize`` -- the driver's copy and nothing else (``backend.copy`` would add its
    Python checks and views, tens of microseconds that would flatter the EC ratio at 1 MiB).
    The direction (D2H into, or H2D out of, the pinned region) follows from the addresses."""
    from cuda.bindings import driver as cu

    from vtnumba.bench.timing import stream_handle

    h = stream_handle(q)
    (err,) = cu.cuMemcpyAsync(cu.CUdeviceptr(dst_ptr), cu.CUdeviceptr(src_ptr), nbytes, h)
    if err == cu.CUresult.CUDA_SUCCESS:
        (err,) = cu.cuStreamSynchronize(h)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"bench ec: the baseline cuMemcpyAsync of {nbytes} bytes failed: {err}")


def _host_bytes(arr) -> np.ndarray:
    from vtnumba.backend.arrays import to_host

    return to_host(arr)



def check_arguments(args, world_size: int) -> None:
    """``--sizes`` must fit in memory (:func:`vtnumba.bench.runner.check_sizes_fit`)."""
    from vtnumba.bench.runner import check_sizes_fit

    check_sizes_fit(getattr(args, "sizes", None))

def run(args) -> dict:
    """Measure every size (``args.quick``: fewer, shorter) and return the suite's results."""
    from vtnumba.backend.cpu import CPUBackend
    from vtnumba.backend.default import default_backend
    from vtnumba.target import current_target

    quick = bool(args.quick)
    sizes = args.sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)
    block = HIDDEN * np.dtype(DTYPE).itemsize
    for s in sizes:
        if s <= 0 or s % block:
            raise ValueError(f"--sizes: {s} is not a positive multiple of the {block}-byte block")
    per_step = getattr(args, "entries_per_step", ENTRIES_PER_STEP)
    if type(per_step) is not int or not 1 <= per_step <= 64:
        raise ValueError(f"--entries-per-step: {per_step!r} is not a whole number of entries from 1 to 64")
    backend = default_backend()
    target = current_target().name
    # Pipelining needs queues that run beside the Python thread: threaded cpu queues.
    threaded = CPUBackend(threaded=True) if target == "cpu" else None
    results, ratios, notes = [], {}, []
    if backend.capabilities.host_addressable:  # cpu, the simulator: every copy is a host memcpy
        big_memcpy = memcpy_bandwidth_gbs(16 * MiB if quick else 64 * MiB)
        ceiling = {"save": big_memcpy, "load": big_memcpy}
        ceiling_name = {"save": "memcpy bandwidth", "load": "memcpy bandwidth"}
        baselines = {"memcpy GB/s": big_memcpy}
    else:  # a GPU: saves and loads cross the host link
        ceiling_name = {"save": "pinned D2H bandwidth", "load": "pinned H2D bandwidth"}
        try:
            ceiling = link_bandwidths(backend, 64 * MiB if quick else 256 * MiB)
            baselines = {"pinned D2H GB/s": ceiling["save"], "pinned H2D GB/s": ceiling["load"]}
        except Exception as exc:  # (a side figure: its failure must not cost the rows the aims read)
            ceiling, baselines = {}, {}
            notes.append(f"pinned D2H/H2D bandwidth not measured: {type(exc).__name__}: {exc}")
    pin_statuses: dict[str, set] = {"producer": set(), "consumer": set()}
    try:
        for n in sizes:
            # (Entries up to a few MiB take well under a millisecond a step: even --quick can
            # afford the samples that keep their medians, and so the aims' ratios, steady.)
            repeat = (15 if n <= 4 * MiB else 5) if quick else (10 if n >= 16 * MiB else 30)
            pipe = threaded if (threaded is not None and n <= 16 * MiB) else None
            r = _bench_size(backend, n, repeat, False, f"c{n}", pipe)
            for side, status in r["pinned"].items():
                pin_statuses[side].add(status)
            if r["descriptors"] != r["runs"]:
                raise RuntimeError(f"bench ec: {r['descriptors']} descriptors per entry but {r['runs']} block runs "
                                   f"({_label(n)})")
            gbs = {k: n / st.median_s / 1e9 for k, st in r.items() if isinstance(st, Stats)}
            for impl, st in r.items():
                if isinstance(st, Stats):
                    results.append(schema.row("ec transfer", impl, n, "bytes", "GB/s", gbs[impl], st))
            results.append(schema.row("ec descriptors/entry", "ec save", n, "bytes", "descriptors",
                                      r["descriptors"], stats_from_times([0.0])))
            for d in ("save", "load"):
                # What a step costs above the copy itself: the fixed cost the small entries pay.
                fixed_us = (r[f"ec {d}"].median_s - r[f"memcpy {d}"].median_s) * 1e6
                results.append(schema.row("ec fixed cost per step", f"ec {d}", n, "bytes", "us", fixed_us,
                                          stats_from_times([0.0])))
                results.append(schema.row(f"ec step size for {AIM:g} x memcpy", f"ec {d}", n, "bytes", "MiB",
                                          break_even_bytes(fixed_us, r[f"memcpy {d}"].median_s, n, AIM) / MiB,
                                          stats_from_times([0.0])))
                ratios[f"{d} {_label(n)} / memcpy same buffers"] = gbs[f"ec {d}"] / gbs[f"memcpy {d}"]
                if f"ec {d} pipelined" in gbs:
                    ratios[f"{d} {_label(n)} pipelined / memcpy same buffers"] = \
                        gbs[f"ec {d} pipelined"] / gbs[f"memcpy {d} beside pipelined"]
                if d in ceiling:
                    ratios[f"{d} {_label(n)} / {ceiling_name[d]}"] = gbs[f"ec {d}"] / ceiling[d]
            if per_step > 1 and n <= BATCHED_MAX:
                _batched_rows(backend, n, per_step, repeat, results, ratios)
            if backend.capabilities.host_addressable and n <= BATCHED_MAX:
                # Why the fixed cost grows with the entry: the caches a copy of its size leaves behind.
                cold, warm = call_after_copy(n, 30 if quick else 100)
                results.append(schema.row("host call after a copy", "cold (right after it)", n, "bytes", "us",
                                          cold.median_s * 1e6, cold))
                results.append(schema.row("host call after a copy", "warm (called again)", n, "bytes", "us",
                                          warm.median_s * 1e6, warm))
        frag = 1 * MiB
        if not quick or frag in sizes:
            r = _bench_size(backend, frag, 5 if quick else 20, True, "frag")
            if r["descriptors"] != r["runs"]:
                raise RuntimeError(f"bench ec: fragmented entry used {r['descriptors']} descriptors for "
                                   f"{r['runs']} runs")
            for impl in ("ec save", "ec load"):
                results.append(schema.row("ec transfer fragmented", impl, frag, "bytes", "GB/s",
                                          frag / r[impl].median_s / 1e9, r[impl]))
            results.append(schema.row("ec descriptors/entry fragmented", "ec save", frag, "bytes", "descriptors",
                                      r["descriptors"], stats_from_times([0.0])))
        if threaded is not None:
            # What the pipelined rows stand on: handing work to a queue's thread and hearing back.
            rt = thread_round_trip()
            results.append(schema.row("thread hand-off", "round trip", 1, "message", "us", rt.median_s * 1e6, rt))
    finally:
        if threaded is not None:
            threaded.close()
    notes.append(f"block = one row of {HIDDEN} x {np.dtype(DTYPE).name} = {block} B; entries rotate through "
                 f"{SLOTS} region slots; descriptors per entry equal the number of block runs (checked)")
    notes.append("'memcpy same buffers' = np.copyto of the same bytes between the same buffers (region slot <-> "
                 "device buffer), so cache effects match; 'memcpy bandwidth' = large-copy baseline of this run")
    notes.append("'ec fixed cost per step' = median ec step minus median memcpy of the same bytes: the Python and "
                 "driver work around the copy (descriptors, checks, pools, the report), which entries of a few "
                 f"MiB cannot hide; 'ec step size for {AIM:g} x memcpy' = the bytes a step must move for its copy to "
                 f"hide that cost down to {AIM:g} of memcpy (fixed cost x memcpy bandwidth x {AIM / (1 - AIM):g}): "
                 "batch entries into steps at least that large")
    if backend.capabilities.host_addressable:
        notes.append("'host call after a copy' = one address_of() (a Python function, a numpy view, a compiled "
                     "call: the kind of operation a step makes a few dozen of) right after a memcpy of the row's "
                     "size, and again at once: a copy larger than a core's L2 cache evicts the interpreter's code "
                     "and data, so every operation of a waited-for step around it costs more than it would warm, "
                     "the more the larger the copy -- why the fixed cost per step grows with the entry, and why "
                     "batching entries (one step's Python for several) is what brings small entries to copy speed")
    if per_step > 1:
        notes.append(f"'{per_step} entries/step' = a step saving (then loading) {per_step} entries of the row's size "
                     "together: one batched copy per direction for all of them, against one np.copyto of the "
                     "step's bytes between the same buffers; 'fixed cost per entry, batched' = the step's cost "
                     f"above that copy, divided by {per_step}")
    notes.append(f"ec save/load = one entry on {backend.name}, waited for: descriptor building, the batched copy, "
                 "its events and the completion report; 'pipelined' = 8 steps back to back on threaded cpu "
                 f"queues with up to {SLOTS - 2} copies in flight (the copies overlap the next step's Python work)")
    if threaded is not None:
        notes.append("'thread hand-off' = one message to another thread and back (queue.SimpleQueue, as a threaded "
                     "queue takes each operation): a pipelined step crosses threads several times (to the copy "
                     "queue, to the compute queue, back to the host) and its threads share the GIL, so where this "
                     "is large next to the copy -- a virtual machine, few cores -- pipelined steps are slower than "
                     "waited-for ones")
    if target == "cuda":
        notes.extend(pin_notes(pin_statuses))
        notes.append("on a GPU the saves are D2H and the loads H2D copies into and out of the pinned region; "
                     "'memcpy same buffers' is then the driver's copy between the same device buffer and region "
                     "slot (one cuMemcpyAsync + cuStreamSynchronize, straight to the driver): the ceiling a "
                     "batched copy can reach; 'pinned D2H/H2D bandwidth' = a large copy between device memory "
                     "and pinned host memory, the host link's rate (not the host's memcpy)")
    return schema.suite("ec", target, 1, results, ratios, baselines, notes)

