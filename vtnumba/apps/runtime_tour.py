"""``vtnumba demo runtime``: a guided tour of the device runtime on every rank.

What it shows, step by step (each rank does the same work on its own device and rank 0
prints a summary of all of them):

1. the target and the backend serving it (registry lookup by device);
2. a pinned host buffer and a device buffer, an asynchronous H2D copy on a *copy queue*;
3. a second *compute queue* that waits for the copy through ``queue_wait_event`` -- the
   cross-queue ordering every inference engine relies on -- then runs a small kernel;
4. ``query_event`` answering False while the copy queue is held at a gate (threaded cpu
   queues and real GPUs only: on the simulator every launch is synchronous), then True;
5. an asynchronous D2H copy back and a check of every byte, with ``elapsed_ms`` timings.
"""

from __future__ import annotations

import threading

import numpy as np

from vtnumba.backend import CPUBackend, default_backend, register_backend
from vtnumba.target import current_target


def _scale_kernel_host(data: np.ndarray, factor: float) -> None:
    data *= factor


def _run_scale(backend, q, arr, factor: float) -> None:
    """Submit ``arr *= factor`` on queue ``q`` (a CUDA kernel on cuda/cudasim)."""
    if current_target().uses_cuda_kernels:
        from vtnumba.apps.runtime_tour_kernels import scale_kernel as scale

        threads = 128
        blocks = (arr.size + threads - 1) // threads
        backend.submit(q, lambda stream: scale[blocks, threads, stream](arr, factor), name="scale_kernel")
    else:
        backend.submit(q, lambda _stream: _scale_kernel_host(arr, factor), name="scale_kernel")


def run_runtime_demo(n: int | None = None) -> int:
    """``vtnumba demo runtime`` on every rank: queues, events, pinned copies, a kernel; returns the exit code.

    ``n`` is the element count of the arrays (default: small on the simulator, larger elsewhere).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    target = current_target()
    if n is None:
        # The simulator runs about 7,000 GPU threads per second: keep its tour small.
        n = 4096 if target.simulator else 1 << 20
    if target.name == "cpu":
        # Threaded queues make ordering observable: a queue really can be "not done yet".
        register_backend(CPUBackend().device, CPUBackend(threaded=True))
    backend = default_backend()

    copy_q = backend.create_queue("copy")
    compute_q = backend.create_queue("compute")
    nbytes = n * 4
    host_in = backend.alloc_pinned(nbytes)
    host_out = backend.alloc_pinned(nbytes)
    dev = backend.alloc(nbytes)
    rng = np.random.default_rng(1234 + rank)
    src = rng.standard_normal(n).astype(np.float32)
    host_in.view(np.float32)[:] = src
    host_out.view(np.uint8)[:] = 0xFF  # poison: every byte must be overwritten

    start, copied, done = (backend.create_event() for _ in range(3))
    gate = threading.Event()
    can_hold = backend.capabilities.async_queues
    # The kernel's first launch compiles and loads it -- and loading a kernel may make the
    # driver wait for the whole GPU, which would wait for the queue held below, forever.
    # So it runs once first, on nothing that is held.
    _run_scale(backend, compute_q, dev.view(np.float32), 1.0)
    backend.synchronize(compute_q)

    backend.record_event(start, copy_q)
    if can_hold:
        backend.launch_host_func(copy_q, gate.wait, name="gate")  # hold the copy queue
    backend.copy(copy_q, dev, host_in, nbytes)
    backend.record_event(copied, copy_q)
    pending_seen = backend.query_event(copied)  # False while held: the copy has not run yet
    backend.queue_wait_event(compute_q, copied)  # compute must not start before the copy lands
    _run_scale(backend, compute_q, dev.view(np.float32), 2.0)
    backend.copy(compute_q, host_out, dev, nbytes)
    backend.record_event(done, compute_q)
    gate.set()
    backend.synchronize(compute_q)
    completed_seen = backend.query_event(done)

    ok = bool(np.array_equal(host_out.view(np.float32), src * 2.0))
    h2d_ms = backend.elapsed_ms(start, copied)
    total_ms = backend.elapsed_ms(start, done)
    row = dict(rank=rank, backend=backend.name, device=str(backend.device), ok=ok,
               held=can_hold, pending_seen=pending_seen, completed_seen=completed_seen,
               h2d_ms=h2d_ms, total_ms=total_ms, mib=nbytes / 2**20)
    rows = comm.gather(row, root=0)

    for e in (start, copied, done):
        backend.destroy_event(e)
    for b in (host_in, host_out):
        backend.free_pinned(b)
    backend.free(dev)
    backend.destroy_queue(copy_q)
    backend.destroy_queue(compute_q)

    all_ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print(f"vtnumba runtime tour: target={target.name} ({target.reason}), {size} rank(s)")
        print("  each rank: pinned host -> device copy on queue 'copy', compute queue waits on the copy's "
              "event, scale kernel x2, device -> host copy, check every byte")
        print(f"  {'rank':>4} {'backend':<24} {'device':<7} {'MiB':>5} {'held?':>5} {'query while held':>16} "
              f"{'query after':>11} {'H2D ms':>8} {'total ms':>9} {'bytes ok':>8}")
        for r in rows:
            print(f"  {r['rank']:>4} {r['backend']:<24} {r['device']:<7} {r['mib']:>5.1f} {str(r['held']):>5} "
                  f"{str(r['pending_seen']):>16} {str(r['completed_seen']):>11} {r['h2d_ms']:>8.3f} "
                  f"{r['total_ms']:>9.3f} {str(r['ok']):>8}")
        print("  'query while held' is False when the queue really was still busy (threaded cpu queues, GPUs);")
        print("  the simulator and synchronous cpu queues finish work as it is submitted, so it reads True there.")
        print("RESULT:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1
