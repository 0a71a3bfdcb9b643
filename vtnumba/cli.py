"""The ``vtnumba`` command line (also ``python -m vtnumba``).

Every command takes ``--target auto|cuda|cudasim|cpu`` (default: ``$VTNUMBA_TARGET`` or
``auto``).  The target is chosen *before* any command module is imported, because the
simulator must be switched on before ``numba.cuda`` is imported (see
:mod:`vtnumba.target`).  This module only parses and dispatches: each command lives in
the package that owns the concept.
"""

from __future__ import annotations

import argparse
import sys

from vtnumba.target import TARGETS, select_target

BENCH_SUITES = ("kernels", "memory", "peer", "tpsp", "ec", "model")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="execution target (default: $VTNUMBA_TARGET or 'auto' = cuda if a GPU is usable, else cpu)")


BENCH_HELP = {
    "kernels": "fused host norm vs numpy, host matmul vs BLAS; on a GPU the matmul ladder vs cuBLAS",
    "memory": "cached vs uncached allocation",
    "ec": "encoder-cache save/load throughput vs memcpy",
    "peer": "peer-buffer reduce-scatter / all-gather vs mpi4py collectives (mpiexec -n 2)",
    "tpsp": "fused TPSP vs matmul alone and the unfused mpi4py forward (mpiexec -n 2)",
    "model": "MiniLM encoder with TPSP vs the regular forward (and sentence-transformers if installed)",
    "all": "every suite above, one JSON document",
}


def _add_bench_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", nargs="?", const="-", default=None,
                   help="write the results as JSON to PATH (or stdout with no PATH)")
    p.add_argument("--plot", metavar="DIR", default=None, help="write perf_report-style PNG plots into DIR")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (seconds, not minutes)")


def add_suite_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """Let a benchmark suite add its own flags (its ``add_arguments(parser)``, if any).

    Suite modules import nothing heavy at module level, so this is cheap."""
    import importlib

    add = getattr(importlib.import_module(f"vtnumba.bench.{name}"), "add_arguments", None)
    if add is not None:
        add(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vtnumba",
        description="vtnumba: a readable inference-engine runtime (device runtime, TPSP, encoder cache). "
                    "Run multi-rank commands under 'mpiexec -n N python -m vtnumba ...'.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="versions, the chosen target and why, GPU, MPI rank/size")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="print the same information as JSON")

    p = sub.add_parser("demo", help="the main job: MiniLM tensor-parallel encoder + encoder-cache consumers "
                                    "(or 'demo runtime': queues, events, async copies)")
    _add_target(p)
    p.add_argument("which", nargs="?", default="pipeline", choices=("pipeline", "runtime"),
                   help="pipeline (default): the real-model pipeline; runtime: the device-runtime tour")
    p.add_argument("--encoder-ranks", type=int, default=None,
                   help="pipeline: ranks running the encoder tensor-parallel (default: all but the last rank)")
    p.add_argument("--region-mib", type=float, default=None,
                   help="pipeline: encoder-cache region size in MiB (default: small enough to force evictions)")
    p.add_argument("--queries", nargs="*", default=None, help="pipeline: search queries (default: built-in ones)")
    p.add_argument("--no-tpsp", action="store_true", help="pipeline: encode with the regular forward only")
    p.add_argument("--fail-at", type=int, default=None, help=argparse.SUPPRESS)  # test hook: consumer raises

    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2, tensor-parallel over the ranks")
    _add_target(p)
    p.add_argument("--no-tpsp", action="store_true", help="use the regular forward instead of TPSP")
    p.add_argument("--json", action="store_true", help="print a JSON list of {text, embedding}")
    p.add_argument("texts", nargs="+", metavar="TEXT")

    p = sub.add_parser("bench", help="benchmarks against stock baselines (numpy/BLAS, mpi4py, memcpy)",
                       description="Each suite measures vtnumba against its stock baseline in the same run. "
                                   "Multi-rank suites (peer, tpsp, model) need mpiexec -n 2 or more.")
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name in BENCH_SUITES + ("all",):
        sp = suites.add_parser(name, help=BENCH_HELP[name])
        _add_target(sp)
        _add_bench_common(sp)
        if name != "all":
            add_suite_arguments(name, sp)

    p = sub.add_parser("trace", help="run a command with VTNUMBA_TRACE set, then merge and draw the timeline",
                       usage="vtnumba trace [--out PREFIX] -- COMMAND ...")
    _add_target(p)
    p.add_argument("--out", default="vtnumba-trace", help="output prefix (default: vtnumba-trace)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to trace, after --")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # Choose the target first: nothing below may import numba.cuda before this line.
    select_target(args.target)

    if args.command == "info":
        from vtnumba.info import print_info

        return print_info(as_json=args.json)
    if args.command == "demo":
        if args.which == "runtime":
            from vtnumba.demo_runtime import run_runtime_demo

            return run_runtime_demo()
        from vtnumba.models.pipeline import run_pipeline_demo

        return run_pipeline_demo(args)
    if args.command == "embed":
        from vtnumba.models.cli import run_embed

        return run_embed(args)
    if args.command == "bench":
        from vtnumba.bench.runner import run_bench

        return run_bench(args)
    if args.command == "trace":
        from vtnumba.tracing_tools import run_traced

        cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
        if not cmd:
            parser.error("trace needs a command after --, e.g. vtnumba trace -- mpiexec -n 2 python mpi/tpsp_model.py")
        return run_traced(cmd, args.out)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
