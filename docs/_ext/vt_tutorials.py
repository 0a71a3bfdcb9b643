"""Sphinx extension: render ``tutorials/NN_name.py`` as pages, with the output of a real run.

Each tutorial is a runnable script in the style of Triton's tutorials: a module docstring
(title and introduction, in reStructuredText), then sections separated by ``# %%`` lines.
In a section, the leading ``#`` comment lines are prose and the rest is code.

The output shown under each page is never typed by hand: it is the stdout of
``mpiexec -n 2 python tutorials/NN_name.py --target cpu``, either saved by
``scripts/run_tutorials.py`` in this same test run (reused only while the script's hash
matches) or produced here, at build time.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
GENERATED = ROOT / "docs" / "tutorials"
OUTPUTS = ROOT / "docs" / "_build" / "tutorial-output"


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def tutorial_output(path: Path) -> str:
    saved = OUTPUTS / f"{path.stem}.txt"
    if saved.exists():
        first, _, rest = saved.read_text().partition("\n")
        if first == f"# hash {_hash(path)}":
            return rest
    env = dict(os.environ, PYTHONUNBUFFERED="1", VTNUMBA_TARGET="cpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(path), "--target", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"tutorial {path.name} failed while building the docs:\n{proc.stdout}\n{proc.stderr}")
    OUTPUTS.mkdir(parents=True, exist_ok=True)
    saved.write_text(f"# hash {_hash(path)}\n{proc.stdout}")
    return proc.stdout


def split_sections(source: str) -> tuple[str, list[tuple[str, str]]]:
    tree = ast.parse(source)
    doc = ast.get_docstring(tree) or ""
    body = source
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(getattr(tree.body[0], "value", None), ast.Constant):
        body = "\n".join(source.splitlines()[tree.body[0].end_lineno:])
    sections = []
    for chunk in body.split("\n# %%"):
        lines = chunk.strip("\n").splitlines()
        prose, i = [], 0
        while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()) and not (
                lines[i].strip() == "" and prose == []):
            prose.append(lines[i][2:] if lines[i].startswith("# ") else lines[i].lstrip("#"))
            i += 1
        code = "\n".join(lines[i:]).strip("\n")
        if prose or code:
            sections.append(("\n".join(prose).strip(), code))
    return doc, sections


def render(path: Path) -> str:
    doc, sections = split_sections(path.read_text())
    out = [doc, "", f"Source: ``tutorials/{path.name}``", ""]
    for prose, code in sections:
        if prose:
            out += [prose, ""]
        if code:
            out += [".. code-block:: python", ""] + ["   " + l if l else "" for l in code.splitlines()] + [""]
    output = tutorial_output(path)
    out += ["Output", "------", "",
            f"This is the output of ``mpiexec -n 2 python tutorials/{path.name} --target cpu``, "
            "run while these docs were built:", "", ".. code-block:: text", ""]
    out += ["   " + l if l else "" for l in output.rstrip().splitlines()] + [""]
    return "\n".join(out)


def generate(app=None) -> None:
    GENERATED.mkdir(exist_ok=True)
    paths = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
    for path in paths:
        text = render(path)
        target = GENERATED / f"{path.stem}.rst"
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
    index = ["Tutorials", "=========", "",
             "Numbered lessons; each runs with ``mpiexec -n 2 python tutorials/NN_name.py`` on a laptop "
             "(``--target cpu``), in the simulator (``--target cudasim``) and on a GPU, with the same code.", "",
             ".. toctree::", "   :maxdepth: 1", ""] + [f"   {p.stem}" for p in paths] + [""]
    idx = GENERATED / "index.rst"
    text = "\n".join(index)
    if not idx.exists() or idx.read_text() != text:
        idx.write_text(text)


def setup(app):
    app.connect("builder-inited", generate)
    return {"version": "1.0", "parallel_read_safe": True}
