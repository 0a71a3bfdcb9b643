"""128-bit loads and stores for the ``@cuda.jit`` kernels: four consecutive elements in one instruction.

A GPU moves memory in 32-byte sectors, and every load *instruction* costs issue slots and a
slot in the memory pipeline.  CUDA C spells a wide access ``float4 v = *(float4*)&a[i]``
(``ld.global.v4.f32``): one instruction for 16 bytes instead of four.  **numba-cuda has no
float4 array access**: its vector types (``cuda.float32x4``) are values, not a way to
reinterpret an array, and it has no inline-PTX API for kernel code.  What it does have is
numba's extension API, which numba-cuda itself uses for its cache-hint loads
(``cuda.ldcs`` ...): an ``@intrinsic`` writes LLVM IR directly.  :func:`load4` and
:func:`store4` here are such intrinsics: a ``<4 x float>`` load/store with 16-byte
alignment, which NVVM lowers to ``ld.global.v4.f32`` / ``ld.shared.v4.f32`` /
``st.global.v4.f32`` (float16 arrays: 8-byte ``v4.u16``); ``tests/test_kernels_wide.py``
checks that the PTX really contains them.

**The hazard: alignment.**  A vector access must be aligned to its size (16 bytes for four
float32).  The hardware does not round a misaligned address; the kernel dies with
"misaligned address" and takes the CUDA context with it.  So a kernel uses the wide path
only where the *launcher* has checked, with :func:`wide_ok`, that every array involved
starts at an aligned address and that its rows are a multiple of 4 elements long (then
every row starts aligned too, and a quad starting at a column that is a multiple of 4
never straddles the end of a row).  Otherwise the kernel takes the scalar path: the same
quads, element by element, with per-element bounds checks.  Shared arrays used with
:func:`load4`/:func:`store4` are declared with ``alignment=SMEM_ALIGN``.

**In the simulator** there is no LLVM: :func:`load4`/:func:`store4` are plain Python that
read or write the four elements one by one -- *after checking the alignment the hardware
would require* (the absolute address for global memory; the offset from the array's start
for shared memory, whose alignment ``SMEM_ALIGN`` guarantees on a GPU).  A launcher that
took the wide path for a misaligned array fails in the simulator with the address, instead
of passing there and crashing on a GPU.

The bounds-checked helpers :func:`quad`, :func:`vquad` and :func:`store_quad` build on them:
the kernels (matmul rungs ``wide``/``warptile``/``dbuf``/``async``, the fused norms, the peer copies)
call these.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from vtnumba.backend.arrays import address_of, host_view, is_c_contiguous, simulator_active

#: Elements per wide access, and the alignment (bytes) of shared arrays used with load4/store4.
#: ``cuda.shared.array(..., alignment=)`` is refused by the simulator, which gets None (numpy's
#: own allocations are at least 16-byte aligned; the simulated load4 checks offsets anyway).
VEC = 4
SMEM_ALIGN = None if simulator_active() else 16


def wide_ok(*arrays) -> bool:
    """May a kernel use 4-wide accesses on all of ``arrays`` (None entries are skipped)?

    True when every array is C-contiguous, starts at a multiple of ``4 * itemsize`` bytes and
    its last dimension is a multiple of 4 (so every row starts aligned as well).  Host-side
    check, made by the launchers; the kernels get the answer as a flag.  (The public kernels
    refuse strided arrays before they get here; the 4-wide loads assume C-contiguous rows.)
    """
    for arr in arrays:
        if arr is None:
            continue
        if not is_c_contiguous(arr):
            return False
        width = VEC * np.dtype(arr.dtype).itemsize
        if arr.shape[arr.ndim - 1] % VEC or address_of(arr) % width:  # (simulator shapes take no [-1])
            return False
    return True


# ---------------------------------------------------------------------------- real GPU: intrinsics
def _make_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def vector_pointer(context, builder, aryty, ary_value, idx_tuple_type, idx_tuple):
        """(pointer to arr[idx] as <4 x T>*, alignment in bytes, vector type)."""
        ary = context.make_array(aryty)(context, builder, ary_value)
        idx = [context.cast(builder, builder.extract_value(idx_tuple, i), t, types.intp)
               for i, t in enumerate(idx_tuple_type)]
        # wraparound=False: a negative index is a bug here, not "from the end" (as in CUDA C).
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)
        vec = ir.VectorType(context.get_data_type(aryty.dtype), VEC)
        return builder.bitcast(ptr, vec.as_pointer()), VEC * (aryty.dtype.bitwidth // 8), vec

    # ``*idx`` arrives as one tuple argument (numba's StarArgTuple), whatever the array's ndim.
    @intrinsic
    def load4(typingctx, arr, *idx):
        if not isinstance(arr, types.Array) or len(idx) != arr.ndim:
            return None
        ret = types.UniTuple(arr.dtype, VEC)

        def codegen(context, builder, sig, args):
            vptr, align, _ = vector_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = builder.load(vptr, align=align)
            items = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(VEC)]
            return context.make_tuple(builder, ret, items)

        return ret(arr, types.StarArgTuple.from_types(idx)), codegen

    @intrinsic
    def store4(typingctx, arr, *rest):
        if not isinstance(arr, types.Array) or len(rest) != arr.ndim + VEC:
            return None

        def codegen(context, builder, sig, args):
            aryty, rest_ty = sig.args
            nidx = aryty.ndim
            vptr, align, vecty = vector_pointer(context, builder, aryty, args[0], rest_ty[:nidx], args[1])
            vec = ir.Constant(vecty, ir.Undefined)
            for i in range(VEC):
                v = builder.extract_value(args[1], nidx + i)
                v = context.cast(builder, v, rest_ty[nidx + i], aryty.dtype)
                vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), i))
            builder.store(vec, vptr, align=align)
            return context.get_dummy_value()

        return types.void(arr, types.StarArgTuple.from_types(rest)), codegen

    return load4, store4


# ---------------------------------------------------------------------------- simulator: checked Python
def _sim_check(arr, idx, what):
    """Raise if ``arr[idx]`` is not where a 4-wide access may start on a GPU."""
    # Inside a simulated kernel a global array is wrapped (numba's FakeWithinKernelCUDAArray
    # around the FakeCUDAArray); shared and local arrays are plain numpy.
    item = getattr(arr, "_item", None)
    if item is not None:
        view = host_view(item)
        base = view.__array_interface__["data"][0]
    else:  # shared or local memory: numpy standing in for SMEM_ALIGN-aligned memory, so offsets count
        view, base = arr, 0
    width = VEC * view.itemsize
    if len(idx) != view.ndim:
        raise IndexError(f"{what}: {len(idx)} indices for a {view.ndim}-D array")
    if not (0 <= idx[-1] and idx[-1] + VEC <= view.shape[-1]):
        raise IndexError(f"{what}: elements {idx[-1]}..{idx[-1] + VEC - 1} of a row of {view.shape[-1]}")
    offset = sum(int(i) * s for i, s in zip(idx, view.strides))
    if (base + offset) % width:
        raise ValueError(f"{what} at index {tuple(int(i) for i in idx)}: address {base + offset:#x} is not "
                         f"{width}-byte aligned (a GPU would stop with 'misaligned address')")


def _load4_sim(arr, *idx):
    """``arr[..., c:c+4]`` as a 4-tuple (the simulator's :func:`load4`, alignment checked)."""
    _sim_check(arr, idx, "load4")
    head, last = idx[:-1], idx[-1]
    return tuple(arr[(*head, last + i)] for i in range(VEC))


def _store4_sim(arr, *rest):
    """``arr[..., c:c+4] = v0, v1, v2, v3`` (the simulator's :func:`store4`, alignment checked)."""
    idx, values = rest[:-VEC], rest[-VEC:]
    _sim_check(arr, idx, "store4")
    head, last = idx[:-1], idx[-1]
    for i in range(VEC):
        arr[(*head, last + i)] = values[i]


if simulator_active():
    load4, store4 = _load4_sim, _store4_sim
else:
    load4, store4 = _make_intrinsics()


# ---------------------------------------------------------------------------- bounds-checked quads
@cuda.jit(device=True)
def quad(arr, r, c, n, wide):
    """``arr[r, c:c+4]`` as four float32, zeros for columns ``>= n`` (``c`` a multiple of 4).

    ``wide``: the launcher's :func:`wide_ok` verdict; then ``n % 4 == 0``, so the quad is
    all inside or all outside and one vector load fetches it.
    """
    zero = float32(0.0)
    if wide:
        if c < n:
            x0, x1, x2, x3 = load4(arr, r, c)
            return float32(x0), float32(x1), float32(x2), float32(x3)
        return zero, zero, zero, zero
    x0 = float32(arr[r, c]) if c < n else zero
    x1 = float32(arr[r, c + 1]) if c + 1 < n else zero
    x2 = float32(arr[r, c + 2]) if c + 2 < n else zero
    x3 = float32(arr[r, c + 3]) if c + 3 < n else zero
    return x0, x1, x2, x3


@cuda.jit(device=True)
def vquad(vec, c, n, wide):
    """``vec[c:c+4]`` of a 1-D array as four float32, zeros past ``n``; see :func:`quad`."""
    zero = float32(0.0)
    if wide:
        if c < n:
            x0, x1, x2, x3 = load4(vec, c)
            return float32(x0), float32(x1), float32(x2), float32(x3)
        return zero, zero, zero, zero
    x0 = float32(vec[c]) if c < n else zero
    x1 = float32(vec[c + 1]) if c + 1 < n else zero
    x2 = float32(vec[c + 2]) if c + 2 < n else zero
    x3 = float32(vec[c + 3]) if c + 3 < n else zero
    return x0, x1, x2, x3


@cuda.jit(device=True)
def store_quad(arr, r, c, n, wide, v0, v1, v2, v3):
    """``arr[r, c:c+4] = v0..v3``, only the columns ``< n``; one vector store when ``wide``."""
    if wide:
        if c < n:
            store4(arr, r, c, v0, v1, v2, v3)
        return
    if c < n:
        arr[r, c] = v0
    if c + 1 < n:
        arr[r, c + 1] = v1
    if c + 2 < n:
        arr[r, c + 2] = v2
    if c + 3 < n:
        arr[r, c + 3] = v3


__all__ = ["VEC", "SMEM_ALIGN", "wide_ok", "load4", "store4", "quad", "vquad", "store_quad"]
