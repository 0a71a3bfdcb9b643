"""vtnumba.faults: the --inject test flag refuses faults that could never fire.

A fault test passes when the job ends as it should after the fault; if the fault never
fires (a rank the job does not have, an ``@n`` beyond the points a run passes), the test
would pass without testing anything.  So those specs are errors, named by the flag.
"""

import pytest

from vtnumba.faults import FaultInjection, parse_inject


def test_a_spec_reads_how_rank_point_and_nth():
    spec = FaultInjection.parse("stop:2:tpsp@3", {"tpsp": 3})
    assert (spec.how, spec.rank, spec.point, spec.nth) == ("stop", 2, "tpsp", 3)


@pytest.mark.parametrize("text, points, size, words", [
    ("raise:1:nowhere", ("here",), None, "expected (raise|kill|stop|interrupt):RANK:(here)[@N]"),
    ("raise:1", ("here",), None, "must look like kill:1:here@2"),
    ("raise:-1:here", ("here",), None, "RANK >= 0"),
    ("raise:3:here", ("here",), 3, "rank 3 does not exist; the job has ranks 0..2"),
    ("raise:0:here@2", {"here": 1}, None, "a run passes 'here' 1 time(s), so @2 would never fire"),
    ("raise:0:here@0", ("here",), None, "N >= 1"),
])
def test_faults_that_could_never_fire_are_refused(text, points, size, words):
    with pytest.raises(ValueError) as info:
        FaultInjection.parse(text, points, size)
    assert f"--inject={text!r}" in str(info.value) and words in str(info.value)


def test_the_hook_fires_on_the_nth_pass_only_on_its_rank():
    assert parse_inject("raise:1:p@2", {"p": 2}, rank=0, world_size=2) is None
    hook = parse_inject("raise:1:p@2", {"p": 2}, rank=1, world_size=2)
    hook("other")
    hook("p")  # first pass: nothing
    with pytest.raises(RuntimeError, match="injected failure at 'p'"):
        hook("p")


def _roles(rank):
    return ("the producer", ("created", "saving")) if rank == 0 else ("a consumer", ("opened", "loading"))


@pytest.mark.parametrize("text, size, words", [
    ("kill:1:saving@2", 3, "rank 1 is a consumer, which never passes 'saving' (it passes only opened, loading), "
                           "so the fault would never fire"),
    ("kill:3:loading", 3, "rank 3 does not exist; the job has ranks 0..2"),
])
def test_a_fault_its_rank_never_reaches_is_refused(text, size, words):
    spec = FaultInjection.parse(text, ("created", "opened", "saving", "loading"))
    with pytest.raises(ValueError) as info:
        spec.check_fires(size, _roles)
    assert f"--inject={text!r}" in str(info.value) and words in str(info.value)


def test_a_fault_its_rank_reaches_is_kept():
    spec = FaultInjection.parse("stop:2:loading@2", ("saving", "loading"))
    assert spec.check_fires(3, _roles) is spec
