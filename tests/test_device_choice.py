"""Which GPU a process uses: one per node-local rank, or the one VTNUMBA_DEVICE names."""

import threading

import pytest

from vtnumba.backend.device_choice import choose_cuda_device, node_local_rank


def test_outside_a_launcher_the_process_uses_device_0():
    choice = choose_cuda_device(4, environ={})
    assert choice.index == 0 and "no launcher" in choice.reason


@pytest.mark.parametrize("variable", ["MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"])
def test_each_launchers_local_rank_picks_the_device(variable):
    choice = choose_cuda_device(4, environ={variable: "2"})
    assert choice.index == 2 and variable in choice.reason and "share" not in choice.reason


def test_more_ranks_than_devices_share_them_round_robin():
    picked = [choose_cuda_device(3, environ={"MPI_LOCALRANKID": str(r)}).index for r in range(7)]
    assert picked == [0, 1, 2, 0, 1, 2, 0]
    assert "ranks share devices" in choose_cuda_device(3, environ={"MPI_LOCALRANKID": "4"}).reason
    # Two ranks on a one-GPU machine (a laptop, the H200 check): both on device 0.
    assert [choose_cuda_device(1, environ={"MPI_LOCALRANKID": str(r)}).index for r in (0, 1)] == [0, 0]


def test_the_first_launcher_variable_wins_and_junk_is_ignored():
    env = {"MPI_LOCALRANKID": "1", "LOCAL_RANK": "0", "SLURM_LOCALID": "0"}
    assert node_local_rank(env) == (1, "MPI_LOCALRANKID")
    assert node_local_rank({"MPI_LOCALRANKID": "", "OMPI_COMM_WORLD_LOCAL_RANK": "x", "LOCAL_RANK": "3"}) == \
        (3, "LOCAL_RANK")
    assert node_local_rank({"MPI_LOCALRANKID": "-1"}) is None


def test_vtnumba_device_puts_every_rank_on_one_device():
    for rank in range(3):
        choice = choose_cuda_device(4, environ={"VTNUMBA_DEVICE": "3", "MPI_LOCALRANKID": str(rank)})
        assert choice.index == 3 and choice.reason == "VTNUMBA_DEVICE=3"
    assert choose_cuda_device(2, environ={"VTNUMBA_DEVICE": "local", "MPI_LOCALRANKID": "1"}).index == 1
    assert choose_cuda_device(2, environ={"VTNUMBA_DEVICE": " LOCAL "}).index == 0


@pytest.mark.parametrize("value", ["2", "-1", "gpu1", "1.0"])
def test_a_bad_vtnumba_device_names_the_variable_and_the_choices(value):
    with pytest.raises(ValueError, match=rf"VTNUMBA_DEVICE='{value}' is not a device here; expected 'local' .* "
                                         r"an index from 0 to 1 \(2 visible CUDA device"):
        choose_cuda_device(2, environ={"VTNUMBA_DEVICE": value})


@pytest.mark.parametrize("value, index", [("local", None), ("", None), (" LOCAL ", None), ("0", 0), (" 7 ", 7)])
def test_requested_device_reads_the_variable(value, index):
    from vtnumba.device_rule import requested_device

    assert requested_device({"VTNUMBA_DEVICE": value}) == index
    assert requested_device({}) is None


@pytest.mark.parametrize("value", ["abc", "-1", "1.0", "gpu1"])
def test_a_malformed_vtnumba_device_is_refused_without_counting_devices(value):
    # (Checked on every target that chooses a CUDA device -- the simulator too -- so a typo
    # shows on the laptop, not first on the GPU machine.)
    from vtnumba.device_rule import requested_device

    with pytest.raises(ValueError, match=rf"VTNUMBA_DEVICE='{value}' is not a device; expected 'local' .*index"):
        requested_device({"VTNUMBA_DEVICE": value})


@pytest.mark.parametrize("count", [0, -1, 1.5, None])
def test_no_visible_device_is_refused(count):
    with pytest.raises(ValueError, match="device_count=.*expected at least one visible CUDA device"):
        choose_cuda_device(count, environ={})


@pytest.mark.simulator_only  # (the run's target is cpu there; on a GPU run it is cuda)
def test_off_the_cuda_target_the_cuda_device_is_0_whatever_the_launcher_says(monkeypatch):
    # The simulator has one device and the cpu target none: a rank-based index would name a
    # device that does not exist.
    from vtnumba.backend import default_cuda_device, device_choice
    from vtnumba.backend.device import Device, DeviceType

    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    monkeypatch.setattr(device_choice, "_chosen", None)
    assert default_cuda_device() == Device(DeviceType.CUDA, 0)
    assert "one (simulated or no) CUDA device" in device_choice.process_cuda_device().reason


@pytest.mark.cuda
def test_on_a_gpu_a_thread_without_a_context_gets_this_processs_device(device_backend):
    # numba would make device 0's context current on a fresh thread; vtnumba's helper makes
    # the process's own GPU's current (the same one here, the device the backend runs on).
    from vtnumba.backend.cuda import current_context

    seen = []
    thread = threading.Thread(target=lambda: seen.append(current_context().device.id))
    thread.start()
    thread.join(60)
    assert seen == [device_backend.device.index]


@pytest.mark.cuda
def test_on_a_gpu_one_process_drives_one_device(device_backend):
    from vtnumba.backend.cuda import CUDABackend
    from vtnumba.backend.device import Device, DeviceType

    other = Device(DeviceType.CUDA, (device_backend.device.index + 1) % 16)
    with pytest.raises(ValueError, match=rf"device={other}: this process already runs on cuda:"):
        CUDABackend(other)


NO_GPU_SCRIPT = """
from vtnumba.backend.cuda import CUDABackend
from vtnumba.backend.device_choice import process_cuda_device
choice = process_cuda_device()
assert choice.index == 0 and "no usable CUDA GPU" in choice.reason, choice
try:
    CUDABackend()
except RuntimeError as exc:
    print("refused:", exc)
"""


def test_the_cuda_target_without_a_gpu_gets_the_backends_own_refusal():
    # Counting the devices would raise from deep in the driver binding; the choice says
    # device 0, and CUDABackend says what is wrong and what to do.
    import os
    import subprocess
    import sys

    from vtnumba.target import gpu_usable

    if gpu_usable()[0]:
        pytest.skip("this machine has a GPU")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", VTNUMBA_TARGET="cuda", MPI_LOCALRANKID="1")
    proc = subprocess.run([sys.executable, "-c", NO_GPU_SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: CUDABackend: no usable CUDA GPU (use VTNUMBA_TARGET=cpu or cudasim)" in proc.stdout, proc.stdout
