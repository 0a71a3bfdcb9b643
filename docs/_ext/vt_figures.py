"""Sphinx extension: draw the docs' figures at build time with matplotlib.

* ``_generated/architecture.png`` -- the layers of vtnumba (imports point downward);
* ``_generated/timeline.png`` -- a real 2-rank traced run (``vtnumba trace``), merged;
* ``_generated/bench_*.png`` -- quick benchmark runs, perf_report style.

Nothing is a stock picture: the timeline and the plots come from runs made during this build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "_generated"

LAYERS = [
    ("cli / mpi scripts / tutorials / benchmarks", "use everything, define nothing"),
    ("tpsp/        ec/        models/", "the seed features and the real-model pipeline"),
    ("dist/", "process groups on mpi4py, peer buffers, signals, agreement"),
    ("kernels/", "matmul ladder, fused add+norm, peer reduce/gather, batched copy"),
    ("memory/", "caching allocator + record_stream, step arena, hazard checker"),
    ("backend/", "Device, DType, Backend seam, CPU and CUDA backends, registry"),
]


def draw_architecture(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(9, 5.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, len(LAYERS) * 1.1 + 0.2)
    ax.axis("off")
    for i, (name, what) in enumerate(LAYERS):
        y = (len(LAYERS) - 1 - i) * 1.1 + 0.2
        ax.add_patch(FancyBboxPatch((0.2, y), 9.6, 0.8, boxstyle="round,pad=0.02",
                                    facecolor=plt.cm.Blues(0.25 + 0.1 * i), edgecolor="black"))
        ax.text(0.45, y + 0.48, name, fontsize=11, fontweight="bold", va="center", family="monospace")
        ax.text(0.45, y + 0.18, what, fontsize=9, va="center")
        if i < len(LAYERS) - 1:
            ax.annotate("", xy=(9.3, y - 0.28), xytext=(9.3, y + 0.02), arrowprops=dict(arrowstyle="->"))
    ax.set_title("vtnumba layers: imports point downward only")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run(cmd, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", VTNUMBA_TARGET="cpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def draw_timeline(prefix: Path) -> None:
    """Trace a short 2-rank TPSP run and draw its merged timeline."""
    script = ROOT / "mpi" / "tpsp_model.py"
    args = ["--tokens", "256", "--hidden", "256", "--ffn", "512", "--layers", "2"] if script.exists() else []
    inner = ["mpiexec", "-n", "2", sys.executable, str(script), *args] if script.exists() else \
        ["mpiexec", "-n", "2", sys.executable, "-m", "vtnumba", "demo", "runtime"]
    proc = _run([sys.executable, "-m", "vtnumba", "trace", "--out", str(prefix), "--", *inner])
    if proc.returncode != 0:
        raise RuntimeError(f"traced run for the docs failed:\n{proc.stdout}\n{proc.stderr}")


def draw_bench_plots() -> None:
    proc = _run([sys.executable, "-m", "vtnumba", "bench", "kernels", "--quick", "--plot", str(OUT),
                 "--json", str(OUT / "bench_kernels.json")])
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run for the docs failed:\n{proc.stdout}\n{proc.stderr}")


def generate(app=None) -> None:
    OUT.mkdir(exist_ok=True)
    draw_architecture(OUT / "architecture.png")
    if os.environ.get("VTNUMBA_DOCS_FAST") != "1":
        draw_timeline(OUT / "timeline")
        draw_bench_plots()


def setup(app):
    app.connect("builder-inited", generate)
    return {"version": "1.0", "parallel_read_safe": True}
