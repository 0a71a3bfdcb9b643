"""The ``vtnumba`` command line (also ``python -m vtnumba``).

Every command takes ``--target auto|cuda|cudasim|cpu`` (default: ``$VTNUMBA_TARGET`` or
``auto``), before or after the command name (``vtnumba --target cpu info`` and
``vtnumba info --target cpu`` are the same; for ``bench``, before or after the suite's name
as well).  The target is chosen *before* any command
module is imported, because the simulator must be switched on before ``numba.cuda`` is
imported (see :mod:`vtnumba.target`).  This module only parses and dispatches: each command
lives in a module of its own in :mod:`vtnumba.apps`, the benchmarks in :mod:`vtnumba.bench`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from vtnumba.apps.processes import (
    RankZeroErrorsParser,
    check_output_folder,
    choose_target,
    exit_quietly_when_interrupted,
    one_line_warnings,
    share_cores_between_local_ranks,
)
from vtnumba.bench.runner import non_negative_int, path_text, positive_seconds
from vtnumba.target import TARGETS, TargetError, select_target

_TARGET_HELP = "execution target (default: $VTNUMBA_TARGET or 'auto' = cuda if a GPU is usable, else cpu)"


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=TARGETS, default=None, help=_TARGET_HELP)


def _chosen_target(parser: argparse.ArgumentParser, args) -> str | None:
    """``--target`` given before the command, before a bench suite's name, or after it (one name
    each: a subcommand's default would hide the others)."""
    given = [(getattr(args, dest, None), where) for dest, where in
             (("target_before_command", "before the command"), ("target_before_suite", "before the suite"),
              ("target", "after it"))]
    given = [(value, where) for value, where in given if value is not None]
    if len({value for value, _ in given}) > 1:
        shown = ", ".join(f"{value!r} {where}" for value, where in given)
        parser.error(f"--target is given more than once with different values ({shown}); give it once")
    return given[-1][0] if given else None


def build_parser() -> argparse.ArgumentParser:
    """The ``vtnumba`` argument parser: one subcommand per program, each with ``--target``."""
    # The benchmark suites add their own flags; their modules load numpy, so main() has
    # shared the cores between ranks before this runs.
    from vtnumba.bench.runner import (
        BENCH_HELP,
        BENCH_SUITES,
        add_common_arguments,
        add_suite_arguments,
    )

    parser = RankZeroErrorsParser(  # under mpiexec a usage error is printed once, not per rank
        prog="vtnumba",
        description="vtnumba: a readable inference-engine runtime (device runtime, TPSP, encoder cache). "
                    "Run multi-rank commands under 'mpiexec -n N python -m vtnumba ...'.")
    parser.add_argument("--target", dest="target_before_command", choices=TARGETS, default=None, help=_TARGET_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = sub.choices  # name -> its parser: a usage error names the command's own usage

    p = sub.add_parser("info", help="versions, the chosen target and why, GPU, MPI (and the job's size under mpiexec)")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="print the same information as JSON")

    p = sub.add_parser("demo", help="the main job: MiniLM tensor-parallel encoder + encoder-cache consumers "
                                    "(or 'demo runtime': queues, events, async copies)")
    _add_target(p)
    p.add_argument("which", nargs="?", default="pipeline", choices=("pipeline", "runtime"),
                   help="pipeline (default): the real-model pipeline (cpu or cuda: the simulator would take "
                        "hours); runtime: the device-runtime tour (every target)")
    p.add_argument("--encoder-ranks", type=int, default=None,
                   help="pipeline: ranks running the encoder tensor-parallel (default: all but the last rank)")
    p.add_argument("--region-mib", type=float, default=None,
                   help="pipeline: encoder-cache region size in MiB (default: small enough to force evictions)")
    p.add_argument("--queries", nargs="+", default=None, metavar="QUERY",
                   help="pipeline: search queries (default: built-in ones)")
    p.add_argument("--no-tpsp", action="store_true", help="pipeline: encode with the regular forward only")
    p.add_argument("--timeout", type=float, default=None,
                   help="pipeline: seconds a wait for another rank may take before the demo gives up "
                        "(default: vtnumba.dist.DEFAULT_TIMEOUT_S = 60); a wait that spans the awaited "
                        "rank's own wait gets that much longer, so the rank waiting directly for a stopped "
                        "one names it")
    p.add_argument("--fail-at", type=non_negative_int, default=None, help=argparse.SUPPRESS)  # test: consumer raises
    # Test hook (vtnumba.ec.endpoints.FaultInjection): how:rank:point[@n], e.g. stop:2:loading.
    p.add_argument("--inject", default=None, help=argparse.SUPPRESS)

    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2, tensor-parallel over the ranks")
    _add_target(p)
    p.add_argument("--no-tpsp", action="store_true", help="use the regular forward instead of TPSP")
    p.add_argument("--json", action="store_true", help="print a JSON list of {text, embedding}")
    p.add_argument("--timeout", type=positive_seconds, default=None,
                   help="seconds any wait for another rank may take (default: vtnumba.dist.DEFAULT_TIMEOUT_S = 60)")
    p.add_argument("--inject", default=None, help=argparse.SUPPRESS)  # test hook: how:rank:(loading|encoding)
    p.add_argument("texts", nargs="+", metavar="TEXT")

    p = sub.add_parser("bench", help="benchmarks against stock baselines (numpy/BLAS, mpi4py, memcpy)",
                       description="Each suite measures vtnumba against its stock baseline in the same run. "
                                   "Multi-rank suites (peer, tpsp, model) need mpiexec -n 2 or more.")
    p.add_argument("--target", dest="target_before_suite", choices=TARGETS, default=None, help=_TARGET_HELP)
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    p.commands = suites.choices
    for name in BENCH_SUITES + ("all",):
        sp = suites.add_parser(name, help=BENCH_HELP[name])
        _add_target(sp)
        add_common_arguments(sp)
        if name != "all":
            add_suite_arguments(name, sp)

    p = sub.add_parser("trace", help="run a command with VTNUMBA_TRACE set, then merge and draw the timeline",
                       usage="vtnumba trace [-h] [--target {auto,cuda,cudasim,cpu}] [--out PREFIX] -- COMMAND ...")
    _add_target(p)
    default_prefix = os.path.join(os.environ.get("VTNUMBA_OUT_DIR") or "out", "vtnumba-trace")
    p.add_argument("--out", default=default_prefix, metavar="PREFIX", type=path_text,
                   help=f"output prefix: PREFIX.json (merged trace), PREFIX.png, PREFIX.rankN.json; a name "
                        f"ending in .json means the same prefix without it (default: {default_prefix}, in the "
                        "ignored out/ folder)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to trace, after --")
    return parser


def _command_parser(parser, args) -> argparse.ArgumentParser:
    """The parser of the command (and bench suite) ``args`` names, for its usage errors: ``vtnumba
    bench memory: error: ...`` under that command's usage line, not the top level's."""
    command = getattr(parser, "commands", {}).get(getattr(args, "command", None))
    if command is None:
        return parser
    return getattr(command, "commands", {}).get(getattr(args, "suite", None), command)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, choose the target, run the command; returns its exit code (2 for usage errors)."""
    share_cores_between_local_ranks()  # before anything loads numpy's BLAS
    one_line_warnings("vtnumba")
    parser = build_parser()
    # (parse_known_args: an option no parser knows is said under the usage line of the command
    # it was given to -- argparse's own parse_args sends it up to the top level's.)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    # Choose the target first: nothing below may import numba.cuda before this line.  (info
    # is how to find out why cuda is not usable: it takes the cuda target as it is, and says.)
    if args.command in ("info", "trace"):  # (trace only passes the choice on: its command checks it)
        try:
            select_target(_chosen_target(_command_parser(parser, args), args), source="--target")
        except TargetError as exc:
            parser.error(str(exc))
        if args.command == "info":  # (info reports what a program would run with: bad switches first)
            from vtnumba.apps.processes import check_environment

            check_environment(_command_parser(parser, args))
    else:
        choose_target(parser, _chosen_target(_command_parser(parser, args), args))

    usage_error = _command_parser(parser, args).error
    if args.command == "info":
        from vtnumba.apps.info import print_info

        return print_info(as_json=args.json)
    if args.command == "demo":
        if args.which == "runtime":
            # The pipeline's options mean nothing to the tour: say so instead of ignoring them.
            given = [flag for flag, value in (("--encoder-ranks", args.encoder_ranks), ("--region-mib", args.region_mib),
                                              ("--queries", args.queries), ("--no-tpsp", args.no_tpsp or None),
                                              ("--timeout", args.timeout)) if value is not None]
            if given:
                usage_error(f"demo runtime takes none of the pipeline's options ({', '.join(given)})")
            from vtnumba.apps.runtime_tour import run_runtime_demo
            from vtnumba.dist import run_collectively

            return run_collectively(run_runtime_demo)
        from vtnumba.apps.pipeline_demo import run_pipeline_demo

        return run_pipeline_demo(args)
    if args.command == "embed":
        from vtnumba.apps.embed import INJECT_POINTS, run_embed
        from vtnumba.dist import run_collectively, set_default_timeout
        from vtnumba.dist.comm import DEFAULT
        from vtnumba.faults import FaultInjection

        if args.inject is not None:
            from mpi4py import MPI

            try:
                FaultInjection.parse(args.inject, INJECT_POINTS, MPI.COMM_WORLD.Get_size())
            except ValueError as exc:
                usage_error(str(exc))
        if args.timeout is not None:
            set_default_timeout(args.timeout)
        # A rank that fails (not bad input: every rank refuses that alike) ends the others' waits.
        return run_collectively(lambda: run_embed(args), timeout_s=args.timeout if args.timeout is not None else DEFAULT)
    if args.command == "bench":
        from mpi4py import MPI

        from vtnumba.apps.info import collect_info
        from vtnumba.bench.runner import AUTO, check_inject, check_suite_arguments, resolve_outputs, run_bench
        from vtnumba.dist import run_collectively, set_default_timeout

        json_path, plot_dir = resolve_outputs(args)
        try:
            check_inject(args, MPI.COMM_WORLD.Get_size())  # every rank refuses a bad one alike
            check_suite_arguments(args, MPI.COMM_WORLD.Get_size())
            # Where the results go must be writable before the suites run, not after them.  (A
            # default path is the environment's doing when VTNUMBA_OUT_DIR is set: named so.)
            def named(flag: str, given) -> str:
                out_dir = os.environ.get("VTNUMBA_OUT_DIR")
                if given in (None, AUTO) and out_dir:
                    return f"{flag} (its default folder, from VTNUMBA_OUT_DIR={out_dir!r})"
                return flag

            if json_path not in (None, "-"):
                if os.path.isdir(json_path):
                    raise ValueError(f"--json {json_path}: is a folder; expected a file name")
                check_output_folder(named("--json", args.json), os.path.dirname(os.path.abspath(json_path)))
            if plot_dir is not None:
                check_output_folder(named("--plot", args.plot), plot_dir)
        except ValueError as exc:
            usage_error(str(exc))

        # Every wait of the suites uses the flag; a failing rank reaches the others at once.
        set_default_timeout(args.timeout)
        return run_collectively(lambda: run_bench(args, collect_info()), timeout_s=args.timeout)
    if args.command == "trace":
        from vtnumba.apps.trace_tools import run_traced

        cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
        if not cmd:
            usage_error("trace needs a command after --, e.g. vtnumba trace -- mpiexec -n 2 python mpi/tpsp_model.py")
        if shutil.which(cmd[0]) is None:
            usage_error(f"{cmd[0]!r} is not a command found on PATH (nor an executable file)")
        # --out is a prefix (PREFIX.rank0.json ...), not a folder: a folder there, or a name
        # ending in '/', would give files nobody can write -- found only after the whole run.
        if args.out.endswith(os.sep) or os.path.isdir(args.out):
            usage_error(f"--out {args.out}: is a folder; --out is a file name prefix, e.g. {os.path.join(args.out, 'trace')}"
                        " (for trace.rank0.json, trace.rank1.json, ...)")
        out_dir = os.environ.get("VTNUMBA_OUT_DIR")
        from_env = out_dir and args.out == os.path.join(out_dir, "vtnumba-trace")  # (the default: the variable's doing)
        flag = f"--out (its default folder, from VTNUMBA_OUT_DIR={out_dir!r})" if from_env else "--out"
        try:
            check_output_folder(flag, os.path.dirname(os.path.abspath(args.out)))
        except ValueError as exc:
            usage_error(str(exc))
        return run_traced(cmd, args.out)
    parser.error(f"unknown command {args.command!r}")
    return 2


def run() -> int:
    """The console entry point: :func:`main`, quiet when the reader closes the pipe (``vtnumba info | head``),
    and one line for a Ctrl-C during startup (:func:`~vtnumba.apps.processes.exit_quietly_when_interrupted`)."""
    try:
        return exit_quietly_when_interrupted(main)
    except BrokenPipeError:
        # The reader is gone; point stdout at /dev/null so Python's exit flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
