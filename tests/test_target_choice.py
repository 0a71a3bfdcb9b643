"""Choosing the target: honoured at ``import vtnumba``, misspellings refused clearly, late choices explained.

Each case runs in a fresh interpreter: numba reads its simulator switch once per process.
"""

import os
import subprocess
import sys

import pytest

# (Nor which GPU a launcher or the user would give the process: the cases below set their own.)
ENV = {k: v for k, v in os.environ.items()
       if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET", "VTNUMBA_DEVICE", "MPI_LOCALRANKID",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
                    "LOCAL_RANK")}


def _python(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**ENV, **env}, stdin=subprocess.DEVNULL)


def test_vtnumba_target_cudasim_is_honoured_even_if_numba_cuda_is_imported_right_after():
    proc = _python("import vtnumba; from numba import cuda; from vtnumba.backend.arrays import simulator_active; "
                   "print(simulator_active())", VTNUMBA_TARGET="cudasim")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_import_vtnumba_leaves_the_environment_alone_for_other_targets():
    for target in ("cpu", "cuda", "auto"):
        proc = _python("import os; before = dict(os.environ); import vtnumba; print(before == dict(os.environ))",
                       VTNUMBA_TARGET=target)
        assert proc.stdout.strip() == "True", (target, proc.stderr)


def test_a_malformed_vtnumba_device_is_refused_on_the_simulator_too():
    # The simulator has one device, so only the value's form is checked there; on a GPU the
    # index is checked against the GPUs too (test below, with stand-in GPUs).
    bad = _python("import vtnumba; vtnumba.select_target()", VTNUMBA_TARGET="cudasim", VTNUMBA_DEVICE="gpu0")
    assert bad.returncode == 1 and "TargetError: VTNUMBA_DEVICE='gpu0' is not a device; expected 'local'" \
        in bad.stderr, bad.stderr
    ok = _python("import vtnumba; print(vtnumba.select_target().name)", VTNUMBA_TARGET="cudasim", VTNUMBA_DEVICE="1")
    assert ok.returncode == 0 and ok.stdout.strip() == "cudasim", ok.stderr


@pytest.mark.parametrize("how", ["env", "flag"])
def test_an_unknown_target_is_a_clear_error_not_a_traceback(how):
    args = [sys.executable, "-m", "vtnumba", "info"] + (["--target", "gpu"] if how == "flag" else [])
    env = {**ENV, **({"VTNUMBA_TARGET": "gpu"} if how == "env" else {})}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "'gpu'" in proc.stderr and "cudasim" in proc.stderr


def test_the_library_refuses_an_unknown_target_naming_the_variable():
    proc = _python("from vtnumba.target import current_target\n"
                   "try:\n    current_target()\nexcept ValueError as e:\n    print(e)", VTNUMBA_TARGET="gpu")
    assert "VTNUMBA_TARGET='gpu' is not a target" in proc.stdout, proc.stderr


def test_asking_for_the_simulator_after_numba_cuda_was_imported_says_what_happened():
    proc = _python("from numba import cuda\nfrom vtnumba.target import select_target\n"
                   "try:\n    select_target('cudasim')\nexcept RuntimeError as e:\n    print(e)")
    assert "already imported as the real CUDA target" in proc.stdout, proc.stdout + proc.stderr
    assert "before anything imports numba.cuda" in proc.stdout


def test_choosing_the_cuda_target_asks_for_every_hardware_queue_unless_the_user_said():
    # The driver reads CUDA_DEVICE_MAX_CONNECTIONS when the process's context is made, so it
    # must be set when the target is chosen -- before any context -- not only when a backend
    # is made; only for the cuda target, and a value the user set wins.
    code = ("import os, vtnumba; vtnumba.select_target({!r}); "
            "print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))")
    env = {k: v for k, v in ENV.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    run = lambda target, **extra: subprocess.run([sys.executable, "-c", code.format(target)], capture_output=True,
                                                 text=True, timeout=120, env={**env, **extra},
                                                 stdin=subprocess.DEVNULL)
    for target, extra, want in (("cuda", {}, "32"), ("cuda", {"CUDA_DEVICE_MAX_CONNECTIONS": "4"}, "4"),
                                ("cpu", {}, "None")):
        proc = run(target, **extra)
        assert proc.returncode == 0 and proc.stdout.strip() == want, (target, extra, proc.stdout, proc.stderr)


def test_auto_takes_the_cpu_target_when_the_gpu_found_will_not_make_a_context():
    # A GPU that is there but refuses a context (held by another process in exclusive-process
    # mode, out of memory): 'auto' must say so and run on cpu, not pick cuda and fail later.
    # The driver is played by stand-ins: two GPUs, whose primary contexts the driver refuses.
    code = """
import os, vtnumba.target as t
from numba import cuda
from cuda.bindings import driver as cu
t.gpu_usable = lambda: (True, "CUDA GPU found: Stand-in H200")
cuda.gpus = [object(), object()]
calls = []
cu.cuInit = lambda flags: calls.append("init") or (cu.CUresult.CUDA_SUCCESS,)
cu.cuDeviceGet = lambda i: calls.append(("get", i, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))) or \
    (cu.CUresult.CUDA_SUCCESS, 7)
cu.cuDevicePrimaryCtxRetain = lambda dev: calls.append(("retain", dev)) or (RETAIN, None)
cu.cuDevicePrimaryCtxRelease = lambda dev: calls.append(("release", dev)) or (cu.CUresult.CUDA_SUCCESS,)
choice = t.select_target("auto")
assert t.select_target("auto") is choice  # chosen once: asking again probes nothing
print(choice.name); print(choice.reason); print(calls); print(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
"""
    env = {k: v for k, v in ENV.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}

    def run(script, **extra):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**env, **extra}, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().splitlines()

    name, reason, calls, connections = run(code.replace("RETAIN", "cu.CUresult.CUDA_ERROR_DEVICE_UNAVAILABLE"),
                                           MPI_LOCALRANKID="1")
    assert name == "cpu", reason
    assert reason == ("auto: CUDA GPU found: Stand-in H200, but cuda:1 would not make a CUDA context "
                      "(cuDevicePrimaryCtxRetain: CUDA_ERROR_DEVICE_UNAVAILABLE); using the cpu target"), reason
    # It asked on the process's own device (node-local rank 1: GPU 1), after asking for the
    # hardware queues (which the driver reads when the context is made) -- and left the
    # environment as it was.
    assert calls == "['init', ('get', 1, '32'), ('retain', 7)]" and connections == "None", calls
    # A GPU whose context can be made is the cuda target; the probe's context is let go again
    # (numba's memory manager may still be chosen before the process's first real context).
    name, reason, calls, connections = run(code.replace("RETAIN", "cu.CUresult.CUDA_SUCCESS"))
    assert (name, reason, connections) == ("cuda", "auto: CUDA GPU found: Stand-in H200", "32")
    assert calls == "['init', ('get', 0, '32'), ('retain', 7), ('release', 7)]", calls
    # A driver that cannot even list its GPUs: the cpu target too, saying so.
    broken = code.replace("cuda.gpus = [object(), object()]", "class Gpus:\n    def __len__(self):\n"
                          "        raise RuntimeError('driver gone')\ncuda.gpus = Gpus()")
    name, reason, _, _ = run(broken)
    assert name == "cpu" and "but listing the GPUs failed (RuntimeError: driver gone)" in reason, reason
    # A VTNUMBA_DEVICE that names no GPU is the user's error, not a reason to fall back: a
    # TargetError, which the programs turn into a usage message.
    proc = subprocess.run([sys.executable, "-c", code.replace("RETAIN", "cu.CUresult.CUDA_SUCCESS")],
                          capture_output=True, text=True, timeout=120, env={**env, "VTNUMBA_DEVICE": "5"},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and "vtnumba.target.TargetError: VTNUMBA_DEVICE='5' is not a device here" \
        in proc.stderr, proc.stderr
