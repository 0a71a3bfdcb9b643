"""Every public name has a docstring (the API reference is generated from them)."""

import importlib
import inspect

import pytest

PACKAGES = ["vtnumba", "vtnumba.backend", "vtnumba.memory", "vtnumba.kernels", "vtnumba.dist", "vtnumba.tpsp",
            "vtnumba.nn", "vtnumba.ec", "vtnumba.models"]


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_have_docstrings(package):
    mod = importlib.import_module(package)
    assert (mod.__doc__ or "").strip(), f"{package} has no module docstring"
    missing = []
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(name)
    assert not missing, f"{package}: public names without a docstring: {missing}"


def test_every_module_has_a_docstring():
    import pkgutil

    import vtnumba

    missing = []
    for info in pkgutil.walk_packages(vtnumba.__path__, "vtnumba."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        if not (mod.__doc__ or "").strip():
            missing.append(info.name)
    assert not missing, f"modules without a docstring: {missing}"
