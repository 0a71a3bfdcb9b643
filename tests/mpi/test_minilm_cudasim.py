"""MiniLM with TPSP's CUDA backend on the device target: one short sentence, a slice of layers.

The device target is numba's simulator, or the GPU under ``VTNUMBA_TARGET=cuda`` (the
``device_backend`` fixture of tests/conftest.py).  The simulator runs ~7,000 GPU threads per
second, so this runs the first layer (two fused TPSP calls: attention output and output
projection) on a 6-token sentence and compares them with the host model's regular forward
on the same layers.  It needs the real checkpoint (see tests/minilm_weights.py).
"""

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
MPI = pytest.importorskip("mpi4py.MPI")

from minilm_weights import minilm_dir  # noqa: E402
from vtnumba.dist import destroy_distributed, init_distributed  # noqa: E402
from vtnumba.models import MiniLMEncoder, TPSPReduceNorm, load_minilm_weights  # noqa: E402
from vtnumba.models.minilm_batch import pack_batch  # noqa: E402
from vtnumba.tpsp import CudaTPSPBackend, TPSPOp, TPSPOpsGroup, profile_tpsp  # noqa: E402

LAYERS = 1


@pytest.mark.mpi(min_size=2)
def test_minilm_layers_with_cuda_tpsp_match_the_regular_forward(device_backend):
    comm = MPI.COMM_WORLD
    if 12 % comm.Get_size():
        pytest.skip("the world size must divide MiniLM's 12 heads")
    weights = load_minilm_weights(minilm_dir())
    group = init_distributed()
    backend = CudaTPSPBackend(group.name, backend=device_backend)
    try:
        enc = MiniLMEncoder(group, weights=weights)
        ids = enc.tokenize(["A cat sat down."])
        batch = pack_batch(ids)
        expected = enc.model.forward(batch, num_layers=LAYERS).copy()  # host regular forward

        # Only the first layer's two projections run: open just those (the parity check is
        # this test itself, so the profile's own is skipped -- it would double the runtime).
        groups = [TPSPOpsGroup(n, p, nm) for n, p, nm in enc.model.row_parallel_projections()][:2 * LAYERS]
        ctx = profile_tpsp(backend, groups, max_batched_tokens=16, parity_check=False)
        assert ctx is not None, "TPSP declined on the device"
        ops = {g.name: TPSPOp(ctx, g.name, norm="layer", group=group) for g in groups}
        enc.model.set_reduce_norm(TPSPReduceNorm(ops, group.rank, group.size, device=True))
        got = enc.model.forward(batch, num_layers=LAYERS)
        fused = sum(op.fused_calls for op in ops.values())
        err = float(np.abs(got - expected).max())
        ok = comm.allreduce(bool(err <= 1e-5 and fused == 2 * LAYERS), op=MPI.LAND)
        assert ok, f"rank {group.rank}: max abs error {err:.2e}, fused calls {fused}"
    finally:
        backend.close()
        destroy_distributed()
