"""Flag kernels: ``write_value32`` / ``wait_value32`` written as one-thread CUDA kernels.

On a GPU, :meth:`~vtnumba.backend.Backend.write_value32` and
:meth:`~vtnumba.backend.Backend.wait_value32` are *stream memory operations*
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``): the stream's front end stores or
polls a 32-bit word itself, no kernel and no host thread involved.  Where a driver or device
refuses them (``CUDA_ERROR_NOT_SUPPORTED``), these two kernels do the same job, and they
are also the readable definition of what the memory operations do:

* :func:`write_flag_kernel` -- ``threadfence_system()`` (every earlier write of the stream,
  which has finished because a kernel only starts after its predecessors on the stream,
  becomes visible to every device and process first), then store the value -- on a GPU
  with an atomic exchange: the PTX memory model makes "fence, then write" a *release* only
  when the write is strong (an atomic), and a plain store racing with the waiter's atomic
  polls would be a data race, however well it happens to work;
* :func:`wait_flag_kernel` -- poll the word until it reaches the value, in CUDA's cyclic
  ``>=``, then fence so later reads of the stream are not satisfied early.  On a GPU each
  poll is an atomic add of 0 -- a read done at the L2 cache, where every processor's
  writes meet: the SM's L1 is not kept coherent with other processors' writes, so a plain
  load could keep answering from a stale line and never see the peer's store.  (Not
  :func:`numba.cuda.ldcv`: its inline assembly is not marked as reading memory, and the
  compiler hoists it out of the loop -- checked in the PTX.)

Each word has exactly one writer, so nothing here needs a read-modify-write for its own sake
(the exchange's old value is discarded, and with one writer no update can be lost), and in
the simulator both are plain loads and stores.  That matters twice: an atomic used only to
*read* (``atomic.max(f, i, 0)``) writes the old
value back, which in numba's simulator (whose atomics are Python code under a per-process
lock) can overwrite a peer's store that landed in between, losing the flag; and a plain load
alone in a loop is hoisted out of it by the compiler -- the ``threadfence()`` in the loop
body is what makes the load happen again every iteration (verified in the PTX).  That is
why the atomics are for the GPU only: the simulator, which has no caches, polls with a
plain load and writes with a plain store.

A waiting kernel occupies one thread of one SM until the flag arrives, and cannot time out:
the host that synchronizes its stream keeps the wait's deadline
(:meth:`vtnumba.backend.cuda.CUDABackend.synchronize`) and watches for peers that fail
(:mod:`vtnumba.dist.queue_flags`).  Host twins: :func:`vtnumba.backend.atomics.store_release`
and :func:`vtnumba.backend.cpu.wait_flag_word`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int64, uint32

from vtnumba.backend.arrays import simulator_active

if simulator_active():
    @cuda.jit(device=True)
    def _poll_word(flags, index):
        return flags[index]

    @cuda.jit(device=True)
    def _publish_word(flags, index, value):
        flags[index] = value
else:
    @cuda.jit(device=True)
    def _poll_word(flags, index):
        return cuda.atomic.add(flags, index, uint32(0))  # read at L2, past the (incoherent) L1

    @cuda.jit(device=True)
    def _publish_word(flags, index, value):
        # An atomic, not a plain store: in the PTX memory model a fence followed by a *strong*
        # write is a release, while a plain (weak) store racing with the waiter's polls is a
        # data race, whatever the fence before it.
        cuda.atomic.exch(flags, index, value)


@cuda.jit
def write_flag_kernel(flags, index, value):
    """``flags[index] = value`` after a system-wide fence."""
    if cuda.grid(1) == 0:
        cuda.threadfence_system()  # everything this stream wrote before is visible first
        _publish_word(flags, index, value)


@cuda.jit
def wait_flag_kernel(flags, index, value):
    """Return once ``(int32)(flags[index] - value) >= 0``; one thread polls."""
    if cuda.grid(1) == 0:
        while True:
            seen = _poll_word(flags, index)
            if ((int64(seen) - int64(value)) & 0xFFFFFFFF) < 0x80000000:  # cyclic >= of 32-bit words
                break
            cuda.threadfence()  # forces the load above to be repeated (and orders the polls)
        cuda.threadfence_system()


def load_flag_kernels() -> None:
    """Compile and load both kernels now, on a word of their own, and wait for them.

    A kernel's first launch compiles it and loads it onto the GPU, and loading may make the
    driver wait for the whole GPU -- which, once some stream is held by a wait kernel, could
    wait for good.  So the backend calls this once, when it switches to these kernels, before
    any stream waits on one."""
    word = cuda.to_device(np.zeros(1, np.uint32))
    stream = cuda.stream()
    launch_write_flag(word, 0, 1, stream)
    launch_wait_flag(word, 0, 1, stream)  # already reached: returns at once
    stream.synchronize()


def launch_write_flag(flags, index: int, value: int, stream) -> None:
    """Queue :func:`write_flag_kernel` (one thread) on ``stream``: the fallback for ``cuStreamWriteValue32``."""
    write_flag_kernel[1, 1, stream](flags, np.int64(index), np.uint32(value))


def launch_wait_flag(flags, index: int, value: int, stream) -> None:
    """Queue :func:`wait_flag_kernel` (one thread) on ``stream``: the fallback for ``cuStreamWaitValue32``.

    Later work on ``stream`` starts only once the flag has arrived; the kernel never times out.
    """
    wait_flag_kernel[1, 1, stream](flags, np.int64(index), np.uint32(value))


PTX_SIGNATURES = [
    ("write_flag", write_flag_kernel, "void(uint32[::1], int64, uint32)"),
    ("wait_flag", wait_flag_kernel, "void(uint32[::1], int64, uint32)"),
]

__all__ = ["write_flag_kernel", "wait_flag_kernel", "load_flag_kernels", "launch_write_flag", "launch_wait_flag",
           "PTX_SIGNATURES"]
