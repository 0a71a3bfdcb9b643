"""Test configuration shared by the serial and the MPI suites.

The simulator must be switched on before anything imports ``numba.cuda``, so this runs
first: unless the run targets a real GPU (``VTNUMBA_TARGET=cuda``), numba's CUDA simulator
is enabled for the whole test process.  The ``cpu`` backend never touches numba.cuda, so
tests can use both the cpu backend and the simulated CUDA backend side by side.
"""

import os

_TARGET = os.environ.get("VTNUMBA_TARGET", "cpu").lower()
if _TARGET != "cuda":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import pytest  # noqa: E402

ON_GPU = _TARGET == "cuda"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a real GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real GPU (run with VTNUMBA_TARGET=cuda on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker, not any id containing "cuda"
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh, seeded-per-test random generator (never zeros as inputs)."""
    import numpy as np

    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)
