"""StepArena: 64-byte-aligned bump allocation, per-step reset, clear overflow errors."""

import numpy as np
import pytest

from vtnumba.backend import CPUBackend
from vtnumba.memory import ArenaOverflowError, StepArena
from vtnumba.backend.arrays import address_of
from test_memory_support import KINDS, make_backend, read, write


@pytest.fixture(params=KINDS)
def backend(request, device_backend_factory):
    b = make_backend(request.param, device_backend_factory)
    yield b
    b.close()


def _addr(view) -> int:
    return address_of(view)  # a host address on cpu and in the simulator, a device address on a GPU


def test_bump_allocation_is_aligned_and_typed(backend, rng):
    with StepArena(backend, 4096) as arena:
        a = arena.alloc(7)
        b = arena.alloc(33 * 4, np.float32, (33,))
        c = arena.alloc(65 * 8, np.float64, (5, 13))
        base = _addr(a)
        assert base % 64 == 0
        assert [_addr(v) - base for v in (a, b, c)] == [0, 64, 64 + 192]
        assert np.dtype(b.dtype) == np.float32 and tuple(c.shape) == (5, 13)
        assert arena.used == 256 + 520 and arena.remaining == 4096 - 832 and arena.allocations == 3
        vals = rng.standard_normal((5, 13))
        write(backend, c, vals)                 # views alias the slab, and do not overlap
        write(backend, a, 0x5A)
        write(backend, b, 1.5)
        np.testing.assert_array_equal(read(backend, c), vals)
        assert (read(backend, a) == 0x5A).all() and (read(backend, b) == 1.5).all()
        assert arena.alloc(0).size == 0 and arena.used == 776 + 56  # zero bytes: aligned, nothing taken


def test_reset_reuses_the_slab(backend):
    arena = StepArena(backend, 1024)
    first = _addr(arena.alloc(100))
    arena.alloc(500)
    peak = arena.used
    arena.reset()
    assert arena.used == 0 and arena.steps == 1 and arena.remaining == 1024
    assert _addr(arena.alloc(100)) == first       # the same memory, next step
    assert arena.peak_used == peak
    arena.close()
    arena.close()                                 # idempotent
    assert arena.closed
    with pytest.raises(RuntimeError, match="StepArena was closed"):
        arena.alloc(1)
    with pytest.raises(RuntimeError, match="StepArena was closed"):
        arena.reset()


def test_overflow_names_requested_and_remaining(backend):
    with StepArena(backend, 1000) as arena:
        arena.alloc(900)
        with pytest.raises(ArenaOverflowError, match=r"alloc\(nbytes=100\) requested 100 bytes but only 40 bytes "
                                                     r"remain \(capacity 1000, used 900, next aligned offset 960\)"):
            arena.alloc(100)
        assert isinstance(ArenaOverflowError("x"), MemoryError)
        assert arena.alloc(40).size == 40 and arena.remaining == 0
        with pytest.raises(ArenaOverflowError, match="requested 1 bytes but only 0 bytes remain"):
            arena.alloc(1)


def test_bad_input():
    be = CPUBackend()
    with pytest.raises(ValueError, match=r"capacity=0 .*expected > 0"):
        StepArena(be, 0)
    with pytest.raises(ValueError, match="capacity=-1"):
        StepArena(be, -1)
    with pytest.raises(TypeError, match="backend must be a vtnumba Backend"):
        StepArena("cpu", 10)
    with StepArena(be, 1024) as arena:
        with pytest.raises(ValueError, match="nbytes=-3"):
            arena.alloc(-3)
        with pytest.raises(TypeError, match="nbytes=2.0 must be an int"):
            arena.alloc(2.0)
        with pytest.raises(ValueError, match="nbytes=6 is not a multiple of dtype float32's itemsize 4"):
            arena.alloc(6, np.float32)
        with pytest.raises(ValueError, match=r"shape=\(3, 3\) of float32 is 36 bytes, but nbytes=32"):
            arena.alloc(32, np.float32, (3, 3))
        assert arena.used == 0


def test_a_shape_that_is_not_ints_is_refused(backend):
    with StepArena(backend, 4096) as arena:
        with pytest.raises(TypeError, match=r"shape='ab' must be an int or a sequence of ints, got str"):
            arena.alloc(8, np.float32, "ab")
        with pytest.raises(TypeError, match=r"shape=\(2.5,\) must contain ints"):
            arena.alloc(8, np.float32, (2.5,))
