"""Kernels: the compute pieces of TPSP and the encoder cache, each a CUDA kernel with a host twin.

Every operation exists twice with one contract: a ``@cuda.jit`` kernel (run on a real GPU,
or in numba's simulator) and a host reference (numpy / ``@numba.njit``) that the ``cpu``
target runs.  The functions below dispatch on the array type -- numpy arrays run the host
reference, numba device arrays run the kernel -- and accept an optional ``queue`` to run in
queue order (see :mod:`vtnumba.kernels._common`).

* :mod:`~vtnumba.kernels.matmul` -- ``matmul``, ``linear``, ``linear_rows_to``; the CUDA
  ladder of seven rungs (``variant=``; ``matmul.LADDER`` lists them in order): naive ->
  shared-memory tiles -> register tiling -> 128-bit accesses (wide) -> warp tiles ->
  double-buffered shared tiles -> asynchronous (``cp.async``) copies, in
  :mod:`~vtnumba.kernels.matmul_cuda`;
* :mod:`~vtnumba.kernels.norm` -- fused residual add + RMSNorm / LayerNorm
  (CUDA: :mod:`~vtnumba.kernels.norm_cuda`);
* :mod:`~vtnumba.kernels.peer` -- TPSP's peer reduce fused with the norm, and the gather copy
  (CUDA: :mod:`~vtnumba.kernels.peer_cuda`);
* :mod:`~vtnumba.kernels.activation` -- ReLU / GELU (tanh and erf) / SiLU with an optional bias,
  and the bias add (CUDA: :mod:`~vtnumba.kernels.activation_cuda`);
* :mod:`~vtnumba.kernels.attention` -- multi-head self-attention over packed variable-length
  sentences (CUDA: :mod:`~vtnumba.kernels.attention_cuda`);
* ``batched_copy`` -- re-exported from :mod:`vtnumba.memory.copy_engine`, where the copy engine
  lives (its old module name ``vtnumba.kernels.batched_copy`` still works);
* :mod:`~vtnumba.kernels.ptx` -- compile every kernel to PTX (no GPU needed) and read
  ``ptxas`` resource usage.

Importing this package never imports ``numba.cuda``: the ``*_cuda`` modules load on the first
device array, and the ``@cuda.jit`` kernels themselves (``vtnumba.kernels.matmul_naive_kernel``,
``...matmul_smem_kernel``, ``...matmul_regtile_kernel``, ``...matmul_wide_kernel``, ``...matmul_warptile_kernel``,
``...matmul_dbuf_kernel``, ``...matmul_async_kernel``, ``...fused_add_norm_kernel``,
``...peer_reduce_norm_kernel``, ``...sum_sources_kernel``, ``...gather_rows_kernel``,
``...copy_rows_kernel``, ``...add_rows_kernel``, ``...accumulate_rows_kernel``,
``...activation_kernel``, ``...add_bias_kernel``, ``...attention_kernel``) are attributes loaded
on first access, for tutorials that launch one ladder step by hand.

(``vtnumba.kernels.activation`` and ``vtnumba.kernels.attention`` name the *functions*, as
``vtnumba.kernels.matmul`` does; the modules are imported by their full dotted names.)
"""

from vtnumba.kernels.activation import (
    ACTIVATIONS,
    activation,
    activation_host,
    add_bias,
    add_bias_host,
    bias_gelu_,
    fast_erf,
)
from vtnumba.kernels.attention import AttentionWorkspace, attention, attention_host
from vtnumba.kernels.matmul import (DEFAULT_VARIANT, VARIANT_ENV, VARIANTS, default_variant, linear, linear_rows_to,
                                    matmul, matmul_rows_host)
from vtnumba.kernels.norm import add_norm_rows_host, fused_add_layer_norm, fused_add_rms_norm
from vtnumba.kernels.peer import NORMS, gather_rows, gather_rows_host, peer_reduce_norm, peer_reduce_norm_rows_host
from vtnumba.memory.copy_engine import batched_copy, batched_copy_reference

__all__ = [
    "VARIANTS", "DEFAULT_VARIANT", "VARIANT_ENV", "default_variant", "matmul", "linear", "linear_rows_to",
    "matmul_rows_host",
    "fused_add_rms_norm", "fused_add_layer_norm", "add_norm_rows_host",
    "NORMS", "peer_reduce_norm", "gather_rows", "peer_reduce_norm_rows_host", "gather_rows_host",
    "batched_copy", "batched_copy_reference",
    "ACTIVATIONS", "activation", "add_bias", "bias_gelu_", "fast_erf", "activation_host", "add_bias_host",
    "attention", "attention_host", "AttentionWorkspace",
]

# Kernel objects live in modules that import numba.cuda; load them only when asked for.
_LAZY_KERNELS = {
    "matmul_naive_kernel": "matmul_cuda", "matmul_smem_kernel": "matmul_cuda",
    "matmul_regtile_kernel": "matmul_cuda", "matmul_wide_kernel": "matmul_cuda",
    "matmul_warptile_kernel": "matmul_cuda", "matmul_dbuf_kernel": "matmul_cuda",
    "matmul_async_kernel": "matmul_cuda", "fused_add_norm_kernel": "norm_cuda",
    "peer_reduce_norm_kernel": "peer_cuda", "sum_sources_kernel": "peer_cuda", "gather_rows_kernel": "peer_cuda",
    "copy_rows_kernel": "reduce_cuda", "add_rows_kernel": "reduce_cuda", "accumulate_rows_kernel": "reduce_cuda",
    "activation_kernel": "activation_cuda", "add_bias_kernel": "activation_cuda", "attention_kernel": "attention_cuda",
}


def __getattr__(name):
    module = _LAZY_KERNELS.get(name)
    if module is None:
        raise AttributeError(f"module 'vtnumba.kernels' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"vtnumba.kernels.{module}"), name)
