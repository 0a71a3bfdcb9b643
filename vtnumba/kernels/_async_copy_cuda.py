"""Asynchronous global -> shared copies (``cp.async``) for the ``@cuda.jit`` kernels.

Since Ampere (sm_80) a thread can ask the memory system to copy 16 bytes from global memory
straight into shared memory and go on at once: ``cp.async.cg.shared.global [dst], [src], 16``.
The bytes never pass through the thread's registers, and nothing in the thread waits for
them until it says so.  That is what CUDA C's ``cuda::memcpy_async`` and ``__pipeline_*``
compile to, and how CUTLASS keeps several tiles of a matmul in flight.  Three instructions
make the protocol:

* ``cp.async...``: queue one copy (here :func:`copy_quad_to_shared`, a quad of 4 float32);
* ``cp.async.commit_group``: close this thread's copies issued since the last commit into a
  *group* (:func:`commit_copies`);
* ``cp.async.wait_group N``: wait until at most the ``N`` newest groups are still in flight
  (:func:`wait_copies`; ``wait_all_copies`` is ``N = 0`` plus copies never committed).

The wait covers *this thread's* copies only.  Other threads read them after a
``cuda.syncthreads()`` that every thread reaches after its own wait -- the pattern of every
multi-stage pipeline: wait, barrier, read.

**numba-cuda has none of it**, and NVVM does not know LLVM's ``llvm.nvvm.cp.async.*``
intrinsics either (they come out of the PTX as calls to undefined functions).  What works is
numba's extension API, as for the 128-bit accesses of :mod:`vtnumba.kernels._wide_cuda`: an
``@intrinsic`` whose LLVM IR is an *inline-assembly* call of the PTX instruction, marked as
having side effects (otherwise LLVM may move it, or drop it as unused) and as touching
memory (so loads and stores are not reordered across it).  The shared address operand is the
32-bit offset in the shared window (an ``addrspacecast`` to address space 3); the global one
a 64-bit global address.  ``tests/test_kernels_wide.py`` checks that the PTX really holds
the instructions; ``ptxas`` accepts them for sm_80 and sm_90.

**Only float32 moves asynchronously.**  ``cp.async`` copies bytes; it cannot widen float16
to the float32 the tiles hold.  For a float16 source :func:`copy_quad_to_shared` loads the
four halves, converts and stores them -- synchronously, through registers (a correct, slower
path; the launchers' alignment rule, :func:`~vtnumba.kernels._wide_cuda.wide_ok`, applies
to both).

**In the simulator** the copies are Python, and they are made to behave like the hardware
where it matters for correctness: a copy is *not* written into shared memory when it is
issued, but when the issuing thread waits for its group -- the latest moment a GPU may
land it.  A kernel that reads a tile before waiting (or before the barrier after the wait)
therefore reads stale data in the simulator too, and its tests fail there instead of only
on a GPU.  The opposite mistake -- a copy issued into a stage that other threads may still
be reading, which a GPU lands whenever the memory system gets to it -- shows with
:data:`SIMULATED_LANDING` set to ``"issue"``: every copy lands at once, the earliest
moment.  The tests run the async rung both ways.  Alignment is checked as for ``load4``
(16 bytes: the hardware refuses anything else), from the start of the array view the
kernel passes.
"""

from __future__ import annotations

import threading

import numpy as np

from vtnumba.backend.arrays import simulator_active
from vtnumba.kernels._wide_cuda import VEC, _sim_check

#: Bytes one :func:`copy_quad_to_shared` moves for float32 (the only size ``cp.async.cg`` takes).
COPY_BYTES = 16
#: ``cp.async`` came with Ampere: older GPUs have no such instruction (ptxas refuses the kernel).
MIN_COMPUTE_CAPABILITY = (8, 0)


def async_copies_supported() -> tuple[bool, str]:
    """(whether kernels using these copies can run on the current device, and why not).

    Always true in the simulator; on a GPU, compute capability 8.0 or newer."""
    if simulator_active():
        return True, ""
    from vtnumba.backend.cuda import current_context

    try:
        cc = tuple(current_context().device.compute_capability)  # (this process's GPU: device_choice)
    except Exception as exc:  # noqa: BLE001 - no driver, no device: the answer is "no", with the reason
        return False, f"no usable CUDA device ({type(exc).__name__}: {' '.join(str(exc).split())})"
    if cc >= MIN_COMPUTE_CAPABILITY:
        return True, ""
    return False, (f"cp.async needs compute capability {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} "
                   f"or newer; this GPU is {cc[0]}.{cc[1]}")


# ---------------------------------------------------------------------------- real GPU: intrinsics
def _make_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def asm(builder, text: str, args=(), arg_types=(), constraints: str = ""):
        """Call inline PTX ``text`` with side effects and a memory clobber (see the module docstring)."""
        clobber = "~{memory}"
        fnty = ir.FunctionType(ir.VoidType(), list(arg_types))
        builder.call(ir.InlineAsm(fnty, text, f"{constraints},{clobber}" if constraints else clobber,
                                  side_effect=True), list(args))

    def item_pointer(context, builder, aryty, ary_value, i, i_ty, j, j_ty):
        ary = context.make_array(aryty)(context, builder, ary_value)
        idx = [context.cast(builder, i, i_ty, types.intp), context.cast(builder, j, j_ty, types.intp)]
        return cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)

    @intrinsic
    def copy_quad_to_shared(typingctx, dst, i, j, src, r, k):
        ok = (isinstance(dst, types.Array) and dst.ndim == 2 and dst.dtype == types.float32
              and isinstance(src, types.Array) and src.ndim == 2 and src.dtype in (types.float32, types.float16))
        if not ok:
            return None

        def codegen(context, builder, sig, args):
            dty, ity, jty, sty, rty, kty = sig.args
            dptr = item_pointer(context, builder, dty, args[0], args[1], ity, args[2], jty)
            sptr = item_pointer(context, builder, sty, args[3], args[4], rty, args[5], kty)
            if sty.dtype == types.float32:
                i8 = ir.IntType(8)
                shared = builder.addrspacecast(builder.bitcast(dptr, i8.as_pointer()), i8.as_pointer(3))
                glob = builder.addrspacecast(builder.bitcast(sptr, i8.as_pointer()), i8.as_pointer(1))
                asm(builder, f"cp.async.cg.shared.global [$0], [$1], {COPY_BYTES};",
                    [builder.trunc(builder.ptrtoint(shared, ir.IntType(64)), ir.IntType(32)),
                     builder.ptrtoint(glob, ir.IntType(64))], [ir.IntType(32), ir.IntType(64)], "r,l")
            else:  # float16: the four halves loaded (8-byte aligned), widened, one 128-bit shared store
                halves = builder.load(builder.bitcast(sptr, ir.VectorType(ir.HalfType(), VEC).as_pointer()), align=8)
                floats = builder.fpext(halves, ir.VectorType(ir.FloatType(), VEC))
                builder.store(floats, builder.bitcast(dptr, floats.type.as_pointer()), align=16)
            return context.get_dummy_value()

        return types.void(dst, i, j, src, r, k), codegen

    def instruction(text: str):
        """An intrinsic without arguments that is the one PTX instruction ``text``."""
        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, sig, args):
                asm(builder, text)
                return context.get_dummy_value()

            return types.void(), codegen

        return emit

    @intrinsic
    def wait_copies(typingctx, newest_in_flight):
        # The count is part of the instruction (an immediate): it must be known at compile time.
        if not isinstance(newest_in_flight, types.IntegerLiteral):
            return None

        def codegen(context, builder, sig, args):
            asm(builder, f"cp.async.wait_group {int(sig.args[0].literal_value)};")
            return context.get_dummy_value()

        return types.void(newest_in_flight), codegen

    commit_copies = instruction("cp.async.commit_group;")
    wait_all_copies = instruction("cp.async.wait_all;")
    return copy_quad_to_shared, commit_copies, wait_copies, wait_all_copies


# ---------------------------------------------------------------------------- simulator: deferred copies
#: When a simulated copy is written into shared memory: ``"wait"`` (the default), when its
#: thread waits for its group -- the latest moment a GPU may land it, which exposes reads made
#: too early; or ``"issue"``, at once -- the earliest, which exposes a copy issued into a
#: stage that other threads are still reading.  A correct kernel gives the same result with
#: both (the tests run the async rung both ways).
SIMULATED_LANDING = "wait"
# A GPU thread's copies in flight: .groups (committed), .open (not yet committed).  Kept per
# Python thread, and the simulator's reused threads run one GPU thread after another, so
# what a GPU thread leaves in flight lands when it ends (a GPU's copies complete too):
# nothing carries over into the next GPU thread, or the next launch.
_pending = threading.local()


def _state():
    if not hasattr(_pending, "groups"):
        _pending.groups, _pending.open = [], []
    return _pending


def _land(copies) -> None:
    for dst, i, j, values in copies:
        for q in range(VEC):
            dst[i, j + q] = values[q]


def _copy_quad_to_shared_sim(dst, i, j, src, r, k):
    """Queue ``dst[i, j:j+4] = src[r, k:k+4]``; it lands when this thread waits for its group
    (or at once: :data:`SIMULATED_LANDING`)."""
    _sim_check(dst, (i, j), "copy_quad_to_shared (shared destination)")
    _sim_check(src, (r, k), "copy_quad_to_shared (global source)")
    values = tuple(np.float32(src[r, k + q]) for q in range(VEC))  # the source does not change in a kernel
    if SIMULATED_LANDING == "issue" or np.dtype(getattr(src, "dtype", np.float32)) != np.float32:
        _land([(dst, i, j, values)])  # (float16 goes through registers on a GPU: synchronous)
        return
    _state().open.append((dst, i, j, values))


def _commit_copies_sim():
    st = _state()
    st.groups.append(st.open)
    st.open = []


def _wait_copies_sim(newest_in_flight):
    st = _state()
    while len(st.groups) > newest_in_flight:
        _land(st.groups.pop(0))


def _wait_all_copies_sim():
    st = _state()
    for group in st.groups:
        _land(group)
    _land(st.open)
    st.groups, st.open = [], []


def _land_leftovers() -> None:
    if getattr(_pending, "groups", None) or getattr(_pending, "open", None):
        _wait_all_copies_sim()


if simulator_active():
    from vtnumba.backend.simulator_fixes import GPU_THREAD_END_HOOKS

    copy_quad_to_shared, commit_copies = _copy_quad_to_shared_sim, _commit_copies_sim
    wait_copies, wait_all_copies = _wait_copies_sim, _wait_all_copies_sim
    if _land_leftovers not in GPU_THREAD_END_HOOKS:
        GPU_THREAD_END_HOOKS.append(_land_leftovers)
else:
    copy_quad_to_shared, commit_copies, wait_copies, wait_all_copies = _make_intrinsics()


__all__ = ["COPY_BYTES", "MIN_COMPUTE_CAPABILITY", "async_copies_supported", "copy_quad_to_shared", "commit_copies",
           "wait_copies", "wait_all_copies"]
