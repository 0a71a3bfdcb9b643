"""ECWorker: vLLM's save/load cases, completion ordering, pools, and load-buffer lifetime."""

import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import vtnumba.ec.worker as worker_mod
from vtnumba.backend.cpu import CPUBackend
from vtnumba.ec import (
    ECConnectorMetadata,
    ECScheduler,
    ECWorker,
    coalesce_runs,
    create_ec_shared_region,
)

SENTINEL = -77  # int8 poison in every block before a test


CPU_BACKENDS = {"cpu-sync": lambda: CPUBackend(), "cpu-threaded": lambda: CPUBackend(threaded=True)}


pytestmark = pytest.mark.usefixtures("no_new_ec_region_files")


@pytest.fixture(params=[*CPU_BACKENDS, "device"])
def backend(request):
    if request.param == "device":  # numba's simulator, or the GPU under VTNUMBA_TARGET=cuda
        yield request.getfixturevalue("device_backend")
        return
    be = CPU_BACKENDS[request.param]()
    yield be
    be.close()


@pytest.fixture
def threaded():
    be = CPUBackend(threaded=True)
    yield be
    be.close()


def spy_on_copies(monkeypatch) -> list:
    """Record the descriptor count of every copy the worker makes -- queued (batched_copy) or run
    on the spot on synchronous cpu queues (host_copy_now, DescriptorBuffers.copy_block_runs)."""
    from vtnumba.ec.descriptors import DescriptorBuffers

    calls = []
    batched, now, block_runs = worker_mod.batched_copy, worker_mod.host_copy_now, DescriptorBuffers.copy_block_runs

    def spy_batched(*args, **kw):
        calls.append(len(args[2]))
        return batched(*args, **kw)

    def spy_now(src, dst, sizes, count):
        calls.append(count)
        return now(src, dst, sizes, count)

    def spy_block_runs(self, *args, **kw):
        n = block_runs(self, *args, **kw)
        calls.append(n)
        return n

    monkeypatch.setattr(worker_mod, "batched_copy", spy_batched)
    monkeypatch.setattr(worker_mod, "host_copy_now", spy_now)
    monkeypatch.setattr(DescriptorBuffers, "copy_block_runs", spy_block_runs)
    return calls


def refuse_copies(monkeypatch) -> None:
    """Make every copy the worker attempts fail before anything is copied, as the copy engine's
    address check does."""
    from vtnumba.ec.descriptors import DescriptorBuffers

    def refuse(*args, **kwargs):
        raise ValueError("refused for the test")

    monkeypatch.setattr(worker_mod, "batched_copy", refuse)
    monkeypatch.setattr(worker_mod, "host_copy_now", refuse)
    monkeypatch.setattr(DescriptorBuffers, "copy_block_runs", refuse)


def nothing_borrowed(w) -> bool:
    """Every copy queue and descriptor buffer the worker made is back where it keeps idle ones: in
    its pools, or -- on synchronous queues, where a copy is over when its call returns -- held
    for the next step."""
    kept = sum(b is not None for b in w._kept_bufs)
    return len(w._queue_pool) == len(w._all_queues) and len(w._buf_pool) + kept == w._buf_pool.allocations


class Env:
    """A region poisoned with SENTINEL, a worker on it, and helpers to make device outputs."""

    def __init__(self, backend, name, hidden=8, dtype=np.float32, blocks=32, **worker_kw):
        self.backend, self.hidden, self.dtype = backend, hidden, np.dtype(dtype)
        self.region = create_ec_shared_region(engine_id=name, hidden_size=hidden, dtype=dtype,
                                              region_bytes=blocks * hidden * self.dtype.itemsize, create=True,
                                              anonymous=True)  # no name: a killed test leaves no file
        self.region.blocks[:] = SENTINEL
        self.worker = ECWorker(self.region, backend=backend, **worker_kw)
        self._keep = []

    @property
    def bs(self):
        return self.region.block_size_bytes

    def device(self, host):
        buf = self.backend.alloc(host.nbytes)
        self.backend.copy(self.worker.compute_queue, buf, np.ascontiguousarray(host), host.nbytes)
        self._keep.append(buf)
        return buf.view(host.dtype, host.shape)

    def close(self):
        try:
            self.worker.shutdown()
        finally:
            self.region.cleanup()


@pytest.fixture
def env_factory(request):
    envs = []

    def make(backend, **kw):
        name = f"w{os.getpid()}_{abs(hash(request.node.nodeid)) % 10**8}_{len(envs)}"
        envs.append(Env(backend, name, **kw))
        return envs[-1]

    yield make
    for e in envs:
        e.close()


def host_of(arr):
    """An array's contents as numpy: itself on cpu, a view in the simulator, a copy from a GPU."""
    from vtnumba.backend.arrays import to_host

    return to_host(arr)


def complete(worker, timeout=10.0):
    """Poll like an engine loop until a report arrives."""
    deadline = time.monotonic() + timeout
    while True:
        meta = worker.build_connector_worker_meta()
        if meta is not None:
            return meta
        assert time.monotonic() < deadline, "no completion report"
        time.sleep(0.001)


def save(env, outputs: dict, saves: dict):
    enc = {h: env.device(v) for h, v in outputs.items()}
    meta = ECConnectorMetadata(saves=saves)
    for h in saves:
        env.worker.save_caches(enc, h, meta)
    env.worker.flush_saves()
    return meta


def as_bytes(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.int8)


# ------------------------------------------------------------------------------ vLLM's cases
def test_exact_fit_save_leaves_everything_else_untouched(backend, env_factory, rng):
    env = env_factory(backend)
    out = rng.standard_normal((3, env.hidden)).astype(np.float32)
    save(env, {"h": out}, {"h": [5, 6, 7]})
    assert complete(env.worker).completed_saves == ["h"]
    np.testing.assert_array_equal(env.region.blocks[5:8].reshape(-1), as_bytes(out))
    assert (env.region.blocks[:5] == SENTINEL).all() and (env.region.blocks[8:] == SENTINEL).all()


def test_blocks_the_output_never_reaches_get_no_descriptor(backend, env_factory, rng):
    env = env_factory(backend)
    out = rng.standard_normal((2, env.hidden)).astype(np.float32)
    save(env, {"h": out}, {"h": [0, 1, 5, 6, 9]})  # sized by placeholders: 5 blocks for 2 rows
    complete(env.worker)
    np.testing.assert_array_equal(env.region.blocks[0:2].reshape(-1), as_bytes(out))
    assert (env.region.blocks[2:] == SENTINEL).all()
    assert env.worker.stats["save"]["descriptors"] == 1, "unused blocks must not get descriptors"


def test_only_tp_rank_zero_saves(backend, env_factory, rng):
    env = env_factory(backend, tp_rank=1)
    save(env, {"h": rng.standard_normal((2, env.hidden)).astype(np.float32)}, {"h": [0, 1]})
    assert env.worker.inflight() == (0, 0)
    assert env.worker.build_connector_worker_meta() is None
    assert (env.region.blocks == SENTINEL).all()


def test_oversize_output_is_a_value_error(backend, env_factory, rng):
    # vLLM's worker asserts; an assert vanishes under python -O and row 3 would land in block 2,
    # which belongs to another entry.
    env = env_factory(backend)
    out = rng.standard_normal((3, env.hidden)).astype(np.float32)
    with pytest.raises(ValueError, match=r"encoder_cache\['h'\] has 3 rows \(96 bytes\) but mm_hash='h' was "
                                         r"allocated 2 blocks \(64 bytes\)"):
        save(env, {"h": out}, {"h": [0, 1]})
    assert (env.region.blocks == SENTINEL).all() and env.worker.inflight() == (0, 0)


@pytest.mark.parametrize("dtype, shape, words", [
    (np.float16, (2, 8), ["has dtype float16", "the region holds float32 rows"]),   # the bytes would be misread
    (">f4", (2, 8), ["has dtype >f4", "the region holds <f4 rows"]),                # float32 both: byte order
    (np.float32, (2, 4), ["has shape (2, 4)", "expected [rows, 8]"]),               # rows of another width
    (np.float32, (16,), ["has shape (16,)", "expected [rows, 8]"]),                 # not rows at all
])
def test_output_of_another_dtype_or_width_is_refused(backend, env_factory, rng, dtype, shape, words):
    env = env_factory(backend)
    out = rng.standard_normal(shape).astype(dtype)
    with pytest.raises(ValueError) as ei:
        save(env, {"h": out}, {"h": [0, 1]})
    for w in words:
        assert w in str(ei.value)
    assert (env.region.blocks == SENTINEL).all() and env.worker.inflight() == (0, 0)


def test_raw_buffer_must_be_whole_rows(env_factory):
    be = CPUBackend()
    env = env_factory(be)
    buf = be.alloc(40)  # 1.25 rows of 32 bytes
    with pytest.raises(ValueError, match=r"a Buffer of 40 bytes, not a whole number of rows of 32 bytes"):
        env.worker.save_caches({"h": buf}, "h", ECConnectorMetadata(saves={"h": [0, 1]}))
    ok = be.alloc(64)
    env.worker.save_caches({"h": ok}, "h", ECConnectorMetadata(saves={"h": [0, 1]}))
    env.worker.flush_saves()
    assert complete(env.worker).completed_saves == ["h"]


def test_oversize_check_survives_python_O():
    code = ("import os, numpy as np\n"
            "from vtnumba.backend.cpu import CPUBackend\n"
            "from vtnumba.ec import ECConnectorMetadata, ECWorker, create_ec_shared_region\n"
            "r = create_ec_shared_region(engine_id=f'opt{os.getpid()}', hidden_size=8, region_bytes=32 * 4,\n"
            "                            create=True, anonymous=True)\n"
            "w = ECWorker(r, backend=CPUBackend())\n"
            "try:\n"
            "    w.save_caches({'h': np.zeros((3, 8), np.float32)}, 'h', ECConnectorMetadata(saves={'h': [0, 1]}))\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n"
            "w.shutdown(); r.cleanup()\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    assert out.returncode == 0, out.stderr
    assert "refused: encoder_cache['h'] has 3 rows" in out.stdout


def test_several_hashes_one_batched_copy(backend, env_factory, rng, monkeypatch):
    env = env_factory(backend)
    outs = {h: rng.standard_normal((r, env.hidden)).astype(np.float32) for h, r in (("a", 2), ("b", 3), ("c", 1))}
    calls = spy_on_copies(monkeypatch)
    save(env, outs, {"a": [3, 4], "b": [9, 10, 11], "c": [5]})
    monkeypatch.undo()
    assert calls == [3], "expected ONE batched copy with one descriptor per run"
    assert complete(env.worker).completed_saves == ["a", "b", "c"]
    assert env.worker.stats["save"]["transfers"] == 1
    for h, ids in (("a", [3, 4]), ("b", [9, 10, 11]), ("c", [5])):
        np.testing.assert_array_equal(env.region.blocks[ids].reshape(-1), as_bytes(outs[h]))


def test_loads_have_the_right_shape_dtype_and_bytes_on_every_rank(backend, env_factory, rng):
    env = env_factory(backend, dtype=np.float16, hidden=16)
    data = {h: rng.standard_normal((r, 16)).astype(np.float16) for h, r in (("x", 4), ("y", 1), ("z", 3))}
    ids = {"x": [7, 8, 9, 10], "y": [2], "z": [20, 21, 22]}
    for h, b in ids.items():
        env.region.blocks[b] = data[h].view(np.int8).reshape(len(b), -1)
    second = ECWorker(env.region, backend=backend, tp_rank=1)  # another TP rank on the same region
    try:
        meta = ECConnectorMetadata(loads={h: (i, b) for i, (h, b) in enumerate(ids.items())})
        caches = [{}, {}]
        for w, cache in zip((env.worker, second), caches):
            w.start_load_caches(cache, meta)
            assert sorted(complete(w).completed_loads) == [0, 1, 2]
        for cache in caches:
            for h, arr in data.items():
                got = cache[h]
                assert got.shape == (len(ids[h]), 16) and got.dtype == np.float16
                np.testing.assert_array_equal(host_of(got).view(np.int16), arr.view(np.int16))
    finally:
        second.shutdown()


def test_round_trip_through_the_scheduler(backend, env_factory, rng):
    env = env_factory(backend, blocks=24)
    sched = ECScheduler("both", env.region.num_blocks)
    data = {f"h{i}": rng.standard_normal((int(r), env.hidden)).astype(np.float32)
            for i, r in enumerate(rng.integers(3, 7, size=10))}
    loaded = {}
    for h, arr in data.items():
        assert sched.request_save(h, arr.shape[0]) is not None
        meta = sched.build_connector_meta()
        enc = {h: env.device(arr)}
        env.worker.save_caches(enc, h, meta)
        env.worker.flush_saves()
        assert sched.update_connector_output(complete(env.worker)).ready == [h]
        tid = sched.request_load(h)
        cache = {}
        env.worker.start_load_caches(cache, sched.build_connector_meta())
        assert sched.update_connector_output(complete(env.worker)).released == [h]
        assert tid is not None
        loaded[h] = host_of(cache[h]).copy()
    for h, arr in data.items():  # including entries whose blocks were later evicted and reused
        np.testing.assert_array_equal(loaded[h], arr)
    assert sched.cache.stats.evictions > 0


def test_descriptor_buffers_are_reused(backend, env_factory, rng):
    env = env_factory(backend)
    out = rng.standard_normal((2, env.hidden)).astype(np.float32)
    for step in range(5):
        save(env, {"h": out}, {"h": [2 * step, 2 * step + 1]})
        complete(env.worker)
    pool = env.worker._buf_pool
    assert pool.allocations == 1, "one descriptor buffer should serve every step"
    assert pool.reuses == (0 if env.worker.synchronous else 4)  # (synchronous: the worker keeps it)
    assert len(env.worker._all_queues) <= 1, "the copy queue should be recycled too"
    assert nothing_borrowed(env.worker)


def test_synchronous_copies_are_reported_once_by_the_next_poll(env_factory, rng):
    """On synchronous queues a copy is finished when it is issued: its resources go straight back
    to the pools, but it still counts as unreported -- in inflight() -- until one poll reports
    it, exactly once, saves and loads alike."""
    be = CPUBackend()
    try:
        env = env_factory(be)
        out = rng.standard_normal((3, env.hidden)).astype(np.float32)
        save(env, {"a": out, "b": out[:1]}, {"a": [4, 5, 6], "b": [9]})
        w = env.worker
        assert w.inflight() == (1, 0)                       # one batched copy for the step's two saves
        assert nothing_borrowed(w)                          # already recycled
        assert w.stats["save"]["transfers"] == 1 and w.stats["save"]["entries"] == 2
        assert w.stats["save"]["descriptors"] == 2 and w.stats["save"]["bytes"] == 4 * env.bs
        np.testing.assert_array_equal(env.region.blocks[4:7].reshape(-1), as_bytes(out))
        cache: dict = {}
        w.start_load_caches(cache, ECConnectorMetadata(loads={"a": (7, [4, 5, 6])}))
        assert w.inflight() == (1, 1)
        meta = w.build_connector_worker_meta()
        assert sorted(meta.completed_saves) == ["a", "b"] and meta.completed_loads == [7]
        assert w.inflight() == (0, 0) and w.build_connector_worker_meta() is None  # reported once
        np.testing.assert_array_equal(cache["a"], out)
        assert [h[:3] for h in w.history] == [("save", 2, 4 * env.bs), ("load", 1, 3 * env.bs)]
        del cache
    finally:
        env.close()
        be.close()


def test_a_load_whose_copy_is_refused_hands_out_nothing_and_keeps_nothing(backend, env_factory, monkeypatch):
    """The views are cut before the copy; if the copy is refused, none reaches the caller's
    cache, and the buffer, descriptors, queue and events all go back."""

    env = env_factory(backend)
    w = env.worker
    refuse_copies(monkeypatch)
    cache = {"old": "untouched"}
    with pytest.raises(ValueError, match="refused for the test"):
        w.start_load_caches(cache, ECConnectorMetadata(loads={"a": (1, [0, 1]), "b": (2, [5])}))
    assert cache == {"old": "untouched"}
    assert w.inflight() == (0, 0) and w.build_connector_worker_meta() is None
    assert w._destinations.pending() == [] and nothing_borrowed(w)
    cache = {"old": "untouched"}
    with pytest.raises(ValueError, match="refused for the test"):  # a one-entry step, too (cpu: the copy on the spot)
        w.start_load_caches(cache, ECConnectorMetadata(loads={"a": (1, [0, 1])}))
    assert cache == {"old": "untouched"} and w.inflight() == (0, 0) and w.build_connector_worker_meta() is None
    assert w._destinations.pending() == [] and nothing_borrowed(w)
    monkeypatch.undo()
    env.region.blocks[0:2] = 3
    w.start_load_caches(cache, ECConnectorMetadata(loads={"a": (3, [0, 1])}))  # and the worker carries on
    assert complete(w).completed_loads == [3]
    assert (host_of(cache["a"]).view(np.int8) == 3).all()


def test_a_save_whose_copy_is_refused_is_dropped_and_the_worker_carries_on(backend, env_factory, monkeypatch,
                                                                             rng):
    from vtnumba.memory.copy_engine import live_address

    env = env_factory(backend)
    w = env.worker
    out = rng.standard_normal((2, env.hidden)).astype(np.float32)
    refuse_copies(monkeypatch)
    # Two saves scheduled (one made): the step's batch is copied by the flush on every target.
    meta = ECConnectorMetadata(saves={"h": [0, 1], "later": [5]})
    w.save_caches({"h": out}, "h", meta)  # the caller's own array: registered for the copy
    assert live_address(out, out.nbytes)[1]
    with pytest.raises(ValueError, match="refused for the test"):
        w.flush_saves()
    assert w.inflight() == (0, 0) and w.build_connector_worker_meta() is None
    assert not live_address(out, out.nbytes)[1], "the output's registration must be undone"
    assert nothing_borrowed(w)
    assert (env.region.blocks == SENTINEL).all()
    monkeypatch.undo()
    save(env, {"h": out}, {"h": [0, 1]})
    assert complete(w).completed_saves == ["h"]
    np.testing.assert_array_equal(env.region.blocks[0:2].reshape(-1), as_bytes(out))


@pytest.mark.parametrize("output", ["caller's array", "backend buffer"])
def test_a_report_polled_from_another_thread_loses_and_repeats_nothing(env_factory, rng, output):
    """Synchronous copies file their completions as they finish; a poller on another thread
    must see each exactly once, however its polls interleave with the steps.  (A backend
    buffer is live memory: each one-save step is copied by save_caches, on the spot.)"""
    be = CPUBackend()
    try:
        env = env_factory(be)
        w = env.worker
        out = rng.standard_normal((1, env.hidden)).astype(np.float32)
        if output == "backend buffer":
            out = env.device(out)
        reported, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                meta = w.build_connector_worker_meta()
                if meta is not None:
                    reported.extend(meta.completed_saves)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            for step in range(300):
                h = f"h{step}"
                w.save_caches({h: out}, h, ECConnectorMetadata(saves={h: [step % 32]}))
                w.flush_saves()
        finally:
            stop.set()
            poller.join()
        meta = w.build_connector_worker_meta()
        reported += meta.completed_saves if meta is not None else []
        assert sorted(reported) == sorted(f"h{step}" for step in range(300))
        assert w.inflight() == (0, 0)
    finally:
        env.close()
        be.close()


def gated_save(env, rng, ids):
    """Save random rows into ``ids`` behind a held compute queue (the "model" is still running):
    the copy is queued and cannot start until the returned gate is set.  Returns (gate, rows)."""
    out = rng.standard_normal((len(ids), env.hidden)).astype(np.float32)
    gate = threading.Event()
    enc = {"h": env.device(out)}
    env.backend.launch_host_func(env.worker.compute_queue, lambda: gate.wait(10))
    meta = ECConnectorMetadata(saves={"h": list(ids)})
    env.worker.save_caches(enc, "h", meta)
    env.worker.flush_saves()
    return gate, out


def test_shutdown_drains_inflight_transfers(threaded, env_factory, rng):
    env = env_factory(threaded)
    gate, out = gated_save(env, rng, [0, 1, 2, 3])
    t = threading.Thread(target=env.worker.shutdown)
    t.start()
    time.sleep(0.1)
    assert t.is_alive(), "shutdown returned while a copy was still queued"
    assert (env.region.blocks == SENTINEL).all()
    gate.set()
    t.join(10)
    assert not t.is_alive()
    np.testing.assert_array_equal(env.region.blocks[:4].reshape(-1), as_bytes(out))
    with pytest.raises(RuntimeError, match="after shutdown"):
        env.worker.flush_saves()


def test_a_worker_as_a_context_manager_shuts_down_on_exit(threaded, env_factory, rng):
    # `with ECWorker(...) as w:` drains what is in flight on the way out, as shutdown does.
    env = env_factory(threaded)
    out = rng.standard_normal((2, env.hidden)).astype(np.float32)
    with ECWorker(env.region, backend=threaded) as w:
        w.save_caches({"e": out}, "e", ECConnectorMetadata(saves={"e": [5, 6]}))  # (a host output)
        w.flush_saves()
    np.testing.assert_array_equal(env.region.blocks[5:7].reshape(-1), as_bytes(out))
    with pytest.raises(RuntimeError, match="after shutdown"):
        w.flush_saves()


# ------------------------------------------------------------------------------ completion ordering
def test_save_is_not_reported_before_the_copy_ran(threaded, env_factory, rng):
    env = env_factory(threaded)
    gate, out = gated_save(env, rng, [1, 2, 3])  # the save is gated behind the (held) compute queue
    for _ in range(20):
        assert env.worker.build_connector_worker_meta() is None
        time.sleep(0.005)
    assert (env.region.blocks == SENTINEL).all(), "the save ran before the compute queue allowed it"
    gate.set()
    report = complete(env.worker)
    assert report.completed_saves == ["h"] and report.completed_loads == []
    np.testing.assert_array_equal(env.region.blocks[1:4].reshape(-1), as_bytes(out))
    assert env.worker.build_connector_worker_meta() is None  # reported exactly once


def test_loads_are_reported_in_order_each_exactly_once(threaded, env_factory, rng, monkeypatch):
    env = env_factory(threaded)
    env.region.blocks[:8] = rng.integers(-100, 100, size=(8, env.bs), dtype=np.int8)
    gates = [threading.Event(), None]
    real = worker_mod.batched_copy

    def delayed(src, dst, sizes, queue=None, backend=None, **kw):
        g = gates.pop(0)
        if g is not None:  # inject a delay in front of this copy on its queue
            backend.launch_host_func(queue, lambda: g.wait(10))
        return real(src, dst, sizes, queue=queue, backend=backend, **kw)

    monkeypatch.setattr(worker_mod, "batched_copy", delayed)
    first_gate = gates[0]
    c1, c2 = {}, {}
    env.worker.start_load_caches(c1, ECConnectorMetadata(loads={"a": (11, [0, 1])}))
    env.worker.start_load_caches(c2, ECConnectorMetadata(loads={"b": (12, [4, 5, 6])}))
    # The second copy finishes first, but nothing may be reported before the first.
    threaded.synchronize_event(env.worker._inflight_loads[1].end_event)
    for _ in range(10):
        assert env.worker.build_connector_worker_meta() is None
    first_gate.set()
    reports = []
    deadline = time.monotonic() + 10
    while sum(len(r.completed_loads) for r in reports) < 2 and time.monotonic() < deadline:
        m = env.worker.build_connector_worker_meta()
        if m is not None:
            reports.append(m)
    assert [t for r in reports for t in r.completed_loads] == [11, 12]
    assert env.worker.build_connector_worker_meta() is None
    np.testing.assert_array_equal(host_of(c1["a"]).view(np.int8).reshape(2, -1), env.region.blocks[0:2])
    np.testing.assert_array_equal(host_of(c2["b"]).view(np.int8).reshape(3, -1), env.region.blocks[4:7])


def test_compute_queue_sees_loaded_bytes(threaded, env_factory, rng, monkeypatch):
    """Work queued on the compute queue after start_load_caches waits for the copy."""
    env = env_factory(threaded)
    env.region.blocks[3:5] = rng.integers(-100, 100, size=(2, env.bs), dtype=np.int8)
    gate = threading.Event()
    real = worker_mod.batched_copy

    def delayed(src, dst, sizes, queue=None, backend=None, **kw):
        backend.launch_host_func(queue, lambda: gate.wait(10))
        return real(src, dst, sizes, queue=queue, backend=backend, **kw)

    monkeypatch.setattr(worker_mod, "batched_copy", delayed)
    cache, seen = {}, {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [3, 4])}))
    view = cache["a"]
    threaded.launch_host_func(env.worker.compute_queue, lambda: seen.update(a=view.copy()))  # "a kernel"
    time.sleep(0.05)
    assert not seen, "compute-queue work ran before the load copy finished"
    gate.set()
    threaded.synchronize(env.worker.compute_queue)
    np.testing.assert_array_equal(seen["a"].view(np.int8).reshape(2, -1), env.region.blocks[3:5])


@pytest.mark.parametrize("own_compute_queue", [True, False])
def test_a_worker_with_its_own_compute_queue_follows_the_default_stream(threaded, env_factory, rng, monkeypatch,
                                                                       own_compute_queue):
    """A worker that made its compute queue itself orders it after the default stream before a
    save (the outputs came from there), the default stream after a load (the views are read
    there), and a load buffer's release after the default stream's reads; a worker given a
    compute queue leaves the default stream alone.  (No-ops off a GPU: the calls are counted.)"""
    calls = []
    monkeypatch.setattr(threaded, "order_after_default_stream", lambda q: calls.append(("after", q.name)))
    monkeypatch.setattr(threaded, "order_default_stream_after", lambda q: calls.append(("before", q.name)))
    given = None if own_compute_queue else threaded.create_queue("the caller's")
    env = env_factory(threaded, compute_queue=given)
    q = env.worker.compute_queue.name
    save(env, {"a": rng.standard_normal((2, env.hidden)).astype(np.float32)}, {"a": [0, 1]})
    complete(env.worker)
    assert calls == ([("after", q)] if own_compute_queue else [])
    calls.clear()
    cache = {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [0, 1])}))
    assert calls == ([("before", q)] if own_compute_queue else [])
    calls.clear()
    complete(env.worker)
    cache.clear()  # the views die: the next poll releases the buffer
    threaded.synchronize(env.worker.compute_queue)
    env.worker.build_connector_worker_meta()
    assert calls == ([("after", q)] if own_compute_queue else [])
    if given is not None:
        env.close()
        threaded.destroy_queue(given)


# ------------------------------------------------------------------------------ descriptors
def test_coalesce_runs_matches_a_naive_split(rng):
    for _ in range(50):
        ids = rng.permutation(40)[: int(rng.integers(1, 40))]
        ids = np.sort(ids) if rng.random() < 0.5 else ids
        slots, first, num = coalesce_runs(ids.tolist())
        runs, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                runs.append((start, ids[start], i - start))
                start = i
        assert list(zip(slots.tolist(), first.tolist(), num.tolist())) == [(a, int(b), c) for a, b, c in runs]
    assert [x.size for x in coalesce_runs([])] == [0, 0, 0]


def test_loads_are_sorted_by_first_block_and_coalesce_across_hashes(backend, env_factory, rng):
    env = env_factory(backend)
    env.region.blocks[:] = rng.integers(-100, 100, size=env.region.blocks.shape, dtype=np.int8)
    cache = {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"late": (1, [7, 8]), "early": (2, [5, 6])}))
    assert complete(env.worker).completed_loads == [2, 1]  # in the sorted order
    assert env.worker.stats["load"]["descriptors"] == 1, "blocks 5..8 are one run"
    np.testing.assert_array_equal(host_of(cache["early"]).view(np.int8).reshape(2, -1), env.region.blocks[5:7])
    np.testing.assert_array_equal(host_of(cache["late"]).view(np.int8).reshape(2, -1), env.region.blocks[7:9])


def test_a_step_of_random_loads_gets_its_bytes_and_one_descriptor_per_run(backend, env_factory, rng):
    """Entries of random sizes on random blocks (some neighbours in the region, some not, in
    any order): each view holds its own blocks, and the step's descriptors are the runs of
    its ids laid end to end in first-block order -- a run crossing entries counted once."""
    env = env_factory(backend)
    env.region.blocks[:] = rng.integers(-100, 100, size=env.region.blocks.shape, dtype=np.int8)
    for _ in range(3):
        perm = rng.permutation(env.region.num_blocks)
        cut = np.sort(rng.choice(np.arange(1, 20), size=3, replace=False))  # four entries, 20 blocks in all
        parts = np.split(np.sort(perm[:20]) if rng.random() < 0.5 else perm[:20], cut)
        loads = {f"h{j}": (j, ids.tolist()) for j, ids in enumerate(parts)}
        before = env.worker.stats["load"]["descriptors"]
        cache = {}
        env.worker.start_load_caches(cache, ECConnectorMetadata(loads=loads))
        complete(env.worker)
        for h, (_, ids) in loads.items():
            np.testing.assert_array_equal(host_of(cache[h]).view(np.int8).reshape(len(ids), -1),
                                          env.region.blocks[ids])
        ordered = np.concatenate(sorted(parts, key=lambda ids: ids[0]))
        assert env.worker.stats["load"]["descriptors"] - before == len(coalesce_runs(ordered.tolist())[0])


def test_a_bad_block_id_in_a_later_entry_names_that_entry_and_loads_nothing(backend, env_factory):
    env = env_factory(backend)
    cache = {}
    with pytest.raises(ValueError, match=r"loads\['second'\] contains block id 40, outside the region's 0..31"):
        env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"second": (1, [6, 40]), "first": (0, [2, 3])}))
    assert cache == {} and env.worker.inflight() == (0, 0)
    assert env.worker.build_connector_worker_meta() is None  # nothing to report, nothing held
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"first": (0, [2, 3])}))  # still usable
    assert complete(env.worker).completed_loads == [0]


def test_save_descriptors_equal_block_runs(backend, env_factory, rng):
    env = env_factory(backend)
    out = rng.standard_normal((5, env.hidden)).astype(np.float32)
    ids = [3, 4, 5, 9, 10]
    save(env, {"h": out}, {"h": ids})
    complete(env.worker)
    assert env.worker.stats["save"]["descriptors"] == len(coalesce_runs(ids)[0]) == 2
    np.testing.assert_array_equal(env.region.blocks[ids].reshape(-1), as_bytes(out))


def test_empty_output_is_still_reported(backend, env_factory):
    env = env_factory(backend)
    save(env, {"h": np.zeros((0, env.hidden), np.float32)}, {"h": []})
    assert complete(env.worker).completed_saves == ["h"]


# ------------------------------------------------------------------------------ load buffers
def test_load_buffer_waits_for_views_and_the_compute_queue(threaded, env_factory):
    env = env_factory(threaded, allocator=None)
    live_before = len(threaded.live_buffers())
    cache = {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [0, 1])}))
    complete(env.worker)
    dest = env.worker._destinations.pending()[0]
    gate = threading.Event()
    threaded.launch_host_func(env.worker.compute_queue, lambda: gate.wait(10))  # a kernel still reading
    sliced = cache["a"][1:]  # a view of the view keeps the buffer in use too
    del cache
    gc.collect()
    env.worker.build_connector_worker_meta()
    assert not dest.views_dead and not dest.freed
    del sliced
    gc.collect()
    for _ in range(5):
        env.worker.build_connector_worker_meta()
    assert dest.views_dead and not dest.freed, "freed while the compute queue could still read it"
    gate.set()
    threaded.synchronize(env.worker.compute_queue)
    env.worker.build_connector_worker_meta()
    assert dest.freed and len(threaded.live_buffers()) == live_before


def test_a_slice_of_a_loaded_view_keeps_its_buffer_from_the_next_load(env_factory):
    """Synchronous queues reuse the last load buffer as soon as nothing views it; an array cut
    from a view (the view itself gone) still counts, and the buffer is reused once it is gone."""
    be = CPUBackend()
    try:
        env = env_factory(be)
        env.region.blocks[0:2] = 1
        env.region.blocks[2:4] = 2
        cache = {}
        env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [0, 1])}))
        complete(env.worker)
        kept = cache.pop("a")[1:].view(np.int8)  # a view of a view; the handed-out view is dropped
        gc.collect()
        env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"b": (1, [2, 3])}))
        complete(env.worker)
        assert (kept == 1).all(), "the second load overwrote bytes a live array still shows"
        assert env.worker._destinations.spare_reuses == 0
        del kept, cache
        gc.collect()
        cache = {}
        env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"c": (2, [0, 1])}))
        complete(env.worker)
        assert env.worker._destinations.spare_reuses == 1 and (cache["c"].view(np.int8) == 1).all()
        del cache
    finally:
        env.close()
        be.close()


def test_steps_that_drop_their_views_reuse_one_load_buffer_and_each_sees_its_own_bytes(env_factory, rng):
    """Synchronous queues: a step whose caller dropped the previous step's views gets the very
    same buffer back (one allocation for the whole run); a step that keeps them gets another,
    and the kept views still show their own bytes; the dropped one is reused after that."""
    be = CPUBackend()
    try:
        env = env_factory(be, allocator=None)
        rows = rng.standard_normal((32, env.hidden)).astype(np.float32)
        env.region.blocks[:] = rows.view(np.int8).reshape(32, -1)
        w, dests = env.worker, env.worker._destinations
        allocs_before = len(be.live_buffers())
        buffers = set()
        for step, first in enumerate((0, 7, 3, 20, 0)):
            cache = {}
            w.start_load_caches(cache, ECConnectorMetadata(loads={"e": (step, list(range(first, first + 5)))}))
            assert complete(w).completed_loads == [step]
            np.testing.assert_array_equal(cache["e"], rows[first:first + 5])
            buffers.add(cache["e"].__array_interface__["data"][0])
            del cache  # the caller is done with the entry before the next step
        assert len(buffers) == 1 and dests.spare_reuses == 4
        assert len(be.live_buffers()) == allocs_before + 1, "each step allocated a buffer of its own"
        kept = {}
        w.start_load_caches(kept, ECConnectorMetadata(loads={"k": (10, [1, 2])}))  # the one buffer again
        complete(w)
        typed_slice = kept["k"][1:].view(np.int32)  # an array derived from the view, kept too
        cache = {}
        w.start_load_caches(cache, ECConnectorMetadata(loads={"n": (11, [30, 31])}))
        complete(w)
        assert cache["n"].__array_interface__["data"][0] not in buffers, "a buffer still viewed was reused"
        np.testing.assert_array_equal(kept["k"], rows[1:3])
        np.testing.assert_array_equal(typed_slice, rows[2:3].view(np.int32))
        np.testing.assert_array_equal(cache["n"], rows[30:32])
        del kept, typed_slice, cache
        reuses = dests.spare_reuses
        cache = {}
        w.start_load_caches(cache, ECConnectorMetadata(loads={"z": (12, [4])}))
        complete(w)
        assert dests.spare_reuses == reuses + 1 and len(dests.pending()) == 1
        np.testing.assert_array_equal(cache["z"], rows[4:5])
        del cache
    finally:
        env.close()
        be.close()


def test_a_report_gives_back_the_load_buffers_whose_views_are_gone(env_factory):
    """Synchronous queues: the report after the caller dropped its entries hands every dead
    buffer but one (the spare) back to the caching allocator -- not only the next load."""
    be = CPUBackend()
    try:
        env = env_factory(be)
        w = env.worker
        kept = {}
        for step in range(5):  # five loads whose entries the caller keeps: five buffers
            w.start_load_caches(kept, ECConnectorMetadata(loads={f"e{step}": (step, [step])}))
            complete(w)
        assert len(w._destinations.pending()) == 5
        kept.clear()
        gc.collect()
        assert w.build_connector_worker_meta() is None  # nothing to report, but the buffers go back
        assert w._destinations.pending() == [] and w._destinations._spare is not None
        assert w.allocator.stats()["num_frees"] == 4
    finally:
        env.close()
        be.close()


def test_a_buffer_a_load_took_back_is_not_freed_by_a_reclaim_that_saw_it_free(env_factory, rng):
    """A report on another thread may find the previous step's buffer free just before a
    load takes it back in place; its late free must see that and leave the buffer alone."""
    be = CPUBackend()
    try:
        env = env_factory(be)
        rows = rng.standard_normal((32, env.hidden)).astype(np.float32)
        env.region.blocks[:] = rows.view(np.int8).reshape(32, -1)
        w, dests = env.worker, env.worker._destinations
        cache = {}
        w.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [0, 1])}))
        complete(w)
        del cache
        gc.collect()
        (seen_free,) = dests.pending()
        assert seen_free.copy_done and seen_free.views_dead  # what a reclaim on another thread sees ...
        cache = {}
        w.start_load_caches(cache, ECConnectorMetadata(loads={"b": (1, [7, 8])}))  # ... then the load
        assert dests.pending() == [seen_free] and dests.spare_reuses == 1  # took it back in place
        dests._free(seen_free)  # ... and then the reclaim's free runs
        assert dests.pending() == [seen_free] and not seen_free.freed and dests._spare is None
        np.testing.assert_array_equal(cache["b"], rows[7:9])
        assert complete(w).completed_loads == [1]
        del cache
    finally:
        env.close()
        be.close()


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-threaded"])
def test_loads_under_the_hazard_checker_take_the_allocators_path_and_flag_nothing(mode, env_factory, rng):
    """With a hazard checker watching, a load buffer is neither reused in place nor kept as
    the spare: it goes back to the caching allocator (record_stream as upstream), so the
    checker sees every use -- and a correct worker gives it nothing to report."""
    from vtnumba.memory import check_hazards

    be = CPU_BACKENDS[mode]()
    try:
        env = env_factory(be)
        rows = rng.standard_normal((32, env.hidden)).astype(np.float32)
        env.region.blocks[:] = rows.view(np.int8).reshape(32, -1)
        w = env.worker
        with check_hazards("record") as checker:
            kept = []
            for step, first in enumerate((0, 9, 4, 20)):
                cache = {}
                w.start_load_caches(cache, ECConnectorMetadata(loads={"e": (step, list(range(first, first + 3)))}))
                assert complete(w).completed_loads == [step]
                be.synchronize(w.compute_queue)
                np.testing.assert_array_equal(host_of(cache["e"]), rows[first:first + 3])
                if step == 1:
                    kept.append(cache["e"])  # one entry the caller keeps through the later steps
                del cache
            np.testing.assert_array_equal(kept[0], rows[9:12])
            del kept
            gc.collect()
            cache = {}  # (a synchronous worker takes buffers back when a load needs one)
            w.start_load_caches(cache, ECConnectorMetadata(loads={"e": (9, [5])}))
            complete(w)
            be.synchronize(w.compute_queue)
            w.build_connector_worker_meta()
            np.testing.assert_array_equal(host_of(cache["e"]), rows[5:6])
            del cache
            assert checker.reports == []
        dests = w._destinations
        assert dests.spare_reuses == 0 and dests._spare is None
        assert w.allocator.stats()["num_frees"] >= 3, "the buffers did not go back to the allocator"
    finally:
        env.close()
        be.close()


def test_load_buffer_goes_back_to_the_caching_allocator(threaded, env_factory):
    env = env_factory(threaded)
    alloc = env.worker.allocator
    assert alloc is not None
    cache = {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [0, 1, 2])}))
    complete(env.worker)
    assert alloc.stats()["active_blocks"] == 1
    del cache
    gc.collect()
    env.worker.build_connector_worker_meta()
    threaded.synchronize(env.worker.compute_queue)
    env.worker.build_connector_worker_meta()
    s = alloc.stats()
    assert s["active_blocks"] == 0 and s["num_frees"] == 1 and s["events_recorded"] == 1  # record_stream
    cache = {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"b": (1, [3, 4, 5])}))
    complete(env.worker)
    assert alloc.stats()["cache_hits"] >= 1, "the freed buffer should be reused"


# ------------------------------------------------------------------------------ bad input
def test_bad_input(backend, env_factory, rng):
    env = env_factory(backend)
    out = {"h": env.device(rng.standard_normal((1, env.hidden)).astype(np.float32))}
    with pytest.raises(KeyError, match="mm_hash 'ghost'"):
        env.worker.save_caches(out, "ghost", ECConnectorMetadata(saves={"ghost": [0]}))
    with pytest.raises(ValueError, match=r"saves\['h'\] contains block id 32"):
        env.worker.save_caches(out, "h", ECConnectorMetadata(saves={"h": [32]}))
    with pytest.raises(ValueError, match=r"loads\['h'\] contains block id -3"):
        env.worker.start_load_caches({}, ECConnectorMetadata(loads={"h": (0, [-3])}))
    assert env.worker.inflight() == (0, 0) and (env.region.blocks == SENTINEL).all()
    with pytest.raises(ValueError, match="dtype=float16 differs from the region's dtype=float32"):
        ECWorker(env.region, backend=backend, dtype=np.float16)
    with pytest.raises(ValueError, match="tp_rank=-1"):
        ECWorker(env.region, backend=backend, tp_rank=-1)
    with pytest.raises(TypeError, match="ECSharedRegion"):
        ECWorker("region", backend=backend)
    with pytest.raises(ValueError, match="max_inflight=-1"):
        env.worker.wait(-1)
    # The wrong containers: named before anything is touched (the region's blocks unchanged).
    meta = ECConnectorMetadata(saves={"h": [0]}, loads={"h": (0, [0])})
    with pytest.raises(TypeError, match="connector_metadata must be the ECConnectorMetadata"):
        env.worker.save_caches(out, "h", None)
    with pytest.raises(TypeError, match="encoder_cache must be a dict of mm_hash -> encoder output, got list"):
        env.worker.save_caches([out["h"]], "h", meta)
    with pytest.raises(TypeError, match="connector_metadata must be the ECConnectorMetadata"):
        env.worker.start_load_caches({}, {"h": (0, [0])})
    with pytest.raises(TypeError, match="encoder_cache must be a dict of mm_hash -> encoder output, got list"):
        env.worker.start_load_caches([], meta)
    assert env.worker.inflight() == (0, 0) and (env.region.blocks == SENTINEL).all()
    workers_before = len(env.region._workers)
    with pytest.raises(TypeError, match="allocator must be 'auto', None or a CachingAllocator; object has no "
                                        "allocate, free, record_stream, process_events"):
        ECWorker(env.region, backend=backend, allocator=object())
    with pytest.raises(TypeError, match="dtype='foo' is not a numpy dtype"):
        ECWorker(env.region, backend=backend, dtype="foo")
    assert len(env.region._workers) == workers_before  # a refused worker was never registered
    with pytest.raises(TypeError, match="backend must be a vtnumba Backend or None, got str"):
        env.region.pin_memory("cpu")
    with pytest.raises(TypeError, match="cache must be an EmbeddingCache or None, got str"):
        ECScheduler("producer", 8, cache="c")


GPU_VIEW_TRACKING = r'''
import contextlib, gc
import numpy as np
import numba.cuda
from cuda.bindings import driver as cu
from numba.cuda.cudadrv import devices, driver
from numba.cuda.cudadrv.devicearray import DeviceNDArray

# numba's pointer classes count references without a GPU; only their context lookups need
# one, and nothing here is ever dereferenced.
devices._runtime.ensure_context = contextlib.nullcontext
import vtnumba.backend.cuda
vtnumba.backend.cuda.current_context = lambda: None  # (it asks the driver which context is current)

from vtnumba.ec.destination import LoadDestination, _gpu_view

BASE = 0x7F0000


class DeviceMemoryAtAMadeUpAddress:
    array = "the allocation"

    def view(self, dtype, shape, offset):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr = driver.MemoryPointer(None, cu.CUdeviceptr(BASE + offset), n)
        return DeviceNDArray(shape, (shape[1] * np.dtype(dtype).itemsize, np.dtype(dtype).itemsize), dtype,
                             gpu_data=ptr)


dest = LoadDestination(DeviceMemoryAtAMadeUpAddress(), BASE, 8192)
f16 = np.dtype(np.float16)
a = _gpu_view(dest, f16, (2, 1024), 0, 4096)
b = _gpu_view(dest, f16, (2, 1024), 4096, 4096)
assert a.device_ctypes_pointer.value == BASE and b.device_ctypes_pointer.value == BASE + 4096
assert a.shape == b.shape == (2, 1024) and a.dtype == np.float16 and a.strides == (2048, 2)
row = a[1]                           # a slice outlives the view it was cut from
typed = b.view(np.int16).reshape(-1)  # and so does a re-typed, reshaped one
del a, b
gc.collect()
assert not dest.views_dead, "the buffer was declared free while slices of its views still read it"
del row
gc.collect()
assert not dest.views_dead
del typed
gc.collect()
assert dest.views_dead, "the last derived array died but the buffer was never declared free"
# An empty view reads nothing and holds nothing.
class NoRows:  # (a zero-size device array needs a context to make)
    def view(self, dtype, shape, offset):
        return ("the memory's own empty view", shape)


empty = LoadDestination(NoRows(), 0, 0)
assert _gpu_view(empty, f16, (0, 1024), 0, 0) == ("the memory's own empty view", (0, 1024))
assert empty.views_pointer is None
print("ok")
'''


def test_gpu_load_views_are_tracked_through_everything_derived_from_them():
    # On a GPU a step's load buffer may be reused once its views are gone -- all of them,
    # including slices and re-typed arrays cut from a view after the view itself died.  numba's
    # own refcount (OwnedPointer) tracks that; the real numba.cuda classes, in a process
    # without the simulator.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", GPU_VIEW_TRACKING], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ from a review
def test_a_block_written_twice_in_one_step_is_refused(backend, env_factory, rng):
    # Two saves of one step sharing a block (or one save naming a block twice) overwrote each
    # other silently: the region held only the last entry's bytes.
    env = env_factory(backend)
    a = rng.standard_normal((2, env.hidden)).astype(np.float32)
    b = rng.standard_normal((2, env.hidden)).astype(np.float32)
    enc = {"a": env.device(a), "b": env.device(b)}
    meta = ECConnectorMetadata(saves={"a": [3, 4], "b": [4, 5]})
    env.worker.save_caches(enc, "a", meta)
    with pytest.raises(ValueError, match=r"saves\['b'\] writes block 4 \(index 0\) that this step already writes"):
        env.worker.save_caches(enc, "b", meta)
    env.worker.flush_saves()
    assert complete(env.worker).completed_saves == ["a"]
    np.testing.assert_array_equal(env.region.blocks[3:5].reshape(-1), as_bytes(a))
    assert (env.region.blocks[5] == SENTINEL).all()  # b wrote nothing
    with pytest.raises(ValueError, match=r"saves\['c'\] writes block 7 \(index 1\)"):
        save(env, {"c": a}, {"c": [7, 7]})
    # The next step starts afresh: the same blocks may be written again, once each.
    save(env, {"b": b}, {"b": [4, 5]})
    assert complete(env.worker).completed_saves == ["b"]
    np.testing.assert_array_equal(env.region.blocks[4:6].reshape(-1), as_bytes(b))


@pytest.fixture
def cpu():
    be = CPUBackend()
    yield be
    be.close()


def test_a_freed_output_leaves_the_step_batch_as_it_was(cpu, env_factory, rng):
    # The freed Buffer raised after the step's batch had been taken: every later step then
    # failed with "pass the same connector_metadata to every save_caches call".
    env = env_factory(cpu)
    dead = cpu.alloc(2 * env.bs)
    cpu.free(dead)
    meta = ECConnectorMetadata(saves={"dead": [0, 1]})
    with pytest.raises(RuntimeError, match="already freed"):
        env.worker.save_caches({"dead": dead}, "dead", meta)
    env.worker.flush_saves()  # nothing to send
    out = rng.standard_normal((2, env.hidden)).astype(np.float32)
    save(env, {"ok": out}, {"ok": [0, 1]})
    assert complete(env.worker).completed_saves == ["ok"]


def test_cleanup_waits_for_copies_still_in_flight(threaded, env_factory, rng):
    # Unmapping the region under a copy a threaded queue was still running crashed the process.
    env = env_factory(threaded)
    gate, _ = gated_save(env, rng, [0, 1, 2, 3])
    done = threading.Event()
    threading.Thread(target=lambda: (env.region.cleanup(), done.set())).start()
    time.sleep(0.1)
    assert not done.is_set(), "cleanup unmapped the region while a copy into it was queued"
    gate.set()
    assert done.wait(10) and env.region.closed


def test_reports_name_their_rank_and_count_once_per_rank(cpu, env_factory):
    from vtnumba.ec import ECScheduler, ECWorkerMetadata

    env = env_factory(cpu, tp_rank=1)
    s = ECScheduler("consumer", 32, expected_load_reports=2)
    tid = s.request_load("h", [0, 1])
    env.worker.start_load_caches({}, s.build_connector_meta())
    report = complete(env.worker)
    assert report.completed_loads == [tid] and report.load_ranks == [1]
    # One rank's report handed in twice must not stand in for the other rank's.
    assert s.update_connector_output(report).released == []
    assert s.update_connector_output(report).released == [] and s.stats["stale_reports"] == 1
    other = ECWorkerMetadata(completed_loads=[tid], load_ranks=[0])
    assert s.update_connector_output(other).released == ["h"]


# ------------------------------------------------------------------------------ cpu: copies on the spot
@pytest.mark.parametrize("output", ["caller's array", "backend buffer"])
def test_a_steps_only_save_is_copied_by_save_caches_and_reported_after_the_flush(env_factory, rng, monkeypatch,
                                                                                   output):
    """On the cpu target's synchronous queues a step's only save is its whole batch: save_caches
    copies it (one compiled call), flush_saves files it, the next poll reports it -- once."""
    from vtnumba.memory.copy_engine import live_address

    be = CPUBackend()
    try:
        env = env_factory(be)
        w = env.worker
        out = rng.standard_normal((3, env.hidden)).astype(np.float32)
        # A backend buffer's view is live memory; the caller's own array is not, and is not
        # registered either: the copy checks only the region's side of it.
        enc = {"h": env.device(out) if output == "backend buffer" else out}
        meta = ECConnectorMetadata(saves={"h": [7, 8, 9, 11]})  # an entry sized larger than the output
        calls = spy_on_copies(monkeypatch)
        w.save_caches(enc, "h", meta)
        assert calls == [1], "save_caches should have copied the step's one save"
        if output == "caller's array":
            assert not live_address(out, out.nbytes)[1], "nothing to register for a copy made on the spot"
        np.testing.assert_array_equal(env.region.blocks[7:10].reshape(-1), as_bytes(out))
        assert (env.region.blocks[11] == SENTINEL).all()
        assert w.inflight() == (0, 0) and w.build_connector_worker_meta() is None  # not filed before the flush
        w.flush_saves()
        assert calls == [1], "the flush must not copy it again"
        assert w.inflight() == (1, 0)
        assert complete(w).completed_saves == ["h"] and w.build_connector_worker_meta() is None
        assert w.stats["save"]["transfers"] == 1 and w.stats["save"]["bytes"] == 3 * env.bs
        assert w.history[-1][:4] == ("save", 1, 3 * env.bs, 1) and nothing_borrowed(w)
    finally:
        env.close()
        be.close()


def test_a_save_refused_on_the_spot_raises_in_save_caches_and_the_worker_carries_on(env_factory, rng, monkeypatch):
    be = CPUBackend()
    try:
        env = env_factory(be)
        w = env.worker
        out = rng.standard_normal((2, env.hidden)).astype(np.float32)
        enc = {"h": env.device(out)}
        refuse_copies(monkeypatch)
        with pytest.raises(ValueError, match="refused for the test"):
            w.save_caches(enc, "h", ECConnectorMetadata(saves={"h": [0, 1]}))
        w.flush_saves()  # nothing left to flush
        assert w.inflight() == (0, 0) and w.build_connector_worker_meta() is None and nothing_borrowed(w)
        assert (env.region.blocks == SENTINEL).all()
        monkeypatch.undo()
        save(env, {"h": out}, {"h": [0, 1]})  # the same blocks again: the refused step left no marks behind
        assert complete(w).completed_saves == ["h"]
        np.testing.assert_array_equal(env.region.blocks[0:2].reshape(-1), as_bytes(out))
    finally:
        env.close()
        be.close()


def test_a_save_copied_on_the_spot_but_not_flushed_joins_the_next_steps_batch(env_factory, rng, monkeypatch):
    """A caller that skips a flush: the next step's flush files both entries, and copies only the
    one that was not copied yet.  (Its descriptors must fit the first step's batch, sized from that
    step's metadata: here an entry of 4 blocks whose output fills 2.)"""
    be = CPUBackend()
    try:
        env = env_factory(be)
        w = env.worker
        a, b = rng.standard_normal((2, env.hidden)).astype(np.float32), rng.standard_normal((1, env.hidden))
        calls = spy_on_copies(monkeypatch)
        w.save_caches({"a": env.device(a)}, "a", ECConnectorMetadata(saves={"a": [0, 1, 2, 3]}))
        save(env, {"b": b.astype(np.float32)}, {"b": [6]})
        assert calls == [1, 1], "each entry copied once"
        assert sorted(complete(w).completed_saves) == ["a", "b"]
        np.testing.assert_array_equal(env.region.blocks[0:2].reshape(-1), as_bytes(a))
        np.testing.assert_array_equal(env.region.blocks[6].reshape(-1), as_bytes(b.astype(np.float32)))
        assert (env.region.blocks[2:6] == SENTINEL).all()
    finally:
        env.close()
        be.close()


def test_shutdown_gives_the_load_buffers_back_to_the_backend(threaded, env_factory):
    # On threaded queues the last load buffer, freed at shutdown, waits on an event just recorded
    # on the compute queue; empty_cache() then released nothing, and every producer/consumer
    # pair closed in a long-lived process kept a segment, its address range and two events in
    # the process-wide backend (found by a leak probe: +2 MiB a cycle).
    live_before, events_before = len(threaded.live_buffers()), len(threaded._events)
    env = env_factory(threaded)
    cache = {}
    env.worker.start_load_caches(cache, ECConnectorMetadata(loads={"a": (0, [0, 1])}))
    complete(env.worker)
    assert len(threaded.live_buffers()) > live_before
    del cache
    gc.collect()
    env.worker.shutdown()
    assert len(threaded.live_buffers()) == live_before
    assert len(threaded._events) == events_before
