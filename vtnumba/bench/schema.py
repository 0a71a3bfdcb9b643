"""The documented result schema every ``vtnumba bench`` returns (and ``--json`` writes), and how sizes read.

A suite result is a dict::

    {
      "suite": "kernels",                     # which benchmark
      "target": "cpu",                        # the process target it ran on
      "ranks": 1,                             # MPI ranks that took part
      "results": [                            # one row per (case, implementation, size)
        {"case": "rmsnorm", "impl": "vtnumba-fused-host", "size": 1048576,
         "size_unit": "elements", "metric": "GB/s", "value": 23.1,
         "median_s": 0.0012, "p10_s": 0.0011, "p90_s": 0.0013, "samples": 10,
         "value_p10": 21.3, "value_p90": 25.2,           # optional, see below
         "shape": [1024, 1024]},                         # optional, see below
        ...
      ],
      "ratios": {"rmsnorm fused / numpy (speed-up)": 5.2, ...},   # vtnumba vs. the stock baseline
      "baselines": {"memcpy GB/s": 27.0},            # measured in the same run
      "notes": ["..."],
      "paired": [...]                                # optional, see below
    }

Optional row fields (older documents lack them; readers fall back as described):

* ``value_p10`` / ``value_p90`` -- the 10th and 90th percentile of the *metric* (for a rate
  such as GB/s the fast calls give the high values, so ``value_p90`` comes from ``p10_s``).
  :func:`row` fills them in; :func:`value_bounds` derives them for rows without them.
* ``shape`` -- the array shape behind ``size`` (e.g. ``[8192, 4096]`` for 32 Mi elements),
  printed as ``8 Ki × 4 Ki``.
* ``group`` -- which plot panel the row belongs to (default: its ``case``).  Rows of one
  group with different sizes become one line per implementation across sizes.

``paired`` rows compare two implementations *round by round* (see
:func:`vtnumba.bench.timing.paired_differences`): the same fields as a result row, without
the ``*_s`` times, with ``value`` the median of the per-round comparison and
``value_p10`` / ``value_p90`` its percentiles.  A difference may be negative.

``vtnumba bench all`` wraps several suites as ``{"machine": {...}, "suites": [suite, ...]}``.
:func:`validate_suite` checks a dict against this schema (the tests use it).
"""

from __future__ import annotations

_NUM = (int, float)
ROW_KEYS = {"case": str, "impl": str, "size": _NUM, "size_unit": str, "metric": str,
            "value": _NUM, "median_s": _NUM, "p10_s": _NUM, "p90_s": _NUM, "samples": int}
OPTIONAL_ROW_KEYS = {"value_p10": _NUM, "value_p90": _NUM, "shape": list, "group": str}
PAIRED_KEYS = {"case": str, "impl": str, "size": _NUM, "size_unit": str, "metric": str,
               "value": _NUM, "value_p10": _NUM, "value_p90": _NUM, "samples": int}
SUITE_KEYS = {"suite": str, "target": str, "ranks": int, "results": list, "ratios": dict, "baselines": dict,
              "notes": list}

TIME_UNITS = ("s", "ms", "us", "µs", "ns")


def metric_kind(metric: str) -> str:
    """``"time"`` if the metric grows with the measured time (``ms``, ``us/op``), ``"rate"`` if
    it shrinks with it (``GB/s``, ``sentences/s``), else ``"count"`` (``descriptors``)."""
    first = metric.split()[0] if metric.split() else ""
    if first.split("/")[0] in TIME_UNITS:
        return "time"
    if "/s" in metric:
        return "rate"
    return "count"


def value_bounds(r: dict) -> tuple[float, float]:
    """The p10 and p90 of a row's metric: its own fields if present, else derived from the times."""
    if "value_p10" in r and "value_p90" in r:
        return float(r["value_p10"]), float(r["value_p90"])
    v, med = float(r["value"]), float(r.get("median_s", 0.0))
    kind = metric_kind(r["metric"])
    if med <= 0 or kind == "count":
        return v, v  # no timing behind the value (a count): nothing to spread
    if kind == "time":  # value = c * t
        return v * r["p10_s"] / med, v * r["p90_s"] / med
    # a rate: value = c / t, so the slow calls (p90_s) give the low value
    return (v * med / r["p90_s"] if r["p90_s"] > 0 else v), (v * med / r["p10_s"] if r["p10_s"] > 0 else v)


def row(case: str, impl: str, size, size_unit: str, metric: str, value: float, stats, *,
        shape=None, group: str | None = None) -> dict:
    """One result row from a :class:`vtnumba.bench.timing.Stats` (with the metric's p10/p90 filled in)."""
    r = {"case": case, "impl": impl, "size": size, "size_unit": size_unit, "metric": metric,
         "value": float(value), "median_s": stats.median_s, "p10_s": stats.p10_s, "p90_s": stats.p90_s,
         "samples": stats.samples}
    r["value_p10"], r["value_p90"] = value_bounds(r)
    if shape is not None:
        r["shape"] = [int(d) for d in shape]
    if group is not None:
        r["group"] = group
    return r


def paired_row(case: str, impl: str, size, size_unit: str, metric: str, paired, *, scale: float = 1.0,
               group: str | None = None) -> dict:
    """One ``paired`` row from a :class:`vtnumba.bench.timing.PairedStats`, its numbers times ``scale``
    (1e3 to report a difference of seconds in ms)."""
    r = {"case": case, "impl": impl, "size": size, "size_unit": size_unit, "metric": metric,
         "value": paired.median * scale, "value_p10": paired.p10 * scale, "value_p90": paired.p90 * scale,
         "samples": paired.samples}
    if group is not None:
        r["group"] = group
    return r


def suite(name: str, target: str, ranks: int, results: list, ratios: dict, baselines: dict | None = None,
          notes: list | None = None, paired: list | None = None) -> dict:
    """One suite result in the schema above (ratios as floats; ``paired`` only when there are any)."""
    d = {"suite": name, "target": target, "ranks": ranks, "results": results,
         "ratios": {k: float(v) for k, v in ratios.items()}, "baselines": dict(baselines or {}),
         "notes": list(notes or [])}
    if paired:
        d["paired"] = list(paired)
    return d


def _check_rows(rows, keys: dict, where: str) -> None:
    for i, r in enumerate(rows):
        if not isinstance(r, dict):  # (a string row was "string indices must be integers")
            raise ValueError(f"{where}[{i}] should be a dict (one row), got {type(r).__name__}")
        for key, typ in keys.items():
            if key not in r or not isinstance(r[key], typ):
                raise ValueError(f"{where}[{i}] field {key!r} missing or not {typ}")
        for key, typ in OPTIONAL_ROW_KEYS.items():
            if key in r and not isinstance(r[key], typ):
                raise ValueError(f"{where}[{i}] field {key!r} should be {typ}, got {type(r[key]).__name__}")


def validate_suite(d: dict) -> None:
    """Raise ValueError naming the first field that does not follow the schema."""
    if not isinstance(d, dict):
        raise ValueError(f"a suite result should be a dict, got {type(d).__name__}")
    for key, typ in SUITE_KEYS.items():
        if key not in d:
            raise ValueError(f"suite result lacks {key!r}")
        if not isinstance(d[key], typ):
            raise ValueError(f"suite field {key!r} should be {typ}, got {type(d[key]).__name__}")
    _check_rows(d["results"], ROW_KEYS, "results")
    if "paired" in d:
        if not isinstance(d["paired"], list):
            raise ValueError("suite field 'paired' should be a list")
        _check_rows(d["paired"], PAIRED_KEYS, "paired")
    for k, v in d["ratios"].items():
        if not isinstance(v, (int, float)):
            raise ValueError(f"ratio {k!r} is not a number")


def validate_all(d: dict) -> None:
    """Check a ``bench all`` (or ``--json``) document: the machine, and every suite with :func:`validate_suite`."""
    if not isinstance(d, dict) or "machine" not in d or "suites" not in d:
        raise ValueError("bench-all result needs 'machine' and 'suites'")
    if not isinstance(d["machine"], dict):
        raise ValueError(f"bench-all field 'machine' should be a dict, got {type(d['machine']).__name__}")
    if not isinstance(d["suites"], list):
        raise ValueError(f"bench-all field 'suites' should be a list, got {type(d['suites']).__name__}")
    for s in d["suites"]:
        validate_suite(s)


# ---------------------------------------------------------------------------- sizes people can read
_BINARY = ("", "Ki", "Mi", "Gi", "Ti")


def format_count(n) -> str:
    """A count as people write it: ``64``, ``1000``, ``4 Ki`` (4096), ``32 Mi`` (33554432), ``1.43 Mi``.

    Below 1024, and for counts under 10,000 that are not a multiple of 1024, the digits
    themselves read best; larger counts use binary prefixes, exact where the count is a
    multiple of the prefix and with three significant digits otherwise (never ``3.35544e+07``).
    """
    n = float(n)
    if not n.is_integer():
        return f"{n:.3g}" if abs(n) < 1000 else f"{n:.0f}"  # (2048.5 was '2.05e+03')
    n = int(n)
    if abs(n) < 1024:
        return str(n)
    k = _prefix(n)
    if n % 1024 ** k == 0:
        return f"{n // 1024 ** k} {_BINARY[k]}"
    if abs(n) < 10_000:
        return str(n)
    return _three_digits(n, k)


def _prefix(n: float) -> int:
    """The binary prefix (index into _BINARY) for ``n``: the largest power of 1024 not above it."""
    k = 0
    while k + 1 < len(_BINARY) and abs(n) >= 1024 ** (k + 1):
        k += 1
    return k


def _three_digits(n: float, k: int) -> str:
    """``n`` in prefix ``k`` with three significant digits -- one prefix up where it would need
    four digits before the point, which ``.3g`` writes as an exponent (1048575 is '1 Mi', not
    '1.02e+03 Ki')."""
    if k + 1 < len(_BINARY) and abs(n) / 1024 ** k >= 999.5:
        k += 1
    return f"{n / 1024 ** k:.3g} {_BINARY[k]}"


def format_bytes(n) -> str:
    """``512 B``, ``4 KiB``, ``64 MiB``, ``1.5 GiB``."""
    n = float(n)
    k = _prefix(n)
    v = n / 1024 ** k
    return f"{v:.0f} {_BINARY[k]}B" if v.is_integer() else f"{_three_digits(n, k)}B"


_BYTE_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def format_size(size, unit: str, shape=None, *, with_unit: bool = True) -> str:
    """A row's size for a table (``with_unit=True``) or an axis tick (the unit is on the axis label).

    ``format_size(1 << 20, "bytes") == "1 MiB"``, ``format_size(2048, "M=N=K") == "2048³"``,
    ``format_size(8192 * 4096, "elements", [8192, 4096]) == "8 Ki × 4 Ki"``,
    ``format_size(4096, "tokens") == "4 Ki tokens"``.
    """
    if shape:
        return " × ".join(format_count(d) for d in shape)
    if unit in _BYTE_UNITS:
        return format_bytes(float(size) * _BYTE_UNITS[unit])
    if unit == "M=N=K":
        return f"{format_count(size)}³" if not float(size).is_integer() else f"{int(size)}³"
    if unit == "batch":
        return f"batch {format_count(size)}" if with_unit else format_count(size)
    return f"{format_count(size)} {unit}" if with_unit else format_count(size)


def axis_label(unit: str) -> str:
    """The x-axis label for sizes in ``unit``."""
    return {"B": "size", "bytes": "size", "KiB": "size", "MiB": "size", "GiB": "size",
            "M=N=K": "matrix size M = N = K", "batch": "batch size", "tokens": "tokens T"}.get(unit, unit)


def format_number(v: float, digits: int = 4) -> str:
    """``digits`` significant digits, but never exponent notation for numbers people meet in a
    benchmark (``12345``, not ``1.234e+04``)."""
    if v != 0 and (abs(v) >= 10 ** digits or abs(v) < 1e-3):
        return f"{v:.0f}" if abs(v) >= 1 else f"{v:.{digits}g}"
    text = f"{v:.{digits}g}"
    return f"{v:.0f}" if "e" in text and abs(v) >= 1 else text  # (9999.6 rounds to '1e+04')


def format_relative(value: float, median: float) -> str:
    """``value`` relative to ``median`` as a signed percentage: ``-4%``, ``+12%`` (``?`` when undefined)."""
    if median == 0:
        return "?"
    return f"{(value - median) / abs(median):+.0%}"
