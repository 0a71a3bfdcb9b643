"""The documented result schema every ``vtnumba bench`` returns (and ``--json`` writes).

A suite result is a dict::

    {
      "suite": "kernels",                     # which benchmark
      "target": "cpu",                        # the process target it ran on
      "ranks": 1,                             # MPI ranks that took part
      "results": [                            # one row per (case, implementation, size)
        {"case": "rmsnorm", "impl": "vtnumba-fused", "size": 4096,
         "size_unit": "rows", "metric": "GB/s", "value": 23.1,
         "median_s": 0.0012, "p10_s": 0.0011, "p90_s": 0.0013, "samples": 10},
        ...
      ],
      "ratios": {"rmsnorm fused / numpy": 5.2, ...},   # vtnumba vs. the stock baseline
      "baselines": {"memcpy GB/s": 27.0},            # measured in the same run
      "notes": ["..."]
    }

``vtnumba bench all`` wraps several suites as ``{"machine": {...}, "suites": [suite, ...]}``.
:func:`validate_suite` checks a dict against this schema (the tests use it).
"""

from __future__ import annotations

ROW_KEYS = {"case": str, "impl": str, "size": (int, float), "size_unit": str, "metric": str,
            "value": (int, float), "median_s": (int, float), "p10_s": (int, float), "p90_s": (int, float),
            "samples": int}
SUITE_KEYS = {"suite": str, "target": str, "ranks": int, "results": list, "ratios": dict, "baselines": dict,
              "notes": list}


def row(case: str, impl: str, size, size_unit: str, metric: str, value: float, stats) -> dict:
    """One result row from a :class:`vtnumba.bench.timing.Stats`."""
    return {"case": case, "impl": impl, "size": size, "size_unit": size_unit, "metric": metric,
            "value": float(value), "median_s": stats.median_s, "p10_s": stats.p10_s, "p90_s": stats.p90_s,
            "samples": stats.samples}


def suite(name: str, target: str, ranks: int, results: list, ratios: dict, baselines: dict | None = None,
          notes: list | None = None) -> dict:
    return {"suite": name, "target": target, "ranks": ranks, "results": results,
            "ratios": {k: float(v) for k, v in ratios.items()}, "baselines": dict(baselines or {}),
            "notes": list(notes or [])}


def validate_suite(d: dict) -> None:
    """Raise ValueError naming the first field that does not follow the schema."""
    for key, typ in SUITE_KEYS.items():
        if key not in d:
            raise ValueError(f"suite result lacks {key!r}")
        if not isinstance(d[key], typ):
            raise ValueError(f"suite field {key!r} should be {typ}, got {type(d[key]).__name__}")
    for i, r in enumerate(d["results"]):
        for key, typ in ROW_KEYS.items():
            if key not in r or not isinstance(r[key], typ):
                raise ValueError(f"results[{i}] field {key!r} missing or not {typ}")
    for k, v in d["ratios"].items():
        if not isinstance(v, (int, float)):
            raise ValueError(f"ratio {k!r} is not a number")


def validate_all(d: dict) -> None:
    if "machine" not in d or "suites" not in d:
        raise ValueError("bench-all result needs 'machine' and 'suites'")
    for s in d["suites"]:
        validate_suite(s)
