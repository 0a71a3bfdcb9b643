"""Objects used in the wrong order: after a close, from two threads, torn down backwards.

Each case was found by a probe of lifecycle misuse and once ended in a deep internal error
(an IndexError from a closed object), a half-done teardown, blocks held for good, or a call
that worked or failed depending on what a cache happened to hold.  Now each either works
(teardown in any order) or refuses with an error that says what happened.  (A model's
encoder from two threads: ``tests/test_minilm.py``; a host function waiting for its own
queue, and close() after failed work: ``tests/test_backend.py``; a TPSP handle from two
threads: ``tests/mpi/test_tpsp_lifecycle.py``.)
"""

import threading

import numpy as np
import pytest

from vtnumba import dist
from vtnumba.backend import CPUBackend
from vtnumba.backend.single_caller import SingleCaller
from vtnumba.ec import ECScheduler, ECWorker, create_ec_shared_region
from vtnumba.ec.metadata import ECWorkerMetadata
from vtnumba.memory import CachingAllocator, StepArena


def test_single_caller_refuses_a_second_thread_and_lets_the_first_reenter():
    guard = SingleCaller("the thing", "its calls share scratch")
    inside, leave, errors = threading.Event(), threading.Event(), []

    def first():
        with guard, guard:  # re-entry by the same thread is fine
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(30)
    try:
        with guard:
            errors.append("entered")
    except RuntimeError as exc:
        errors.append(str(exc))
    leave.set()
    t.join(30)
    assert errors == ["the thing is already running a call on another thread: its calls share scratch, so it "
                      "serves one thread at a time -- give each thread its own, or call it from one thread"]
    with guard:  # free again
        pass


@pytest.mark.parametrize("threaded", [False, True], ids=["cpu", "cpu-threaded"])
def test_an_ec_worker_shuts_down_after_its_backend_was_closed(threaded):
    """shutdown() raised 'was closed' from its drain, after marking itself shut down: its
    queues were never released and a second shutdown() did nothing."""
    region = create_ec_shared_region(engine_id="lifecycle", hidden_size=4, region_bytes=4096, create=True,
                                     anonymous=True)
    try:
        b = CPUBackend(threaded=threaded)
        w = ECWorker(region, backend=b)
        b.close()
        w.shutdown()
        assert b.live_queues() == []
    finally:
        region.cleanup()


def test_scheduler_shutdown_gives_back_the_blocks_of_what_it_forgets():
    """Unconfirmed saves kept their blocks and pinned loads their pins for good, and
    has_pending_work() stayed True: a 'step while pending' loop never ended."""
    s = ECScheduler("both", 8)
    s.request_save("saving", 3)  # scheduled, never confirmed
    s.request_save("ready", 2)
    s.build_connector_meta()
    s.update_connector_output(ECWorkerMetadata(completed_saves=["ready"]))
    assert s.request_load("ready") is not None  # pins it
    s.build_connector_meta()
    assert s.has_pending_work() and s.cache.num_free_blocks == 3
    s.shutdown()
    assert not s.has_pending_work() and s.cache.num_free_blocks == 6  # "ready" stays cached, evictable
    assert s.cache.lookup("saving") is None and s.cache.lookup("ready").state == "ready"
    assert s.request_save("saving", 3) is not None  # the name is free again


def test_queue_flags_after_close_say_so_or_do_nothing():
    """received() / missing() / release() raised IndexError after close(); missing() and
    release() run while another error is being reported, where they must not raise one."""
    with dist.distributed(tp_size=1) as g:
        flags = dist.QueueFlags(g, ["a"], CPUBackend())
        flags.close()
        with pytest.raises(RuntimeError, match="QueueFlags on group 'tp' are closed"):
            flags.received()
        assert flags.missing() == "unknown (the flags were closed)"
        flags.release()  # nothing left to release


def test_a_closed_backend_is_refused_by_what_holds_its_memory():
    """After close(), a cached block or an arena's slab still handed out memory, and peer
    buffers were made -- the same call worked or failed depending on what a cache held."""
    b = CPUBackend()
    q = b.create_queue()
    alloc = CachingAllocator(b)
    alloc.free(alloc.allocate(256, q))  # now cached: the next allocate would not ask the backend
    arena = StepArena(b, 1024)
    b.close()
    with pytest.raises(RuntimeError, match="this allocator's backend CPUBackend on cpu:0 was closed"):
        alloc.allocate(256, q)
    with pytest.raises(RuntimeError, match="StepArena's backend CPUBackend on cpu:0 was closed"):
        arena.alloc(64)
    arena.close()  # giving memory back still works
    with dist.distributed(tp_size=1) as g:
        with pytest.raises(RuntimeError, match="backend CPUBackend on cpu:0 was closed"):
            dist.PeerBuffers(64, g, b)


def test_a_closed_backend_makes_no_arrays_either():
    # close() says allocating raises from now on: alloc did, empty and asarray did not.
    b = CPUBackend()
    b.close()
    for call in (lambda: b.empty(3), lambda: b.asarray(np.zeros(3)), lambda: b.alloc(8)):
        with pytest.raises(RuntimeError, match="CPUBackend on cpu:0 was closed; make a new backend"):
            call()


@pytest.mark.parametrize("value", ["no", "false", "0", 1, None])
def test_cpu_backend_threaded_must_be_a_bool(value, monkeypatch):
    # CPUBackend(threaded="no") made threaded queues ("no" is truthy).
    monkeypatch.delenv("VTNUMBA_CPU_QUEUES", raising=False)
    if value is None:
        assert CPUBackend(threaded=None).threaded is False  # None: the environment's choice
        return
    with pytest.raises(TypeError, match=rf"threaded={value!r} must be True, False or None"):
        CPUBackend(threaded=value)


def test_two_backends_of_one_kind_are_told_apart():
    a, b = CPUBackend(), CPUBackend()
    with pytest.raises(ValueError, match="belongs to another backend object .* not this CPUBackend on cpu:0: a "
                                         "queue works only with the backend that created it"):
        b.synchronize(a.create_queue())
