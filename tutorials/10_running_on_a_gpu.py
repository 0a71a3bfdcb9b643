"""Running on a real GPU
=====================

What it does: shows, in one script that runs on every target, what changes when the same
vtnumba code meets a real GPU: which backend serves the process and what it can do, what
kind of array a buffer hands to a kernel, how peer memory travels, and the one feature only
a GPU has -- graph capture, which records a sequence of launches once and replays it with
one call.  On ``cpu`` and ``cudasim`` it runs and checks everything that exists there, and
says what a GPU would do instead.  A timeline shows what the lesson's queue ran on this
target -- copies, kernels, the first calls that compile.  Last: how to run the whole GPU
check in one command.

**Builds on:** every lesson before it, above all :doc:`01_devices_queues_events` (the
backend seam) and :doc:`08_tpsp`.  It is the last lesson; the :doc:`../benchmarks` page
measures what the lessons taught.

Run it::

    mpiexec -n 2 python tutorials/10_running_on_a_gpu.py              # default target (cpu without a GPU)
    mpiexec -n 2 python tutorials/10_running_on_a_gpu.py --target cudasim
    mpiexec -n 2 python tutorials/10_running_on_a_gpu.py --target cuda  # on a GPU machine
    bash scripts/gpu_check.sh                                         # the full GPU check

Key insight: the code above the backend seam does not change between targets.  What
changes is underneath: where memory lives, whether queues really run concurrently, how a
peer's memory is mapped -- and what a launch costs, which is what graphs are for.
"""

# %%
# What this process runs on
# -------------------------
#
# ``--target`` (or ``VTNUMBA_TARGET``) chooses once per
# process, before ``numba.cuda`` is imported; ``auto`` picks ``cuda`` when a GPU is usable
# and ``cpu`` otherwise -- never the simulator, which is only ever asked for.  ``vtnumba
# info`` prints the same facts as ``collect_info()`` here.
from vtnumba.apps.tutorial import start

lesson = start("10 running on a real GPU")

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from vtnumba import default_backend  # noqa: E402
from vtnumba.apps.info import collect_info  # noqa: E402
from vtnumba.kernels import fused_add_rms_norm, linear  # noqa: E402

target, rank = lesson.target, lesson.rank
info = collect_info()
for key in ("target", "target_reason", "simulator", "gpu", "compute_capability", "numba_cuda", "mpi_library"):
    lesson.say(f"  {key:<18} {info[key]}")
lesson.check(info["target"] == target and info["simulator"] == (target == "cudasim"), "vtnumba info agrees")

# %%
# The backend
# -----------
#
# The same seam, three implementations:
#
# ======== ==================== ================ ============ =============
# target   backend              memory           queues       graph capture
# ======== ==================== ================ ============ =============
# cpu      CPUBackend           host (numpy)     synchronous  no
# cudasim  CUDABackend (sim.)   host, as device  synchronous  no
# cuda     CUDABackend          GPU memory       CUDA streams yes
# ======== ==================== ================ ============ =============
backend = default_backend()
caps = {"unified_memory": backend.unified_memory(), "device_capability": backend.device_capability(),
        "supports_aux_stream": backend.supports_aux_stream(),
        "supports_graph_capture": backend.supports_graph_capture()}
lesson.say(f"backend {backend.name} on {backend.device}: " + ", ".join(f"{k}={v}" for k, v in caps.items()))
lesson.check(caps["supports_graph_capture"] == (target == "cuda"), "graph capture exactly on a real GPU")

# %%
# Which GPU each rank uses
# ------------------------
#
# On a machine with several GPUs, ``mpiexec -n N`` should not pile every rank onto GPU 0.
# Each rank takes the GPU of its *node-local rank* -- its place among the ranks on this
# machine, which the launcher tells every process (``MPI_LOCALRANKID`` under MPICH) --
# modulo the number of GPUs, so ranks share GPUs evenly when there are more ranks than GPUs
# (two ranks on one GPU, as here and on a laptop, both use device 0).  ``VTNUMBA_DEVICE=K``
# puts every rank on GPU ``K``.  Only the ``cuda`` target asks; the simulator has one device.
#
# .. vt-source:: vtnumba.device_rule.choose_cuda_device
from vtnumba import default_device  # noqa: E402
from vtnumba.backend.device_choice import process_cuda_device  # noqa: E402
from vtnumba.device_rule import choose_cuda_device, node_local_rank  # noqa: E402

local = node_local_rank()
lesson.say(f"node-local rank {local[0] if local else None} (from {local[1] if local else 'no launcher'}); "
           f"this rank's CUDA device: cuda:{process_cuda_device().index} ({process_cuda_device().reason}); "
           f"default device {default_device()}")
lesson.say("on a machine with 4 GPUs, node-local ranks 0..5 would take devices "
           f"{[choose_cuda_device(4, {'MPI_LOCALRANKID': str(r)}).index for r in range(6)]}")
lesson.check(backend.device == default_device(), "the default backend runs on the default device")

# %%
# Arrays
# ------
#
# ``backend.alloc`` returns a Buffer; ``buffer.view(dtype, shape)`` is the
# array a kernel takes: a numpy array on ``cpu`` (the host reference runs on it), the
# simulator's ``FakeCUDAArray`` on ``cudasim`` (host memory the simulated kernels use
# without copying), a numba ``DeviceNDArray`` on ``cuda``.  Host data gets there with
# ``backend.copy`` on a queue, in queue order.
rng = np.random.default_rng(100 + rank)
ROWS, H, EPS = 6, 96, 1e-6
y = rng.standard_normal((ROWS, H), dtype=np.float32)
res = rng.standard_normal((ROWS, H), dtype=np.float32)
w = rng.standard_normal(H, dtype=np.float32)
wm = rng.standard_normal((8, H), dtype=np.float32)
q = backend.create_queue("lesson10")
host_arrays = {"y": y, "res": res, "w": w, "wm": wm}
bufs = {name: backend.alloc(arr.nbytes) for name, arr in host_arrays.items()}
for name, arr in host_arrays.items():
    backend.copy(q, bufs[name], arr, arr.nbytes)
dy, dres, dw, dwm = (bufs[name].view(np.float32, arr.shape) for name, arr in host_arrays.items())
back = np.empty_like(y)
backend.copy(q, back, bufs["y"], y.nbytes)
backend.synchronize(q)
lesson.say(f"buffer.view(...) on {target}: {type(dy).__module__}.{type(dy).__name__}")
lesson.check(np.array_equal(back, y), "host -> buffer -> host round trip is exact")

# %%
# One call, two places
# --------------------
#
# ``fused_add_rms_norm`` on numpy arrays runs the host reference; on the buffer views it
# runs wherever they live -- the CUDA kernel on ``cudasim`` and ``cuda``, the host reference
# again on ``cpu``.  Both must give the float64 answer.  A small projection too:
# ``linear(x [6, 96], w [8, 96])`` -- BLAS on the host, the default ladder rung on a
# device.  Each queued call is made three times and traced.  A first call may load the
# kernel from numba's cache or compile it (on a GPU: hundreds of milliseconds); when a
# first call takes far longer than the later ones, the timeline hatches it and labels it
# "1st call" -- a one-time cost, not the kernel's.  (Here the host calls just above have
# already loaded the cpu kernels.)  On a GPU the traced span of a kernel is its device
# time, measured with events around the launch:
#
# .. vt-source:: vtnumba.backend.cuda.CUDABackend._submit
z64 = y.astype(np.float64) + res
truth = z64 / np.sqrt((z64 ** 2).mean(-1, keepdims=True) + EPS) * w
host_out, _ = fused_add_rms_norm(y, res, w, EPS)
lin_host = linear(y, wm)
dev_host = np.empty_like(y)
lin_back = np.empty_like(lin_host)
with lesson.timeline("queue.png", f"What the lesson's queue ran on the {target} target (both ranks): "
                     "three calls each of fused_add_rms_norm and linear, the copies out.  A hatched bar is a first "
                     "call that took far longer than the later ones: loading or compiling the kernel.",
                     title=f"10: one queue on the {target} target", labels=True):
    for _ in range(3):
        dev_out, _ = fused_add_rms_norm(dy, dres, dw, EPS, queue=q)
        lin_dev = linear(dy, dwm, queue=q)
    backend.copy(q, dev_host, dev_out, dev_host.nbytes)
    backend.copy(q, lin_back, lin_dev, lin_back.nbytes)
    backend.synchronize(q)
lin_truth = y.astype(np.float64) @ wm.T.astype(np.float64)
where = "host reference (both)" if target == "cpu" else "host reference vs CUDA kernel"
lesson.say(f"fused add + RMSNorm, {where}: max |host - float64| {np.max(np.abs(host_out - truth)):.1e}, "
           f"max |target - host| {np.max(np.abs(dev_host - host_out)):.1e}")
lesson.say(f"linear, {where}: max |host - float64| {np.max(np.abs(lin_host - lin_truth)):.1e}, "
           f"max |target - host| {np.max(np.abs(lin_back - lin_host)):.1e}")
lesson.check(np.max(np.abs(dev_host - truth)) < 1e-5 and np.max(np.abs(host_out - truth)) < 1e-5,
             "fused add + RMSNorm: the same answer on the host and on the target")
lesson.check(np.max(np.abs(lin_back - lin_truth)) < 1e-4 and np.max(np.abs(lin_host - lin_truth)) < 1e-4,
             "linear: the same answer on the host and on the target")

# %%
# Peer memory
# -----------
#
# The same ``PeerBuffers`` call maps every rank's buffer into every
# rank; underneath it is anonymous shared memory (memfd) on ``cpu`` and ``cudasim`` and CUDA IPC
# (``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``) on ``cuda``.  ``try_create`` returns
# None on *every* rank when peer memory is impossible (ranks on different nodes), so all
# fall back to MPI together.
from vtnumba.dist import PeerBuffers, destroy_distributed, init_distributed  # noqa: E402

group = init_distributed()
pb = PeerBuffers.try_create(4096, group)
kind = pb.kind if pb is not None else None
lesson.say(f"peer buffers on {target}: transport {kind!r}")
lesson.check(kind == {"cpu": "shm", "cudasim": "shm-sim", "cuda": "cuda_ipc"}[target],
             "the transport matches the target")
if pb is not None:
    pb.close()
destroy_distributed()

# %%
# Graph capture (cuda only)
# -------------------------
#
# Each kernel launch from Python costs microseconds of
# host time; a decoder step is hundreds of small launches.  A CUDA graph records the
# launches made on a queue between ``begin_capture`` and ``end_capture_graph`` -- nothing
# runs while capturing, so there is nothing to wait for: ``synchronize`` refuses a capturing
# queue (in the driver it would break the capture), and ``destroy_queue`` or ``close`` end an
# open capture and drop its graph -- and ``replay_graph`` submits them all with one call,
# reading and writing the *same addresses* each time.  Rules: warm every kernel up first (a first-call
# compilation inside capture would synchronize, which capture forbids), and no host
# arrays inside the captured region.  Here: a residual stream updated in place by LAYERS
# fused add + RMSNorm launches, captured once and replayed twice, checked against the
# same 2 x LAYERS calls on the host.  Elsewhere ``begin_capture`` refuses with a clear error.
# The backend's part is three driver calls:
#
# .. vt-source:: vtnumba.backend.cuda.CUDABackend._begin_capture
#
# .. vt-source:: vtnumba.backend.cuda.CUDABackend._end_capture
#
# .. vt-source:: vtnumba.backend.cuda.CUDABackend._replay
LAYERS = 20
if backend.supports_graph_capture():
    stream_dev = bufs["res"].view(np.float32, res.shape)          # the residual stream, in place
    out_buf = backend.alloc(y.nbytes)
    out_dev = out_buf.view(np.float32, y.shape)
    backend.copy(q, stream_dev, res, res.nbytes)

    def layer():
        fused_add_rms_norm(dy, stream_dev, dw, EPS, out=out_dev, new_residual=stream_dev, queue=q)

    layer()                                  # warm up (compiles), then reset the stream
    backend.copy(q, stream_dev, res, res.nbytes)
    backend.synchronize(q)
    backend.begin_capture(q)
    for _ in range(LAYERS):
        layer()
    graph = backend.end_capture_graph(q)
    for _ in range(2):
        backend.replay_graph(q, graph)
    got_stream, got_out = np.empty_like(res), np.empty_like(y)
    backend.copy(q, got_stream, stream_dev, res.nbytes)
    backend.copy(q, got_out, out_dev, y.nbytes)
    backend.synchronize(q)
    h_stream, h_out = res.copy(), np.empty_like(y)
    for _ in range(2 * LAYERS):
        fused_add_rms_norm(y, h_stream, w, EPS, out=h_out, new_residual=h_stream)
    err = max(np.max(np.abs(got_stream - h_stream)) / np.max(np.abs(h_stream)), np.max(np.abs(got_out - h_out)))
    lesson.say(f"captured {LAYERS} launches, replayed twice: max error vs {2 * LAYERS} host calls {err:.1e}")
    lesson.check(err < 1e-4, "graph replay == the same launches on the host")

    # What a launch costs: LAYERS eager launches vs one replay of the same LAYERS.
    e0, e1, e2 = backend.create_event(), backend.create_event(), backend.create_event()
    backend.record_event(e0, q)
    for _ in range(LAYERS):
        layer()
    backend.record_event(e1, q)
    backend.replay_graph(q, graph)
    backend.record_event(e2, q)
    backend.synchronize_event(e2)
    lesson.say(f"{LAYERS} small launches: eager {backend.elapsed_ms(e0, e1) * 1e3 / LAYERS:.1f} us each, "
               f"from a graph {backend.elapsed_ms(e1, e2) * 1e3 / LAYERS:.1f} us each")
    backend.destroy_graph(graph)
    backend.free(out_buf)
else:
    try:
        backend.begin_capture(q)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    lesson.say(f"begin_capture on {target} -> RuntimeError: {refused}")
    lesson.check("does not support graph capture" in refused, "capture is refused with a clear error off-GPU")
for buf in bufs.values():
    backend.free(buf)
backend.destroy_queue(q)

# %%
# What to expect, and the GPU check
# ---------------------------------
#
# On a GPU the same tutorials print different
# numbers: the matmul ladder (tutorial 04) climbs from the naive kernel to the register
# tiles by several times, the fused norm (tutorial 05) runs near the device-copy
# bandwidth, and peer-buffer collectives (tutorial 07) move data over NVLink or PCIe.
# ``vtnumba bench all`` measures all of it, with ratios against the stock baselines.
#
# ``bash scripts/gpu_check.sh`` does the whole check on a GPU machine in one call: it
# makes a virtual environment from the machine's Python, installs the wheels that
# ``bash scripts/gpu_wheels.sh`` downloaded into ``.whl/`` (for machines without network;
# ``.whl/`` is git-ignored, so whatever copies the tree there must take it along),
# prints ``vtnumba info``, runs the quick benchmarks at the sizes of the project's GPU aims
# (and judges each aim in its summary), the TPSP model, the MPI tests with two ranks
# sharing the one GPU (CUDA IPC between two processes), and every test file on the
# ``cuda`` target in its own process (a kernel's illegal memory access kills its process's
# CUDA context, not the others'), and writes at most eight files under ``$OUT`` (or
# ``gpu-results/``), ``0-summary.txt`` first.  Without a GPU it says so and exits 0 --
# which this lesson runs, when there is no GPU, to show that first step.
if rank == 0:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "VTNUMBA_TARGET")}
    probe = subprocess.run([sys.executable, "-c", "from vtnumba.target import gpu_usable; print(*gpu_usable())"],
                           env=env, capture_output=True, text=True, timeout=60, check=False)
    has_gpu = probe.stdout.startswith("True")
    lesson.say(f"GPU probe (what target 'auto' would see): {probe.stdout.strip()}")
    if has_gpu:
        lesson.say("a GPU is here: run  bash scripts/gpu_check.sh  (a few minutes; results in gpu-results/)")
        dry_ok = True
    else:
        script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
        with tempfile.TemporaryDirectory() as out_dir:
            run = subprocess.run(["bash", str(script)], env=dict(env, OUT=out_dir, PYTHON=sys.executable),
                                 capture_output=True, text=True, timeout=120, check=False)
            summary_file = Path(out_dir) / "0-summary.txt"
            summary = summary_file.read_text().strip() if summary_file.exists() else ""
        first = summary.splitlines()[0] if summary else "(no summary)"
        lesson.say(f"bash scripts/gpu_check.sh -> exit {run.returncode}: {first}")
        dry_ok = run.returncode == 0 and summary.startswith("no GPU")
else:
    dry_ok = True
lesson.check(dry_ok, "the GPU check knows whether it has a GPU (a dry run exits 0 without one)")
lesson.say("done")

# %%
# Expected output
# ---------------
#
# * On ``cpu``: ``CPUBackend``, ``supports_graph_capture=False``, ``buffer.view`` gives a
#   ``numpy.ndarray``, transport ``'shm'``, ``begin_capture`` refused with a clear error, and
#   ``bash scripts/gpu_check.sh -> exit 0: no GPU ...`` (a dry run).
# * The timeline: one row per rank for the queue ``lesson10``: three ``fused_add_rms_norm``
#   and three ``linear`` calls, then the two copies out (the copies in ran before it); a first call that
#   took far longer than the other two is hatched ("1st call").
# * On ``cudasim``: a ``FakeCUDAArray``, transport ``'shm-sim'``, the same answers.  On
#   ``cuda``: a ``DeviceNDArray``, ``'cuda_ipc'``, and a graph replay much cheaper per
#   launch than eager launches.
#
# Common issues
# -------------
#
# * ``--target cuda`` on a machine without a usable GPU is refused before anything runs, as a
#   usage error (status 2, said once by rank 0): ``--target=cuda, but this process finds no
#   usable CUDA GPU (no CUDA driver (libcuda) found); use --target cpu or cudasim``.  From
#   Python, ``select_target("cuda")`` is accepted and making the backend fails instead:
#   ``RuntimeError: CUDABackend: no usable CUDA GPU (use VTNUMBA_TARGET=cpu or cudasim)``.
#   ``vtnumba info`` (or ``--target auto``) tells you what the process can see;
#   ``vtnumba --target cuda info`` prints its ``gpu`` line and an ``error`` line and exits 1.
# * ``NUMBA_ENABLE_CUDASIM=1`` left in the environment turns ``numba.cuda`` into the
#   simulator for the whole process: ``auto`` then never finds the GPU.
# * numba's IPC pickling is broken with cuda-bindings 13.5 (an ``AttributeError`` about
#   ``reserved``); vtnumba sends the raw 64 handle bytes instead.
# * Inside a graph capture: no first-call compilation and no host arrays -- each makes
#   ``cuStreamEndCapture`` fail (vtnumba refuses a host copy, and a ``synchronize`` of the
#   capturing queue, at once with a RuntimeError).  Warm up, use device buffers, capture again.
# * Several ranks on one GPU share it: per-rank timings are lower than one process's.
#
# Try next
# --------
#
# 1. Run this lesson with ``--target cudasim`` and compare the timeline with the cpu one:
#    the same calls, now simulated kernels -- slow, because every CUDA thread is a Python
#    thread, and meaningless as GPU times.
# 2. On a GPU, raise ``LAYERS`` to 200 and watch the eager and graph times per launch: at
#    which launch count does the graph's one-time capture pay for itself?
