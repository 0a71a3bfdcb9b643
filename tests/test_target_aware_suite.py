"""The suite itself is target-aware: a GPU run (``VTNUMBA_TARGET=cuda``) never touches the simulator.

Tests written for numba's simulator used to build simulator arrays and hand them to real
kernels, so a GPU run reported failures that said nothing about the GPU.  Now every device
test takes the ``device_backend`` fixture (tests/conftest.py), and under
``VTNUMBA_TARGET=cuda`` the conftest switches the simulator off and turns any use of it into
an error that names ``numba.cuda.simulator``.  These tests run pytest in subprocesses to
check, on any machine:

* the whole suite (the MPI tests too) collects under ``VTNUMBA_TARGET=cuda`` exactly as it
  does on the default run -- the same tests, no module using the simulator at import;
* without a GPU, the device tests of a few kernel files are *skipped* there, each saying that
  no GPU is usable -- not failed, not errored -- while their host tests still pass.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Kernel test files: device tests next to host ones.  (Their PTX checks compile in
# subprocesses of their own, which is slow and says nothing about the target.)
DEVICE_FILES = ["tests/test_kernels_matmul.py", "tests/test_kernels_norm.py", "tests/test_kernels_peer.py",
                "tests/test_tpsp_nn.py", "tests/test_memory_arena.py"]


def _env(target: str | None) -> dict:
    # The test process runs with the simulator switched on; the child decides for itself.
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    if target is not None:
        env["VTNUMBA_TARGET"] = target
    return env


def _pytest(*args, target: str | None, timeout: float = 120, extra_env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**_env(target), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _collected(proc) -> list[str]:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_gpu_run_collects_the_same_suite_without_the_simulator():
    # The two collections run at once (threads waiting on subprocesses): each is one core's work.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        gpu_run, default_run = (pool.submit(_pytest, "--collect-only", "-q", "tests", target=t) for t in ("cuda", None))
        gpu, default_proc = gpu_run.result(), default_run.result()
    text = gpu.stdout + gpu.stderr
    assert "numba.cuda.simulator" not in text, text[-4000:]
    on_gpu = _collected(gpu)
    default = _collected(default_proc)
    assert len(default) > 500 and any(t.startswith("tests/mpi/") for t in default), len(default)
    missing, extra = sorted(set(default) - set(on_gpu)), sorted(set(on_gpu) - set(default))
    assert not missing and not extra, f"only on the default run: {missing[:20]}; only on the GPU run: {extra[:20]}"


def _gpu_usable() -> bool:
    probe = "from vtnumba.target import gpu_usable; print(gpu_usable()[0])"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_env(None), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    return proc.stdout.strip().endswith("True")


# A plugin for the child pytest: tag each device test in the JUnit report -- one whose
# parameter says "device", or, without a cpu/host parameter, one that takes the device fixtures.
_TAG_DEVICE_TESTS = """
def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        kinds = {v for v in callspec.params.values() if isinstance(v, str)} if callspec else set()
        if "device" in kinds:
            device = True
        elif kinds & {"cpu", "cpu-threaded", "host"}:
            device = False
        else:
            device = bool({"device_backend", "device_backend_factory"} & set(item.fixturenames))
        if device:
            item.user_properties.append(("device_test", "yes"))
"""


def test_without_a_gpu_the_device_tests_skip_and_say_why(tmp_path):
    if _gpu_usable():
        pytest.skip("a GPU is usable here: the GPU run executes these device tests instead of skipping them")
    (tmp_path / "tag_device_tests.py").write_text(_TAG_DEVICE_TESTS)
    report = tmp_path / "report.xml"
    env_path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = _pytest("-q", "-p", "tag_device_tests", "-k", "not ptx", f"--junitxml={report}", *DEVICE_FILES,
                   target="cuda", timeout=300, extra_env={"PYTHONPATH": env_path})
    text = proc.stdout + proc.stderr
    assert "numba.cuda.simulator" not in text, text[-4000:]
    assert proc.returncode == 0, text[-4000:]
    device, host = {}, {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = [c.get("message") for c in case if c.tag in ("failure", "error")]
        assert not bad, f"{name}: {bad}"
        skipped = case.find("skipped")
        outcome = "passed" if skipped is None else f"skipped: {skipped.get('message', '')}"
        is_device = any(p.get("name") == "device_test" for p in case.iter("property"))
        (device if is_device else host)[name] = outcome
    assert len(device) >= 50 and len(host) >= 20, (len(device), len(host))
    # Skipped for the right reason: no GPU here, or a check of the simulator itself (which a GPU
    # run does not have).
    reasons = ("no usable GPU", "checks numba's CUDA simulator")
    not_skipped = {n: o for n, o in device.items() if not (o.startswith("skipped") and any(r in o for r in reasons))}
    assert not not_skipped, not_skipped
    assert all(o == "passed" for o in host.values()), {n: o for n, o in host.items() if o != "passed"}
