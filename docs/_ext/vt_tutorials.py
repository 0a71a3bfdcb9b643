"""Sphinx extension: tutorial pages made from ``tutorials/NN_name.py`` and a real run of them.

Two directives:

``.. vt-tutorial:: 04_matmul_ladder``
    The whole page of one tutorial (``docs/tutorials/NN_name.rst`` holds only this line).
    The script is split into its docstring and its ``# %%`` sections
    (:func:`vtnumba.apps.tutorial.parse_script`); each section shows its prose, its code,
    the output that section printed and the figures it drew.  Output and figures come from
    ``mpiexec -n 2 python tutorials/NN_name.py --target cpu``: the run that
    ``scripts/run_tutorials.py`` saved in this test run, reused while the script and the
    vtnumba sources hash the same (:func:`vtnumba.apps.tutorial.load_recorded`), or else a
    run made now.  Nothing is typed by hand.

``.. vt-source:: vtnumba.kernels.norm_cuda.fused_add_norm_kernel``
    The source of a function, class or method, included from the vtnumba sources at build
    time (``literalinclude`` with ``:pyobject:``), so a page never drifts from the code.  A
    module with the ``:cuda-kernels:`` flag includes every ``@cuda.jit`` function of it, in
    source order -- a new rung of the matmul ladder appears on its own.  Tutorials use it in
    their prose.

**Where things are written.**  Only under ``docs/_build/``: runs and figures go to
``docs/_build/tutorials/<name>/`` (``output.txt``, ``stderr.txt``, ``*.png``), which is
inside the Sphinx source folder, so the pages refer to the figures as
``/_build/tutorials/<name>/<figure>.png`` (``_build`` is in ``exclude_patterns``: it holds
no pages).  Nothing is generated into ``docs/`` itself.  Each run prints a progress line on
stderr (even with ``-q``), because a run takes seconds.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
BUILD = ROOT / "docs" / "_build"
CACHE = BUILD / "tutorials"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vtnumba.apps.tutorial import (  # noqa: E402
    RecordedRun,
    load_recorded,
    parse_output,
    parse_script,
    run_recorded,
)


def progress(message: str) -> None:
    """A progress line on stderr: shown even under ``sphinx -q`` (a tutorial run takes seconds)."""
    print(f"vt-tutorials: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- sources
def resolve_source(dotted: str) -> tuple[Path, str | None]:
    """``vtnumba.kernels.norm_cuda.fused_add_norm_kernel`` -> (the .py file, ``"fused_add_norm_kernel"``).

    The longest prefix that names a module file wins; the rest (possibly ``Class.method``)
    is the object, None for a whole module.  Raises ValueError if the file or the object
    does not exist -- checked by parsing the file, nothing is imported.
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                obj = ".".join(parts[cut:]) or None
                if obj is not None and not find_object(candidate, obj):
                    raise ValueError(f"{dotted}: {candidate.relative_to(ROOT)} defines no {obj!r}")
                return candidate, obj
    raise ValueError(f"{dotted}: no such module file under {ROOT}")


def find_object(path: Path, obj: str):
    """The ast node of ``obj`` (``name`` or ``Class.name``) at the top of ``path``, or None."""
    body = ast.parse(path.read_text()).body
    node = None
    for name in obj.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


def _is_cuda_jit(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" and \
        isinstance(target.value, ast.Name) and target.value.id == "cuda"


def cuda_kernels(path: Path) -> list[str]:
    """The names of the top-level ``@cuda.jit`` functions of ``path`` (device functions too), in order."""
    return [n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and any(_is_cuda_jit(d) for d in n.decorator_list)]


def source_directives(dotted: str, srcdir: Path, cuda_kernels_only: bool = False, caption: str | None = None):
    """reST lines that include ``dotted`` (see the ``vt-source`` directive)."""
    path, obj = resolve_source(dotted)
    rel = Path(os.path.relpath(path, ROOT)).as_posix()
    src = "/" + Path(os.path.relpath(path, srcdir)).as_posix()
    if obj is None and not cuda_kernels_only:
        return [f".. literalinclude:: {src}", "   :language: python", f"   :caption: ``{rel}``", ""]
    names = cuda_kernels(path) if obj is None else [obj]
    if not names:
        raise ValueError(f"{dotted}: {rel} has no @cuda.jit function")
    lines = []
    for name in names:
        lines += [f".. literalinclude:: {src}", "   :language: python", f"   :pyobject: {name}",
                  f"   :caption: {caption or f'``{name}`` in ``{rel}``'}"]
        if "." in name:
            lines.append("   :dedent:")
        lines.append("")
    return lines


class VtSource(SphinxDirective):
    """``.. vt-source:: dotted.name`` -- include code from the vtnumba sources (see the module docstring)."""

    required_arguments = 1
    has_content = False
    option_spec = {"cuda-kernels": directives.flag, "caption": directives.unchanged}

    def run(self):
        try:
            lines = source_directives(self.arguments[0], Path(self.env.srcdir), "cuda-kernels" in self.options,
                                      self.options.get("caption"))
        except ValueError as exc:
            raise self.error(str(exc)) from exc
        node = nodes.container(classes=["vt-source"])
        self.state.nested_parse(StringList(lines, source=f"<vt-source {self.arguments[0]}>"), self.content_offset,
                                node)
        return node.children


# ---------------------------------------------------------------------------- tutorials
def tutorial_path(name: str) -> Path:
    """``04_matmul_ladder`` (or ``04_matmul_ladder.py``) -> the script; ValueError if missing."""
    path = TUTORIALS / (name if name.endswith(".py") else f"{name}.py")
    if not path.is_file():
        raise ValueError(f"no tutorial {path.relative_to(ROOT)}")
    return path


def recorded_run(path: Path) -> RecordedRun:
    """The saved run of a tutorial when it is current, else a new run (with progress lines)."""
    run = load_recorded(path, CACHE)
    if run is not None:
        progress(f"{path.stem}: reusing the run saved with this script and these sources "
                 f"({run.seconds:.0f} s when it was made)")
        return run
    progress(f"running {path.name} under mpiexec -n 2 --target cpu (output and figures into "
             f"{os.path.relpath(CACHE / path.stem, ROOT)}/) ...")
    run = run_recorded(path, CACHE)
    if run.returncode != 0:
        raise ExtensionError(f"tutorial {path.name} failed while building the docs (exit {run.returncode}):\n"
                             f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    progress(f"{path.stem}: done in {run.seconds:.1f} s, {len(run.figures)} figure(s)")
    return run


def _indent(text: str, prefix: str = "   ") -> list[str]:
    return [prefix + line if line.strip() else "" for line in text.splitlines()]


_NOQA = re.compile(r"\s+# noqa(: ?[A-Z0-9, ]+)?$")


def shown_code(code: str) -> str:
    """The code as the page shows it: without linter pragmas (``# isort: split`` lines and
    trailing ``# noqa`` comments), which are there for the tools, not for the reader."""
    lines = [_NOQA.sub("", line) for line in code.splitlines() if line.strip() != "# isort: split"]
    return "\n".join(lines)


def render_tutorial(path: Path, run: RecordedRun, figure_root: str) -> list[str]:
    """The reST of one tutorial page: docstring, then per section prose, code, output, figures.

    ``figure_root`` is how the page refers to ``docs/_build/tutorials`` (``/_build/tutorials``).
    """
    doc, sections = parse_script(path.read_text())
    parsed = parse_output(run.stdout)
    out = doc.splitlines() + [
        "",
        f".. note:: The output and figures on this page come from ``{run.command}``, run while these "
        f"docs were built ({run.seconds:.0f} s).  The script is ``tutorials/{path.name}``; run it yourself and its "
        f"figures land in ``out/tutorials/{path.stem}/``.",
        "",
    ]
    shown = set()
    for sec in sections:
        if sec.prose:
            out += sec.prose.splitlines() + [""]
        if sec.code:
            out += [".. code-block:: python", ""] + _indent(shown_code(sec.code)) + [""]
        text = parsed.section_text(sec.index)
        if text.strip():
            out += [".. code-block:: text", "   :caption: Output", "   :class: vt-output", ""] + _indent(text) + [""]
        for name, caption in parsed.figures.get(sec.index, []):
            shown.add(sec.index)
            out += [f".. figure:: {figure_root}/{path.stem}/{name}", f"   :alt: {caption.split('.')[0]}",
                    "   :width: 100%", "", f"   {caption}", ""]
    # Output printed outside every section (before the first marker) goes last, so nothing is lost.
    leftover = [i for i in set(parsed.text) | set(parsed.figures) if i not in {s.index for s in sections}]
    for index in sorted(leftover):
        text = parsed.section_text(index)
        if text.strip():
            out += [".. code-block:: text", "   :caption: Output", ""] + _indent(text) + [""]
        for name, caption in parsed.figures.get(index, []):
            out += [f".. figure:: {figure_root}/{path.stem}/{name}", "   :width: 100%", "", f"   {caption}", ""]
    return out


def _vtnumba_sources() -> list[str]:
    return [str(p) for p in sorted((ROOT / "vtnumba").rglob("*.py"))]


class VtTutorial(SphinxDirective):
    """``.. vt-tutorial:: NN_name`` -- the page of one tutorial (see the module docstring)."""

    required_arguments = 1
    has_content = False

    def run(self):
        try:
            path = tutorial_path(self.arguments[0])
        except ValueError as exc:
            raise self.error(str(exc)) from exc
        # The page is rebuilt when the script or any vtnumba source changes (the run's key).
        self.env.note_dependency(str(path))
        for src in _vtnumba_sources():
            self.env.note_dependency(src)
        run = recorded_run(path)
        figure_root = "/" + Path(os.path.relpath(CACHE, self.env.srcdir)).as_posix()
        lines = render_tutorial(path, run, figure_root)
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source=str(path)), node)
        return node.children


def setup(app):
    app.add_directive("vt-tutorial", VtTutorial)
    app.add_directive("vt-source", VtSource)
    return {"version": "2.0", "parallel_read_safe": True, "parallel_write_safe": True}
