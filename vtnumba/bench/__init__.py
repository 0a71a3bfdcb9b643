"""Benchmarks: each measures vtnumba against a stock baseline in the same run.

Every benchmark module exposes ``run(args) -> dict`` returning the schema in
:mod:`vtnumba.bench.schema`; ``vtnumba bench <name>`` (:mod:`vtnumba.bench.runner`) prints
it as a table with readable sizes and p10/p90 spreads, ``--json`` saves it and ``--plot``
draws one figure per metric family (by default under ``out/``).  A suite reports the size
it is working on with :func:`vtnumba.bench.timing.progress_step`, so that a long run says
what it is doing; it may define ``estimate_s(args, ranks)`` for the runner's estimate.
"""
