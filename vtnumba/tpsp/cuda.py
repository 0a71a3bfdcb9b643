"""``CudaTPSPBackend``: TPSP with CUDA kernels on device arrays -- a real GPU, or numba's simulator.

Upstream: vLLM's ``CudaTPSPBackend`` (``vllm/platforms/tpsp_cuda.py``).  The pipeline is
:mod:`vtnumba.tpsp.pipeline` with:

* device arrays everywhere (numba ``DeviceNDArray`` on a GPU, ``FakeCUDAArray`` in the
  simulator -- zero-copy views, so a peer's writes are seen);
* the ``@cuda.jit`` kernels of :mod:`vtnumba.kernels` (register-tiled matmul whose
  output rows go to the destinations' inbox slots, the fused peer reduce + norm, the
  gather copy), launched on two streams: *compute* for the matmuls and *exchange* for the
  reduce/gather, so chunk i+1's matmul can run while chunk i is exchanged;
* peer memory through CUDA IPC handles on a GPU, anonymous shared memory (memfd) in the simulator
  (:class:`vtnumba.dist.PeerBuffers` picks the transport);
* ``exchange="push"`` by default: remote writes from the matmul epilogue, as vLLM's
  design does over NVLink.

``TPSPConfig.sm_count_target`` is honoured here: the reduce + norm and gather kernels run on
at most that many thread blocks (each block walks several rows), so at most that many SMs
are busy with the exchange and the rest run the next chunk's matmul.  On a real GPU the
default is an eighth of the SMs (at least 8); the measured profile (``profile(search=True)``)
then picks the microchunk and the token threshold with that budget.

The flags are raised and awaited *by the streams* (:class:`vtnumba.dist.QueueFlags`:
``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` on flag words in the IPC workspace), so
between two chunks no host thread is involved: the host queues every step of the call,
then waits for the streams with a deadline that also watches for peers that fail.  In the
simulator, launches and waits run synchronously on the host, in the same order.
"""

from __future__ import annotations

import numpy as np

from vtnumba.backend.arrays import cdiv
from vtnumba.backend.device import Device, DeviceType
from vtnumba.dist.comm import DEFAULT
from vtnumba.kernels.matmul import queue_linear_rows_to
from vtnumba.tpsp.config import TPSPConfig
from vtnumba.tpsp.peer_backend import PeerTPSPBackend
from vtnumba.tpsp.pipeline import ChunkStrategy


class DeviceChunkStrategy(ChunkStrategy):
    """A chunk's partial sums on the GPU: the matmul kernel's epilogue writes each destination.

    ``linear_rows_to`` launches one matmul per destination over that destination's row range,
    writing straight into the destination's inbox slot (push: a peer's IPC-mapped memory) or
    this rank's outbox (pull); with one chunk and push, a single queue operation covers all
    destinations.  The exchange's kernels (reduce + norm, gathers) run on at most
    ``sm_count_target`` blocks, each walking several rows, so the rest of the GPU stays free
    for the next chunk's matmul on the compute stream.
    """

    def exchange_max_blocks(self, call) -> int | None:
        """The SM budget of the exchange (``TPSPConfig.sm_count_target``; None: unbounded)."""
        return call.sm_limit

    def begin(self, pipe) -> None:
        # The queues are non-blocking streams: order the compute queue after work the caller
        # queued on the default stream (which produced x, say) before reading any input.
        pipe.backend.order_after_default_stream(pipe.compute_q)

    def compute(self, pipe, i: int, s: int) -> None:
        call, tp, me, R, H, q = pipe.call, pipe.tp, pipe.me, pipe.R, pipe.H, pipe.compute_q
        x, w, kind = call.x, call.w, pipe.kind
        # (Queued as checked, like the exchange's kernels: see ChunkPipeline.)
        if pipe.n == 1 and pipe.push:  # one queue op, one launch per destination's inbox
            queue_linear_rows_to(kind, x, w, None, [pipe.partial_slot(me, d, s) for d in range(tp)], R, q)
        elif pipe.n == 1:  # pull, one chunk: my outbox xfer[me][s] *is* [tp*R, H] in token order
            queue_linear_rows_to(kind, x, w, None, [pipe.xfer[me][s].reshape(tp * R, H)], tp * R, q)
        else:
            r0, rows = pipe.chunk_rows(i)
            for d in range(tp):
                t0, v = pipe.valid_rows(d, r0, rows)
                queue_linear_rows_to(kind, x[t0:t0 + v], w, None, [pipe.partial_slot(me, d, s)[:rows]], rows, q)


class CudaTPSPBackend(PeerTPSPBackend):
    """TPSP for numba device arrays (the ``cuda`` and ``cudasim`` targets)."""

    default_exchange = "push"
    tpsp_chunk_granularity = 64

    def __init__(self, group_name: str = "tp", device=None, *, backend=None, exchange: str | None = None,
                 timeout_s: float = DEFAULT) -> None:
        if device is None:
            from vtnumba.backend.default import default_cuda_device

            device = default_cuda_device()
        if not isinstance(device, Device) or device.type is not DeviceType.CUDA:
            raise ValueError(f"device={device!r} must be a CUDA Device for CudaTPSPBackend")
        if backend is not None and backend.device_type is not DeviceType.CUDA:
            raise ValueError(f"backend={backend.name} is not a CUDA backend")
        super().__init__(group_name, device, exchange=exchange, timeout_s=timeout_s)
        self._own_backend = backend is None  # made here: closed by close(), with its streams
        if backend is None:
            from vtnumba.backend.cuda import CUDABackend

            backend = CUDABackend(device)
        self._backend = backend

    @property
    def data_backend(self):
        return self._backend

    @property
    def simulator(self) -> bool:
        """True when the kernels run in numba's CUDA simulator (``cudasim``), not on a GPU."""
        return self._backend.capabilities.simulator

    def _check_array_kind(self, arrays: dict) -> None:
        from vtnumba.backend.cuda import is_device_array

        for name, arr in arrays.items():
            if arr is not None and not is_device_array(arr):
                raise TypeError(f"{name} is a {type(arr).__module__}.{type(arr).__name__}; CudaTPSPBackend takes "
                                "numba device arrays (copy with cuda.to_device, or use HostTPSPBackend for numpy)")

    def _to_target(self, host: np.ndarray):
        from numba import cuda

        return cuda.to_device(host)

    def _empty(self, shape):
        from numba import cuda

        return cuda.device_array(shape, dtype=np.float32)

    def chunk_strategy(self, handle) -> DeviceChunkStrategy:
        return DeviceChunkStrategy()

    def default_config(self, handle) -> TPSPConfig:
        """Four microchunks of at least one granule each (overlap needs several chunks), and on a
        real GPU an exchange bounded to an eighth of the SMs (at least 8), so the next chunk's
        matmul keeps most of the GPU while this chunk is exchanged."""
        rows = handle.max_chunk_rows
        chunk = max(self.tpsp_chunk_granularity, cdiv(rows, 4))
        sms = self.sm_count()
        return TPSPConfig(min(rows, chunk), sm_count_target=None if sms is None else min(sms, max(8, sms // 8)))

    def sm_count(self) -> int | None:
        """The device's streaming-multiprocessor count (None in the simulator)."""
        if self.simulator:
            return None
        from vtnumba.backend.cuda import current_context

        return int(current_context().device.MULTIPROCESSOR_COUNT)

    def close(self, handle=None) -> None:
        super().close(handle)
        if handle is None and self._own_backend:
            # Its streams (kept idle for reuse) and the flag side queue go with it: a process
            # that made many TPSP backends would otherwise pile up streams, and streams beyond
            # the hardware queues share them (a stream held by a flag wait holds up its sharer).
            self._backend.close()

    def _check_sm_count(self, sm_count_target: int) -> None:
        total = self.sm_count()
        if total is not None and sm_count_target > total:
            raise ValueError(f"sm_count_target={sm_count_target} exceeds the device's {total} SMs")


__all__ = ["CudaTPSPBackend"]
