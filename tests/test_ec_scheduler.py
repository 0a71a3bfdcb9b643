"""ECScheduler and the per-step metadata: saves -> ready, loads -> exactly-once release."""

import pickle

import numpy as np
import pytest

from vtnumba.ec import ECConnectorMetadata, ECScheduler, ECWorkerMetadata


def test_producer_allocates_one_block_per_row_and_marks_ready_on_completion():
    s = ECScheduler("producer", 10)
    ids = s.request_save("img", 4)
    assert list(ids) == [0, 1, 2, 3]
    assert s.request_save("img", 4) is None  # already has an entry (save in flight)
    meta = s.build_connector_meta()
    assert list(meta.saves["img"]) == [0, 1, 2, 3] and meta.loads == {}
    assert not s.build_connector_meta()  # handed out once
    assert not s.has_cache_item("img") and s.has_pending_work()
    up = s.update_connector_output(ECWorkerMetadata(completed_saves=["img"]))
    assert up.ready == ["img"] and s.has_cache_item("img") and not s.has_pending_work()
    # A replayed report is stale, not an error.
    assert s.update_connector_output(ECWorkerMetadata(completed_saves=["img"])).ready == []
    assert s.stats["stale_reports"] == 1


def test_producer_without_room_schedules_nothing():
    s = ECScheduler("producer", 4)
    s.request_save("a", 3)
    assert s.request_save("b", 2) is None  # a is not ready: cannot be evicted
    assert s.stats["saves_without_room"] == 1
    assert list(s.build_connector_meta().saves) == ["a"]


def test_consumer_release_needs_every_rank_exactly_once():
    s = ECScheduler("consumer", 8, expected_load_reports=2)
    t1 = s.request_load("img", [4, 5])
    assert s.request_load("img", [4, 5]) is None  # one load per hash per step
    meta = s.build_connector_meta()
    tid, ids = meta.loads["img"]
    assert tid == t1 and list(ids) == [4, 5]
    assert s.update_connector_output(ECWorkerMetadata(completed_loads=[t1])).released == []  # 1 of 2
    assert s.outstanding_loads() == {t1: ("img", 1)}
    assert s.update_connector_output(ECWorkerMetadata(completed_loads=[t1])).released == ["img"]
    # A replay (a third report, or a late duplicate) must not release again.
    assert s.update_connector_output(ECWorkerMetadata(completed_loads=[t1])).released == []
    assert s.stats["stale_reports"] == 1 and s.stats["loads_completed"] == 1
    t2 = s.request_load("img", [4, 5])
    assert t2 != t1, "every dispatch gets a fresh transfer id"


def test_aggregated_reports_from_two_ranks_in_one_update():
    s = ECScheduler("consumer", 8, expected_load_reports=2)
    t = s.request_load("x", [1])
    s.build_connector_meta()
    agg = ECWorkerMetadata.aggregate_all([ECWorkerMetadata(completed_loads=[t]), None,
                                          ECWorkerMetadata(completed_loads=[t])])
    assert agg.completed_loads == [t, t]
    assert s.update_connector_output(agg).released == ["x"]
    assert ECWorkerMetadata.aggregate_all([None, None]) is None


def test_role_both_pins_and_unpins_its_own_cache():
    s = ECScheduler("both", 6, expected_load_reports=1)
    s.request_save("a", 3)
    assert s.request_load("a") is None  # not ready yet
    s.build_connector_meta()
    s.update_connector_output(ECWorkerMetadata(completed_saves=["a"]))
    t = s.request_load("a")
    assert s.cache.lookup("a").pinned
    assert s.request_save("b", 6) is None  # a is pinned: no room even with eviction
    meta = s.build_connector_meta()
    assert list(meta.loads["a"][1]) == [0, 1, 2]
    up = s.update_connector_output(ECWorkerMetadata(completed_loads=[t, t]))  # duplicate in one report
    assert up.released == ["a"] and not s.cache.lookup("a").pinned
    assert s.request_save("b", 6) is not None  # now a can be evicted
    with pytest.raises(ValueError, match="without block_ids"):
        s.request_load("b", [0])


def test_producer_serves_remote_reads():
    s = ECScheduler("producer", 4)
    s.request_save("a", 2)
    s.build_connector_meta()
    assert s.grant_read("a") is None  # not ready
    s.update_connector_output(ECWorkerMetadata(completed_saves=["a"]))
    ids = s.grant_read("a")
    assert list(ids) == [0, 1] and s.cache.lookup("a").pinned
    s.release_read("a")
    assert not s.cache.lookup("a").pinned
    with pytest.raises(KeyError, match="mm_hash 'ghost'"):
        s.release_read("ghost")
    with pytest.raises(RuntimeError, match=r"release_read\('a'\): no read of it was granted"):
        s.release_read("a")  # (released already)
    assert (s.stats["reads_granted"], s.stats["reads_refused"]) == (1, 1)


def test_a_both_schedulers_own_load_pin_cannot_be_released_as_a_read():
    # release_read took the pin of the scheduler's own load; its completion report then failed
    # in the middle of update_connector_output, dropping the next report: 'b' stayed pinned and
    # has_pending_work() True for good.
    s = ECScheduler("both", 8)
    for h in ("a", "b"):
        s.request_save(h, 2)
    s.build_connector_meta()
    s.update_connector_output(ECWorkerMetadata(completed_saves=["a", "b"]))
    ta, tb = s.request_load("a"), s.request_load("b")
    s.build_connector_meta()
    with pytest.raises(RuntimeError, match=r"release_read\('a'\): no read of it was granted .* own loads"):
        s.release_read("a")
    update = s.update_connector_output(ECWorkerMetadata(completed_loads=[ta, tb]))
    assert update.released == ["a", "b"] and not s.has_pending_work()
    assert not s.cache.lookup("a").pinned and not s.cache.lookup("b").pinned


def test_a_consumer_scheduler_refuses_a_cache_it_would_not_use():
    from vtnumba.ec import EmbeddingCache

    with pytest.raises(ValueError, match="cache= is for a producer or both scheduler"):
        ECScheduler("consumer", 4, cache=EmbeddingCache(4))


def test_two_schedulers_can_share_one_cache(monkeypatch):
    # EmbeddingCache is shared by design ("scheduler threads ... can share one cache"):
    # - an empty shared cache was replaced by a private one (`cache or ...`: empty is falsy);
    # - two schedulers asking for the same entry at once: each looked the key up under its own
    #   lock, and the later alloc raised ValueError ("already has an entry") instead of None.
    from vtnumba.ec import EmbeddingCache

    shared = EmbeddingCache(8)
    a, b = ECScheduler("producer", 8, cache=shared), ECScheduler("producer", 8, cache=shared)
    assert a.cache is shared and b.cache is shared
    assert list(a.request_save("img", 2)) == [0, 1]
    # b's lookup ran just before a's alloc (the race, made deterministic):
    monkeypatch.setattr(shared, "lookup", lambda key: None)
    assert b.request_save("img", 2) is None
    with pytest.raises(ValueError, match="can never fit"):  # a real refusal still raises
        b.request_save("huge", 9)


def test_bad_input():
    with pytest.raises(ValueError, match="role='encoder'"):
        ECScheduler("encoder", 4)
    with pytest.raises(ValueError, match="expected_load_reports=0"):
        ECScheduler("consumer", 4, expected_load_reports=0)
    c = ECScheduler("consumer", 4)
    with pytest.raises(ValueError, match="block id 4 is outside the region's 0..3"):
        c.request_load("h", [2, 4])
    with pytest.raises(ValueError, match="needs the block_ids"):
        c.request_load("h")
    with pytest.raises(TypeError, match="must be int block ids, got dtype float64"):
        c.request_load("h", [1.7])  # not silently block 1
    # Python ints past int64 are ints (dtype object), out of range; uint64's top half is not -1.
    with pytest.raises(ValueError, match=r"block id 1180591620717411303424 is outside the region's 0..3"):
        c.request_load("h", [2**70])
    with pytest.raises(ValueError, match=r"block id 18446744073709551615 is outside the region's 0..3"):
        c.request_load("h", np.array([2**64 - 1], np.uint64))
    assert c.request_load("h", np.array([1, 2], np.int32)) == 0
    with pytest.raises(ValueError, match="num_blocks=-1"):
        ECScheduler("producer", -1)
    assert ECScheduler("producer", np.int64(4)).num_blocks == 4
    with pytest.raises(RuntimeError, match="request_save needs a producer.*role='consumer'"):
        c.request_save("h", 1)
    p = ECScheduler("producer", 4)
    with pytest.raises(RuntimeError, match="request_load needs a consumer"):
        p.request_load("h", [0])
    with pytest.raises(ValueError, match="can never fit"):
        p.request_save("h", 5)
    with pytest.raises(TypeError, match="ECWorkerMetadata or None"):
        p.update_connector_output({"completed_saves": []})
    # (True was taken to the cache, whose error named its own n_blocks; a 5 was counted as a miss;
    # a 2-D list was flattened into a 4-row load.)
    with pytest.raises(TypeError, match="num_rows=True must be an int"):
        p.request_save("h", True)
    with pytest.raises(TypeError, match="key=5 must be a str"):
        p.grant_read(5)
    assert p.stats["reads_refused"] == 0
    with pytest.raises(ValueError, match=r"block_ids must be a flat list of block ids, got shape \(2, 2\)"):
        ECScheduler("consumer", 8).request_load("q", [[0, 1], [2, 3]])


def test_cancel_load_takes_back_an_undispatched_load():
    c = ECScheduler("consumer", 8, expected_load_reports=2)
    c.request_load("a", [0, 1])
    assert c.cancel_load("a") and not c.cancel_load("a")
    assert not c.build_connector_meta() and c.outstanding_loads() == {} and not c.has_pending_work()
    assert c.request_load("a", [0, 1]) is not None  # it may be asked for again
    b = ECScheduler("both", 8)
    b.request_save("x", 1)
    b.update_connector_output(ECWorkerMetadata(completed_saves=["x"]))
    b.request_load("x")
    assert b.cache.lookup("x").pinned
    assert b.cancel_load("x") and not b.cache.lookup("x").pinned  # its pin is given back


def test_metadata_validation_and_pickling():
    m = ECConnectorMetadata(saves={"a": np.arange(3)}, loads={"b": (np.int64(7), [1, 2])})
    assert m.loads["b"][0] == 7 and type(m.loads["b"][0]) is int
    m2 = pickle.loads(pickle.dumps(m))
    assert list(m2.saves["a"]) == [0, 1, 2] and m2.loads["b"] == (7, [1, 2])
    with pytest.raises(TypeError, match="transfer_id"):
        ECConnectorMetadata(loads={"b": ("7", [1])})
    with pytest.raises(TypeError, match="pair"):
        ECConnectorMetadata(loads={"b": [1, 2, 3]})
    with pytest.raises(TypeError, match="mm_hash str"):
        ECConnectorMetadata(saves={3: [1]})
    with pytest.raises(TypeError, match="integer array"):
        ECConnectorMetadata(saves={"a": np.zeros(2)})
    w = ECWorkerMetadata(["a"], [1]).aggregate(ECWorkerMetadata(["b"], [2]))
    assert w.completed_saves == ["a", "b"] and w.completed_loads == [1, 2]
    with pytest.raises(TypeError, match="cannot aggregate"):
        w.aggregate("x")
