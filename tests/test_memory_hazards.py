"""The seed's record_stream hazard, reproduced end to end, and the checker that catches it.

The scenario (the encoder-cache worker's): a block on the main queue holds an embedding;
a copy on a side queue reads it out; main frees the block, allocates again and writes.
Without ``record_stream(block, side)`` the allocator hands main the same memory at once,
and if the side copy has not run yet it reads main's new bytes.  We hold the side queue
at a gate before its copy so the copy has *certainly* not run -- no luck involved.
"""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from vtnumba.backend import CPUBackend
from vtnumba.memory import (CachingAllocator, HazardError, HazardReport, active_checker, check_hazards,
                            hazard_checks_off, note_use)
from test_memory_support import Holder, make_backend

N = 4096
OLD, NEW = 0xAB, 0xCD


def _seed_hazard(backend, *, record_stream: bool, hold, report_use: bool = True):
    """Run the scenario; returns (bytes the side copy read, reallocated-at-same-address?)."""
    alloc = CachingAllocator(backend)
    main, side = backend.create_queue("main"), backend.create_queue("side")
    block = alloc.allocate(N, main)
    ptr = block.ptr
    backend.memset(main, block, OLD)                 # the "embedding"
    written = backend.create_event()
    backend.record_event(written, main)
    backend.queue_wait_event(side, written)          # side reads only after main wrote
    hold(side)                                       # ... and not yet: held at the gate
    out = np.zeros(N, np.uint8)
    backend.copy(side, out, block, N)                # side reads the block (queued)
    if report_use:
        note_use(block, side)                        # what library code may tell the checker
    if record_stream:
        alloc.record_stream(block, side)             # the fix: tell the allocator too
    alloc.free(block)
    again = alloc.allocate(N, main)                  # main allocates again ...
    same = again.ptr == ptr
    backend.memset(main, again, NEW)                 # ... and overwrites
    backend.synchronize(main)
    return alloc, again, out, same, side


def _gate_holder(backend):
    gates = []

    def hold(q):
        g = threading.Event()
        gates.append(g)
        backend.launch_host_func(q, lambda: g.wait(10.0), name="gate")

    def release():
        for g in gates:
            g.set()

    return hold, release


@pytest.fixture
def threaded():
    b = CPUBackend(threaded=True)
    yield b
    b.close()


@pytest.mark.parametrize("how", ["backend.copy", "a kernel on the side queue"])
def test_checker_sees_a_cross_queue_use_made_through_the_backend_api_alone(threaded, how):
    """Nobody calls note_use: the side queue's copy (or kernel) is reported by the Backend API itself."""
    from vtnumba.kernels import fused_add_rms_norm

    hold, release = _gate_holder(threaded)
    with check_hazards("record") as checker:
        alloc = CachingAllocator(threaded)
        main, side = threaded.create_queue("main"), threaded.create_queue("side")
        block = alloc.allocate(N, main)
        threaded.memset(main, block, OLD)
        threaded.synchronize(main)
        hold(side)
        if how == "backend.copy":
            out = np.zeros(N, np.uint8)
            threaded.copy(side, out, block, N)
        else:
            y = block.view(np.float32, (8, N // 32))
            fused_add_rms_norm(y, None, np.ones(N // 32, np.float32), 1e-5, queue=side)
        alloc.free(block)                    # no record_stream, no note_use
        again = alloc.allocate(N, main)
        release()
        threaded.synchronize(side)
        assert [r.kind for r in checker.reports] == ["reuse-before-complete"], checker.reports
        assert "queue 'side'" in checker.reports[0].message
        alloc.free(again)


def test_without_record_stream_the_copy_reads_wrong_bytes(threaded):
    hold, release = _gate_holder(threaded)
    with hazard_checks_off():    # (even under VTNUMBA_CHECK_HAZARDS=1)
        alloc, again, out, same, side = _seed_hazard(threaded, record_stream=False, hold=hold)
    release()
    threaded.synchronize(side)
    assert same, "without record_stream the freed memory is reissued at once"
    assert (out == NEW).all(), "the side copy should have read the new owner's bytes (the hazard)"
    alloc.free(again)


def test_checker_flags_the_missing_record_stream(threaded):
    hold, release = _gate_holder(threaded)
    with check_hazards("record") as checker:
        alloc, again, out, same, side = _seed_hazard(threaded, record_stream=False, hold=hold)
        release()
        threaded.synchronize(side)
        assert len(checker.reports) == 1
        report = checker.reports[0]
        assert isinstance(report, HazardReport) and report.kind == "reuse-before-complete"
        assert report.block_id == again.id and report.queues == ["main", "side"]
        msg = report.message
        assert f"record_stream(block #{report.other_block_id}, side) before free" in msg
        assert "queue 'side'" in msg and "queue 'main'" in msg
        assert (out == NEW).all()                    # record mode: the corruption still happens
        alloc.free(again)


def test_a_cross_queue_use_that_finished_before_the_free_is_not_a_hazard(threaded):
    # The use on the side queue was waited for before the free.  The checker still recorded
    # an event there at free time, which the idle queue's thread had not reached when the
    # next allocation looked: a false report every time (and HazardError in raise mode).
    alloc = CachingAllocator(threaded)
    main, side = threaded.create_queue("main"), threaded.create_queue("side")
    src = threaded.alloc(N)
    with check_hazards("raise") as checker:
        for _ in range(20):
            block = alloc.allocate(N, main)
            threaded.copy(side, block.view(np.uint8), src, N)
            threaded.synchronize(side)  # the use is complete
            assert threaded.query_queue(side) and threaded.query_queue(main)
            alloc.free(block)
            alloc.free(alloc.allocate(N, main))  # the same memory again: fine
    assert checker.reports == []
    # ... while a use still in flight is reported, as before (the side queue held at a gate).
    gate = threading.Event()
    threaded.launch_host_func(side, gate.wait)
    assert not threaded.query_queue(side)
    with check_hazards("record") as checker:
        block = alloc.allocate(N, main)
        threaded.copy(side, block.view(np.uint8), src, N)
        alloc.free(block)
        alloc.free(alloc.allocate(N, main))
        gate.set()
        threaded.synchronize(side)
    assert [r.kind for r in checker.reports] == ["reuse-before-complete"]


def test_checker_in_raise_mode_refuses_the_reuse(threaded):
    hold, release = _gate_holder(threaded)
    alloc = CachingAllocator(threaded)
    main, side = threaded.create_queue("main"), threaded.create_queue("side")
    with check_hazards() as checker:
        block = alloc.allocate(N, main)
        hold(side)
        out = np.zeros(N, np.uint8)
        threaded.copy(side, out, block, N)
        note_use(block, side)
        alloc.free(block)
        with pytest.raises(HazardError, match=r"call record_stream\(block #\d+, side\) before free") as err:
            alloc.allocate(N, main)
        assert err.value.report is checker.reports[0]
        alloc.check_invariants()                     # the refused block went back to the pool
        assert alloc.stats()["active_blocks"] == 0
        release()
        threaded.synchronize(side)
        fine = alloc.allocate(N, main)               # side finished: the reuse is now safe
        assert len(checker.reports) == 1
        alloc.free(fine)


def test_a_refused_block_leaves_no_trace_in_the_checker(threaded):
    # The refused block stayed "live" in the checker: the next legal use of its memory on
    # another queue was reported as a use after free of a block nobody ever received.
    hold, release = _gate_holder(threaded)
    alloc = CachingAllocator(threaded)
    main, side = threaded.create_queue("main"), threaded.create_queue("side")
    out = np.zeros(N, np.uint8)
    with check_hazards() as checker:
        block = alloc.allocate(N, main)
        hold(side)
        threaded.copy(side, out, block, N)
        alloc.free(block)
        with pytest.raises(HazardError):
            alloc.allocate(N, main)
        release()
        threaded.synchronize()
        fresh = alloc.allocate(N, main)
        alloc.record_stream(fresh, side)
        threaded.copy(side, out, fresh, N)  # legal: was a false "use after free"
        threaded.synchronize(side)
        alloc.free(fresh)
        assert len(checker.reports) == 1


def test_a_free_after_the_backend_was_closed_is_allowed_with_the_checker_on(threaded):
    # Backend.close lets outstanding memory still be freed; with the checker on, the free
    # asked the closed backend about its queues, raised, and left the block live.
    alloc = CachingAllocator(threaded)
    q, side = threaded.create_queue("q"), threaded.create_queue("side")
    with check_hazards() as checker:
        block = alloc.allocate(N, q)
        threaded.copy(side, np.zeros(N, np.uint8), block, N)
        threaded.close()
        alloc.free(block)
        assert alloc.stats()["active_blocks"] == 0 and not checker.reports


def test_finished_uses_of_released_segments_are_forgotten(threaded):
    # The checker pruned a freed block's records only when the same segment was allocated from
    # or freed into again -- never, once empty_cache had released it: each step of a loop kept
    # a record and a backend event for good.
    main, side = threaded.create_queue("main"), threaded.create_queue("side")
    holder = Holder(threaded)
    with check_hazards("record") as checker:
        for _ in range(10):
            alloc = CachingAllocator(threaded)
            block = alloc.allocate(N, main)
            holder.hold(side)
            threaded.memset(side, block, 1)  # still queued when the block is freed: a record
            alloc.record_stream(block, side)
            alloc.free(block)
            holder.release()
            threaded.synchronize()
            alloc.empty_cache()
        alloc = CachingAllocator(threaded)
        alloc.free(alloc.allocate(N, main))  # any free forgets every segment's finished uses
        assert not checker._retired and len(threaded._events) == 0 and not checker.reports
        assert checker.pending() == 0
    holder.close()


def test_with_record_stream_nothing_is_flagged_and_bytes_are_intact(threaded):
    hold, release = _gate_holder(threaded)
    with check_hazards() as checker:
        alloc, again, out, same, side = _seed_hazard(threaded, record_stream=True, hold=hold)
        assert not same, "with record_stream the memory must wait for the side queue"
        assert alloc.stats()["blocks_waiting_on_events"] == 1
        release()
        threaded.synchronize(side)
        assert (out == OLD).all(), "the side copy must read the original bytes"
        assert checker.reports == []
        alloc.free(again)
        alloc.process_events()
        alloc.check_invariants()


def test_use_after_free_is_reported(threaded):
    alloc = CachingAllocator(threaded)
    main, side = threaded.create_queue("main"), threaded.create_queue("side")
    with check_hazards() as checker:
        block = alloc.allocate(100, main)
        alloc.free(block)
        with pytest.raises(HazardError, match=r"use after free: block #\d+ \(100 B, allocated on queue 'main'\) "
                                              r"is used on queue 'side'"):
            note_use(block, side)
        assert checker.reports[0].kind == "use-after-free"


# The simulator is the synchronous *device* backend; a GPU's queues really lag, so there the
# "nothing is flagged" half would race with the side copy.
@pytest.mark.parametrize("kind", [pytest.param("device", marks=pytest.mark.simulator_only), "cpu"])
def test_synchronous_backends_flag_only_an_emulated_lag(kind, device_backend_factory):
    """On synchronous backends every use completes at once, so nothing is flagged; with a
    lagging stream emulated (a GPU's reality) the same checker flags the reuse."""
    backend = make_backend(kind, device_backend_factory)
    try:
        for lagging in (False, True):
            holder = Holder(backend)
            try:
                with check_hazards("record") as checker:
                    hold = holder.hold if lagging else (lambda q: None)
                    alloc, again, out, same, side = _seed_hazard(backend, record_stream=False, hold=hold)
                    assert same
                    assert len(checker.reports) == (1 if lagging else 0), (kind, lagging)
                    alloc.free(again)
                holder.release()
                with check_hazards() as checker:
                    hold = holder.hold if lagging else (lambda q: None)
                    alloc, again, out, same, side = _seed_hazard(backend, record_stream=True, hold=hold)
                    assert same is (not lagging) and checker.reports == []
                    holder.release()
                    alloc.free(again)
            finally:
                holder.close()
    finally:
        backend.close()


def test_check_hazards_nests_and_restores():
    before = active_checker()    # None, or the environment's checker
    with check_hazards("record") as outer:
        assert active_checker() is outer
        with check_hazards() as inner:
            assert active_checker() is inner and inner.on_hazard == "raise"
            with hazard_checks_off():
                assert active_checker() is None
                with hazard_checks_off():
                    assert active_checker() is None
                assert active_checker() is None
            assert active_checker() is inner
        assert active_checker() is outer
    assert active_checker() is before
    with pytest.raises(ValueError, match="on_hazard='warn' must be one of raise, record"):
        with check_hazards("warn"):
            pass


def test_note_use_bad_input(threaded):
    alloc = CachingAllocator(threaded)
    q = threaded.create_queue()
    b = alloc.allocate(10, q)
    with pytest.raises(TypeError, match="note_use\\(block=...\\) needs a Block"):
        note_use(threaded.alloc(10), q)
    with pytest.raises(TypeError, match="note_use\\(queue=...\\) needs a Queue"):
        note_use(b, "side")
    with pytest.raises(ValueError, match="belongs to CPUBackend, not to the block's backend"):
        note_use(b, CPUBackend().create_queue())
    with hazard_checks_off():
        note_use(b, q)  # checker off: a no-op
    alloc.free(b)


def _run(code, env_value):
    env = {k: v for k, v in os.environ.items()}
    env["VTNUMBA_CHECK_HAZARDS"] = env_value
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_environment_variable_turns_the_checker_on():
    code = ("from vtnumba.memory import active_checker\n"
            "c = active_checker(); print(type(c).__name__, c.on_hazard)")
    assert _run(code, "1").stdout.split() == ["HazardChecker", "raise"]
    assert _run(code, "record").stdout.split() == ["HazardChecker", "record"]
    off = _run("from vtnumba.memory import active_checker; print(active_checker())", "0")
    assert off.stdout.strip() == "None"
    bad = _run("import vtnumba.memory", "maybe")
    assert bad.returncode != 0 and "VTNUMBA_CHECK_HAZARDS='maybe' is not understood" in bad.stderr
