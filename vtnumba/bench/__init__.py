"""Benchmarks: each measures vtnumba against a stock baseline in the same run.

Every benchmark module exposes ``run(args) -> dict`` returning the schema in
:mod:`vtnumba.bench.schema`; ``vtnumba bench <name>`` prints it, ``--json`` saves it.
"""
