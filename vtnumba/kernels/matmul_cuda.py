"""The CUDA matmul ladder: naive -> shared-memory tiles -> register tiling (``@cuda.jit``).

This module imports ``numba.cuda``, so :mod:`vtnumba.kernels.matmul` loads it only when a
device array is seen.  Read the three kernels in order; each fixes the main cost of the
one before (the same ladder as llm.c's ``dev/cuda`` and Simon Boehm's SGEMM walk-through):

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
   is what moves a kernel from the shared-memory roof toward the FMA roof.  The shape is
   the classic one (Boehm's "2D blocktiling"); ptxas gives it about 154 registers and no
   spills on sm_80/sm_90 (one 256-thread block per SM; asking for two with
   ``launch_bounds`` forces 128 registers and spills).  ``vtnumba bench kernels --ptxas``
   prints these numbers.

**One contract for all three**, so TPSP's epilogue (rows to different destinations) needs
no fourth kernel.  With ``B`` either ``b`` ([K, N], ``trans_b=0``) or ``b.T`` (``b`` is
``[N, K]``, the nn.Linear weight layout, ``trans_b=1``)::

    c[i, :] = a[m0 + i, :] @ B (+ bias)   for 0 <= i < m_valid
    c[i, :] = 0                           for m_valid <= i < c.shape[0]   (zero padding)

A plain matmul is ``m0 = 0, m_valid = M``.  Inputs may be float32 or float16; every load
is converted to float32 and all accumulation is float32; ``c`` is float32.  ``bias``
must always be an array (numba kernels take no None): when ``has_bias == 0`` the caller
passes any float32 vector and the kernel never reads it.

Every bound is checked, so any M, N, K works (not only tile multiples): out-of-range tile
elements load as 0, which adds nothing, and out-of-range outputs are not stored.
"""

from __future__ import annotations

from numba import cuda, float32

from vtnumba.backend.arrays import cdiv

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


# ---------------------------------------------------------------------------- launching
KERNELS = {"naive": matmul_naive_kernel, "smem": matmul_smem_kernel, "regtile": matmul_regtile_kernel}


def launch_config(variant: str, rows: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) covering a ``rows x n`` output for the given ladder step."""
    if variant == "naive":
        return (cdiv(n, 16), cdiv(rows, 16)), (16, 16)
    if variant == "smem":
        return (cdiv(n, TILE), cdiv(rows, TILE)), (TILE, TILE)
    if variant == "regtile":
        return (cdiv(n, BN), cdiv(rows, BM)), (THREADS_X, THREADS_Y)
    raise ValueError(f"variant={variant!r} is not a matmul variant; expected one of {', '.join(KERNELS)}")


def launch_matmul_rows(variant: str, a, b, bias, c, m0: int, m_valid: int, trans_b: bool, stream) -> None:
    """Launch one ladder kernel with the contract in the module docstring (same arguments as
    :func:`vtnumba.kernels.matmul.matmul_rows_host`, plus ``variant`` and ``stream``)."""
    rows, n = c.shape
    if rows == 0 or n == 0:
        return
    grid, block = launch_config(variant, rows, n)
    has_bias = bias is not None
    # Kernels take no None: hand an unused float32 vector (row 0 of c) when there is no bias.
    bias_arg = bias if has_bias else c[0]
    KERNELS[variant][grid, block, stream](a, b, bias_arg, c, int(m0), int(m_valid), int(bool(trans_b)),
                                          int(has_bias))


# Signatures the PTX tests (and the benchmark's ptxas report) compile each kernel for.
_MAT = "{0}[:, ::1]"
_SIG = "void({a}, {b}, float32[::1], float32[:, ::1], int64, int64, int64, int64)"
PTX_SIGNATURES = [
    (name, kernel, _SIG.format(a=_MAT.format(dt), b=_MAT.format(dt)))
    for name, kernel in KERNELS.items()
    for dt in ("float32", "float16")
]
