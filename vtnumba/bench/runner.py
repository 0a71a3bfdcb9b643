"""``vtnumba bench <suite>|all``: run benchmark suites, print, save JSON, draw plots.

Each suite module (``vtnumba.bench.<name>``) exposes ``run(args) -> dict`` in the schema
of :mod:`vtnumba.bench.schema`, measuring vtnumba against a stock baseline *in the same
run*.  Suites that exchange data between ranks (peer, tpsp, model) run on every rank of
``mpiexec``; single-process suites (kernels, memory, ec) run on rank 0 while the others
wait.  Rank 0 prints a table, writes ``--json`` and draws ``--plot`` figures in the style
of Triton's ``perf_report``: the metric against size, one line per implementation.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time

from vtnumba.bench.schema import validate_all, validate_suite

MULTI_RANK = {"peer", "tpsp", "model"}
ORDER = ("kernels", "memory", "ec", "peer", "tpsp", "model")
BENCH_SUITES = ORDER
BENCH_HELP = {
    "kernels": "fused host norm vs numpy, host matmul vs BLAS; on a GPU the matmul ladder vs cuBLAS",
    "memory": "cached vs uncached allocation",
    "ec": "encoder-cache save/load throughput vs memcpy",
    "peer": "peer-buffer reduce-scatter / all-gather vs mpi4py collectives (mpiexec -n 2)",
    "tpsp": "fused TPSP vs matmul alone and the unfused mpi4py forward (mpiexec -n 2)",
    "model": "MiniLM encoder with TPSP vs the regular forward (and sentence-transformers if installed)",
    "all": "every suite above, one JSON document",
}


def add_common_arguments(p) -> None:
    """The flags every suite takes (``--json``, ``--plot``, ``--quick``)."""
    p.add_argument("--json", metavar="PATH", nargs="?", const="-", default=None,
                   help="write the results as JSON to PATH (or stdout with no PATH)")
    p.add_argument("--plot", metavar="DIR", default=None, help="write perf_report-style PNG plots into DIR")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (seconds, not minutes)")


def add_suite_arguments(name: str, p) -> None:
    """Let a benchmark suite add its own flags (its ``add_arguments(parser)``, if any).

    Suite modules import nothing heavy at module level, so this is cheap."""
    add = getattr(importlib.import_module(f"vtnumba.bench.{name}"), "add_arguments", None)
    if add is not None:
        add(p)


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


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def suite_args(name: str, args):
    """The namespace a suite's ``run`` gets: its own flags' defaults under the common flags.

    ``vtnumba bench all`` parses only the common flags (--quick, --json, --plot); each
    suite still sees every attribute its ``add_arguments`` defines."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    add_suite_arguments(name, parser)
    ns = parser.parse_args([])
    for key, value in vars(args).items():
        if not hasattr(ns, key) or args.suite == name:
            setattr(ns, key, value)
    return ns


def run_suite(name: str, args, comm) -> dict | None:
    """Run one suite on the ranks it needs; returns the result on rank 0 (None elsewhere)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if name in MULTI_RANK and size < 2:
        if rank == 0:
            _progress(f"{name}: skipped (needs mpiexec -n 2 or more)")
        return None
    module = importlib.import_module(f"vtnumba.bench.{name}")
    if rank == 0:
        _progress(f"{name}: running{' (quick)' if args.quick else ''} ...")
    t0 = time.perf_counter()
    result = None
    if name in MULTI_RANK or rank == 0:
        result = module.run(suite_args(name, args))
    # A sleeping barrier: ranks idle during a single-process suite must not spin on a core
    # the measured code needs (a plain MPI Barrier busy-polls).
    from vtnumba.dist.comm import wait_request

    wait_request(comm.Ibarrier(), None, f"the barrier after bench {name}", 3600.0)
    if rank == 0 and result is not None:
        validate_suite(result)
        _progress(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    return result if rank == 0 else None


def print_suite(res: dict) -> None:
    print(f"\n== {res['suite']} (target {res['target']}, {res['ranks']} rank(s))")
    print(f"  {'case':<26} {'impl':<24} {'size':>12} {'value':>12} {'metric':<9} {'spread':>7}")
    for r in res["results"]:
        spread = (r["p90_s"] - r["p10_s"]) / r["median_s"] if r["median_s"] else 0.0
        size = f"{r['size']:g} {r['size_unit']}"
        print(f"  {r['case']:<26} {r['impl']:<24} {size:>12} {r['value']:>12.4g} {r['metric']:<9} {spread:>6.0%}")
    for k, v in res["baselines"].items():
        print(f"  baseline  {k}: {v:.4g}")
    for k, v in res["ratios"].items():
        print(f"  ratio     {k}: {v:.3f}")
    for n in res["notes"]:
        print(f"  note      {n}")


def plot_suite(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    cases: dict[str, list[dict]] = {}
    for r in res["results"]:
        cases.setdefault(r["case"], []).append(r)
    for case, rows in cases.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["size"], r["value"]) for r in rows if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"size ({rows[0]['size_unit']})")
        ax.set_ylabel(rows[0]["metric"])
        ax.set_title(f"{res['suite']}: {case} [{res['target']}, {res['ranks']} rank(s)]")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in case)
        path = os.path.join(out_dir, f"bench_{res['suite']}_{safe}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def run_bench(args, stack: dict | None = None) -> int:
    """Run ``args.suite`` (or all); ``stack`` describes the software and target for the JSON document."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    names = ORDER if args.suite == "all" else (args.suite,)
    suites = []
    for name in names:
        res = run_suite(name, args, comm)
        if res is not None:
            suites.append(res)
            if comm.Get_rank() == 0 and args.json != "-":
                print_suite(res)
    if comm.Get_rank() != 0:
        return 0
    doc = {"machine": machine_description(stack), "suites": suites}
    validate_all(doc)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nwrote {args.json}")
    if args.plot:
        paths = [p for s in suites for p in plot_suite(s, args.plot)]
        print(f"wrote {len(paths)} plot(s) into {args.plot}")
    return 0
