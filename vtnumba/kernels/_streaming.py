"""Non-temporal ("streaming") stores for the host loops: write big outputs without reading them first.

A normal store to a line that is not in cache makes the CPU *read* the line first (a
read-for-ownership) so it can merge the new bytes in.  For a fused norm over ``[8192, 4096]``
float32 that nobody reads again soon, that means DRAM sees: read y, read residual, read
new_residual (RFO), write new_residual, read out (RFO), write out -- six streams where four
carry data.  Non-temporal stores (x86 ``movntps``/``vmovntps``, AArch64 ``stnp``) write whole
lines through write-combining buffers with no read, which is how large memcpys run at full
speed; with them the fused norm runs at memcpy speed instead of about two thirds of it.

numba has no API for them, so :func:`_stream8` is a small ``@intrinsic``: one 32-byte vector
store of 8 float32 tagged ``!nontemporal`` in the LLVM IR.  :func:`store_row` streams a
scratch row into ``dst[r]``: scalar stores up to the first 32-byte boundary, 32-byte
streaming stores, scalar stores for the tail.

:func:`store_norm_row` does the same for the *normalised* row without materialising it:
:func:`_stream8_norm` computes ``(z - mean) * inv * weight (+ norm_bias)`` for 8 elements in
vector registers and streams them out.  Writing the normalised row into a second scratch
row first and streaming that (as :func:`store_row` would) costs an extra 2 x H floats of
cache traffic per row -- with ``H = 4096`` the scratch rows, ``weight`` and the streaming
inputs no longer fit a 32 KiB L1 together -- and was measured 1.2x slower (8192 x 4096 on
the 2-core cpu target, one thread, paired rounds).

Two rules come with them:

* **Ordering.**  Streaming stores are weakly ordered: other threads may see later ordinary
  stores first.  :func:`store_fence` (LLVM ``fence seq_cst``, an ``mfence`` on x86) must run
  before anything that publishes the result -- the host loops call it before returning, so
  a queue's completion (an event, a flag) is never seen before the data.
* **Only for outputs bigger than the cache.**  A small output that the next operation reads
  would be found in cache; streaming it would push it out to DRAM.  Callers stream only
  when the call writes at least :data:`STREAM_MIN_BYTES`.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Stream only when a call writes more than a core's share of cache could hold (L2 is 1-2 MiB
# per core on current x86 servers); below this the plain-store path is used.
STREAM_MIN_BYTES = 8 << 20


def _store8(builder, value, ptr, nontemporal: bool) -> None:
    """Store the 8-float vector ``value`` at ``ptr``: streaming (32-byte aligned, the caller
    guarantees it) or plain (any alignment: a plain vector store has no such rule)."""
    vec_ptr = builder.bitcast(ptr, value.type.as_pointer())
    store = builder.store(value, vec_ptr, align=32 if nontemporal else 1)
    if nontemporal:
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))


def _row_copy8(nontemporal: bool):
    """The intrinsic ``dst[r, i:i+8] = src[i:i+8]`` as one 32-byte store (streaming or plain)."""

    @intrinsic
    def copy8(typingctx, dst, r, i, src):
        sig = types.void(dst, r, i, src)

        def codegen(context, builder, signature, args):
            dty, _, _, sty = signature.args
            d = context.make_array(dty)(context, builder, args[0])
            s = context.make_array(sty)(context, builder, args[3])
            dptr = cgutils.get_item_pointer(context, builder, dty, d, [args[1], args[2]], wraparound=False)
            sptr = cgutils.get_item_pointer(context, builder, sty, s, [args[2]], wraparound=False)
            vec = ir.VectorType(ir.FloatType(), 8)
            value = builder.load(builder.bitcast(sptr, vec.as_pointer()), align=4)  # scratch row: any alignment
            _store8(builder, value, dptr, nontemporal)
            return context.get_dummy_value()

        return sig, codegen

    return copy8


def _row_norm8(nontemporal: bool):
    """The intrinsic ``dst[r, i:i+8] = (z[i:i+8] - mean) * inv * weight[i:i+8] (+ norm_bias[i:i+8])``
    as one 32-byte store (streaming or plain).  ``norm_bias`` is always a valid array of
    ``z``'s length (a placeholder when ``has_norm_bias`` is false): it is loaded either way
    and the sum selected, which keeps the code branch-free."""

    @intrinsic
    def norm8(typingctx, dst, r, i, z, mean, inv, weight, norm_bias, has_norm_bias):
        sig = types.void(dst, r, i, z, mean, inv, weight, norm_bias, has_norm_bias)

        def codegen(context, builder, signature, args):
            dty, _, _, zty, _, _, wty, nbty, hty = signature.args
            vec = ir.VectorType(ir.FloatType(), 8)

            def load8(aty, value):  # any alignment: the scratch row and the vectors are only 4-byte aligned
                a = context.make_array(aty)(context, builder, value)
                ptr = cgutils.get_item_pointer(context, builder, aty, a, [args[2]], wraparound=False)
                return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)

            def splat(x):
                v = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
                return builder.shuffle_vector(v, ir.Constant(vec, ir.Undefined),
                                              ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))

            o = builder.fmul(builder.fmul(builder.fsub(load8(zty, args[3]), splat(args[4])), splat(args[5])),
                             load8(wty, args[6]))
            flag = context.cast(builder, args[8], hty, types.boolean)
            o = builder.select(flag, builder.fadd(o, load8(nbty, args[7])), o)
            d = context.make_array(dty)(context, builder, args[0])
            dptr = cgutils.get_item_pointer(context, builder, dty, d, [args[1], args[2]], wraparound=False)
            _store8(builder, o, dptr, nontemporal)
            return context.get_dummy_value()

        return sig, codegen

    return norm8


# Streaming (non-temporal) and plain versions of the two 8-float stores.  The plain ones are
# not a detail: numba's scalar loop over ``dst[r, k]`` does not vectorize (LLVM cannot rule
# out that dst overlaps the scratch row or weight), and ran the fused norm at a fifth of the
# streaming path's speed on arrays that fit in the caches.
_stream8, _copy8 = _row_copy8(True), _row_copy8(False)
_stream8_norm, _norm8 = _row_norm8(True), _row_norm8(False)


@intrinsic
def store_fence(typingctx):
    """Order every earlier store (streaming ones included) before every later one."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always")
def store_row(dst, r, src, stream):
    """``dst[r, :] = src`` (float32); with ``stream`` through non-temporal stores."""
    h = src.shape[0]
    addr = dst.ctypes.data + r * dst.strides[0]
    i = 0
    if not stream or addr % 4:
        # Plain 8-float stores, at any alignment.  (A row that is not even 4-byte aligned --
        # np.frombuffer at an odd offset -- never reaches a 32-byte boundary in whole floats,
        # so it is never streamed.)
        while i + 8 <= h:
            _copy8(dst, r, i, src)
            i += 8
    else:
        head = min(h, ((32 - addr % 32) % 32) // 4)
        for k in range(head):
            dst[r, k] = src[k]
        i = head
        while i + 8 <= h:
            _stream8(dst, r, i, src)
            i += 8
    for k in range(i, h):
        dst[r, k] = src[k]


@numba.njit(inline="always")
def store_norm_row(dst, r, z, mean, inv, weight, norm_bias, has_norm_bias, stream):
    """``dst[r, :] = (z - mean) * inv * weight (+ norm_bias)`` (float32), straight from the scratch
    row ``z``; with ``stream`` through non-temporal stores (see :func:`_stream8_norm`)."""
    h = z.shape[0]
    i = 0
    addr = dst.ctypes.data + r * dst.strides[0]
    if stream and addr % 4 == 0:  # (see store_row)
        head = min(h, ((32 - addr % 32) % 32) // 4)
        for k in range(head):
            v = (z[k] - mean) * inv * weight[k]
            dst[r, k] = v + norm_bias[k] if has_norm_bias else v
        i = head
        while i + 8 <= h:
            _stream8_norm(dst, r, i, z, mean, inv, weight, norm_bias, has_norm_bias)
            i += 8
    else:
        while i + 8 <= h:
            _norm8(dst, r, i, z, mean, inv, weight, norm_bias, has_norm_bias)
            i += 8
    for k in range(i, h):
        v = (z[k] - mean) * inv * weight[k]
        dst[r, k] = v + norm_bias[k] if has_norm_bias else v
