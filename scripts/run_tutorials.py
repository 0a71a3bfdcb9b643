#!/usr/bin/env python
"""Run every tutorial the way the docs tell a reader to, and keep its real output and figures.

Each ``tutorials/NN_name.py`` runs under ``mpiexec -n 2 python tutorials/NN_name.py
--target cpu`` (the ones listed in ``SIMULATOR_TOO`` also with ``--target cudasim``, and the
ones in ``MORE_RANKS`` also on the cpu target with the rank count their docstring tells a
reader to try); a tutorial passes when it exits 0 within its time limit (its own checks are
the self-checks).  The cpu run is made the way the docs build makes it
(:func:`vtnumba.apps.tutorial.run_recorded`): output marked by section, figures and output
saved under ``docs/_build/tutorials/NN_name/`` with a key made of the script's and the
vtnumba sources' hashes, so the docs build renders this very run instead of running the
tutorial again.  The other runs draw their figures into a temporary folder.

Usage: ``python scripts/run_tutorials.py [NN_name ...]`` (default: all).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vtnumba.apps.tutorial import run_recorded  # noqa: E402

OUT_ROOT = ROOT / "docs" / "_build" / "tutorials"
TIME_LIMIT_S = 120
# Tutorials whose whole lesson is small enough for numba's simulator (~7,000 threads/s).
SIMULATOR_TOO = {"01_devices_queues_events", "02_async_copies_pinned", "04_matmul_ladder", "05_fused_add_rmsnorm",
                 "06_peer_buffers", "07_reduce_scatter_all_gather", "10_running_on_a_gpu", "03_caching_allocator",
                 "08_tpsp", "09_encoder_cache"}
# Tutorials whose docstring also runs them with more ranks: that rank count, cpu target.
MORE_RANKS = {"07_reduce_scatter_all_gather": 3, "09_encoder_cache": 3}


def main(argv: list[str]) -> int:
    only = {a[:-3] if a.endswith(".py") else a for a in argv[1:]}
    tutorials = sorted(p for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py") if not only or p.stem in only)
    if not tutorials:
        print("no tutorials found")
        return 5
    failures = []
    with tempfile.TemporaryDirectory(prefix="vtnumba-tutorials-") as sim_out:
        for path in tutorials:
            runs = [("cpu", 2)] + ([("cudasim", 2)] if path.stem in SIMULATOR_TOO else [])
            runs += [("cpu", MORE_RANKS[path.stem])] if path.stem in MORE_RANKS else []
            for target, ranks in runs:
                saved = target == "cpu" and ranks == 2  # the run the docs render
                out_root = OUT_ROOT if saved else Path(sim_out) / f"{target}-{ranks}"
                run = run_recorded(path, out_root, target=target, ranks=ranks, timeout_s=TIME_LIMIT_S, save=saved)
                status = "ok" if run.returncode == 0 else f"FAILED (exit {run.returncode})"
                figures = f", {len(run.figures)} figure(s)" if run.returncode == 0 else ""
                where = target if ranks == 2 else f"{target} -n {ranks}"
                print(f"{path.name:<40} {where:<13} {run.seconds:6.1f} s  {status}{figures}", flush=True)
                if run.returncode != 0:
                    failures.append(f"{path.name} [{where}]")
                    tail = (run.stdout + run.stderr).strip().splitlines()[-30:]
                    print("    " + "\n    ".join(tail))
    print(f"{len(failures)} failed, {len(tutorials)} tutorials; cpu output and figures in "
          f"{OUT_ROOT.relative_to(ROOT)}/")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
