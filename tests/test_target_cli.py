"""Target selection, dtypes and the command line (run as a user would, in subprocesses)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ON_GPU

from vtnumba.backend.dtype import DType, as_dtype, check_dtype_supported, supported_dtypes


def run_cli(*args, env_extra=None, mpiexec=0, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "vtnumba", *args]
    if mpiexec:
        cmd = ["mpiexec", "-n", str(mpiexec), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def test_info_json_cpu():
    proc = run_cli("info", "--json", "--target", "cpu")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    for key in ("python", "numpy", "numba", "numba_cuda", "mpi4py", "mpi_library", "target", "target_reason",
                "gpu", "simulator"):
        assert key in info
    assert info["target"] == "cpu" and info["simulator"] is False and info["gpu"] == "none"
    assert "MPICH" in info["mpi_library"] or "Open MPI" in info["mpi_library"]
    # Which numba.cuda is active, and on which binding (the wrong one breaks the GPU path).
    assert info["numba_cuda_active"].startswith("numba-cuda (") and info["cuda_bindings"] != "not installed"
    assert "numba_cuda_problem" not in info


@pytest.mark.skipif(ON_GPU, reason="checks the message a machine without a GPU gets")
def test_info_on_the_cuda_target_without_a_gpu_says_why_instead_of_a_traceback():
    proc = run_cli("info", "--target", "cuda")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "gpu" in proc.stdout and "unavailable:" in proc.stdout
    assert "needs a usable GPU; run with --target cpu" in proc.stdout


@pytest.mark.skipif(ON_GPU, reason="checks the message a machine without a GPU gets")
@pytest.mark.parametrize("how", ["--target", "VTNUMBA_TARGET"])
def test_the_cuda_target_without_a_gpu_is_a_usage_error_said_once_before_anything_runs(how):
    # Every rank on this machine sees the same driver: rank 0 says it once, status 2, before
    # the demo loads its model (it was every rank's own RuntimeError, after loading).
    args, env = (("demo", "--target", "cuda"), None) if how == "--target" else (("demo",), {"VTNUMBA_TARGET": "cuda"})
    proc = run_cli(*args, env_extra=env, mpiexec=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count(f"{how}=cuda, but this process finds no usable CUDA GPU") == 1, out
    assert "use --target cpu or cudasim" in out and "loading the model" not in out and "Traceback" not in out


@pytest.mark.parametrize("variable, value, says", [
    ("VTNUMBA_CHECK_HAZARDS", "abc", "VTNUMBA_CHECK_HAZARDS='abc' is not understood; expected 1/raise, record, or 0"),
    ("VTNUMBA_CPU_QUEUES", "bogus", "VTNUMBA_CPU_QUEUES='bogus' is not understood; expected sync or threaded"),
    ("VTNUMBA_DEVICE", "gpu1", "VTNUMBA_DEVICE='gpu1' is not a device; expected 'local'"),
    ("VTNUMBA_MATMUL_VARIANT", "fastest", "VTNUMBA_MATMUL_VARIANT='fastest' is not a matmul variant; expected one of"),
])
@pytest.mark.parametrize("command", [("embed", "--target", "cpu", "hi"), ("info", "--target", "cpu")])
def test_a_bad_switch_in_the_environment_is_a_usage_error_said_once(variable, value, says, command):
    # VTNUMBA_CHECK_HAZARDS=abc was a traceback per rank as a module loaded; VTNUMBA_CPU_QUEUES=bogus
    # silently gave synchronous queues; VTNUMBA_DEVICE=gpu1 was ignored off a GPU; info took them all;
    # VTNUMBA_MATMUL_VARIANT=fastest was ignored on the cpu target and failed mid-run on a device.
    proc = run_cli(*command, env_extra={variable: value}, mpiexec=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count(says) == 1 and "Traceback" not in out, out


@pytest.mark.parametrize("bad_ranks", [(1,), (0,), (1, 2)])
@pytest.mark.parametrize("program", [("-m", "vtnumba", "info", "--target", "cpu"),
                                     ("tutorials/01_devices_queues_events.py", "--target", "cpu")])
def test_a_usage_error_on_some_ranks_only_ends_the_job_and_names_them(bad_ranks, program):
    # A rank whose own environment is bad (a launcher setting VTNUMBA_DEVICE per rank) left
    # before MPI_Init: the others waited there for good, and nothing was said if rank 0 was fine.
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    cmd = ["mpiexec"]
    for rank in range(3):
        cmd += [":"] if rank else []
        cmd += ["-n", "1", "env", *(["VTNUMBA_DEVICE=x"] if rank in bad_ranks else []), sys.executable, *program]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    said = out.count("VTNUMBA_DEVICE='x' is not a device")
    if 0 in bad_ranks:
        assert said == 1 and "[rank" not in out, out  # rank 0 says it, once, and ends the job
    else:
        # Each failing rank says its own -- unless another's MPI_Abort ends it first (a busy
        # machine): at least one, and every one said names its rank.
        assert 1 <= said <= len(bad_ranks), out
        assert said == sum(f"error: [rank {r}] VTNUMBA_DEVICE='x'" in out for r in bad_ranks), out
    assert "Traceback" not in out and "BAD TERMINATION" not in out and "MPI_Abort" not in out, out


def test_the_switches_readers_name_their_variable(monkeypatch):
    from vtnumba.backend.cpu import CPUBackend, threaded_from_env
    from vtnumba.dist.groups import fake_node_size

    for value, threaded in (("", False), ("sync", False), (" Threaded ", True)):
        monkeypatch.setenv("VTNUMBA_CPU_QUEUES", value)
        assert threaded_from_env() is threaded
    monkeypatch.setenv("VTNUMBA_CPU_QUEUES", "bogus")
    with pytest.raises(ValueError, match="VTNUMBA_CPU_QUEUES='bogus'"):
        CPUBackend()
    for value, size in (("", None), ("2", 2)):
        monkeypatch.setenv("VTNUMBA_FAKE_NODE_SIZE", value)
        assert fake_node_size() == size
    for bad in ("abc", "0", "-1", "1.5"):
        monkeypatch.setenv("VTNUMBA_FAKE_NODE_SIZE", bad)
        with pytest.raises(ValueError, match=f"VTNUMBA_FAKE_NODE_SIZE='{re.escape(bad)}' must be a positive int"):
            fake_node_size()


def test_info_cudasim_and_auto_reason():
    sim = json.loads(run_cli("info", "--json", "--target", "cudasim").stdout)
    assert sim["target"] == "cudasim" and sim["simulator"] is True
    auto = run_cli("info", "--json", env_extra={"VTNUMBA_TARGET": "auto"})
    data = json.loads(auto.stdout)
    assert data["target"] in ("cpu", "cuda") and data["target_reason"].startswith("auto:")


def test_info_under_mpiexec_is_printed_once_by_rank_0():
    proc = run_cli("info", "--json", "--target", "cpu", mpiexec=2)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON document: rank 0 speaks for the job
    assert data["mpi_size"] == 2 and data["per_rank"]["mpi_rank"] == [0, 1]
    assert data["python"] and "python" not in data["per_rank"]  # shared values appear once
    text = run_cli("info", "--target", "cpu", mpiexec=2)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert sum(line.startswith("python ") for line in lines) == 1  # no interleaved duplicates
    assert any(line.startswith("mpi_size") and line.split()[-1] == "2" for line in lines)


def test_merge_rank_infos_lists_only_what_differs():
    from vtnumba.apps.info import merge_rank_infos

    merged = merge_rank_infos([{"python": "3.11", "gpu": "A", "mpi_rank": 0},
                               {"python": "3.11", "gpu": "B", "mpi_rank": 1}])
    assert merged == {"python": "3.11", "per_rank": {"gpu": ["A", "B"], "mpi_rank": [0, 1]}}
    assert merge_rank_infos([{"python": "3.11"}]) == {"python": "3.11"}


def test_bad_target_is_refused_clearly():
    proc = run_cli("info", "--target", "tpu")
    assert proc.returncode == 2 and "invalid choice: 'tpu'" in proc.stderr
    proc = run_cli("info", env_extra={"VTNUMBA_TARGET": "gpu9"})
    assert proc.returncode != 0 and "VTNUMBA_TARGET='gpu9' is not a target" in proc.stderr


def test_help_lists_every_command():
    proc = run_cli("--help")
    for cmd in ("info", "demo", "embed", "bench", "trace"):
        assert cmd in proc.stdout


def test_runtime_demo_under_mpiexec():
    proc = run_cli("demo", "runtime", "--target", "cpu", mpiexec=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout
    # Threaded cpu queues were really held: the event query answered False on both ranks.
    rows = [l for l in proc.stdout.splitlines() if "CPUBackend(threaded)" in l]
    assert len(rows) == 2 and all(" False " in r for r in rows)


def test_runtime_demo_on_the_simulator():
    # The tour's CUDA kernel (scale_kernel, one thread per element over many blocks) against
    # its numpy answer, on poisoned output: the one place the tests launch it.
    proc = run_cli("demo", "runtime", "--target", "cudasim")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "CUDABackend(simulator)" in proc.stdout


def test_demo_options_that_would_be_ignored_are_refused():
    proc = run_cli("demo", "runtime", "--no-tpsp", "--region-mib", "2")
    assert proc.returncode == 2 and "demo runtime takes none of the pipeline's options (--region-mib, --no-tpsp)" \
        in proc.stderr, proc.stderr
    proc = run_cli("demo", "--queries")  # an empty list would silently mean "the built-in queries"
    assert proc.returncode == 2 and "argument --queries: expected at least one argument" in proc.stderr


def test_select_target_refuses_switch_after_choice():
    from vtnumba import target

    saved = target._choice
    try:
        target._reset_for_tests()
        target.select_target("cpu")
        with pytest.raises(RuntimeError, match="already 'cpu'"):
            target.select_target("cudasim")
    finally:
        target._choice = saved


def test_dtypes():
    assert as_dtype("fp16") is DType.FLOAT16 and as_dtype(np.float32) is DType.FLOAT32
    assert DType.FLOAT16.itemsize == 2 and DType.FLOAT32.to_numpy() == np.float32
    assert DType.BFLOAT16 not in supported_dtypes("cpu")
    assert DType.BFLOAT16 in supported_dtypes("cuda", (9, 0))
    with pytest.raises(TypeError, match="numba's simulator has no bfloat16"):
        check_dtype_supported("bf16", "cudasim")
    with pytest.raises(TypeError, match=r"no compute capability was given \(bfloat16 needs 8.0 or newer\)"):
        check_dtype_supported("bf16", "cuda")
    with pytest.raises(TypeError, match=r"compute capability \(7, 5\) < 8.0"):
        check_dtype_supported("bf16", "cuda", (7, 5))
    with pytest.raises(TypeError, match="bfloat16 has no numpy dtype"):
        DType.BFLOAT16.to_numpy()
    with pytest.raises(TypeError, match="dtype=.*int8.* is not supported"):
        as_dtype(np.int8)


def test_target_before_or_after_the_command():
    before = json.loads(run_cli("--target", "cudasim", "info", "--json").stdout)
    after = json.loads(run_cli("info", "--json", "--target", "cudasim").stdout)
    assert before["target"] == after["target"] == "cudasim"
    both = run_cli("--target", "cpu", "info", "--target", "cudasim")
    assert both.returncode == 2 and "--target is given more than once with different values ('cpu' before " \
        "the command, 'cudasim' after it)" in both.stderr


@pytest.mark.parametrize("argv", [["--target", "cudasim", "bench", "memory"], ["bench", "--target", "cudasim", "memory"],
                                  ["bench", "memory", "--target", "cudasim"],
                                  ["--target", "cudasim", "bench", "--target", "cudasim", "memory"]])
def test_bench_takes_the_target_before_or_after_the_suite(argv):
    # `vtnumba bench --target cpu memory` was a usage error ("invalid choice: 'cpu'").
    import argparse

    from vtnumba.apps.cli import _chosen_target, build_parser

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    assert not unknown and args.suite == "memory" and _chosen_target(parser, args) == "cudasim"
    args, _ = parser.parse_known_args(["bench", "--target", "cpu", "memory", "--target", "cudasim"])
    with pytest.raises(SystemExit):
        _chosen_target(argparse.ArgumentParser(prog="vtnumba"), args)


def test_bench_refuses_two_different_targets():
    proc = run_cli("bench", "--target", "cpu", "memory", "--target", "cudasim")
    assert proc.returncode == 2 and "('cpu' before the suite, 'cudasim' after it)" in proc.stderr


def test_closed_pipe_is_not_a_traceback():
    import subprocess
    import sys

    proc = subprocess.run(f"{sys.executable} -m vtnumba info --target cpu | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr
    assert proc.stdout.startswith("python")


@pytest.mark.parametrize("command", ["-m vtnumba demo runtime --target cpu", "-m vtnumba bench memory --quick",
                                     "tutorials/01_devices_queues_events.py --target cpu"])
def test_a_reader_that_closes_the_pipe_ends_the_program_quietly(command):
    # 'vtnumba bench ... | head -1' was "[rank 0] failed while running: BrokenPipeError", status 1
    # (a tutorial: a traceback too): the programs' failure reports got the error before the
    # entry point's quiet handler could.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(["bash", "-c", f"{sys.executable} {command} | head -1; exit ${{PIPESTATUS[0]}}"],
                          capture_output=True, text=True, timeout=120, cwd=root, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr and "failed" not in proc.stderr
    assert len(proc.stdout.splitlines()) == 1


@pytest.mark.parametrize("argv, says", [
    (["bench", "memory", "--quick", "--json", "/proc/nonexistent/x.json"],
     "vtnumba bench memory: error: --json /proc/nonexistent: cannot write there (No such file or directory)"),
    (["bench", "memory", "--quick", "--json", "{file}/x.json"], "--json {file}: is a file, not a folder"),
    (["bench", "memory", "--quick", "--plot", "{file}"], "--plot {file}: is a file, not a folder"),
    (["bench", "memory", "--quick", "--json", "{dir}"], "--json {dir}: is a folder; expected a file name"),
    (["trace", "--out", "/proc/nonexistent/p", "--", "true"],
     "vtnumba trace: error: --out /proc/nonexistent: cannot write there"),
    (["trace", "--", "no-such-command-here"], "vtnumba trace: error: 'no-such-command-here' is not a command found on PATH"),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_run(argv, says, tmp_path):
    # Before: the benchmark (or the traced command) ran, and then the write failed with a traceback.
    afile = tmp_path / "afile"
    afile.write_text("")
    fill = {"file": str(afile), "dir": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "vtnumba", *[a.format(**fill) for a in argv]], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and says.format(**fill) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "bench memory: running" not in proc.stderr


def test_a_trace_folder_from_vtnumba_out_dir_is_named_as_the_variables():
    # It said "--out /sys/nope: cannot write there" to a user who gave no --out.
    env = dict(os.environ, VTNUMBA_OUT_DIR="/proc/nonexistent")
    proc = subprocess.run([sys.executable, "-m", "vtnumba", "trace", "--", "true"], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "--out (its default folder, from VTNUMBA_OUT_DIR='/proc/nonexistent') /proc/nonexistent: cannot write" \
        in proc.stderr, proc.stderr


def test_select_target_names_the_argument_its_caller_used():
    # A Python caller passed target='tpu' and was told about a '--target' flag it never used.
    from vtnumba import target

    with pytest.raises(target.TargetError, match=r"^target='tpu' is not a target; expected one of auto"):
        target.select_target("tpu")
    with pytest.raises(target.TargetError, match=r"^--target='tpu' is not a target"):
        target.select_target("tpu", source="--target")


@pytest.mark.parametrize("args, prefix", [
    (("embed", "--bogus", "hi"), "vtnumba embed: error: unrecognized arguments: --bogus"),
    (("bench", "memory", "--nope"), "vtnumba bench memory: error: unrecognized arguments: --nope"),
    (("info", "--x"), "vtnumba info: error: unrecognized arguments: --x"),
    (("--zzz",), "vtnumba: error: unrecognized arguments: --zzz"),
])
def test_an_unknown_option_is_said_under_its_commands_usage(args, prefix):
    # argparse's parse_args sends an option no subparser knows up to the top level: "usage:
    # vtnumba [-h] ... COMMAND", where every other bad argument of a command gets its own.
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(prefix) == 1 and "Traceback" not in proc.stderr, proc.stderr
    command = prefix.split(": error")[0]
    assert f"usage: {command} " in proc.stderr, proc.stderr
