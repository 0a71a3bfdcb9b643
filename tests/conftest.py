"""Test configuration shared by the serial and the MPI suites: one suite, three targets.

Every test runs on the target the run asks for with ``VTNUMBA_TARGET``:

* without it (or ``cpu``/``cudasim``): host tests run on the ``cpu`` backend, and tests of
  the ``@cuda.jit`` kernels run on the *device target*, which is numba's CUDA simulator --
  switched on here, before anything imports ``numba.cuda``;
* ``VTNUMBA_TARGET=cuda`` (a GPU machine): the same tests, with the device target being the
  real GPU.  The simulator is never switched on, and a guard makes any attempt to use it
  (a test building a ``FakeCUDAArray``, say) fail loudly instead of passing simulator
  arrays to real kernels.

Tests reach the device target through one fixture, :func:`device_backend` (a
:class:`~vtnumba.backend.cuda.CUDABackend`; its ``asarray``/``empty``/``to_host`` make and
read device arrays), never by constructing simulator arrays themselves.  Two markers cover
what only one kind of device can show:

* ``@pytest.mark.cuda``            -- needs a real GPU: skipped without one;
* ``@pytest.mark.simulator_only``  -- checks behaviour of numba's simulator itself (e.g. that
  an API refuses it): skipped on a GPU.
"""

import os

from vtnumba.apps.processes import share_cores_between_local_ranks

# Under mpiexec the test ranks share the cores, as vtnumba's programs do (before numpy loads).
share_cores_between_local_ranks()

_TARGET = os.environ.get("VTNUMBA_TARGET", "cpu").lower()
ON_GPU = _TARGET == "cuda"
DEVICE_TARGET = "cuda" if ON_GPU else "cudasim"
if not ON_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _refuse_simulator_objects() -> None:
    """Under VTNUMBA_TARGET=cuda: creating a simulated device array or kernel is an error.

    The guard is on *use*, not on import: numba-cuda's own ``cuda.jit`` decorator module
    imports the simulator's kernel class (and with it the simulator package) even when the
    simulator is off, so its modules are always loaded once ``numba.cuda`` is.  What a GPU
    run must never do is build a ``FakeCUDAArray`` (or a simulated kernel) and hand it to
    real code -- that is the bug this turns into a loud error at the line that does it.
    """
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator.cudadrv import devicearray as sim_arrays

    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"numba.cuda.simulator: {type(self).__name__} made on a run that targets a real GPU "
                           "(VTNUMBA_TARGET=cuda); a test must not use numba's simulator there -- use the "
                           "device_backend fixture, or mark the test simulator_only")

    sim_arrays.FakeCUDAArray.__init__ = refuse
    sim_kernel.FakeCUDAKernel.__init__ = refuse


if ON_GPU:
    # A simulator switch left in the environment would turn the GPU run into a simulator run.
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    _refuse_simulator_objects()

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a real GPU (skipped without one)")
    config.addinivalue_line("markers", "simulator_only: checks numba's CUDA simulator itself (skipped on a GPU)")
    config.addinivalue_line("markers", "slow: longer than a few seconds")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a real GPU (run with VTNUMBA_TARGET=cuda on a GPU machine)")
    on_gpu = pytest.mark.skip(reason="checks numba's CUDA simulator; this run targets a real GPU")
    usable = False
    if ON_GPU:
        from vtnumba.target import gpu_usable

        usable, why = gpu_usable()
        if not usable:  # VTNUMBA_TARGET=cuda on a machine without a GPU: skip, do not fail
            no_gpu = pytest.mark.skip(reason=f"VTNUMBA_TARGET=cuda but no usable GPU: {why}")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not usable:
            item.add_marker(no_gpu)
        if item.get_closest_marker("simulator_only") is not None and ON_GPU:
            item.add_marker(on_gpu)


def pytest_report_header(config):
    return f"vtnumba test target: host tests on cpu, device tests on {DEVICE_TARGET}"


def _gpu_or_skip() -> None:
    if ON_GPU:
        from vtnumba.target import gpu_usable

        ok, why = gpu_usable()
        if not ok:
            pytest.skip(f"VTNUMBA_TARGET=cuda but no usable GPU: {why}")


@pytest.fixture
def device_backend_factory():
    """``make()`` -> a new CUDABackend on the device target (simulator, or the GPU under
    VTNUMBA_TARGET=cuda; the test is skipped when that target has no usable GPU)."""

    def make():
        _gpu_or_skip()
        from vtnumba.backend.cuda import CUDABackend

        return CUDABackend()

    return make


@pytest.fixture
def device_backend(device_backend_factory):
    """A CUDABackend on the device target (see the module docstring)."""
    backend = device_backend_factory()
    yield backend
    backend.close()


@pytest.fixture
def dev(device_backend):
    """``dev(host)``: a copy of ``host`` in the device target's memory (None stays None)."""
    return lambda a: None if a is None else device_backend.asarray(a)


@pytest.fixture
def host(device_backend):
    """``host(arr)``: a device array's contents as numpy (a view in the simulator, a copy on a GPU)."""
    return device_backend.to_host


# The PTX compiles behind the ``kernel_ptx`` fixture: started when collection finds a test that
# needs them, so they run beside the tests that come before it (see the fixture).
_ptx_compiles: list = []


def _start_ptx_compiles() -> list:
    """Start (once) one ``python -m vtnumba.kernels.ptx`` process per architecture; returns
    ``[(cc, process, stdout file, stderr file)]``.

    compile_ptx needs the real numba.cuda, and this process runs with the simulator on, so
    the compiles run in subprocesses with NUMBA_ENABLE_CUDASIM=0 -- one per architecture:
    NVVM is single-threaded.  At the lowest priority (nice 19), because they start while
    other tests run, some of them timing how fast a stopped rank is noticed: the compiles
    take mostly the CPU time those tests leave idle (the scheduler gives a nice-19 process
    a few percent of a busy core), so those tests slow down little.  Output goes to
    files, not pipes: a pipe nobody reads until the fixture asks would stall the writer.
    """
    if _ptx_compiles:
        return _ptx_compiles
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    # Through the nice command, not preexec_fn=os.nice: Python code run between fork and exec
    # is unsafe once the process has threads (pytest-timeout's, when a test asks first).
    nice = [shutil.which("nice"), "-n", "19"] if shutil.which("nice") else []
    for cc in ("80", "90"):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([*nice, sys.executable, "-m", "vtnumba.kernels.ptx", "--cc", cc, "--keep-ptx"],
                                env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True)
        _ptx_compiles.append((cc, proc, out, err))
    return _ptx_compiles


def pytest_collection_finish(session):
    # session.items is what will run (after -k/-m deselection): start the compiles only if
    # one of those tests uses them (and the run is not --collect-only).
    if session.config.option.collectonly:
        return
    if any("kernel_ptx" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_ptx_compiles()


def pytest_sessionfinish(session, exitstatus):
    # A run stopped early (-x, Ctrl-C) may not have waited for the compiles: end them.
    for _cc, proc, out, err in _ptx_compiles:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    _ptx_compiles.clear()


@pytest.fixture(scope="session")
def kernel_ptx():
    """Every ``@cuda.jit`` kernel's PTX for sm_80 and sm_90, compiled once per test run (it
    takes a minute of CPU time, in the background from the end of collection:
    :func:`_start_ptx_compiles`): ``"results"``, one entry per kernel, signature and
    architecture as ``python -m vtnumba.kernels.ptx`` reports them, PTX text included;
    ``"unlisted"``, the set of kernels without a PTX signature; ``"processes"``, each
    compile process's exit code and stderr."""
    import json
    import subprocess

    report = {"results": [], "unlisted": set(), "processes": []}
    for cc, proc, out, err in _start_ptx_compiles():
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        text, stderr = out.read(), err.read()
        report["processes"].append({"cc": cc, "returncode": proc.returncode, "stderr": stderr, "output": bool(text)})
        if text:
            one = json.loads(text)
            report["results"] += one["results"]
            report["unlisted"].update(one["unlisted"])
    return report


@pytest.fixture
def rng(request):
    """A fresh random generator seeded from the test's id: different data for every test, the
    same data in every run (so a failure can be reproduced; ``hash()`` would change per run)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ---------------------------------------------------------------------------- /dev/shm and groups
def shm_files(contains: str = "vtnumba") -> set[str]:
    """The names in ``/dev/shm`` that contain ``contains`` (ignoring case).

    Tests take this set before and after what they run: a name that *appeared* is a leak.
    One that went away is not -- another test, or another run on the same machine, may end
    its own files meanwhile -- so they compare with ``<=``, never ``==``.
    """
    return {f for f in os.listdir("/dev/shm") if contains in f.lower()}


@pytest.fixture
def no_new_ec_region_files():
    """Fails the test if it left an encoder-cache region file (``vtnumba_ec_*``) in /dev/shm."""
    before = shm_files("vtnumba_ec_")
    yield
    assert shm_files("vtnumba_ec_") <= before, "a test left a region file in /dev/shm"


@pytest.fixture
def group():
    """A fresh distributed group of this process (one rank outside mpiexec), destroyed after
    the test -- so no test inherits another's group.  (The MPI suite's module-wide group is
    ``tests/mpi/mpi_helpers.group``.)"""
    from vtnumba import dist

    dist.destroy_distributed()
    g = dist.init_distributed()
    yield g
    dist.destroy_distributed()
