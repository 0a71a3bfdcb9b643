"""TPSP: the fused tensor-parallel + sequence-parallel projection (vLLM: ``vllm/platforms/tpsp_cuda.py``).

One row-parallel projection and the norm after it, fused into a single collective op::

    partial  = x @ W.T                            # [T, H], this rank's share of the K sum
    y        = reduce_scatter over token rows     # rank r keeps rows r*R .. r*R+R-1
    z        = y + bias + residual_shard          # the new (sharded) residual
    normed   = RMSNorm(z) or LayerNorm(z)
    gathered = all_gather(normed)[:T]             # [T, H] on every rank

over peer memory, in double-buffered microchunks.  Reading order:

* :mod:`~vtnumba.tpsp.config`     -- TPSPConfig, TPSPProfile, TPSPOpsGroup, TPSPContext;
* :mod:`~vtnumba.tpsp.norm_type`  -- get_tpsp_norm_type;
* :mod:`~vtnumba.tpsp.sharding`   -- shard_residual and the token-row ownership rule;
* :mod:`~vtnumba.tpsp.regular`    -- the regular (unfused) forward: fallback and reference;
* :mod:`~vtnumba.tpsp.workspace`  -- the P2P workspace: slots, push/pull, flags;
* :mod:`~vtnumba.tpsp.pipeline`   -- the fused op, chunk by chunk;
* :mod:`~vtnumba.tpsp.backend`    -- the abstract TPSPBackend lifecycle;
* :mod:`~vtnumba.tpsp.peer_backend`, :mod:`~vtnumba.tpsp.host`, :mod:`~vtnumba.tpsp.cuda` --
  the checks, and the host (cpu) and CUDA (GPU / simulator) backends;
* :mod:`~vtnumba.tpsp.profiling`  -- static and measured profiles, the parity check;
* :mod:`~vtnumba.tpsp.op`         -- TPSPOp: fused or regular per call, one signature.
"""

from vtnumba.tpsp.backend import TPSPBackend
from vtnumba.tpsp.config import TPSPConfig, TPSPContext, TPSPOpsGroup, TPSPProfile
from vtnumba.tpsp.cuda import CudaTPSPBackend
from vtnumba.tpsp.host import HostTPSPBackend
from vtnumba.tpsp.norm_type import get_tpsp_norm_type
from vtnumba.tpsp.op import TPSPOp
from vtnumba.tpsp.peer_backend import PeerTPSPBackend, PreparedWeights, TPSPHandle
from vtnumba.tpsp.pipeline import TPSPShapeMismatch
from vtnumba.tpsp.profiling import ProfileReport, TPSPDisabledWarning, profile_tpsp
from vtnumba.tpsp.regular import regular_matmul_ar_norm, regular_matmul_rs_norm_ag
from vtnumba.tpsp.select import get_tpsp_backend
from vtnumba.tpsp.sharding import shard_residual, shard_rows, token_range, unshard_residual
from vtnumba.tpsp.workspace import EXCHANGE_MODES, TPSPWorkspace

__all__ = [
    "TPSPBackend", "TPSPConfig", "TPSPContext", "TPSPOpsGroup", "TPSPProfile", "CudaTPSPBackend",
    "HostTPSPBackend", "PeerTPSPBackend", "TPSPHandle", "PreparedWeights", "get_tpsp_norm_type", "TPSPOp",
    "TPSPShapeMismatch", "ProfileReport", "TPSPDisabledWarning", "profile_tpsp", "regular_matmul_rs_norm_ag",
    "regular_matmul_ar_norm", "get_tpsp_backend", "shard_residual", "shard_rows", "token_range",
    "unshard_residual", "EXCHANGE_MODES", "TPSPWorkspace",
]
