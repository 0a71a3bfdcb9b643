#!/usr/bin/env python
"""Run every tutorial the way the docs tell a reader to, and keep its real output.

Each ``tutorials/NN_name.py`` runs under ``mpiexec -n 2 python tutorials/NN_name.py
--target cpu`` (and the small ones, listed in ``SIMULATOR_TOO``, also with
``--target cudasim``); a tutorial passes when it exits 0 within its time limit (its own
asserts are the self-checks).  The cpu output is saved to
``docs/_build/tutorial-output/NN_name.txt`` together with a hash of the script, so the
docs build renders the output of this very run instead of text typed by hand.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "_build" / "tutorial-output"
TIME_LIMIT_S = 120
# Tutorials whose whole lesson is small enough for numba's simulator (~7,000 threads/s).
SIMULATOR_TOO = {"01_devices_queues_events", "02_async_copies_pinned", "04_matmul_ladder", "05_fused_add_rmsnorm",
                 "06_peer_buffers", "07_reduce_scatter_all_gather", "10_running_on_a_gpu", "03_caching_allocator",
                 "08_tpsp", "09_encoder_cache"}


def script_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run_tutorial(path: Path, target: str, ranks: int = 2) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", VTNUMBA_TARGET=target)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the tutorial's --target decides
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, str(path), "--target", target]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIME_LIMIT_S,
                              stdin=subprocess.DEVNULL)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out + f"\n[timed out after {TIME_LIMIT_S} s]", time.perf_counter() - t0


def main(argv: list[str]) -> int:
    only = set(argv[1:])
    tutorials = sorted(p for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.py") if not only or p.stem in only)
    if not tutorials:
        print("no tutorials found")
        return 5
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    failures = []
    for path in tutorials:
        targets = ["cpu"] + (["cudasim"] if path.stem in SIMULATOR_TOO else [])
        for target in targets:
            rc, out, secs = run_tutorial(path, target)
            status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            print(f"{path.name:<40} {target:<8} {secs:6.1f} s  {status}", flush=True)
            if rc != 0:
                failures.append(f"{path.name} [{target}]")
                print("    " + "\n    ".join(out.strip().splitlines()[-30:]))
            elif target == "cpu":
                (OUT_DIR / f"{path.stem}.txt").write_text(f"# hash {script_hash(path)}\n{out}")
    print(f"{len(failures)} failed, {sum(1 for _ in tutorials)} tutorials")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
