"""The one tiny CUDA kernel the runtime tour launches (imported only on cuda/cudasim).

Kernels live at module level on purpose: the simulator swaps the *module-global* name
``cuda`` for its fake device module while a kernel runs; a kernel defined inside a
function would capture the host-side module in a closure and fail on ``cuda.grid``.
"""

from numba import cuda


@cuda.jit
def scale_kernel(a, factor):
    """``a[i] *= factor`` for every element: one thread per element, the tour's whole kernel."""
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= factor
