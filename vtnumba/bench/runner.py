"""``vtnumba bench <suite>|all``: run benchmark suites, print, save JSON, draw plots.

Each suite module (``vtnumba.bench.<name>``) exposes ``run(args) -> dict`` in the schema
of :mod:`vtnumba.bench.schema`, measuring vtnumba against a stock baseline *in the same
run*.  Suites that exchange data between ranks (peer, tpsp, model) run on every rank of
``mpiexec``; single-process suites (kernels, memory, ec) run on rank 0 while the others
wait.  Rank 0 alone speaks: it prints a table per suite, writes ``--json`` and draws
``--plot`` figures in the style of Triton's ``perf_report``: the metric against size, one
line per implementation, the median with p10/p90 bars.

Output that explains itself:

* before a suite, one line with its name and an estimate of how long it takes (the
  suite's own ``estimate_s(args, ranks)`` if it has one, and the last run of the same
  suite on this machine, remembered in ``out/bench-durations.json``);
* during it, a line for every step (size) that runs longer than ~2 s
  (:func:`vtnumba.bench.timing.progress_step`);
* generated files go under ``out/`` (ignored by git) unless a path is given:
  ``--json`` alone writes ``out/bench-<suite>.json``, ``--plot`` alone ``out/plots/``, and
  ``bench all`` writes both even when not asked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import re
import sys
import time
from contextlib import nullcontext

from vtnumba.bench.schema import (
    axis_label,
    format_number,
    format_relative,
    format_size,
    metric_kind,
    validate_all,
    validate_suite,
    value_bounds,
)

MULTI_RANK = {"peer", "tpsp", "model"}
#: Suites that do not run in the CUDA simulator, and why (``bench all`` skips them there).
NOT_IN_SIMULATOR = {
    "peer": "it measures bandwidth, and the simulator runs about 7,000 GPU threads a second: its numbers would "
            "mean nothing",
    "model": "the MiniLM model takes many minutes per batch in the simulator",
}


def skip_reason(name: str, world_size: int, target: str | None = None) -> str | None:
    """Why ``bench all`` skips suite ``name`` in this job (None: it runs).  Asked for by name,
    such a suite is a usage error instead (:func:`check_suite_arguments`)."""
    if name in MULTI_RANK and world_size < 2:
        return "needs mpiexec -n 2 or more"
    if target == "cudasim" and name in NOT_IN_SIMULATOR:
        return f"not on cudasim: {NOT_IN_SIMULATOR[name]}; use --target cpu (or cuda on a GPU machine)"
    return None


def _current_target_name() -> str | None:
    from vtnumba.target import current_target

    try:
        return current_target().name
    except Exception:  # noqa: BLE001 (no target chosen yet: a library caller)
        return None
ORDER = ("kernels", "memory", "ec", "peer", "tpsp", "model")
BENCH_SUITES = ORDER
BENCH_HELP = {
    "kernels": "fused host norm vs numpy, host matmul vs BLAS; on a GPU the matmul ladder vs cuBLAS",
    "memory": "cached vs uncached allocation",
    "ec": "encoder-cache save/load throughput vs memcpy",
    "peer": "peer-buffer reduce-scatter / all-gather vs mpi4py collectives (mpiexec -n 2)",
    "tpsp": "fused TPSP vs matmul alone and the unfused mpi4py forward (mpiexec -n 2)",
    "model": "MiniLM encoder with TPSP vs the regular forward (and sentence-transformers if installed) (mpiexec -n 2)",
    "all": "every suite above, one JSON document",
}

#: Where generated files go when no path is given: ``$VTNUMBA_OUT_DIR``, else ``out/`` (in
#: .gitignore).  The docs build points it into its build folder.
OUT_DIR = os.environ.get("VTNUMBA_OUT_DIR") or "out"
#: What ``--json`` / ``--plot`` hold when given without a path: "use the default under out/".
AUTO = "<out>"
#: How long a rank waits for the others by default (``--timeout``): long, because the idle
#: ranks wait in a barrier while rank 0 alone runs a single-process suite.
BARRIER_TIMEOUT_S = 3600.0
#: A step running longer than this prints its progress line ("~2 s": long enough to wonder).
PROGRESS_DELAY_S = 2.0
#: A row whose p10 and p90 lie further apart than this fraction of its median is marked noisy.
NOISY = 0.5


def default_json_path(suite: str, quick: bool = False) -> str:
    """Where ``--json`` without a path writes: ``out/bench-<suite>.json`` (``-quick.json`` for a
    ``--quick`` run, so that a quick look never overwrites the results of a full run)."""
    return os.path.join(OUT_DIR, f"bench-{suite}{'-quick' if quick else ''}.json")


def default_plot_dir(quick: bool = False) -> str:
    """Where ``--plot`` without a directory draws: ``out/plots`` (``out/plots-quick`` with ``--quick``)."""
    return os.path.join(OUT_DIR, "plots-quick" if quick else "plots")


def add_common_arguments(p) -> None:
    """The flags every suite takes (``--json``, ``--plot``, ``--quick``, ``--timeout``, and the
    hidden ``--inject``); each suite's parser adds ``--target`` itself."""
    p.add_argument("--json", metavar="PATH", nargs="?", const=AUTO, default=None, type=path_text,
                   help=f"write the results as JSON to PATH ('-' for stdout; no PATH: {OUT_DIR}/bench-SUITE.json, "
                        "or bench-SUITE-quick.json with --quick)")
    p.add_argument("--plot", metavar="DIR", nargs="?", const=AUTO, default=None, type=path_text,
                   help=f"write perf_report-style PNG plots into DIR (no DIR: {default_plot_dir()}/, or "
                        f"{default_plot_dir(True)}/ with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (seconds, not minutes)")
    p.add_argument("--timeout", type=positive_seconds, default=BARRIER_TIMEOUT_S,
                   help="seconds a rank waits for the others -- also while rank 0 alone runs a single-process "
                        f"suite, so it bounds a suite's run time (default: {BARRIER_TIMEOUT_S:g}); a rank that "
                        "fails ends the others' waits at once")
    # Test hook (vtnumba.faults): how:rank:SUITE, e.g. stop:0:memory -- rank 0 stops as the suite starts.
    p.add_argument("--inject", default=None, help=argparse.SUPPRESS)


def check_inject(args, world_size: int):
    """The hidden ``--inject how:rank:SUITE`` test flag, checked against this command and job:
    the FaultInjection (None without the flag); ValueError naming the flag for a fault that
    could never fire -- a rank the job lacks, or a suite this command does not run (``bench
    memory --inject stop:0:kernels``; a multi-rank suite skipped by a 1-rank job)."""
    from vtnumba.faults import FaultInjection

    text = getattr(args, "inject", None)
    if text is None:
        return None
    names = ORDER if args.suite == "all" else (args.suite,)
    target = _current_target_name()
    runs = tuple(n for n in names if skip_reason(n, world_size, target) is None)
    spec = FaultInjection.parse(text, BENCH_SUITES, world_size)
    if spec.point not in runs:
        raise ValueError(f"--inject={text!r}: this command runs {', '.join(runs) or 'no suite'} "
                         f"on {world_size} rank(s), not {spec.point!r}, so the fault would never fire")
    return spec


def check_suite_arguments(args, world_size: int) -> None:
    """Each suite this command runs on ``world_size`` ranks checks its own flags against the job
    (a suite module's ``check_arguments(args, world_size)``, if it has one): ValueError naming
    the flag -- a usage error said once, not a failure of every rank minutes into the run."""
    names = ORDER if args.suite == "all" else (args.suite,)
    target = _current_target_name()
    if args.suite in MULTI_RANK and world_size < 2:  # (asked for by name: it must run, not be skipped)
        raise ValueError(f"bench {args.suite} runs over 2 or more ranks: mpiexec -n 2 python -m vtnumba bench "
                         f"{args.suite}")
    if args.suite in NOT_IN_SIMULATOR and target == "cudasim":
        raise ValueError(f"bench {args.suite} does not run on cudasim: {NOT_IN_SIMULATOR[args.suite]}; use "
                         "--target cpu (or cuda on a GPU machine)")
    for name in names:
        if skip_reason(name, world_size, target) is not None:
            continue  # (skipped by bench all)
        check = getattr(importlib.import_module(f"vtnumba.bench.{name}"), "check_arguments", None)
        if check is not None:
            check(args, world_size)


def check_sizes_fit(sizes_bytes, flag: str = "--sizes") -> None:
    """ValueError naming ``flag`` for a size larger than this machine's free memory and swap:
    not even one buffer of it could be made (a typo's extra digits were a MemoryError from
    deep inside a suite, after the smaller sizes had run)."""
    from vtnumba.ec.region import available_memory_bytes

    room = available_memory_bytes()
    for n in sizes_bytes or ():
        if room is not None and n > room:
            raise ValueError(f"{flag}: {n / 2**20:g} MiB is more than this machine has free ({room / 2**20:.0f} MiB of "
                             "memory and swap)")


def default_hidden_size(preferred: int, ranks: int) -> int:
    """A TPSP hidden size near ``preferred`` that ``ranks`` can share: rounded up to a multiple of
    8 x the rank count (each rank normalises H / ranks columns, in whole 8-column groups), so
    4096 stays 4096 on 2 and 4 ranks and becomes 4104 on 3."""
    step = 8 * ranks
    from vtnumba.backend.arrays import cdiv  # (here: the backend loads numba, and the CLI imports this module first)

    return cdiv(preferred, step) * step


def check_hidden_split(hidden: int, ranks: int, flag: str = "--hidden") -> None:
    """ValueError naming ``flag`` unless the ``ranks`` divide the hidden size (the fused op's
    output columns are split evenly over the ranks)."""
    if hidden % ranks:
        raise ValueError(f"{flag}={hidden} is not divisible by the {ranks} ranks (each rank normalises "
                         f"H / {ranks} columns of the fused op's output)")


def _inject_hook(args, name: str, rank: int, world_size: int):
    """This rank's hook for the ``--inject`` flag: it fails as the suite starts (None: no fault here)."""
    spec = check_inject(args, world_size)
    return spec.on_point(rank) if spec is not None else None


def positive_int(text: str, least: int = 1) -> int:
    """The argparse type of a count or size flag: a whole number >= 1, refused at parse time with
    the flag's name (argparse adds it) instead of deep inside a suite's run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
    return value


def non_negative_int(text: str) -> int:
    """The argparse type of a seed: a whole number >= 0 (numpy refuses negative seeds)."""
    return positive_int(text, least=0)


def positive_number(text: str) -> float:
    """The argparse type of a size or fraction flag: a positive, finite number ('nan' and 'inf'
    are refused at parse time, not deep inside a run)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number")
    return value


def path_text(text: str) -> str:
    """The argparse type of a path flag: any path but an empty one (``--json=`` or ``--out ""``
    was taken as no path at all: the run went on and wrote nothing, or wrote beside the
    current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give one (or leave the flag out)")
    return text


def positive_seconds(text: str) -> float:
    """The ``--timeout`` flags' argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:  # (argparse's own message would name this function: "invalid positive_seconds value")
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive, finite number of seconds")
    return value


def add_suite_arguments(name: str, p) -> None:
    """Let a benchmark suite add its own flags (its ``add_arguments(parser)``, if any).

    Suite modules import nothing heavy at module level, so this is cheap."""
    add = getattr(importlib.import_module(f"vtnumba.bench.{name}"), "add_arguments", None)
    if add is not None:
        add(p)


def resolve_outputs(args) -> tuple[str | None, str | None]:
    """Where ``--json`` and ``--plot`` write: the given path, the default under ``out/``, or None.

    ``bench all`` saves both by default: a run of minutes should not be lost because a flag
    was forgotten.  ``--json -`` still prints the JSON to stdout."""
    suite = getattr(args, "suite", None) or "results"
    json_path, plot_dir = getattr(args, "json", None), getattr(args, "plot", None)
    if suite == "all":
        json_path = AUTO if json_path is None else json_path
        plot_dir = AUTO if plot_dir is None else plot_dir
    quick = bool(getattr(args, "quick", False))
    if json_path == AUTO:
        json_path = default_json_path(suite, quick)
    if plot_dir == AUTO:
        plot_dir = default_plot_dir(quick)
    return json_path, plot_dir


def machine_description(stack: dict | None = None) -> dict:
    """The machine the numbers come from: ``stack`` (what ``vtnumba info`` collects) plus the CPU."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = dict(stack or {})
    info.update(cpu=cpu, cores=os.cpu_count(), time=time.strftime("%Y-%m-%d %H:%M:%S"))
    return info


#: Where status and progress lines go: stdout, in order with the tables (under mpiexec, stdout
#: and stderr reach the terminal through separate pipes and overtake each other), or stderr
#: when stdout carries the JSON document (``--json -``).
_status_to_stderr = False


def status_stream():
    """The stream status and progress lines go to (see ``_status_to_stderr``)."""
    return sys.stderr if _status_to_stderr else sys.stdout


def say(msg: str) -> None:
    """One status line, flushed at once; rank 0 calls it."""
    sys.stdout.flush()  # a table printed just before must not land after this line
    print(msg, file=status_stream(), flush=True)


def format_duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``4 min 6 s``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes} min {s} s"


# ---------------------------------------------------------------------------- estimates
def durations_path() -> str:
    """Where the runner remembers how long each suite took on this machine: beside its other
    generated files (``out/``, ignored by git), never in the user's home."""
    return os.path.join(OUT_DIR, "bench-durations.json")


def _duration_key(name: str, quick: bool, target: str, ranks: int, extra: str = "") -> str:
    return f"{name} {'quick' if quick else 'full'} {target} {ranks} rank(s){extra}"


def load_durations() -> dict:
    """The remembered suite durations (``{key: seconds}``); empty when there are none yet."""
    try:
        with open(durations_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def remember_duration(key: str, seconds: float) -> None:
    """Record a suite's wall time for the next run's estimate (best effort: a read-only home is fine)."""
    path = durations_path()
    data = load_durations()
    data[key] = round(float(seconds), 2)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def estimate_line(module, sargs, ranks: int, key: str) -> str:
    """What the runner says before a suite: its own estimate and/or the last run here."""
    parts = []
    estimate = getattr(module, "estimate_s", None)
    if estimate is not None:
        try:
            got = estimate(sargs, ranks)
        except Exception as exc:  # noqa: BLE001 - an estimate must never stop a benchmark
            got = None
            parts.append(f"no estimate ({type(exc).__name__}: {exc})")
        if got is not None:
            seconds, basis = got
            parts.append(f"estimate {format_duration(seconds)} ({basis})")
    last = load_durations().get(key)
    if last is not None:
        parts.append(f"last run here took {format_duration(last)}")
    if not parts:
        parts.append("no estimate yet (first run of this suite on this machine)")
    return "; ".join(parts)


# ---------------------------------------------------------------------------- running
def suite_args(name: str, args):
    """The namespace a suite's ``run`` gets: its own flags' defaults under the common flags.

    ``vtnumba bench all`` parses only the common flags (--quick, --json, --plot, --timeout); each
    suite still sees every attribute its ``add_arguments`` defines."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    add_suite_arguments(name, parser)
    ns = parser.parse_args([])
    for key, value in vars(args).items():
        if not hasattr(ns, key) or args.suite == name:
            setattr(ns, key, value)
    return ns


def run_suite(name: str, args, comm, *, target: str | None = None) -> dict | None:
    """Run one suite on the ranks it needs; returns the result on rank 0 (None elsewhere)."""
    from vtnumba.bench.timing import Progress, set_progress

    rank, size = comm.Get_rank(), comm.Get_size()
    if target is None:
        target = _current_target_name()
    why = skip_reason(name, size, target)
    if why is not None:
        if rank == 0:
            say(f"bench {name}: skipped ({why})")
        return None
    module = importlib.import_module(f"vtnumba.bench.{name}")
    sargs = suite_args(name, args)
    ranks = size if name in MULTI_RANK else 1
    # (--ptxas compiles every kernel for two GPU generations: timed apart from the suite alone.)
    key = _duration_key(name, bool(args.quick), target, ranks, " +ptxas" if getattr(sargs, "ptxas", False) else "")
    if rank == 0:
        how = f"{'quick' if args.quick else 'full sizes'}, {ranks} rank{'s' if ranks > 1 else ''}"
        say(f"bench {name}: running ({how}); {estimate_line(module, sargs, ranks, key)}")
    # Rank 0's progress lines for steps longer than ~2 s; the other ranks run the same steps silently.
    progress = Progress(name, enabled=rank == 0, stream=status_stream(), delay_s=PROGRESS_DELAY_S)
    previous = set_progress(progress)
    t0 = time.perf_counter()
    result = None
    # A multi-rank suite's groups first, while every rank is known to be here: creating a
    # communicator is a blocking MPI call with no deadline, so a rank that stopped later in
    # the suite must find the others in waits that can end (--timeout), not inside
    # MPI_Comm_split.  (Freed at the end if this call created them.)
    from vtnumba.dist.comm import wait_request
    from vtnumba.dist.groups import distributed

    with distributed() if name in MULTI_RANK else nullcontext():
        hook = _inject_hook(args, name, rank, size)
        try:
            if hook is not None:
                hook(name)
            if name in MULTI_RANK or rank == 0:
                result = module.run(sargs)
        finally:
            progress.close()
            set_progress(previous)
        # A sleeping barrier: ranks idle during a single-process suite must not spin on a core
        # the measured code needs (a plain MPI Barrier busy-polls).
        wait_request(comm.Ibarrier(), None, f"the barrier after bench {name}",
                     getattr(args, "timeout", None) or BARRIER_TIMEOUT_S)
    if rank == 0 and result is not None:
        validate_suite(result)
        took = time.perf_counter() - t0
        remember_duration(key, took)
        say(f"bench {name}: done in {format_duration(took)}")
    return result if rank == 0 else None


# ---------------------------------------------------------------------------- tables
#: The table's columns, and which are numbers (right-aligned so their digits line up).
COLUMNS = ("case", "impl", "size", "median", "metric", "p10", "p90", "")
NUMERIC = {"median", "p10", "p90"}


def _table(lines: list[tuple]) -> list[str]:
    """Columns as wide as their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(COLUMNS, *lines)]
    out = []
    for cells in (COLUMNS, *lines):
        text = [str(c).rjust(w) if name in NUMERIC else str(c).ljust(w)
                for name, c, w in zip(COLUMNS, cells, widths)]
        out.append("  " + "  ".join(text).rstrip())
    return out


def _has_spread(r: dict) -> bool:
    """Does the row carry a spread of its own -- a timing's percentiles, or a paired ratio's?
    (Not a count, nor a value worked out from medians, such as a fixed cost per step.)"""
    lo, hi = value_bounds(r)
    return not (lo == hi == r["value"] and (r.get("median_s", 0.0) == 0.0 or metric_kind(r["metric"]) == "count"))


def _row_cells(r: dict) -> tuple[tuple, bool]:
    """A result row's cells: p10/p90 relative to the median, and whether the row is noisy."""
    lo, hi = value_bounds(r)
    v = r["value"]
    noisy = v != 0 and (hi - lo) / abs(v) > NOISY
    size = format_size(r["size"], r["size_unit"], r.get("shape"))
    if not _has_spread(r):
        p10 = p90 = ""  # a count, or a value derived from medians: no spread of its own
    else:
        p10, p90 = format_relative(lo, v), format_relative(hi, v)
    return (r["case"], r["impl"], size, format_number(v), r["metric"], p10, p90, "noisy" if noisy else ""), noisy


def _paired_cells(r: dict) -> tuple[tuple, bool]:
    """A paired row's cells: p10/p90 in the row's own unit (a difference near zero has no useful
    percentage), and whether its range includes "no difference" (0, or 1 for a ratio)."""
    lo, hi = value_bounds(r)
    neutral = 1.0 if metric_family(r["metric"]) == "ratio" else 0.0
    unclear = lo <= neutral <= hi
    size = format_size(r["size"], r["size_unit"], r.get("shape"))
    return (r["case"], r["impl"], size, format_number(r["value"]), r["metric"], format_number(lo),
            format_number(hi), "within noise" if unclear else ""), unclear


def print_suite(res: dict) -> None:
    """The suite as tables people can read: sizes as ``4 KiB`` / ``8 Ki × 4 Ki``, spreads as p10/p90
    relative to the median (a long upper tail shows as ``-2% +40%``, not as one "42%")."""
    ranks = res["ranks"]
    print(f"\n== {res['suite']} (target {res['target']}, {ranks} rank{'s' if ranks > 1 else ''})")
    cells, noisy = [], 0
    for r in res["results"]:
        c, n = _row_cells(r)
        cells.append(c)
        noisy += n
    for line in _table(cells):
        print(line)
    print("  p10/p90: the 10th and 90th percentile, relative to the median"
          + (f"; {noisy} row(s) noisy (p10..p90 wider than {NOISY:.0%} of the median)" if noisy else ""))
    paired = res.get("paired") or []
    if paired:
        print("  compared round by round: the median, p10 and p90 of per-round differences or ratios")
        pcells, unclear = [], 0
        for r in paired:
            c, n = _paired_cells(r)
            pcells.append(c)
            unclear += n
        for line in _table(pcells):
            print(line)
        if unclear:
            print(f"  within noise: {unclear} row(s) whose p10..p90 includes 0 (a difference) or 1 (a ratio): "
                  "the rounds disagree on which side is faster")
    for k, v in res["baselines"].items():
        print(f"  baseline  {k}: {v:.4g}")
    for k, v in res["ratios"].items():
        print(f"  ratio     {k}: {v:.3f}")
    for n in res["notes"]:
        print(f"  note      {n}")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- plots
#: Words that mark an implementation as a baseline: drawn dashed, so vtnumba's lines stand out.
BASELINE_WORDS = ("numpy", "mpi4py", "mpi-baseline", "memcpy", "matmul-only", "cublas", "uncached",
                  "sentence-transformers", "copy")


def _slug(text: str) -> str:
    text = text.lower().replace("/", " per ").replace("=", " ")
    return re.sub(r"[^a-z0-9]+", "_", text).strip("_") or "value"


def metric_family(metric: str) -> str:
    """Metrics that share an axis: ``GB/s (traffic)`` and ``GB/s`` are both ``GB/s``."""
    return re.sub(r"\s*\(.*\)\s*$", "", metric).strip() or metric


def plot_families(res: dict) -> dict:
    """``{(metric family, size unit): {group: [row, ...]}}`` over the results and the paired rows.

    One figure per family (the metric and the x axis it shares), one panel per group (the
    row's ``group``, else its ``case``), one line per implementation across sizes."""
    families: dict = {}
    for r in list(res["results"]) + list(res.get("paired") or []):
        key = (metric_family(r["metric"]), r["size_unit"])
        families.setdefault(key, {}).setdefault(r.get("group", r["case"]), []).append(r)
    return families


def _style(impl: str, colors: dict, cmap) -> dict:
    """One colour per implementation in a figure; dashed when it is a baseline.  For a paired
    row (``a - b``, ``a / b``) what counts is ``a``, the implementation being compared."""
    if impl not in colors:
        colors[impl] = cmap(len(colors) % cmap.N)
    first = re.split(r" [-/] ", impl)[0].lower()
    dashed = any(w in first for w in BASELINE_WORDS)
    return {"color": colors[impl], "linestyle": "--" if dashed else "-"}


def figure_title(family: str, groups: dict) -> str:
    """What the figure's y values are: ``time (ms)``, ``throughput (GB/s)``, ``ratio``."""
    kinds = {metric_kind(r["metric"]) for rows in groups.values() for r in rows}
    if family == "ratio":
        return "ratio (below 1: the first is faster)"
    if kinds == {"time"}:
        return f"time ({family}), lower is better"
    if kinds == {"rate"}:
        return f"throughput ({family}), higher is better"
    return family


def _readable_log_axis(axis) -> None:
    """Log-scale ticks at 1, 2, 5 x 10^k written as plain numbers (``200``, not ``2 x 10^2``)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _draw_lines(ax, rows, unit, colors, cmap) -> None:
    """Line panel: x = size (log 2), one line per impl, median with p10/p90 error bars."""
    from matplotlib.ticker import NullFormatter, NullLocator

    xs = sorted({float(r["size"]) for r in rows})
    markers = "osD^vP*Xh<>"
    values = []
    for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows)):
        pts = sorted((float(r["size"]), r["value"], *value_bounds(r)) for r in rows if r["impl"] == impl)
        x = [p[0] for p in pts]
        y = [p[1] for p in pts]
        err = [[max(p[1] - p[2], 0.0) for p in pts], [max(p[3] - p[1], 0.0) for p in pts]]
        values += [p[2] for p in pts] + [p[3] for p in pts]
        ax.errorbar(x, y, yerr=err, marker=markers[i % len(markers)], markersize=5, capsize=3, linewidth=1.6,
                    label=impl, **_style(impl, colors, cmap))
    if min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([format_size(x, unit, with_unit=False) for x in xs], rotation=30 if len(xs) > 6 else 0)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(axis_label(unit))
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 30:
        ax.set_yscale("log")
        _readable_log_axis(ax.yaxis)
    elif positive and len(positive) == len(values):
        ax.set_ylim(bottom=0)  # a linear axis from zero: heights compare as the values do


def _draw_bars(ax, rows, colors, cmap) -> None:
    """Bar panel, for a group measured at one size only: one bar per impl with p10/p90 whiskers."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by_impl = {r["impl"]: r for r in rows}
    ys = list(range(len(impls)))[::-1]
    values = []
    for y, impl in zip(ys, impls):
        r = by_impl[impl]
        lo, hi = value_bounds(r)
        values += [lo, hi]
        style = _style(impl, colors, cmap)
        ax.barh(y, r["value"], height=0.6, xerr=[[max(r["value"] - lo, 0.0)], [max(hi - r["value"], 0.0)]],
                capsize=3, color=style["color"], alpha=0.85, hatch="//" if style["linestyle"] == "--" else None,
                edgecolor="black", linewidth=0.5)
        # The number just past the whisker, where it cannot hide behind it.
        ax.annotate(f"{r['value']:.3g}", (max(hi, r["value"]), y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels(impls, fontsize=8)
    ax.set_ylim(-0.6, len(impls) - 0.4)
    ax.margins(x=0.12)
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 30:
        ax.set_xscale("log")
        _readable_log_axis(ax.xaxis)


def plot_suite(res: dict, out_dir: str) -> list[str]:
    """Draw ``res`` into ``out_dir``: one PNG per metric family, ``bench_<suite>_<metric>_vs_<unit>.png``.

    Each panel is one group of rows.  A group measured at several sizes is a line per
    implementation (x: size, human-readable ticks; y: the median; bars: p10..p90); a group
    measured at one size only is a bar per implementation.  Baselines are dashed (hatched).
    A panel whose values cross zero (a paired difference) gets a line at 0, a ratio panel
    one at 1.  Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    cmap = plt.get_cmap("tab10")
    ranks = res["ranks"]
    for (family, unit), groups in plot_families(res).items():
        n = len(groups)
        ncols = 1 if n == 1 else 2
        nrows = (n + ncols - 1) // ncols
        singles = [len({float(r["size"]) for r in rows}) == 1 for rows in groups.values()]
        bars = max(len({r["impl"] for r in rows}) for rows in groups.values())
        # Bar panels need height for their bars only; line panels need room for the curves.
        panel_h = 0.45 * bars + 1.5 if all(singles) else 4.6
        fig, axes = plt.subplots(nrows, ncols, figsize=(6.8 * ncols, panel_h * nrows + 0.8), squeeze=False,
                                 layout="constrained")
        colors: dict = {}
        samples = set()
        for ax, (group, rows) in zip(axes.flat, groups.items()):
            metrics = list(dict.fromkeys(r["metric"] for r in rows))
            # (only rows with a spread count: a value derived from medians has no samples of its own)
            samples.update(r["samples"] for r in rows if _has_spread(r))
            single = len({float(r["size"]) for r in rows}) == 1
            if single:
                _draw_bars(ax, rows, colors, cmap)
                ax.set_xlabel(", ".join(metrics))
                ax.set_title(f"{group} — {format_size(rows[0]['size'], unit, rows[0].get('shape'))}", fontsize=10)
            else:
                _draw_lines(ax, rows, unit, colors, cmap)
                ax.set_ylabel(", ".join(metrics))
                ax.set_title(group, fontsize=10)
                lows = [value_bounds(r)[0] for r in rows]
                if family == "ratio":
                    ax.axhline(1.0, color="black", linewidth=0.9, linestyle=":", label="1 = equal time")
                elif min(lows) < 0:
                    ax.axhline(0.0, color="black", linewidth=0.9, linestyle=":", label="0 = no difference")
                ax.legend(fontsize=7, loc="best", framealpha=0.85)
            ax.grid(True, alpha=0.3, which="major")
        for ax in list(axes.flat)[n:]:
            ax.set_visible(False)
        derived = any(not _has_spread(r) for rows in groups.values() for r in rows)
        if samples:
            counts = f"{min(samples)}" if len(samples) == 1 else f"{min(samples)}-{max(samples)}"
            how = f"points: median of {counts} sample{'' if counts == '1' else 's'}; bars: 10th to 90th percentile"
            if derived:
                how += " (no bar: a count, or a value derived from medians)"
        else:
            how = "counts and values derived from medians: no spread"
        fig.suptitle(f"bench {res['suite']}: {figure_title(family, groups)}   "
                     f"[{res['target']}, {ranks} rank{'s' if ranks > 1 else ''}]\n{how}", fontsize=11)
        path = os.path.join(out_dir, f"bench_{res['suite']}_{_slug(family)}_vs_{_slug(unit)}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------- the command
def run_bench(args, stack: dict | None = None) -> int:
    """Run ``args.suite`` (or all); ``stack`` describes the software and target for the JSON document."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    target = (stack or {}).get("target")
    if not isinstance(target, str):
        from vtnumba.target import current_target

        target = current_target().name
    names = ORDER if args.suite == "all" else (args.suite,)
    json_path, plot_dir = resolve_outputs(args)
    global _status_to_stderr
    _status_to_stderr = json_path == "-"
    t0 = time.perf_counter()
    if rank == 0 and args.suite == "all":
        if args.quick:
            say(f"bench all: {len(names)} suites at quick sizes")
        else:
            say(f"bench all: {len(names)} suites at full sizes, which takes minutes; "
                "add --quick for small sizes and a few repeats (seconds)")
        if comm.Get_size() < 2:
            say("bench all: one rank, so peer, tpsp and model are skipped; run under mpiexec -n 2 for them")
    suites, took = [], {}
    for name in names:
        t_suite = time.perf_counter()
        res = run_suite(name, args, comm, target=target)
        if skip_reason(name, comm.Get_size(), target) is None:  # (a skipped suite took no time worth listing)
            took[name] = time.perf_counter() - t_suite
        if res is not None:
            suites.append(res)
            if rank == 0 and json_path != "-":
                print_suite(res)
    if rank != 0:
        return 0
    doc = {"machine": machine_description(stack), "suites": suites}
    validate_all(doc)
    written = []
    if json_path == "-":
        print(json.dumps(doc, indent=2))
    elif json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
        written.append(json_path)
    if plot_dir:
        paths = [p for s in suites for p in plot_suite(s, plot_dir)]
        written.append(f"{len(paths)} plot(s) in {plot_dir}/")
    if written:
        say(f"wrote {', '.join(written)}")
    if args.suite == "all":
        each = ", ".join(f"{n} {format_duration(t)}" for n, t in took.items())
        say(f"bench all: done in {format_duration(time.perf_counter() - t0)} ({each})")
        if not args.quick:
            say("bench all: for a first look, 'mpiexec -n 2 python -m vtnumba bench all --quick' runs the same "
                "suites at small sizes in seconds")
    return 0
