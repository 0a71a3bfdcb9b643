"""The CUDA matmul ladder: naive -> shared tiles -> register tiles -> wide loads -> warp tiles -> double
buffering -> asynchronous copies.

This module imports ``numba.cuda``, so :mod:`vtnumba.kernels.matmul` loads it only when a
device array is seen.  Read the kernels in order; each fixes the main cost of the one
before (the ladder of llm.c's ``dev/cuda`` and of Simon Boehm's SGEMM walk-through, whose
kernels 1, 3, 5, 6, 10 and 11 these follow), and each docstring states its one idea:

1. :func:`matmul_naive_kernel` -- one thread per output element, every operand read
   straight from global memory: ``2*K`` loads per ``K`` multiply-adds, so it is bound by
   memory (and, for ``B = W.T``, by uncoalesced loads).
2. :func:`matmul_smem_kernel` -- a ``TILE x TILE`` block stages a tile of A and of B in
   shared memory, so each global element is loaded once per block instead of once per
   thread: ``TILE`` times less global traffic.  Still one output per thread, so the inner
   loop does two shared-memory loads per multiply-add.
3. :func:`matmul_regtile_kernel` -- a 256-thread block computes a ``BM x BN`` = 128 x 128
   tile and each thread a ``TM x TN`` = 8 x 8 block of outputs held in registers.  Per
   ``k`` a thread loads 8 values of A and 8 of B from shared memory and does 64
   multiply-adds (an outer product): 4 multiply-adds per shared load instead of 0.5, which
   is what moves a kernel from the shared-memory roof toward the FMA roof (Boehm's "2D
   blocktiling").
4. :func:`matmul_wide_kernel` -- the same tiles with fewer instructions per multiply-add:
   every access 128 bits wide (one instruction moves 4 floats from global memory, from
   shared memory and into c), and the k-step unrolled by hand, so no loop counter or
   address arithmetic sits between the multiply-adds.  numba-cuda has no ``float4``;
   :mod:`vtnumba.kernels._wide_cuda` builds the access from LLVM IR and the launcher checks
   the alignment it needs.
5. :func:`matmul_warptile_kernel` -- each warp owns a 64 x 32 sub-tile instead of a 16 x 128
   strip, so a warp's shared-memory loads fetch a third fewer bytes per multiply-add.
6. :func:`matmul_dbuf_kernel` -- two shared buffers: tile ``t + 1``'s global loads are issued
   before tile ``t``'s math, so their latency is hidden, with one barrier per k-step.
7. :func:`matmul_async_kernel` -- the staging leaves the registers: ``cp.async`` copies
   global -> shared while the thread computes, three tiles in flight.  numba-cuda does not
   expose it; :mod:`vtnumba.kernels._async_copy_cuda` emits it as inline PTX.  It needs an
   Ampere or newer GPU (compute capability 8.0); on an older one the launcher refuses it.

``vtnumba bench kernels --ptxas`` prints each kernel's registers, shared memory and spills
(no GPU needed): rungs 3-6 use 122-153 registers, no spills; 4-7 declare launch bounds of
two 256-thread blocks per SM, which holds ptxas to 128 registers (regtile fits one block).
Rung 7 spills about 110 bytes there: loop-invariant addresses and bounds, reloaded (from L1)
where the copies are issued; the multiply-adds between two barriers touch no local memory.
:data:`vtnumba.kernels.matmul.LADDER` lists the rungs in order with a one-line description each.

**One contract for all seven**, so TPSP's epilogue (rows to different destinations) needs
no extra kernel.  With ``B`` either ``b`` ([K, N], ``trans_b=0``) or ``b.T`` (``b`` is
``[N, K]``, the nn.Linear weight layout, ``trans_b=1``)::

    c[i, :] = a[m0 + i, :] @ B (+ bias)   for 0 <= i < m_valid
    c[i, :] = 0                           for m_valid <= i < c.shape[0]   (zero padding)

A plain matmul is ``m0 = 0, m_valid = M``.  Inputs may be float32 or float16; every load
is converted to float32 and all accumulation is float32; ``c`` is float32.  ``bias``
must always be an array (numba kernels take no None): when ``has_bias == 0`` the caller
passes any float32 vector and the kernel never reads it.  Rungs 4-7 take three more
flags, computed by :func:`launch_matmul_rows` (:func:`wide_flags`): whether ``a``, ``b``
and ``c`` may be accessed 4 elements at a time.

Every bound is checked, so any M, N, K works (not only tile multiples): out-of-range tile
elements load as 0, which adds nothing, and out-of-range outputs are not stored.
"""

from __future__ import annotations

from numba import cuda, float32

from vtnumba.backend.arrays import cdiv, simulator_active
from vtnumba.kernels._async_copy_cuda import (
    async_copies_supported,
    commit_copies,
    copy_quad_to_shared,
    wait_all_copies,
    wait_copies,
)
from vtnumba.kernels._wide_cuda import SMEM_ALIGN, VEC, load4, quad, store4, store_quad, wide_ok

# ---------------------------------------------------------------------------- tile sizes
# smem kernel: one TILE x TILE thread block per TILE x TILE output tile.
TILE = 16
_TILE_PAD = TILE + 1  # shared rows padded by one so transposed stores hit 16 different banks

# regtile kernel: a (THREADS_X x THREADS_Y) = 16 x 16 block computes a BM x BN output tile,
# each thread TM x TN outputs, stepping through K in slices of BK.  Fixed at compile time
# (shared and local array shapes must be constants); chosen for sm_80/sm_90.
BM = 128
BN = 128
BK = 8
TM = 8
TN = 8
THREADS_X = BN // TN  # 16
THREADS_Y = BM // TM  # 16
_NTHREADS = THREADS_X * THREADS_Y  # 256
_BM_PAD = BM + 1  # see _TILE_PAD: As is stored transposed, k-major
_BN_PAD = BN + 1
_A_LOADS = BM * BK // _NTHREADS  # elements of the A tile each thread loads (4)
_B_LOADS = BK * BN // _NTHREADS  # elements of the B tile each thread loads (4)


# ---------------------------------------------------------------------------- 1. naive
@cuda.jit
def matmul_naive_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias):
    """One thread per output ``c[i, j]``; a 2-D grid of 16 x 16 blocks covers ``c``."""
    # x is the column so that neighbouring threads of a warp write neighbouring c[i, j]
    # (coalesced stores) and, for trans_b == 0, read neighbouring b[k, j].
    j, i = cuda.grid(2)
    rows = c.shape[0]
    n = c.shape[1]
    if i >= rows or j >= n:
        return
    if i >= m_valid:
        c[i, j] = float32(0.0)  # zero padding of a partially filled destination
        return
    r = m0 + i
    acc = float32(0.0)
    for k in range(a.shape[1]):
        if trans_b:
            bv = float32(b[j, k])  # b is [N, K]: neighbouring threads read K apart (uncoalesced)
        else:
            bv = float32(b[k, j])
        acc += float32(a[r, k]) * bv
    if has_bias:
        acc += float32(bias[j])
    c[i, j] = acc


# ---------------------------------------------------------------------------- 2. shared-memory tiles
@cuda.jit
def matmul_smem_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias):
    """A TILE x TILE block stages TILE x TILE tiles of A and B in shared memory per k-step."""
    # Separate lines on purpose: in the simulator two shared arrays declared on one line alias.
    As = cuda.shared.array((TILE, TILE), float32)  # As[ty, kk] = A[row, k0 + kk]
    Bs = cuda.shared.array((TILE, _TILE_PAD), float32)  # Bs[kk, tx] = B[k0 + kk, col]

    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    i = cuda.blockIdx.y * TILE + ty  # output row (index into c)
    j = cuda.blockIdx.x * TILE + tx  # output column
    K = a.shape[1]
    n = c.shape[1]

    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        # A tile: neighbouring tx read neighbouring k of one row of a -> coalesced.
        av = float32(0.0)
        if i < m_valid and k0 + tx < K:
            av = float32(a[m0 + i, k0 + tx])
        As[ty, tx] = av
        bv = float32(0.0)
        if trans_b:
            # b is [N, K]; let neighbouring tx read neighbouring k of one row of b (coalesced)
            # and store transposed; the padded row length keeps these stores conflict-free.
            col = cuda.blockIdx.x * TILE + ty
            if col < n and k0 + tx < K:
                bv = float32(b[col, k0 + tx])
            Bs[tx, ty] = bv
        else:
            if j < n and k0 + ty < K:
                bv = float32(b[k0 + ty, j])
            Bs[ty, tx] = bv
        # Every thread must have stored its element before anyone reads the tiles ...
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[ty, kk] * Bs[kk, tx]
        # ... and everyone must be done reading before the next k-step overwrites them.
        cuda.syncthreads()

    # No early return above: every thread has to reach every syncthreads().
    if i < c.shape[0] and j < n:
        if i >= m_valid:
            c[i, j] = float32(0.0)
        else:
            if has_bias:
                acc += float32(bias[j])
            c[i, j] = acc


# ---------------------------------------------------------------------------- 3. register tiling
@cuda.jit
def matmul_regtile_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias):
    """A 16 x 16 block computes a 128 x 128 tile of c; each thread an 8 x 8 block in registers.

    Thread (tx, ty) owns rows ``row0 + ty + 16*u`` and columns ``col0 + tx + 16*v``
    (u, v < 8): strided rather than contiguous, so the 16 threads of a half-warp read 16
    consecutive shared-memory words (no bank conflicts) and store 16 consecutive columns
    of c (coalesced).
    """
    As = cuda.shared.array((BK, _BM_PAD), float32)  # As[kk, m] = A[row0 + m, k0 + kk] (k-major)
    Bs = cuda.shared.array((BK, _BN_PAD), float32)  # Bs[kk, n] = B[k0 + kk, col0 + n]
    acc = cuda.local.array((TM, TN), float32)  # constant-indexed after unrolling -> registers
    a_frag = cuda.local.array(TM, float32)
    b_frag = cuda.local.array(TN, float32)

    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    tid = ty * THREADS_X + tx
    row0 = cuda.blockIdx.y * BM
    col0 = cuda.blockIdx.x * BN
    K = a.shape[1]
    n = c.shape[1]

    for u in range(TM):
        for v in range(TN):
            acc[u, v] = float32(0.0)

    for k0 in range(0, K, BK):
        # Load the BM x BK tile of A: element e -> (m, kk) with kk fastest, so a warp reads
        # runs of BK consecutive k (whole 32-byte sectors) from rows of a.
        for s in range(_A_LOADS):
            e = tid + s * _NTHREADS
            m = e // BK
            kk = e % BK
            v = float32(0.0)
            if row0 + m < m_valid and k0 + kk < K:
                v = float32(a[m0 + row0 + m, k0 + kk])
            As[kk, m] = v
        # Load the BK x BN tile of B, again with the contiguous axis of b fastest.
        for s in range(_B_LOADS):
            e = tid + s * _NTHREADS
            v = float32(0.0)
            if trans_b:  # b is [N, K]: k is contiguous
                nn = e // BK
                kk = e % BK
                if col0 + nn < n and k0 + kk < K:
                    v = float32(b[col0 + nn, k0 + kk])
            else:  # b is [K, N]: n is contiguous
                kk = e // BN
                nn = e % BN
                if col0 + nn < n and k0 + kk < K:
                    v = float32(b[k0 + kk, col0 + nn])
            Bs[kk, nn] = v
        cuda.syncthreads()  # tiles complete before anyone computes from them

        for kk in range(BK):
            for u in range(TM):
                a_frag[u] = As[kk, ty + u * THREADS_Y]
            for v in range(TN):
                b_frag[v] = Bs[kk, tx + v * THREADS_X]
            # Outer product: TM + TN shared loads feed TM * TN multiply-adds.
            for u in range(TM):
                for v in range(TN):
                    acc[u, v] += a_frag[u] * b_frag[v]
        cuda.syncthreads()  # everyone done reading before the next k-step overwrites

    for u in range(TM):
        i = row0 + ty + u * THREADS_Y
        if i < c.shape[0]:
            for v in range(TN):
                j = col0 + tx + v * THREADS_X
                if j < n:
                    if i >= m_valid:
                        c[i, j] = float32(0.0)
                    elif has_bias:
                        c[i, j] = acc[u, v] + float32(bias[j])
                    else:
                        c[i, j] = acc[u, v]


# ---------------------------------------------------------------------------- 4. wide (128-bit) accesses
# Rungs 4-7 are compiled for two 256-thread blocks per SM: the launch bounds (.maxntid 256,
# .minnctapersm 2 in the PTX) make ptxas fit a thread in 65536 / 512 = 128 registers.  Without
# them the unrolled k-step below takes ~167, and an SM would hold a single block -- 8 warps to
# hide every latency.  (The simulator's cuda.jit takes no launch bounds; it needs none.)
_TWO_BLOCKS_PER_SM = {} if simulator_active() else {"launch_bounds": (_NTHREADS, 2)}
# Rungs 4-7 share regtile's block tile (BM x BN x BK = 128 x 128 x 8, 256 threads, 8 x 8 outputs
# per thread) so that each changes one thing.  Their shared tiles are k-major with rows of
# _SPAD = 132 floats: 528 bytes, a multiple of 16, so every quad of 4 floats is 16-byte aligned
# for load4/store4; and 132 = 4 (mod 32), which spreads the transposed stores over the banks
# (see matmul_wide_kernel).
_SPAD = BM + 4
_HALF = BM // 2  # 64: a thread's two 4-wide row (and column) groups are 64 apart
# The tile loaders below give each of the 256 threads exactly one quad of the A tile and one of
# the B tile; the compute loops give it two quads of rows and two of columns.  Check the sizes.
assert BM * BK == BN * BK == VEC * _NTHREADS and BK == 2 * VEC and BN == 32 * VEC
assert TM == TN == 2 * VEC and BM == BN == 2 * VEC * THREADS_X


@cuda.jit(device=True)
def _stage_tiles(a, b, m0, m_valid, trans_b, row0, col0, k0, tid, wide_a, wide_b):
    """Load this k-step's A and B tiles (one quad of 4 elements each per thread) into registers.

    Returns the two quads; :func:`_store_tiles` writes them to shared memory.  Split in two
    so that the double-buffered rung can issue the loads, compute, and store afterwards.
    """
    K = a.shape[1]
    n = b.shape[0] if trans_b else b.shape[1]
    # A tile, 128 rows x 8 k = 256 quads: thread tid loads row tid // 2, k (tid % 2) * 4 .. +3.
    # A warp reads 16 rows x 32 contiguous bytes: whole 32-byte sectors.
    m = tid // 2
    kq = (tid % 2) * 4
    zero = float32(0.0)
    a0, a1, a2, a3 = zero, zero, zero, zero
    if row0 + m < m_valid:
        a0, a1, a2, a3 = quad(a, m0 + row0 + m, k0 + kq, K, wide_a)
    b0, b1, b2, b3 = zero, zero, zero, zero
    if trans_b:  # b is [N, K]: k is contiguous, the same pattern as A
        if col0 + m < n:
            b0, b1, b2, b3 = quad(b, col0 + m, k0 + kq, K, wide_b)
    else:  # b is [K, N]: a warp reads one 512-byte run of a row of b
        kk = tid // 32
        if k0 + kk < K:
            b0, b1, b2, b3 = quad(b, k0 + kk, col0 + (tid % 32) * 4, n, wide_b)
    return a0, a1, a2, a3, b0, b1, b2, b3


@cuda.jit(device=True)
def _store_tiles(As, Bs, trans_b, tid, a0, a1, a2, a3, b0, b1, b2, b3):
    """Write the quads of :func:`_stage_tiles` into the k-major shared tiles ``As[kk, m]``, ``Bs[kk, n]``."""
    m = tid // 2
    kq = (tid % 2) * 4
    # A quad runs along k, the tile is k-major: 4 scalar stores down a column.  Bank of
    # As[kq + q, m] = (4 * (kq + q) + m) mod 32 (rows are 132 = 4 mod 32 words): the 16 m's of
    # kq = 0 and the 16 of kq = 4 land 16 banks apart, so a warp's 32 stores never collide.
    As[kq, m] = a0
    As[kq + 1, m] = a1
    As[kq + 2, m] = a2
    As[kq + 3, m] = a3
    if trans_b:
        Bs[kq, m] = b0
        Bs[kq + 1, m] = b1
        Bs[kq + 2, m] = b2
        Bs[kq + 3, m] = b3
    else:
        store4(Bs, tid // 32, (tid % 32) * 4, b0, b1, b2, b3)  # already along n: one 128-bit store


@cuda.jit(device=True)
def _store_c(c, bias, acc, m_valid, has_bias, i, u, j, v0, wide_c):
    """Write ``acc[u, v0:v0+4]`` (+ bias) to ``c[i, j:j+4]``, or zeros for padding rows ``i >= m_valid``."""
    n = c.shape[1]
    zero = float32(0.0)
    if i >= m_valid:
        store_quad(c, i, j, n, wide_c, zero, zero, zero, zero)
        return
    x0, x1, x2, x3 = acc[u, v0], acc[u, v0 + 1], acc[u, v0 + 2], acc[u, v0 + 3]
    if has_bias:
        if j < n:
            x0 += float32(bias[j])
        if j + 1 < n:
            x1 += float32(bias[j + 1])
        if j + 2 < n:
            x2 += float32(bias[j + 2])
        if j + 3 < n:
            x3 += float32(bias[j + 3])
    store_quad(c, i, j, n, wide_c, x0, x1, x2, x3)


@cuda.jit(device=True, inline="always")
def _k_products(acc, As, Bs, kk, r0, r1, c0, c1):
    """One k of the tile: ``acc[u, v] += A[row u, kk] * B[kk, col v]`` for a thread's 8 x 8 outputs.

    The thread's rows are the quads at ``r0`` and ``r1`` of the k-major ``As``, its columns the
    quads at ``c0`` and ``c1`` of ``Bs``: 4 shared loads of 128 bits feed 64 multiply-adds.
    """
    af = cuda.local.array(TM, float32)  # constant-indexed after inlining -> registers
    bf = cuda.local.array(TN, float32)
    af[0], af[1], af[2], af[3] = load4(As, kk, r0)
    af[4], af[5], af[6], af[7] = load4(As, kk, r1)
    bf[0], bf[1], bf[2], bf[3] = load4(Bs, kk, c0)
    bf[4], bf[5], bf[6], bf[7] = load4(Bs, kk, c1)
    for u in range(TM):
        for v in range(TN):
            acc[u, v] += af[u] * bf[v]


@cuda.jit(device=True, inline="always")
def _tile_products(acc, As, Bs, r0, r1, c0, c1):
    """All ``BK`` = 8 k of a staged tile pair, unrolled by hand: one :func:`_k_products` per k.

    **Why by hand.**  numba has no ``#pragma unroll``, and NVVM leaves the loop that
    ``for kk in range(BK)`` becomes a loop (numba's range loop counts down a 64-bit number of
    turns left): in the sm_90 SASS, 8 turns of 94 instructions, 64 of them FFMA.  Written
    out, the tile is one straight run of 512 FFMA and 32 ``LDS.128`` at constant offsets
    from a few registers: 91% of the instructions between the two barriers are multiply-adds
    instead of 68% (the PTX through ``ptxas``, then ``nvdisasm``; no GPU needed).
    ``inline="always"`` inlines at numba's IR level, so the local arrays become registers
    exactly as if the body were written out 8 times.
    """
    _k_products(acc, As, Bs, 0, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 1, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 2, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 3, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 4, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 5, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 6, r0, r1, c0, c1)
    _k_products(acc, As, Bs, 7, r0, r1, c0, c1)


assert BK == 8  # _tile_products writes out one call per k


@cuda.jit(**_TWO_BLOCKS_PER_SM)
def matmul_wide_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias, wide_a, wide_b, wide_c):
    """regtile with fewer instructions per multiply-add: 128-bit accesses and an unrolled k-step.

    **The one idea.**  regtile spends its issue slots on everything but math: per k a thread
    issues 16 scalar shared loads for 64 multiply-adds, 8 scalar global loads per tile, and
    the loop over k adds its counter and address arithmetic.  Here every access moves a quad
    of 4 consecutive floats with one instruction (``ld.global.v4.f32``, ``ld.shared.v4.f32``,
    ``st.global.v4.f32``): 4 shared loads per k, 2 global loads per tile, and 16-byte stores
    of c; and the 8 k of a tile are written out (:func:`_tile_products`), so what is left
    between two barriers is multiply-adds and their loads.  numba-cuda has no float4 view of
    an array, so the quads come from :mod:`vtnumba.kernels._wide_cuda` (an LLVM-level
    ``<4 x float>`` access).

    **What that changes in the layout.**  A thread's 8 x 8 outputs are no longer strided by
    16 but two 4 x 4 blocks per direction: rows ``4*ty + {0..3}`` and ``64 + 4*ty + {0..3}``,
    columns ``4*tx + {0..3}`` and ``64 + 4*tx + {0..3}``, so its operands are contiguous quads
    in the k-major tiles.  8 threads with consecutive ``tx`` read 128 contiguous bytes of
    ``Bs`` -- a 128-bit access is served a quarter-warp at a time, so that is conflict-free --
    and the two ``ty`` of a warp read the same ``As`` quads (a broadcast).  A is still stored
    transposed (k-major), now from a quad that runs along k: four scalar stores, arranged to
    be bank-conflict-free (see ``_store_tiles``).

    **Hazard: alignment.**  A misaligned 128-bit access kills the kernel, so the launcher
    passes ``wide_a``/``wide_b``/``wide_c`` (:func:`~vtnumba.kernels._wide_cuda.wide_ok`:
    aligned start, rows a multiple of 4).  Where a flag is 0 the same quads are fetched
    element by element with bounds checks -- any shape and any view still works, just slower.
    """
    As = cuda.shared.array((BK, _SPAD), float32, alignment=SMEM_ALIGN)  # As[kk, m] = A[row0 + m, k0 + kk]
    Bs = cuda.shared.array((BK, _SPAD), float32, alignment=SMEM_ALIGN)  # Bs[kk, n] = B[k0 + kk, col0 + n]
    acc = cuda.local.array((TM, TN), float32)  # constant-indexed after unrolling -> registers

    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    tid = ty * THREADS_X + tx
    row0 = cuda.blockIdx.y * BM
    col0 = cuda.blockIdx.x * BN
    K = a.shape[1]

    for u in range(TM):
        for v in range(TN):
            acc[u, v] = float32(0.0)

    for k0 in range(0, K, BK):
        a0, a1, a2, a3, b0, b1, b2, b3 = _stage_tiles(a, b, m0, m_valid, trans_b, row0, col0, k0, tid, wide_a, wide_b)
        _store_tiles(As, Bs, trans_b, tid, a0, a1, a2, a3, b0, b1, b2, b3)
        cuda.syncthreads()  # tiles complete before anyone computes from them
        # The same outer products as regtile, 4 shared loads now feeding 64 multiply-adds per k.
        _tile_products(acc, As, Bs, 4 * ty, _HALF + 4 * ty, 4 * tx, _HALF + 4 * tx)
        cuda.syncthreads()  # everyone done reading before the next k-step overwrites

    for u in range(TM):
        i = row0 + (u // 4) * _HALF + 4 * ty + u % 4
        if i < c.shape[0]:
            _store_c(c, bias, acc, m_valid, has_bias, i, u, col0 + 4 * tx, 0, wide_c)
            _store_c(c, bias, acc, m_valid, has_bias, i, u, col0 + _HALF + 4 * tx, 4, wide_c)


# ---------------------------------------------------------------------------- 5. warp tiling
# The 8 warps of a block as a 2 x 4 grid of warp tiles, each WM x WN = 64 x 32; inside a warp,
# the 32 lanes as 8 x 4, each lane two 4-row groups (32 apart) and two 4-column groups (16 apart).
WARPS_N = 4
WM = BM // 2  # 64
WN = BN // WARPS_N  # 32
assert (BM // WM) * WARPS_N * 32 == _NTHREADS and 8 * VEC * 2 == WM and 4 * VEC * 2 == WN


@cuda.jit(device=True)
def _warp_tile_origin(tid):
    """(row, column) in the block tile of thread ``tid``'s first output, in the warp-tiled layout above."""
    warp = tid // 32
    lane = tid % 32
    return (warp // WARPS_N) * WM + 4 * (lane // 4), (warp % WARPS_N) * WN + 4 * (lane % 4)


@cuda.jit(device=True, inline="always")
def _store_warp_tile(c, bias, acc, m_valid, has_bias, i0, j0, wide_c):
    """Write a thread's 8 x 8 outputs (+ bias) from ``c[i0, j0]``: rows ``i0 + {0..3}`` and
    ``+ WM / 2``, columns ``j0 + {0..3}`` and ``+ WN / 2``; padding rows get zeros."""
    for u in range(TM):
        i = i0 + (u // 4) * (WM // 2) + u % 4
        if i < c.shape[0]:
            _store_c(c, bias, acc, m_valid, has_bias, i, u, j0, 0, wide_c)
            _store_c(c, bias, acc, m_valid, has_bias, i, u, j0 + WN // 2, 4, wide_c)


@cuda.jit(**_TWO_BLOCKS_PER_SM)
def matmul_warptile_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias, wide_a, wide_b, wide_c):
    """wide, with each warp owning a square-ish 64 x 32 sub-tile of the block's 128 x 128 tile.

    **The one idea.**  Shared-memory bandwidth is spent per *warp*: a warp's load of
    ``As``/``Bs`` fetches whatever its 32 lanes ask for.  In ``wide`` the lanes of one warp
    cover 16 rows x 128 columns of c, so per k the warp fetches 16 + 128 = 144 floats from
    shared memory for its 2048 multiply-adds.  Here the lanes of a warp cover a 64 x 32
    block (warp ``w`` at rows ``64 * (w // 4)``, columns ``32 * (w % 4)``; lane ``l`` at rows
    ``4 * (l // 4) + {0..3}`` and ``+32``, columns ``4 * (l % 4) + {0..3}`` and ``+16``):
    64 + 32 = 96 floats for the same 2048 -- a third less shared traffic, because a squarer
    footprint reuses each fetched word more often.  This is the block -> warp -> thread
    hierarchy of CUTLASS and of Boehm's warptiling kernel, in its simplest form.

    Bank conflicts stay away: a 128-bit shared load is served 8 lanes at a time; those 8
    lanes (two values of ``l // 4``, four of ``l % 4``) read 2 distinct ``As`` quads (a
    broadcast) and 4 contiguous ``Bs`` quads (64 bytes).  Global loads and the alignment
    rule are ``wide``'s (same tile loaders, same flags).
    """
    As = cuda.shared.array((BK, _SPAD), float32, alignment=SMEM_ALIGN)
    Bs = cuda.shared.array((BK, _SPAD), float32, alignment=SMEM_ALIGN)
    acc = cuda.local.array((TM, TN), float32)

    tid = cuda.threadIdx.x  # a 1-D block of 256: the warp is tid // 32
    wrow, wcol = _warp_tile_origin(tid)
    row0 = cuda.blockIdx.y * BM
    col0 = cuda.blockIdx.x * BN
    K = a.shape[1]

    for u in range(TM):
        for v in range(TN):
            acc[u, v] = float32(0.0)

    for k0 in range(0, K, BK):
        a0, a1, a2, a3, b0, b1, b2, b3 = _stage_tiles(a, b, m0, m_valid, trans_b, row0, col0, k0, tid, wide_a, wide_b)
        _store_tiles(As, Bs, trans_b, tid, a0, a1, a2, a3, b0, b1, b2, b3)
        cuda.syncthreads()
        _tile_products(acc, As, Bs, wrow, wrow + WM // 2, wcol, wcol + WN // 2)
        cuda.syncthreads()

    _store_warp_tile(c, bias, acc, m_valid, has_bias, row0 + wrow, col0 + wcol, wide_c)


# ---------------------------------------------------------------------------- 6. double buffering
@cuda.jit(**_TWO_BLOCKS_PER_SM)
def matmul_dbuf_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias, wide_a, wide_b, wide_c):
    """warptile with two shared buffers: the next tile's global loads are in flight during this tile's math.

    **The one idea.**  In every rung so far a k-step is "load tile -> barrier -> compute ->
    barrier", and the global loads are needed right away, so every warp of the block waits
    out the full memory latency (hundreds of cycles) once per k-step -- and with ~128
    registers per thread an SM holds at most two 256-thread blocks, too few to fill that gap
    with other work.  Here each thread *issues* the loads for tile ``t + 1`` into registers, then
    computes tile ``t`` from shared buffer ``t % 2`` while those loads travel, then writes
    them into the other buffer.  One barrier per k-step is enough: the buffer being written
    was last read in step ``t - 1``, and every thread passed the barrier at its end.

    **What numba-cuda does not offer.**  Ampere and Hopper can copy global -> shared without
    registers and asynchronously (``cp.async``, TMA); numba-cuda exposes neither (no
    ``memcpy_async``/pipeline API), so here the staging goes through registers (8 extra per
    thread), as in pre-Ampere CUTLASS.  The next rung, :func:`matmul_async_kernel`, emits
    ``cp.async`` as inline PTX -- and pays for it with a row-major A tile, because
    ``cp.async`` copies 16 bytes as they lie and cannot fill these k-major (transposed) tiles.

    Hazard: the loads for ``t + 1`` and the stores into the other buffer sit in ``if`` on a
    value every thread shares (``k0 + BK < K``), and the barrier is outside them: a
    ``syncthreads`` that some threads skip hangs the block on a GPU.
    """
    As = cuda.shared.array((2, BK, _SPAD), float32, alignment=SMEM_ALIGN)  # As[buf, kk, m]
    Bs = cuda.shared.array((2, BK, _SPAD), float32, alignment=SMEM_ALIGN)
    acc = cuda.local.array((TM, TN), float32)

    tid = cuda.threadIdx.x
    wrow, wcol = _warp_tile_origin(tid)
    row0 = cuda.blockIdx.y * BM
    col0 = cuda.blockIdx.x * BN
    K = a.shape[1]

    for u in range(TM):
        for v in range(TN):
            acc[u, v] = float32(0.0)

    # Prologue: tile 0 into buffer 0.
    a0, a1, a2, a3, b0, b1, b2, b3 = _stage_tiles(a, b, m0, m_valid, trans_b, row0, col0, 0, tid, wide_a, wide_b)
    _store_tiles(As[0], Bs[0], trans_b, tid, a0, a1, a2, a3, b0, b1, b2, b3)
    cuda.syncthreads()

    buf = 0
    for k0 in range(0, K, BK):
        more = k0 + BK < K  # the same for every thread: no divergence around the barrier below
        if more:
            # Issue tile t+1's global loads now; nothing reads these registers before the
            # stores after the math, so the warp does not wait for them here.
            a0, a1, a2, a3, b0, b1, b2, b3 = _stage_tiles(a, b, m0, m_valid, trans_b, row0, col0, k0 + BK, tid,
                                                          wide_a, wide_b)
        _tile_products(acc, As[buf], Bs[buf], wrow, wrow + WM // 2, wcol, wcol + WN // 2)
        if more:
            _store_tiles(As[1 - buf], Bs[1 - buf], trans_b, tid, a0, a1, a2, a3, b0, b1, b2, b3)
        # One barrier: tile t+1 complete before step t+1 reads it, and buffer `buf` free to be
        # overwritten in step t+1 (everyone has finished reading it above).
        cuda.syncthreads()
        buf = 1 - buf

    _store_warp_tile(c, bias, acc, m_valid, has_bias, row0 + wrow, col0 + wcol, wide_c)


# ---------------------------------------------------------------------------- 7. asynchronous copies
# Rung 7's tiles.  A is kept as it lies in global memory, row-major [m][k] -- cp.async copies
# 16 contiguous bytes, it cannot transpose -- with rows of _APITCH = 12 floats (48 bytes: a
# multiple of 16 for cp.async and load4, and rows 4 apart land 64 bytes apart in the banks,
# so the two A quads a quarter-warp reads never collide).  B keeps the k-major tiles of
# rungs 4-6.  STAGES tiles are in flight at once: 3 x (6 KiB + 4.1 KiB) = 30.4 KiB per block.
STAGES = 3
_APITCH = BK + 4
_IN_FLIGHT = STAGES - 2  # groups a thread may leave running when it needs the oldest one


@cuda.jit(device=True)
def _issue_tiles(As, Bs, a, b, m0, m_valid, trans_b, row0, col0, k0, tid, wide_a, wide_b):
    """Start filling one stage with this k-step's tiles: one quad of A and one of B per thread.

    Aligned quads go by ``cp.async`` (:func:`copy_quad_to_shared`) and are not waited for
    here; quads outside the matrices are zeros, stored at once.  What cannot be copied as it
    lies -- B when ``trans_b`` (it must be transposed into the k-major tile), and operands
    without the wide flag -- is loaded into registers and returned, for
    :func:`_store_staged` to write after this k-step's math, as dbuf does.
    """
    K = a.shape[1]
    n = b.shape[0] if trans_b else b.shape[1]
    zero = float32(0.0)
    m = tid // 2
    kq = (tid % 2) * 4
    a0, a1, a2, a3 = zero, zero, zero, zero
    if row0 + m < m_valid and k0 + kq < K:
        if wide_a:
            copy_quad_to_shared(As, m, kq, a, m0 + row0 + m, k0 + kq)
        else:
            a0, a1, a2, a3 = quad(a, m0 + row0 + m, k0 + kq, K, 0)
    elif wide_a:
        store4(As, m, kq, zero, zero, zero, zero)
    b0, b1, b2, b3 = zero, zero, zero, zero
    if trans_b:
        if col0 + m < n:
            b0, b1, b2, b3 = quad(b, col0 + m, k0 + kq, K, wide_b)
        return a0, a1, a2, a3, b0, b1, b2, b3
    kk = tid // 32
    nq = (tid % 32) * 4
    if k0 + kk < K and col0 + nq < n:
        if wide_b:
            copy_quad_to_shared(Bs, kk, nq, b, k0 + kk, col0 + nq)
        else:
            b0, b1, b2, b3 = quad(b, k0 + kk, col0 + nq, n, 0)
    elif wide_b:
        store4(Bs, kk, nq, zero, zero, zero, zero)
    return a0, a1, a2, a3, b0, b1, b2, b3


@cuda.jit(device=True)
def _store_staged(As, Bs, trans_b, tid, wide_a, wide_b, a0, a1, a2, a3, b0, b1, b2, b3):
    """Write the quads :func:`_issue_tiles` returned (those ``cp.async`` did not take)."""
    m = tid // 2
    kq = (tid % 2) * 4
    if not wide_a:
        store4(As, m, kq, a0, a1, a2, a3)  # A's tile is [m][k]: the quad runs along a row
    if trans_b:  # into the k-major tile: four scalar stores down a column, as _store_tiles does
        Bs[kq, m] = b0
        Bs[kq + 1, m] = b1
        Bs[kq + 2, m] = b2
        Bs[kq + 3, m] = b3
    elif not wide_b:
        store4(Bs, tid // 32, (tid % 32) * 4, b0, b1, b2, b3)


@cuda.jit(device=True, inline="always")
def _k_of_quad(acc, af, Bs, kk, j, c0, c1):
    """k = ``kk + j``: ``acc[u, v] += af[u, j] * B[k, col v]`` (A's values already in registers)."""
    bf = cuda.local.array(TN, float32)
    bf[0], bf[1], bf[2], bf[3] = load4(Bs, kk + j, c0)
    bf[4], bf[5], bf[6], bf[7] = load4(Bs, kk + j, c1)
    for u in range(TM):
        for v in range(TN):
            acc[u, v] += af[u, j] * bf[v]


@cuda.jit(device=True, inline="always")
def _k_quad_products(acc, As, Bs, kk, r0, r1, c0, c1):
    """Four k of the tile, ``kk .. kk + 3``, from the row-major A tile: one 128-bit load of 4 k
    per row of the thread (8), then B's two quads per k -- 16 shared loads for 256
    multiply-adds, as in rungs 4-6 (which load two quads of rows per k from a k-major tile),
    and the same order of additions."""
    af = cuda.local.array((TM, VEC), float32)
    af[0, 0], af[0, 1], af[0, 2], af[0, 3] = load4(As, r0, kk)
    af[1, 0], af[1, 1], af[1, 2], af[1, 3] = load4(As, r0 + 1, kk)
    af[2, 0], af[2, 1], af[2, 2], af[2, 3] = load4(As, r0 + 2, kk)
    af[3, 0], af[3, 1], af[3, 2], af[3, 3] = load4(As, r0 + 3, kk)
    af[4, 0], af[4, 1], af[4, 2], af[4, 3] = load4(As, r1, kk)
    af[5, 0], af[5, 1], af[5, 2], af[5, 3] = load4(As, r1 + 1, kk)
    af[6, 0], af[6, 1], af[6, 2], af[6, 3] = load4(As, r1 + 2, kk)
    af[7, 0], af[7, 1], af[7, 2], af[7, 3] = load4(As, r1 + 3, kk)
    _k_of_quad(acc, af, Bs, kk, 0, c0, c1)
    _k_of_quad(acc, af, Bs, kk, 1, c0, c1)
    _k_of_quad(acc, af, Bs, kk, 2, c0, c1)
    _k_of_quad(acc, af, Bs, kk, 3, c0, c1)


assert BK == 2 * VEC and TM == 8  # the kernel below: two k-quads per tile; _k_quad_products: 8 rows


@cuda.jit(**_TWO_BLOCKS_PER_SM)
def matmul_async_kernel(a, b, bias, c, m0, m_valid, trans_b, has_bias, wide_a, wide_b, wide_c):
    """warptile fed by asynchronous copies: ``STAGES`` = 3 tiles in flight, none through registers.

    **The one idea.**  dbuf hides a tile's global loads behind one tile of math, but every
    float still passes through a register on its way to shared memory, and the thread that
    loaded it must wait for it before the store.  Here the memory system does the staging:
    ``cp.async`` (:mod:`vtnumba.kernels._async_copy_cuda`) copies a quad from global into
    shared memory while the thread goes on, so a thread issues tile ``t + 2``'s copies and
    computes tile ``t`` at once, and the copies have two tiles of math to arrive in.  Each
    k-step is: wait for my copies of tile ``t`` (``wait_group 1``: the newest group, tile
    ``t + 1``, may still be running) -> barrier (everyone's copies of tile ``t`` are in, and
    everyone has finished tile ``t - 1``, whose stage is free again) -> issue tile ``t + 2``
    into that stage -> compute tile ``t``.  One barrier per k-step, as in dbuf.

    **What it costs in the layout.**  ``cp.async`` moves 16 bytes as they lie, so A's tile is
    row-major here (``As[m, k]``), not k-major; the math then reads a quad of 4 k per row
    (:func:`_k_quad_products`), where rungs 4-6 read two quads of rows per k.  B keeps its
    k-major tile: for ``b`` as ``[K, N]`` its quads already run along n and go by
    ``cp.async`` too; ``b.T`` (``trans_b``, the nn.Linear layout) must be transposed and
    still goes through registers, stored after the math as in dbuf.  Float16 inputs are
    widened to float32 on the way (synchronously: ``cp.async`` cannot convert), and operands
    without the wide flag are loaded element by element, as in every rung.

    **Hazards.**  A thread's wait covers its own copies only: reading another thread's quads
    needs the barrier after everyone's wait.  Every thread commits a group every k-step, even
    an empty one, so "the newest group" means the same tile for all of them.  The simulator
    lands a copy either at its thread's wait or at once (the latest and the earliest moments
    a GPU may), and the tests run both: a missing wait or barrier, or a copy issued into a
    stage before everyone has finished reading it, fails there too.
    """
    As = cuda.shared.array((STAGES, BM, _APITCH), float32, alignment=SMEM_ALIGN)  # As[s, m, kk]
    Bs = cuda.shared.array((STAGES, BK, _SPAD), float32, alignment=SMEM_ALIGN)  # Bs[s, kk, n]
    acc = cuda.local.array((TM, TN), float32)

    tid = cuda.threadIdx.x
    wrow, wcol = _warp_tile_origin(tid)
    row0 = cuda.blockIdx.y * BM
    col0 = cuda.blockIdx.x * BN
    K = a.shape[1]
    tiles = (K + BK - 1) // BK

    for u in range(TM):
        for v in range(TN):
            acc[u, v] = float32(0.0)

    # Prologue: tiles 0 .. STAGES-2 into their stages, one group each.
    for s in range(STAGES - 1):
        if s < tiles:
            a0, a1, a2, a3, b0, b1, b2, b3 = _issue_tiles(As[s], Bs[s], a, b, m0, m_valid, trans_b, row0, col0,
                                                          s * BK, tid, wide_a, wide_b)
            _store_staged(As[s], Bs[s], trans_b, tid, wide_a, wide_b, a0, a1, a2, a3, b0, b1, b2, b3)
        commit_copies()

    for t in range(tiles):
        wait_copies(_IN_FLIGHT)  # my copies of tile t have landed
        cuda.syncthreads()  # everyone's have; and everyone is done with tile t-1's stage
        ahead = t + STAGES - 1  # the tile to start now, into the stage tile t-1 used
        more = ahead < tiles  # the same for every thread
        s = ahead % STAGES
        if more:
            a0, a1, a2, a3, b0, b1, b2, b3 = _issue_tiles(As[s], Bs[s], a, b, m0, m_valid, trans_b, row0, col0,
                                                          ahead * BK, tid, wide_a, wide_b)
        commit_copies()  # (empty near the end: the group count stays in step with the tiles)
        cur = t % STAGES
        _k_quad_products(acc, As[cur], Bs[cur], 0, wrow, wrow + WM // 2, wcol, wcol + WN // 2)
        _k_quad_products(acc, As[cur], Bs[cur], VEC, wrow, wrow + WM // 2, wcol, wcol + WN // 2)
        if more:
            # The register-held quads, after the math (their loads had it to arrive in); their
            # stage is read only after the next barrier.
            _store_staged(As[s], Bs[s], trans_b, tid, wide_a, wide_b, a0, a1, a2, a3, b0, b1, b2, b3)
    wait_all_copies()  # nothing may still be writing shared memory when the block ends

    _store_warp_tile(c, bias, acc, m_valid, has_bias, row0 + wrow, col0 + wcol, wide_c)


# ---------------------------------------------------------------------------- launching
KERNELS = {"naive": matmul_naive_kernel, "smem": matmul_smem_kernel, "regtile": matmul_regtile_kernel,
           "wide": matmul_wide_kernel, "warptile": matmul_warptile_kernel, "dbuf": matmul_dbuf_kernel,
           "async": matmul_async_kernel}
# The rungs that take the wide-access flags (wide_a, wide_b, wide_c) after the common arguments.
WIDE_VARIANTS = ("wide", "warptile", "dbuf", "async")


MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (gridDim.x may reach 2**31 - 1)


def launch_config(variant: str, rows: int, n: int) -> tuple[tuple[int, int], tuple[int, ...]]:
    """(grid, block) covering a ``rows x n`` output for the given ladder step.

    Row tiles go on the grid's y dimension, so an output may have at most ``MAX_GRID_Y`` of
    them (about a million rows for naive and smem, eight million for the 128-row tiles);
    a taller one raises ValueError here instead of failing to launch on the GPU."""
    if variant == "naive":
        grid, block = (cdiv(n, 16), cdiv(rows, 16)), (16, 16)
    elif variant == "smem":
        grid, block = (cdiv(n, TILE), cdiv(rows, TILE)), (TILE, TILE)
    elif variant in ("regtile", "wide"):
        grid, block = (cdiv(n, BN), cdiv(rows, BM)), (THREADS_X, THREADS_Y)
    elif variant in ("warptile", "dbuf", "async"):
        grid, block = (cdiv(n, BN), cdiv(rows, BM)), (_NTHREADS,)  # 1-D: warps are tid // 32
    else:
        raise ValueError(f"variant={variant!r} is not a matmul variant; expected one of {', '.join(KERNELS)}")
    if grid[1] > MAX_GRID_Y:
        per_tile = cdiv(rows, grid[1])
        raise ValueError(f"rows={rows} is too many for variant={variant!r}: its {grid[1]} row tiles exceed the "
                         f"grid's y limit of {MAX_GRID_Y} (at most {MAX_GRID_Y * per_tile} rows); split the "
                         "matmul into row blocks")
    return grid, block


def unavailable_rungs() -> dict[str, str]:
    """The rungs the current device cannot run, each with the reason: ``async`` before Ampere
    (no ``cp.async``); empty in the simulator and on compute capability 8.0 or newer.  The
    benchmark and tutorial 04 skip these, saying why; a launch of one raises."""
    ok, why = async_copies_supported()
    return {} if ok else {"async": why}


def wide_flags(a, b, c) -> tuple[int, int, int]:
    """Which operands the wide rungs may access 4 elements at a time (see :mod:`vtnumba.kernels._wide_cuda`)."""
    return int(wide_ok(a)), int(wide_ok(b)), int(wide_ok(c))


def launch_matmul_rows(variant: str, a, b, bias, c, m0: int, m_valid: int, trans_b: bool, stream) -> None:
    """Launch one ladder kernel with the contract in the module docstring (same arguments as
    :func:`vtnumba.kernels.matmul.matmul_rows_host`, plus ``variant`` and ``stream``)."""
    rows, n = c.shape
    if rows == 0 or n == 0:
        return
    why = unavailable_rungs().get(variant) if variant == "async" else None
    if why:
        raise RuntimeError(f"variant={variant!r} cannot run here: {why}; use another rung (variant='dbuf' needs "
                           "no cp.async)")
    grid, block = launch_config(variant, rows, n)
    has_bias = bias is not None
    # Kernels take no None: hand an unused float32 vector (row 0 of c) when there is no bias.
    bias_arg = bias if has_bias else c[0]
    args = (a, b, bias_arg, c, int(m0), int(m_valid), int(bool(trans_b)), int(has_bias))
    if variant in WIDE_VARIANTS:
        args += wide_flags(a, b, c)
    KERNELS[variant][grid, block, stream](*args)


def launch_linear_rows_to(variant: str, x, w, bias, dests, rows_per_dest: int, stream) -> None:
    """``x @ w.T (+ bias)`` with output rows ``[d*R, (d+1)*R)`` into ``dests[d]``: one launch per
    destination (:func:`vtnumba.kernels.matmul.linear_rows_to` checks the arguments first)."""
    m = int(x.shape[0])
    for d, dest in enumerate(dests):
        launch_matmul_rows(variant, x, w, bias, dest, d * rows_per_dest, m - d * rows_per_dest, True, stream)


# Signatures the PTX tests (and the benchmark's ptxas report) compile each kernel for.
_MAT = "{0}[:, ::1]"
_SIG = "void({a}, {b}, float32[::1], float32[:, ::1], int64, int64, int64, int64{extra})"
PTX_SIGNATURES = [
    (name, kernel, _SIG.format(a=_MAT.format(dt), b=_MAT.format(dt),
                               extra=", int64, int64, int64" if name in WIDE_VARIANTS else ""))
    for name, kernel in KERNELS.items()
    for dt in ("float32", "float16")
]
