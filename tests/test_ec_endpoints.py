"""ECProducer / ECConsumer in one process (``comm=None``): ownership, saves, loads, refusals, hooks.

The multi-rank setup and failure paths run under mpiexec: ``tests/mpi/test_ec_disagg.py``
(raises, in-process) and ``tests/test_ec_faults.py`` (kills and stops, whole processes).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from vtnumba.backend.cpu import CPUBackend
from vtnumba.ec import ECConsumer, ECProducer
from vtnumba.ec.endpoints import POINTS, FaultInjection

HIDDEN = 8


@pytest.fixture
def be():
    b = CPUBackend()
    yield b
    b.close()


@pytest.fixture
def pair(be):
    """A producer and a consumer on one anonymous region, recording the points they pass."""
    points = []
    prod = ECProducer(hidden_size=HIDDEN, dtype="float32", region_bytes=16 * HIDDEN * 4, name="ept", backend=be,
                      on_point=points.append)
    cons = ECConsumer(hidden_size=HIDDEN, dtype="float32", handle=prod.handle, backend=be, on_point=points.append)
    prod.stop_sharing()
    yield prod, cons, points
    cons.close()
    prod.close()


def _device(be, queue, host):
    buf = be.alloc(host.nbytes)
    be.copy(queue, buf, host, host.nbytes)
    return buf.view(host.dtype, host.shape)


def test_round_trip_through_both_endpoints(be, pair, rng):
    prod, cons, points = pair
    assert prod.region.path is None and not [f for f in os.listdir("/dev/shm") if prod.region.engine_id in f]
    out = rng.standard_normal((3, HIDDEN)).astype(np.float32)
    ids = prod.request_save("h", 3)
    np.testing.assert_array_equal(ids, [0, 1, 2])
    assert prod.save({"h": _device(be, prod.compute_queue, out)}) == ["h"]
    assert prod.wait_saves() == ["h"] and prod.is_ready("h")
    loaded = cons.load({"h": prod.grant("h")})
    np.testing.assert_array_equal(loaded["h"], out)
    assert prod.cache.lookup("h").pinned
    prod.release("h")
    assert not prod.cache.lookup("h").pinned
    assert points == ["created", "opened", "saving", "loading", "loaded"]
    assert set(points) <= set(POINTS)


def test_a_refused_save_gives_its_blocks_back_and_the_others_go_out(be, pair, rng):
    prod, _, _ = pair
    prod.request_save("good", 2)
    prod.request_save("bad", 2)
    outputs = {"good": _device(be, prod.compute_queue, rng.standard_normal((2, HIDDEN)).astype(np.float32)),
               "bad": _device(be, prod.compute_queue, rng.standard_normal((2, HIDDEN)).astype(np.float16))}
    with pytest.raises(ValueError, match=r"encoder_cache\['bad'\] has dtype float16; the region holds float32"):
        prod.save(outputs)
    assert "bad" not in prod.cache and prod.cache.num_free_blocks == 14
    assert prod.wait_saves() == ["good"]


def test_oversize_and_missing_outputs_are_refused_too(be, pair, rng):
    prod, _, _ = pair
    prod.request_save("big", 2)
    with pytest.raises(ValueError, match=r"has 3 rows \(96 bytes\) but mm_hash='big' was allocated 2 blocks"):
        prod.save({"big": _device(be, prod.compute_queue, np.zeros((3, HIDDEN), np.float32))})
    prod.request_save("ghost", 1)
    with pytest.raises(KeyError, match="ghost"):
        prod.save({})
    assert len(prod.cache) == 0 and prod.cache.num_free_blocks == 16


def test_an_output_with_fewer_rows_than_requested_is_refused(be, pair, rng):
    """The consumer loads every requested row: a short output left the rest of its blocks as an
    evicted entry had written them, and the load handed those bytes back as the entry's."""
    prod, cons, _ = pair
    prod.request_save("short", 2)
    rows = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    with pytest.raises(ValueError, match=r"outputs\['short'\] has 1 rows, but request_save\('short', 2\) "
                                         r"reserved 2; .*save exactly the rows requested"):
        prod.save({"short": _device(be, prod.compute_queue, rows)})
    assert "short" not in prod.cache and prod.cache.num_free_blocks == 16
    buf = be.alloc(HIDDEN * 4)  # a raw Buffer counts its rows by bytes
    prod.request_save("raw", 2)
    with pytest.raises(ValueError, match=r"outputs\['raw'\] has 1 rows"):
        prod.save({"raw": buf})
    with pytest.raises(TypeError, match="outputs must be a mapping mm_hash -> device array, got list"):
        prod.save([rows])
    with pytest.raises(TypeError, match="grants must be a mapping mm_hash -> block ids"):
        cons.load([prod.grant("x")])
    prod.request_save("strided", 2)
    wide = np.zeros((2, 2 * HIDDEN), np.float32)
    with pytest.raises(ValueError, match=r"encoder_cache\['strided'\] \(shape \(2, 8\)\) must be C-contiguous"):
        prod.save({"strided": wide[:, ::2]})


def test_a_freed_output_is_refused_and_the_step_goes_on(be, pair, rng):
    # A freed Buffer raised RuntimeError, which save() did not catch: the step's other saves
    # never went out, their entries stayed "not ready" for good, and every later save failed.
    prod, _, _ = pair
    for h in ("a", "dead", "c"):
        prod.request_save(h, 2)
    dead = be.alloc(2 * HIDDEN * 4)
    be.free(dead)
    good = {h: _device(be, prod.compute_queue, rng.standard_normal((2, HIDDEN)).astype(np.float32)) for h in "ac"}
    with pytest.raises(RuntimeError, match="already freed"):
        prod.save({**good, "dead": dead})
    assert sorted(prod.wait_saves()) == ["a", "c"] and "dead" not in prod.cache
    prod.request_save("next", 2)
    assert prod.save({"next": good["a"]}) == ["next"]


def test_a_failed_load_schedules_none_of_its_grants(be, pair, rng):
    # The grants before the bad one stayed scheduled: "'a' is already being loaded" for good,
    # and the next load returned 'a' unasked.
    prod, cons, _ = pair
    for h in ("a", "c"):
        prod.request_save(h, 1)
    prod.save({h: _device(be, prod.compute_queue, rng.standard_normal((1, HIDDEN)).astype(np.float32)) for h in "ac"})
    prod.wait_saves()
    ga, gc = prod.grant("a"), prod.grant("c")
    with pytest.raises(ValueError, match="block id 999 is outside the region"):
        cons.load({"a": ga, "b": [999]})
    assert list(cons.load({"c": gc})) == ["c"]
    assert list(cons.load({"a": ga})) == ["a"]


def test_a_closed_consumer_loads_nothing(be):
    prod = ECProducer(hidden_size=HIDDEN, region_bytes=16 * HIDDEN * 4, name="cl", backend=be)
    cons = ECConsumer(hidden_size=HIDDEN, handle=prod.handle, backend=be)
    cons.close()
    with pytest.raises(RuntimeError, match=r"ECConsumer.load\(\) after close\(\)"):
        cons.load({"a": [0]})
    prod.close()
    with pytest.raises(RuntimeError, match=r"ECProducer.save\(\) after close\(\)"):
        prod.save({})


def test_a_closed_producer_hands_out_nothing(be):
    # request_save after close() handed out blocks of an unmapped region; poll() said [].
    prod = ECProducer(hidden_size=HIDDEN, region_bytes=16 * HIDDEN * 4, name="closed", backend=be)
    prod.close()
    for op, call in (("request_save", lambda: prod.request_save("h", 1)), ("grant", lambda: prod.grant("h")),
                     ("release", lambda: prod.release("h")), ("poll", prod.poll), ("wait_saves", prod.wait_saves)):
        with pytest.raises(RuntimeError, match=rf"ECProducer.{op}\(\) after close\(\)"):
            call()
    prod.close()  # twice: harmless


def test_roles_and_misuse(be, pair):
    prod, cons, _ = pair
    assert cons.is_leader and cons.followers == [] and cons.role_name == "consumer"
    with pytest.raises(RuntimeError, match="serve\\(\\) is for the consumer ranks other than the leader"):
        cons.serve()
    with pytest.raises(RuntimeError, match="no communicator"):
        prod.send("x")
    with pytest.raises(ValueError, match="needs the producer's handle"):
        ECConsumer(hidden_size=HIDDEN, backend=be)
    with pytest.raises(TypeError, match="on_point must be callable"):
        ECProducer(hidden_size=HIDDEN, region_bytes=1024, on_point="nope")
    with pytest.raises(ValueError, match="handle_timeout_s=-1.0 must be a positive"):
        ECConsumer(hidden_size=HIDDEN, backend=be, handle_timeout_s=-1)  # (checked first of all)


@pytest.mark.parametrize("name, exc, match", [
    ("a/b", ValueError, r"name='a/b' must be a str of 1-100 characters of \[A-Za-z0-9_.-\]"),
    ("n" * 101, ValueError, r"name='n{101}' must be a str of 1-100 characters"),
    (5, TypeError, r"name=5 must be a str, got int"),
])
def test_a_bad_producer_name_is_named_as_given(be, name, exc, match):
    # The message named engine_id (never passed), with a pid and random characters added,
    # and name=5 was taken (as "5").
    with pytest.raises(exc, match=match):
        ECProducer(hidden_size=HIDDEN, region_bytes=1024, backend=be, name=name)
    ECProducer(hidden_size=HIDDEN, region_bytes=1024, backend=be, name="n" * 100).close()


def test_pin_memory_must_be_a_bool(be):
    # "no" is a true string: it would have pinned the region on a GPU.
    with pytest.raises(TypeError, match="pin_memory='no' must be True or False"):
        ECProducer(hidden_size=HIDDEN, region_bytes=1024, backend=be, pin_memory="no")


def test_the_first_save_compiles_nothing(be):
    # The worker warmed the descriptor builder with writable ids, but the cache hands out
    # read-only ones: the first save compiled a new signature inside its timed copy (0.5 s
    # with a cold numba cache, in the step's copy_ms and the demo's throughput).
    from vtnumba.ec import descriptors

    with ECProducer(hidden_size=HIDDEN, dtype="float32", region_bytes=16 * HIDDEN * 4, backend=be) as prod:
        kernels = (descriptors._fill_and_copy, descriptors._fill_block_runs)
        before = [len(k.signatures) for k in kernels]
        for step in (["a"], ["b", "c"]):  # one entry in a step, then two (the multi-entry path)
            for h in step:
                prod.request_save(h, 2)
            prod.save({h: np.ones((2, HIDDEN), np.float32) for h in step})
            prod.wait_saves()
        assert [len(k.signatures) for k in kernels] == before


def test_consumer_with_another_model_config_is_refused(be):
    with ECProducer(hidden_size=HIDDEN, dtype="float32", region_bytes=1024, backend=be) as prod:
        with pytest.raises(ValueError, match="hidden_size=16 but the producer"):
            ECConsumer(hidden_size=16, dtype="float32", handle=prod.handle, backend=be)


def test_context_manager_releases_on_error(be):
    with pytest.raises(ZeroDivisionError):
        with ECProducer(hidden_size=HIDDEN, region_bytes=1024, backend=be) as prod:
            1 / 0
    assert prod.region.closed
    prod.close()  # twice is harmless


def test_a_failing_setup_releases_what_it_made(be):
    def boom(point):
        raise RuntimeError(f"at {point}")

    with pytest.raises(RuntimeError, match="at created"):
        ECProducer(hidden_size=HIDDEN, region_bytes=1024, backend=be, on_point=boom)


def test_fault_injection_parsing():
    f = FaultInjection.parse("stop:2:loading@3")
    assert (f.how, f.rank, f.point, f.nth) == ("stop", 2, "loading", 3)
    assert FaultInjection.parse("kill:0:created").nth == 1
    assert f.on_point(1) is None  # another rank: no hook
    hook = FaultInjection.parse("raise:0:saving@2").on_point(0)
    hook("saving")
    hook("loading")
    with pytest.raises(RuntimeError, match="injected failure at 'saving'"):
        hook("saving")
    for bad in ("kill", "kill:x:created", "explode:0:created", "kill:0:nowhere", "kill:0:created@0"):
        with pytest.raises(ValueError, match="--inject"):
            FaultInjection.parse(bad)


def test_faults_that_could_never_fire_are_refused_or_reported():
    from vtnumba.ec.endpoints import points_passed

    passes = lambda r: points_passed(r, 0, [1, 2], steps=10)  # noqa: E731
    FaultInjection.parse("raise:0:saving@10").check_fires(3, passes)
    for spec, says in (("raise:0:created@2", "passes 'created' at most 1 time"),
                       ("kill:0:saving@11", "passes 'saving' at most 10 time"),
                       ("kill:2:loaded", "never passes 'loaded'")):
        with pytest.raises(ValueError, match=says):
            FaultInjection.parse(spec).check_fires(3, passes)
    # An @N only the run's length decides: the hook says at the end that it never fired.
    hook = FaultInjection.parse("raise:0:saving@3").on_point(0)
    hook("saving")
    with pytest.raises(RuntimeError, match=r"--inject='raise:0:saving@3' never fired: this run passed 'saving' "
                                           r"1 time\(s\), not 3"):
        hook.check_fired()


def test_a_communicator_without_consumers_is_refused():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="consumers=\\[\\] must be distinct ranks"):
        ECProducer(MPI.COMM_SELF, hidden_size=HIDDEN, region_bytes=1024)


def test_star_import_does_not_start_mpi():
    code = ("import sys\n"
            "from vtnumba.ec import *\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'importing vtnumba.ec started MPI'\n"
            "print(ECProducer.__name__, ECConsumer.__name__, ECChannel.__name__, PeerFailure.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ECProducer", "ECConsumer", "ECChannel", "PeerFailure"]
