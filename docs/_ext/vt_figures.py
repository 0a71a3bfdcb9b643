"""Sphinx extension: draw the docs' figures at build time, into ``docs/_build/figures/``.

* ``architecture`` -- the layers of vtnumba (imports point downward);
* ``timeline`` -- a real 2-rank traced TPSP run (``vtnumba trace``), merged;
* ``bench_*`` -- quick benchmark runs (``vtnumba bench kernels --quick --plot``).

Nothing is a stock picture: the timeline and the plots come from runs made for this build
(reused while ``mpi/tpsp_model.py`` and the vtnumba sources hash the same; set
``VTNUMBA_DOCS_FAST=1`` to skip both runs).  Pages show a figure with::

    .. vt-figure:: timeline
       :alt: a merged two-rank timeline

       Optional caption.

which refers to ``/_build/figures/timeline.png``.  Nothing is written into ``docs/`` itself:
an image path of the older form ``_generated/NAME`` is read from ``docs/_build/figures/NAME``
(so pages written before this directive keep building; prefer ``vt-figure``).  Every run
prints a progress line on stderr, even under ``sphinx -q``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "_build" / "figures"
LEGACY_PREFIX = "_generated/"

# The floor plan of docs/architecture.rst (checked by tests/test_import_rules.py), top first.
LAYERS = [
    ("apps/   bench/   mpi/   tutorials/", "programs: use everything, define nothing"),
    ("models/", "all-MiniLM-L6-v2 built from nn layers"),
    ("nn/", "tensor-parallel layers: column/row-parallel linear, norms, activations"),
    ("tpsp/          ec/", "the fused tensor-parallel op; the encoder-cache connector"),
    ("dist/", "process groups, agreement, failure board, peer buffers, signals, queue flags"),
    ("kernels/", "matmul ladder, norms, peer reduce/gather, activations, attention"),
    ("memory/", "caching allocator + record_stream, step arena, hazards, copy engine"),
    ("backend/", "devices, arrays, the Backend seam, CPU and CUDA backends, registry"),
]


def progress(message: str) -> None:
    """A progress line on stderr: shown even under ``sphinx -q``."""
    print(f"vt-figures: {message}", file=sys.stderr, flush=True)


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
    # Whatever the programs write by default (bench durations, say) stays in the build folder.
    env = dict(os.environ, PYTHONUNBUFFERED="1", VTNUMBA_TARGET="cpu", VTNUMBA_OUT_DIR=str(OUT / "out"))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _key(*extra: Path) -> str:
    """A hash of the vtnumba sources (and ``extra`` files): a figure's run is reused while it matches."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "vtnumba").rglob("*.py")) + [p for p in extra if p.exists()]:
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cached(name: str, key: str, outputs: list[Path]) -> bool:
    stamp = OUT / f"{name}.key"
    return stamp.exists() and stamp.read_text() == key and all(p.exists() for p in outputs)


def draw_timeline(prefix: Path) -> None:
    """Trace a short 2-rank TPSP run and draw its merged timeline (``<prefix>.png``)."""
    script = ROOT / "mpi" / "tpsp_model.py"
    key = _key(script)
    if _cached("timeline", key, [prefix.with_suffix(".png")]):
        progress("timeline: reusing the traced TPSP run made with these sources")
        return
    args = ["--tokens", "256", "--hidden", "256", "--ffn", "512", "--layers", "2"] if script.exists() else []
    inner = ["mpiexec", "-n", "2", sys.executable, str(script), *args] if script.exists() else \
        ["mpiexec", "-n", "2", sys.executable, "-m", "vtnumba", "demo", "runtime"]
    progress(f"timeline: tracing `{' '.join(['mpiexec', '-n', '2', 'python', *inner[4:]])}` -> "
             f"{os.path.relpath(prefix, ROOT)}.png ...")
    t0 = time.perf_counter()
    proc = _run([sys.executable, "-m", "vtnumba", "trace", "--out", str(prefix), "--", *inner])
    if proc.returncode != 0:
        raise RuntimeError(f"traced run for the docs failed:\n{proc.stdout}\n{proc.stderr}")
    (OUT / "timeline.key").write_text(key)
    progress(f"timeline: done in {time.perf_counter() - t0:.1f} s")


def draw_bench_plots() -> None:
    """``vtnumba bench kernels --quick`` with its plots and JSON into :data:`OUT`."""
    key = _key()
    json_path = OUT / "bench_kernels.json"
    if _cached("bench_kernels", key, [json_path]):
        progress("bench plots: reusing the quick benchmark run made with these sources")
        return
    progress(f"bench plots: running `vtnumba bench kernels --quick` -> {os.path.relpath(OUT, ROOT)}/bench_*.png ...")
    t0 = time.perf_counter()
    for old in OUT.glob("bench_*.png"):
        old.unlink()
    proc = _run([sys.executable, "-m", "vtnumba", "bench", "kernels", "--quick", "--plot", str(OUT),
                 "--json", str(json_path)])
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run for the docs failed:\n{proc.stdout}\n{proc.stderr}")
    (OUT / "bench_kernels.key").write_text(key)
    progress(f"bench plots: done in {time.perf_counter() - t0:.1f} s")


def generate(app=None) -> None:
    """Draw every figure into :data:`OUT` (the runs only when their sources changed)."""
    OUT.mkdir(parents=True, exist_ok=True)
    draw_architecture(OUT / "architecture.png")
    if os.environ.get("VTNUMBA_DOCS_FAST") != "1":
        draw_timeline(OUT / "timeline")
        draw_bench_plots()
    else:
        progress("VTNUMBA_DOCS_FAST=1: no traced run and no benchmark run")


def figure_uri(name: str, srcdir) -> str:
    """How a page refers to ``docs/_build/figures/<name>`` (a path from the source folder)."""
    name = name if "." in Path(name).name else f"{name}.png"
    return "/" + Path(os.path.relpath(OUT / name, srcdir)).as_posix()


class VtFigure(SphinxDirective):
    """``.. vt-figure:: NAME`` -- a figure drawn by this extension (see the module docstring)."""

    required_arguments = 1
    has_content = True
    option_spec = {"alt": directives.unchanged, "width": directives.unchanged}

    def run(self):
        name = self.arguments[0]
        lines = [f".. figure:: {figure_uri(name, self.env.srcdir)}",
                 f"   :alt: {self.options.get('alt', name)}",
                 f"   :width: {self.options.get('width', '100%')}", ""]
        lines += ["   " + line for line in self.content] + [""]
        node = nodes.container()
        self.state.nested_parse(StringList(lines, source=f"<vt-figure {name}>"), self.content_offset, node)
        return node.children


def resolve_legacy_images(app, doctree) -> None:
    """``.. image:: _generated/NAME`` reads ``docs/_build/figures/NAME`` (nothing is generated into docs/)."""
    for node in doctree.findall(nodes.image):
        uri = node.get("uri", "")
        if uri.startswith(LEGACY_PREFIX):
            node["uri"] = figure_uri(uri[len(LEGACY_PREFIX):], app.srcdir)


def setup(app):
    app.connect("builder-inited", generate)
    app.connect("doctree-read", resolve_legacy_images, priority=100)  # before Sphinx collects the images
    app.add_directive("vt-figure", VtFigure)
    return {"version": "2.0", "parallel_read_safe": True, "parallel_write_safe": True}

