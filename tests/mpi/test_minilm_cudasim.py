"""MiniLM computed on the device target, with TPSP's CUDA backend: one short sentence, the first layer.

The device target is numba's simulator, or the GPU under ``VTNUMBA_TARGET=cuda`` (the
``device_backend`` fixture of tests/conftest.py).  The encoder computes on that backend: the
embedding rows are gathered on the host and uploaded once, and from there on every array --
Q/K/V, attention, both fused TPSP calls, bias + GELU -- is a device array; the hidden state
is downloaded once, at the end.  The test checks exactly that (every array handed to the
row-parallel finish is a device array; one download per forward) and compares the result
with the host model's regular forward on the same layer.

The simulator runs ~7,000 GPU threads per second, so this runs the first layer on the
shortest input there is, ``[CLS] [SEP]`` (T = 2; with 3 ranks one rank's token shard is all
padding).  It needs the real checkpoint (see tests/minilm_weights.py).
"""

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
MPI = pytest.importorskip("mpi4py.MPI")

from minilm_weights import minilm_dir  # noqa: E402
from vtnumba.backend import CPUBackend  # noqa: E402
from vtnumba.backend.arrays import is_device_array  # noqa: E402
from vtnumba.dist import destroy_distributed, init_distributed  # noqa: E402
from vtnumba.models import MiniLMEncoder, load_minilm_weights  # noqa: E402
from vtnumba.models.minilm_batch import pack_batch  # noqa: E402
from vtnumba.tpsp import CudaTPSPBackend, TPSPOp, TPSPOpsGroup, profile_tpsp  # noqa: E402

LAYERS = 1


@pytest.mark.mpi(min_size=2)
def test_minilm_layer_on_the_device_with_cuda_tpsp_matches_the_host_forward(device_backend):
    comm = MPI.COMM_WORLD
    if 12 % comm.Get_size():
        pytest.skip("the world size must divide MiniLM's 12 heads")
    weights = load_minilm_weights(minilm_dir())
    group = init_distributed()
    backend = CudaTPSPBackend(group.name, backend=device_backend)
    try:
        host = MiniLMEncoder(group, weights=weights, backend=CPUBackend())
        batch = pack_batch([np.asarray([host.tokenizer.cls_id, host.tokenizer.sep_id], dtype=np.int64)])
        expected = host.model.forward(batch, num_layers=LAYERS)  # host regular forward

        enc = MiniLMEncoder(group, weights=weights, backend=device_backend)
        # Only the first layer's two projections run: open just those (the parity check is
        # this test itself, so the profile's own is skipped -- it would double the runtime).
        groups = [TPSPOpsGroup(n, p, nm) for n, p, nm in enc.model.row_parallel_projections()][:2 * LAYERS]
        ctx = profile_tpsp(backend, groups, max_batched_tokens=16, parity_check=False)
        assert ctx is not None, "TPSP declined on the device"
        ops = {g.name: TPSPOp(ctx, g.name, norm="layer", group=group) for g in groups}
        enc.use_tpsp(ops)

        on_device, downloads = [], []
        tpsp = enc.model.reduce_norm

        def watched(x, w, bias, residual, lw, lb, eps, **lent):
            on_device.append(all(is_device_array(a) for a in (x, w, bias, residual, lw, lb, lent["out"],
                                                              lent["buffers"].residual_shard)))
            return tpsp(x, w, bias, residual, lw, lb, eps, **lent)

        def counted_to_host(arr, _real=device_backend.to_host):
            downloads.append(tuple(arr.shape))
            return _real(arr)

        enc.model.set_reduce_norm(watched)
        device_backend.to_host = counted_to_host
        got = enc.model.forward(batch, num_layers=LAYERS)
        del device_backend.to_host
        fused = sum(op.fused_calls for op in ops.values())
        err = float(np.abs(got - expected).max())
        ok = err <= 1e-5 and fused == 2 * LAYERS and on_device == [True] * (2 * LAYERS) and len(downloads) == 1
        ok = comm.allreduce(bool(ok), op=MPI.LAND)
        assert ok, (f"rank {group.rank}: max abs error {err:.2e}, fused calls {fused}, device arrays {on_device}, "
                    f"downloads {downloads}")
    finally:
        backend.close()
        destroy_distributed()
