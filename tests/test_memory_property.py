"""A hypothesis state machine over random allocate / free / record_stream / hold / step sequences.

After every step it checks what a caching allocator must never break:

* live blocks never overlap, and every byte of a live block is its owner's (each block is
  filled with its own pattern when allocated, and checked on every step);
* memory freed with ``record_stream`` to a queue that is still held is not handed out and
  keeps its bytes until the held queue passes the recorded event;
* the stats agree with the model and with the allocator's own walk of its segments;
* ``empty_cache`` leaves no entirely free segment behind, and in the end returns everything.

Runs on threaded cpu queues (real gates) and on the synchronous cpu backend.
"""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from vtnumba.backend import CPUBackend
from vtnumba.memory import CachingAllocator

MiB = 1 << 20
# Mostly a few size classes, so freed memory is often exactly what the next request wants.
SIZES = st.one_of(st.sampled_from([100, 4096, 4096, 1 * MiB, 3 * MiB]), st.integers(1, 64 * 1024))
NQ = 2


def _pattern(block_id: int) -> int:
    return block_id % 251 + 1  # never 0, differs between neighbours


class AllocatorMachine(RuleBasedStateMachine):
    threaded = True
    blocks = Bundle("blocks")

    def __init__(self):
        super().__init__()
        self.backend = CPUBackend(threaded=self.threaded)
        self.queues = [self.backend.create_queue(f"q{i}") for i in range(NQ)]
        self.alloc = CachingAllocator(self.backend)
        self.live = {}          # block id -> block
        self.held = {}          # queue index -> gate
        self.protected = []     # (segment id, offset, size, pattern, held queue index) freed behind a gate

    # ---------------------------------------------------------------- rules
    @rule(target=blocks, nbytes=SIZES, qi=st.integers(0, NQ - 1))
    def allocate(self, nbytes, qi):
        b = self.alloc.allocate(nbytes, self.queues[qi])
        assert b.nbytes == nbytes and b.size >= nbytes and b.queue is self.queues[qi]
        b.array.fill(_pattern(b.id))
        self.live[b.id] = b
        return b

    @rule(block=blocks, qi=st.integers(0, NQ - 1))
    def record_stream(self, block, qi):
        if block.id in self.live:
            self.alloc.record_stream(block, self.queues[qi])

    @rule(block=consumes(blocks))
    def free(self, block):
        if block.id not in self.live:
            return
        del self.live[block.id]
        held_uses = [i for i, q in enumerate(self.queues)
                     if q.id in block._stream_uses and i in self.held]
        if held_uses:
            self.protected.append((block.segment_id, block.offset, block.size, _pattern(block.id), held_uses))
        self.alloc.free(block)

    @rule(block=consumes(blocks), qi=st.integers(0, NQ - 1), held=st.booleans())
    def side_use_then_free(self, block, qi, held):
        """The seed's pattern in one step: another queue uses the block (perhaps held back),
        record_stream names it, the owner frees the block."""
        if block.id not in self.live:
            return
        if held:
            self.hold(qi)
        self.record_stream(block, qi)
        self.free(block)

    @rule(qi=st.integers(0, NQ - 1))
    def hold(self, qi):
        if qi in self.held or not self.threaded:
            return
        gate = threading.Event()
        self.held[qi] = gate
        self.backend.launch_host_func(self.queues[qi], lambda: gate.wait(10.0), name="gate")

    @rule(qi=st.integers(0, NQ - 1))
    def release(self, qi):
        gate = self.held.pop(qi, None)
        if gate is not None:
            gate.set()
            self.backend.synchronize(self.queues[qi])
            self.protected = [p for p in self.protected if not set(p[4]) <= set(range(NQ)) - set(self.held)]

    @rule()
    def step(self):
        self.alloc.process_events()

    @rule()
    def empty_cache(self):
        self.alloc.empty_cache()
        for seg in self.alloc.segment_map():
            pieces = seg["pieces"]
            assert not (len(pieces) == 1 and pieces[0]["state"] == "free"), \
                f"empty_cache left the entirely free segment #{seg['segment']}"

    # ---------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_is_consistent(self):
        self.alloc.check_invariants()
        s = self.alloc.stats()
        assert s["active_blocks"] == len(self.live)
        assert s["requested_bytes"] == sum(b.nbytes for b in self.live.values())
        assert s["allocated_bytes"] == sum(b.size for b in self.live.values())
        assert s["reserved_bytes"] == s["allocated_bytes"] + s["cached_free_bytes"] + s["bytes_waiting_on_events"]
        assert s["peak_allocated_bytes"] >= s["allocated_bytes"]
        assert s["num_segments"] == len(self.alloc.segment_map())

    @invariant()
    def live_blocks_are_disjoint_and_hold_their_bytes(self):
        ranges = sorted((b.segment_id, b.offset, b.offset + b.size, b) for b in self.live.values())
        for (s1, _, e1, b1), (s2, o2, _, b2) in zip(ranges, ranges[1:]):
            assert s1 != s2 or e1 <= o2, f"{b1!r} overlaps {b2!r}"
        for b in self.live.values():
            assert (b.array == _pattern(b.id)).all(), f"{b!r} lost its bytes"

    @invariant()
    def memory_behind_a_held_queue_is_not_reused(self):
        for seg, off, size, pattern, _ in self.protected:
            for b in self.live.values():
                assert b.segment_id != seg or b.offset + b.size <= off or off + size <= b.offset, \
                    f"{b!r} got memory still protected by record_stream to a held queue"

    def teardown(self):
        for gate in self.held.values():
            gate.set()
        self.backend.synchronize()
        for b in list(self.live.values()):
            self.alloc.free(b)
        self.alloc.empty_cache(wait_s=5.0)
        s = self.alloc.stats()
        assert s["reserved_bytes"] == 0 and s["num_segments"] == 0 and s["blocks_waiting_on_events"] == 0
        self.backend.close()


class SyncAllocatorMachine(AllocatorMachine):
    threaded = False


_settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])

TestAllocatorThreaded = AllocatorMachine.TestCase
TestAllocatorThreaded.settings = _settings
TestAllocatorSync = SyncAllocatorMachine.TestCase
TestAllocatorSync.settings = _settings


def test_property_machine_can_fail():
    """The invariants are not vacuous: a block overwritten by a neighbour is caught."""
    m = AllocatorMachine()
    try:
        a = m.allocate(nbytes=1000, qi=0)
        m.allocate(nbytes=1000, qi=0)
        np.asarray(a._owner.array)[a.offset + a.size] = 0  # scribble on the next block's first byte
        with pytest.raises(AssertionError, match="lost its bytes"):
            m.live_blocks_are_disjoint_and_hold_their_bytes()
    finally:
        m.teardown()
