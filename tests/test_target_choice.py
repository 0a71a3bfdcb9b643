"""Choosing the target: honoured at ``import vtnumba``, misspellings refused clearly, late choices explained.

Each case runs in a fresh interpreter: numba reads its simulator switch once per process.
"""

import os
import subprocess
import sys

import pytest

ENV = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}


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
