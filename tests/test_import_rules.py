"""The floor plan, checked: imports point downward only, no cycles, the library never imports programs.

The layers (``docs/architecture.rst`` draws them), lowest first::

    core      vtnumba.target, vtnumba.device_rule, vtnumba.trace, vtnumba.faults   (what every layer may use)
    backend   devices, arrays, the Backend seam, CPU/CUDA backends
    memory    allocator, arena, hazards, copy engine
    kernels   matmul, norms, peer reduce/gather, activations, attention (+ host references)
    dist      process groups, peer buffers, signals, queue flags, reference collectives
    tpsp, ec  the two seed features (they never import each other)
    nn        tensor-parallel layers
    models    all-MiniLM-L6-v2
    bench     benchmarks                                  (programs)
    apps      command line, demos, tutorial helper        (programs)

Every ``import`` statement counts -- also the ones inside functions (a lazy import is still
a dependency) -- found by parsing the source, without importing anything.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "vtnumba"

LAYERS = {
    "target": 0, "device_rule": 0, "trace": 0, "faults": 0,
    "backend": 1,
    "memory": 2,
    "kernels": 3,
    "dist": 4,
    "tpsp": 5, "ec": 5,
    "nn": 6,
    "models": 7,
    "bench": 8,
    "apps": 9, "__main__": 9,
}
LIBRARY_TOP = LAYERS["models"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every vtnumba module ``path`` imports (absolute names, submodule-precise where possible)."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vtnumba"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("vtnumba"):
                continue
            for alias in node.names:
                candidate = f"{mod}.{alias.name}"
                found.add(candidate if _exists(candidate) else mod)
    return {m for m in found if m != me}


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (PKG.parent / rel).with_suffix(".py").is_file() or (PKG.parent / rel / "__init__.py").is_file()


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself: only lazy names, no imports of its own
    return LAYERS.get(parts[1])


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}


def test_every_folder_and_top_module_has_a_layer(graph):
    unknown = sorted({m.split(".")[1] for m in graph if "." in m and m.split(".")[1] not in LAYERS
                      and m.split(".")[1] not in ("__main__",)})
    assert not unknown, f"modules outside the floor plan (add them to LAYERS and docs/architecture.rst): {unknown}"


def test_imports_point_downward_only(graph):
    upward = []
    for mod, deps in graph.items():
        lm = _layer(mod)
        if lm is None:
            continue
        for dep in deps:
            ld = _layer(dep)
            if ld is not None and ld > lm:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "imports that point upward:\n" + "\n".join(sorted(upward))


def test_tpsp_and_ec_never_import_each_other(graph):
    crossing = [f"{m} -> {d}" for m, ds in graph.items() for d in ds
                if {m.split(".")[1:2][0] if "." in m else "", d.split(".")[1]} == {"tpsp", "ec"}]
    assert not crossing, crossing


def test_the_library_never_imports_a_program(graph):
    bad = [f"{m} -> {d}" for m, ds in graph.items() for d in ds
           if (_layer(m) or 0) <= LIBRARY_TOP and _layer(d) in (LAYERS["bench"], LAYERS["apps"])]
    assert not bad, bad


def test_no_import_cycles(graph):
    # Tarjan-free: a depth-first search that reports the first back edge it meets.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_package_says_what_it_is_for():
    missing = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("__init__.py")
               if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert not missing, f"package __init__ without a docstring saying what the folder is for: {missing}"


def test_import_vtnumba_changes_nothing_in_the_process():
    import os
    import subprocess
    import sys

    code = ("import os, sys; before = dict(os.environ); import vtnumba; "
            "print(dict(os.environ) == before, 'numpy' in sys.modules, 'numba' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["MPI_LOCALNRANKS"] = "2"  # as under mpiexec: still nothing may change
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == ["True", "False", "False"], out.stdout + out.stderr
