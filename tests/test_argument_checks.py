"""check_array, check_eps, check_seconds, is_int and the flag-word checks: their quick paths
accept only what the full checks accept.

Every kernel call checks each of its arrays and its eps, and every queued flag wait or write
its word, index, value (and timeout), so these helpers first try a quick test of the usual,
valid argument and fall back to the full checks (which name what is wrong) for anything else.
The full checks run when ``dtypes`` is not a tuple, for an eps or a timeout that is not
exactly a Python float, and for an index or value that is not exactly a Python int: these
tests compare the two paths case by case.
"""

import numpy as np
import pytest

from vtnumba.backend.arrays import cdiv, check_array, check_eps, check_int, check_seconds, check_shape, is_int


def _outcome(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return "ok"


class NoDtype:
    ndim = 2
    shape = (2, 3)


F32 = np.zeros((4, 6), np.float32)
ARRAYS = {
    "f32": F32,
    "f64": np.zeros((4, 6), np.float64),
    "big-endian f32": np.zeros((4, 6), ">f4"),
    "strided": np.zeros((4, 12), np.float32)[:, ::2],
    "fortran": np.asfortranarray(np.zeros((4, 6), np.float32)),
    "1-D": np.zeros(6, np.float32),
    "0-D": np.float32(1.0),
    "empty rows": np.zeros((0, 6), np.float32),
    "list": [[1.0, 2.0]],
    "no dtype": NoDtype(),
    "None": None,
}
SPECS = [
    dict(ndim=2, dtypes=(np.float32,)),
    dict(ndim=2, dtypes=(np.float32,), shape=(4, 6)),
    dict(ndim=2, dtypes=(np.float32,), shape=(None, 6)),
    dict(ndim=2, dtypes=(np.float32,), shape=(4, None)),
    dict(ndim=2, dtypes=(np.float32,), shape=(5, 6)),
    dict(ndim=2, dtypes=(np.float32,), shape=(None, 7)),
    dict(ndim=2, dtypes=(np.float32,), shape=(4, 6, 1)),
    dict(ndim=2, dtypes=(np.float32,), contiguous=False),
    dict(ndim=2, dtypes=(np.float16, np.float32)),
    dict(ndim=2, dtypes=(np.dtype(np.float32),), shape=(4, 6)),
    dict(ndim=2, dtypes=(np.int64,)),
    dict(ndim=1, dtypes=(np.float32,), shape=(6,)),
]


@pytest.mark.parametrize("spec", SPECS, ids=[str(s) for s in SPECS])
@pytest.mark.parametrize("name", list(ARRAYS))
def test_check_array_quick_path_agrees_with_the_full_checks(name, spec):
    arr = ARRAYS[name]
    quick = _outcome(check_array, "x", arr, **spec)
    full = _outcome(check_array, "x", arr, **{**spec, "dtypes": list(spec["dtypes"])})  # a list: the full checks
    assert quick == full


def test_check_array_still_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"x has shape \(4, 6\); expected \(\?, 7\) \(axis 1 is 6, not 7\)"):
        check_array("x", F32, ndim=2, dtypes=(np.float32,), shape=(None, 7))
    with pytest.raises(TypeError, match="x has dtype float64; expected float32"):
        check_array("x", ARRAYS["f64"], ndim=2, dtypes=(np.float32,))
    with pytest.raises(ValueError, match="must be C-contiguous"):
        check_array("x", ARRAYS["strided"], ndim=2, dtypes=(np.float32,))


F32_INFO = np.finfo(np.float32)
EPS_VALUES = [1e-5, 1e-6, 1e-12, 1.0, float(F32_INFO.tiny), float(F32_INFO.tiny) * 0.5, 1e-45, 1e-46, 0.0, -1e-6,
              float(F32_INFO.max), float(F32_INFO.max) * (1 + 2**-30), 3.5e38, 1e39, float("inf"), float("nan"),
              -float("inf")]


@pytest.mark.parametrize("eps", EPS_VALUES)
def test_check_eps_quick_path_agrees_with_the_full_checks(eps):
    quick = _outcome(check_eps, eps)                   # a float: the quick test first
    full = _outcome(check_eps, np.float64(eps))        # a float subclass: the full checks only
    assert quick == full
    if quick == "ok":
        assert check_eps(eps) == float(np.float64(eps)) and np.float32(eps) > 0 and np.isfinite(np.float32(eps))


@pytest.mark.parametrize("eps, accepted", [(True, False), (1, True), (10**400, False), ("1e-6", False), (None, False),
                                           (np.float32(1e-6), True)])
def test_check_eps_other_types_take_the_full_checks(eps, accepted):
    assert (_outcome(check_eps, eps) == "ok") is accepted


@pytest.mark.parametrize("value, expected", [(3, True), (-2, True), (np.int64(3), True), (np.uint8(0), True),
                                             (True, False), (np.bool_(True), False), (3.0, False), ("3", False),
                                             (None, False)])
def test_is_int_takes_ints_and_numpy_integers_but_not_bools(value, expected):
    assert is_int(value) is expected
    if expected:
        assert check_int("n", value, min_value=-5) == int(value)
    else:
        with pytest.raises(TypeError, match=r"n=.* must be an int"):
            check_int("n", value)


def test_atomic_flag_words_are_checked_by_their_address_where_numpy_does_not_vouch_for_it():
    from vtnumba.backend.atomics import load_acquire, store_release

    words = np.zeros(4, np.int64)
    words.setflags(align=False)  # numpy no longer vouches, but the address is 8-byte aligned
    store_release(words, 1, 7)
    assert load_acquire(words, 1) == 7
    shifted = np.frombuffer(np.zeros(40, np.uint8).data, np.int64, 4, offset=4)  # really misaligned
    with pytest.raises(ValueError, match="8-byte aligned"):
        load_acquire(shifted, 0)


@pytest.mark.parametrize("seconds", [60.0, 0.5, 1e-9, 5e-324, 1e308, 0.0, -1.0, float("inf"), float("nan"),
                                     -float("inf")])
def test_check_seconds_quick_path_agrees_with_the_full_checks(seconds):
    quick = _outcome(check_seconds, "timeout_s", seconds)             # a float: the quick test first
    full = _outcome(check_seconds, "timeout_s", np.float64(seconds))  # a float subclass: the full checks only
    assert quick == full
    if quick == "ok":
        assert check_seconds("timeout_s", seconds) == seconds


_WORD_BYTES = np.zeros(80, np.uint8)
WORD_ARRAYS = {
    "u32": np.zeros(6, np.uint32),
    "i32": np.zeros(6, np.int32),
    "u64": np.zeros(6, np.uint64),
    "i64": np.zeros(6, np.int64),
    "big-endian u32": np.zeros(6, ">u4"),
    "u16": np.zeros(6, np.uint16),
    "f32": np.zeros(6, np.float32),
    "2-D u32": np.zeros((2, 3), np.uint32),
    "strided u32": np.zeros(12, np.uint32)[::2],
    "misaligned u32": np.frombuffer(_WORD_BYTES.data, np.uint32, 6, offset=2),
    "misaligned i64": np.frombuffer(_WORD_BYTES.data, np.int64, 6, offset=4),
    "list": [0, 0, 0],
}
WORD_INDICES = [0, 5, 6, -1, True]


@pytest.mark.parametrize("idx", WORD_INDICES)
@pytest.mark.parametrize("name", list(WORD_ARRAYS))
def test_atomic_word_check_quick_path_agrees_with_the_full_checks(name, idx):
    from vtnumba.backend.atomics import _check

    def outcome(i):
        try:
            _check(WORD_ARRAYS[name], i)
        except (TypeError, ValueError, IndexError) as exc:
            return type(exc)
        return "ok"

    full_idx = idx if type(idx) is bool else np.int64(idx)  # not a Python int: the full checks only
    assert outcome(idx) == outcome(full_idx)


FLAG_VALUES = [0, 7, (1 << 32) - 1, 1 << 32, -1]


@pytest.mark.parametrize("value", FLAG_VALUES)
@pytest.mark.parametrize("idx", WORD_INDICES)
@pytest.mark.parametrize("name", [n for n in WORD_ARRAYS if n != "list"])
def test_flag_word_check_quick_path_agrees_with_the_full_checks(name, idx, value):
    from vtnumba.backend import CPUBackend

    be = CPUBackend()
    flags = WORD_ARRAYS[name]

    def outcome(i, v):
        try:
            return be._check_flag(flags, i, v)
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc)

    full_idx = idx if type(idx) is bool else np.int64(idx)
    quick, full = outcome(idx, value), outcome(full_idx, np.int64(value))
    if isinstance(quick, tuple) and isinstance(quick[0], type):
        # (The messages show the index and value as given: np.int64(5) reads differently from 5.)
        assert isinstance(full, tuple) and isinstance(full[0], type) and quick[0] is full[0]
    else:
        assert quick == full and all(type(v) is int for v in quick)


def test_check_seconds_of_an_int_past_floats_range_is_named():
    # float(10**400) was a bare OverflowError.
    with pytest.raises(ValueError, match="timeout_s=inf must be a positive, finite number of seconds"):
        check_seconds("timeout_s", 10**400)


def test_cdiv_names_a_zero_divisor():
    # cdiv(5, 0) was a bare ZeroDivisionError ("integer division or modulo by zero").
    assert cdiv(5, 2) == 3 and cdiv(0, 4) == 0 and cdiv(np.int64(9), 3) == 3
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"cdiv\(5, {bad}\): the divisor must be a positive int"):
            cdiv(5, bad)


@pytest.mark.parametrize("shape", [b"ab", bytearray(b"\x02"), {4: 1}, {3}, memoryview(b"\x02")])
def test_check_shape_refuses_iterables_that_are_not_shapes(shape):
    # tuple(b"ab") is (97, 98) and tuple({4: 1}) is (4,): both were taken as shapes.
    with pytest.raises(TypeError, match=r"shape=.* must be an int or a sequence of ints, got"):
        check_shape("shape", shape)
    assert check_shape("shape", np.array([2, 3])) == (2, 3) and check_shape("shape", [4]) == (4,)


def test_check_array_names_the_byte_order_of_a_swapped_dtype():
    # Both byte orders are named "float32": the message read "has dtype float32; expected float32".
    from vtnumba.kernels import fused_add_rms_norm

    y = np.ones((2, 4), np.dtype(">f4"))
    with pytest.raises(TypeError, match=r"y has dtype >f4 \(float32 in the other byte order\); expected <f4: "
                                        r"convert it with \.astype\(np\.float32\)"):
        fused_add_rms_norm(y, None, np.ones(4, np.float32), 1e-5)
    with pytest.raises(TypeError, match=r"has dtype int32; expected float32 or float16"):
        check_array("a", np.ones((2, 2), np.int32), ndim=2, dtypes=(np.float32, np.float16))
