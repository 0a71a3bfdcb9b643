"""EmbeddingCache: block allocation, FIFO eviction of ready entries, pins, thread safety."""

import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vtnumba.ec import EmbeddingCache


def ready(cache, key, n):
    e = cache.alloc(key, n)
    assert e is not None
    cache.mark_ready(key)
    return e


def test_blocks_are_ascending_lowest_first():
    c = EmbeddingCache(10)
    assert c.alloc("a", 3).block_ids == (0, 1, 2)
    assert c.alloc("b", 2).block_ids == (3, 4)
    c.discard("a")
    e = c.alloc("c", 4)  # the lowest free ids, ascending: the hole first, then after b
    assert e.block_ids == (0, 1, 2, 5)
    assert list(e.block_array) == [0, 1, 2, 5] and e.block_array.dtype == np.int64
    assert e.runs == [(0, 3), (5, 6)]
    c.check_invariants()


def test_eviction_is_oldest_ready_first():
    c = EmbeddingCache(6)
    ready(c, "a", 2)
    ready(c, "b", 2)
    ready(c, "c", 2)
    assert c.eviction_order() == ["a", "b", "c"]
    e = c.alloc("d", 3)  # needs 3 free: evicts a (2), then b (2)
    assert e is not None and "a" not in c and "b" not in c and "c" in c
    assert c.stats.evictions == 2 and c.stats.evicted_blocks == 4
    assert e.block_ids == (0, 1, 2)
    c.check_invariants()


def test_pinned_and_not_ready_entries_are_never_evicted():
    c = EmbeddingCache(6)
    ready(c, "pinned", 2)
    c.pin("pinned")
    c.alloc("saving", 2)  # not ready
    ready(c, "old", 2)
    assert c.num_evictable_blocks == 2  # only "old": ready and unpinned
    assert c.alloc("new", 2) is not None  # only "old" can go
    assert "pinned" in c and "saving" in c and "old" not in c
    assert c.alloc("more", 1) is None  # nothing evictable left
    assert {"pinned", "saving", "new"} == {k for k in ("pinned", "saving", "new") if k in c}
    c.check_invariants()


def test_no_eviction_when_the_request_cannot_fit_anyway():
    c = EmbeddingCache(8)
    ready(c, "a", 3)
    ready(c, "b", 2)
    c.alloc("c", 3)  # not ready: 3 blocks held
    assert c.alloc("big", 6) is None  # 0 free + 5 evictable < 6
    assert "a" in c and "b" in c, "an alloc that cannot succeed must not evict anything"
    assert c.stats.evictions == 0 and c.stats.failed_allocs == 1
    assert c.alloc("fits", 5) is not None  # 0 free + 5 evictable: evicts both
    c.check_invariants()


def test_nested_pins():
    c = EmbeddingCache(4)
    ready(c, "a", 2)
    assert list(c.pin("a")) == [0, 1]
    assert list(c.pin_if_ready("a")) == [0, 1]
    assert c.lookup("a").pin_count == 2
    c.unpin("a")
    assert c.lookup("a").pinned and c.eviction_order() == []
    ready(c, "b", 2)
    c.unpin("a")
    assert c.eviction_order() == ["b", "a"]  # an unpinned entry rejoins at the young end
    with pytest.raises(RuntimeError, match="unpin\\('a'\\): the entry is not pinned"):
        c.unpin("a")


def test_nested_pins_block_eviction_until_last_unpin():
    c = EmbeddingCache(2)
    ready(c, "a", 2)
    c.pin("a")
    c.pin("a")
    c.unpin("a")
    assert c.alloc("b", 1) is None
    c.unpin("a")
    assert c.alloc("b", 1) is not None and "a" not in c


def test_pin_if_ready_counts_hits_and_misses():
    c = EmbeddingCache(4)
    c.alloc("a", 1)
    assert c.pin_if_ready("a") is None  # not ready
    assert c.pin_if_ready("zz") is None  # absent
    c.mark_ready("a")
    assert c.pin_if_ready("a") is not None
    assert (c.stats.hits, c.stats.misses) == (1, 2)


def test_has_held_entries():
    c = EmbeddingCache(4)
    assert not c.has_held_entries()
    c.alloc("a", 1)
    assert c.has_held_entries()  # a save in flight
    c.mark_ready("a")
    assert not c.has_held_entries()
    c.pin("a")
    assert c.has_held_entries()  # a read in flight
    c.unpin("a")
    assert not c.has_held_entries()


def test_discard_returns_blocks():
    c = EmbeddingCache(3)
    c.alloc("a", 3)
    c.discard("a")
    assert c.num_free_blocks == 3 and "a" not in c
    ready(c, "b", 1)
    with pytest.raises(RuntimeError, match="discard\\('b'\\): the entry is ready"):
        c.discard("b")


@pytest.mark.parametrize("op", ["mark_ready", "pin", "unpin", "discard"])
def test_unknown_keys_raise_keyerror_naming_the_key(op):
    c = EmbeddingCache(2)
    with pytest.raises(KeyError, match="mm_hash 'nope'"):
        getattr(c, op)("nope")


def test_state_violations():
    c = EmbeddingCache(4)
    c.alloc("a", 1)
    with pytest.raises(RuntimeError, match="pin\\('a'\\): the entry is not ready"):
        c.pin("a")
    with pytest.raises(RuntimeError, match="not pinned"):
        c.unpin("a")
    c.mark_ready("a")
    with pytest.raises(RuntimeError, match="already ready"):
        c.mark_ready("a")
    with pytest.raises(ValueError, match="already has an entry"):
        c.alloc("a", 1)
    with pytest.raises(ValueError, match="can never fit.*only 4 blocks"):
        c.alloc("huge", 5)
    with pytest.raises(ValueError, match="n_blocks=-1"):
        c.alloc("neg", -1)
    with pytest.raises(TypeError, match="must be a str"):
        c.alloc(7, 1)
    with pytest.raises(ValueError, match="num_blocks=-2"):
        EmbeddingCache(-2)


def test_zero_block_entries():
    c = EmbeddingCache(0)
    e = c.alloc("empty", 0)
    assert e.block_ids == () and e.block_array.size == 0
    c.mark_ready("empty")
    c.check_invariants()


def test_eight_threads_hammering_one_cache():
    c = EmbeddingCache(64)
    errors = []
    barrier = threading.Barrier(8)

    def worker(t):
        rng = np.random.default_rng(t)
        try:
            barrier.wait()
            mine = []
            for i in range(400):
                key = f"t{t}-{i}"
                e = c.alloc(key, int(rng.integers(1, 6)))
                if e is not None:
                    mine.append(key)
                    c.mark_ready(key)
                    ids = c.pin_if_ready(key)
                    if ids is not None:  # pinned: nobody may evict it while we "read"
                        assert key in c
                        c.unpin(key)
                if mine and rng.random() < 0.3:
                    k = mine[int(rng.integers(len(mine)))]
                    if c.pin_if_ready(k) is not None:
                        assert k in c, "a pinned entry was evicted"
                        c.check_invariants()
                        c.unpin(k)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors[:3]
    c.check_invariants()
    assert not c.has_held_entries()
    assert c.stats.evictions > 0


class CacheMachine(RuleBasedStateMachine):
    """Random operation sequences against a tiny model of what the cache must guarantee."""

    def __init__(self):
        super().__init__()
        self.n = 16
        self.cache = EmbeddingCache(self.n)
        self.model = {}  # key -> {"blocks": int, "state": "not-ready"|"ready", "pins": int}
        self.order = []  # ready, unpinned keys, oldest first
        self.counter = 0

    def _evictable_blocks(self):
        return sum(self.model[k]["blocks"] for k in self.order)

    def _used(self):
        return sum(v["blocks"] for v in self.model.values())

    @rule(n=st.integers(0, 10))
    def alloc(self, n):
        key = f"k{self.counter}"
        self.counter += 1
        free = self.n - self._used()
        can = free + self._evictable_blocks() >= n
        before = set(self.cache.eviction_order())
        e = self.cache.alloc(key, n)
        if not can:
            assert e is None
            assert set(self.cache.eviction_order()) == before, "failed alloc evicted something"
            return
        assert e is not None and len(e.block_ids) == n
        while free < n:  # the model evicts oldest first, exactly as much as needed
            old = self.order.pop(0)
            free += self.model.pop(old)["blocks"]
        self.model[key] = {"blocks": n, "state": "not-ready", "pins": 0}

    @precondition(lambda self: any(v["state"] == "not-ready" for v in self.model.values()))
    @rule(data=st.data())
    def mark_ready(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.items() if v["state"] == "not-ready")))
        self.cache.mark_ready(key)
        self.model[key]["state"] = "ready"
        self.order.append(key)

    @precondition(lambda self: any(v["state"] == "ready" for v in self.model.values()))
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.items() if v["state"] == "ready")))
        assert self.cache.pin_if_ready(key) is not None
        if self.model[key]["pins"] == 0:
            self.order.remove(key)
        self.model[key]["pins"] += 1

    @precondition(lambda self: any(v["pins"] > 0 for v in self.model.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.items() if v["pins"] > 0)))
        self.cache.unpin(key)
        self.model[key]["pins"] -= 1
        if self.model[key]["pins"] == 0:
            self.order.append(key)

    @precondition(lambda self: any(v["state"] == "not-ready" for v in self.model.values()))
    @rule(data=st.data())
    def discard(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, v in self.model.items() if v["state"] == "not-ready")))
        self.cache.discard(key)
        del self.model[key]

    @invariant()
    def agrees_with_model(self):
        self.cache.check_invariants()
        assert set(self.model) == {k for k in self.model if k in self.cache}
        assert len(self.cache) == len(self.model)
        assert self.cache.eviction_order() == self.order
        assert self.cache.num_free_blocks == self.n - self._used()
        for k, v in self.model.items():
            e = self.cache.lookup(k)
            assert e.pin_count == v["pins"] and e.ready == (v["state"] == "ready")
        assert self.cache.has_held_entries() == any(
            v["state"] == "not-ready" or v["pins"] for v in self.model.values())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_key_that_is_not_a_str_is_named():
    cache = EmbeddingCache(4)
    with pytest.raises(TypeError, match=r"key=\[1\] must be a str \(an mm_hash\)"):
        cache.lookup([1])
