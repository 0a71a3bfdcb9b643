"""CUDA packed attention: one block per (query token, head), the sentence's scores in shared memory.

This module imports ``numba.cuda``; :mod:`vtnumba.kernels.attention` loads it only for device
arrays.  The contract is the host reference's (:func:`vtnumba.kernels.attention.attention_host`);
here is how one block of ``blockDim.x`` threads computes ``out[i, head h]``:

1. **Which sentence?**  A binary search of ``offsets`` for token ``i`` gives the sentence's
   first row ``s0`` and length ``n``.  The block only ever reads rows ``s0 .. s0+n-1``: no
   other sentence and no padding exists for it, which is the whole "packed" contract.
2. **Scores.**  Thread ``t`` takes keys ``j = t, t + blockDim, ...`` and writes
   ``scores[j] = q_i . k_j`` (a ``head_dim``-long dot product) to shared memory.
3. **Softmax.**  After a barrier every thread reads the whole row for its maximum ``m`` (a
   shared-memory broadcast; a tree reduction would cost log2(blockDim) barriers), the
   threads replace their scores by ``exp(score - m)`` (never overflows), and after another
   barrier every thread sums the row for the denominator.
4. **Weighted sum of V.**  Thread ``t`` computes the output columns ``c = t, t + blockDim, ...``
   of this head: ``sum_j p_j * v_j[c]``, reading the probabilities from shared memory.  The
   V bias is added once at the end (the probabilities sum to 1).

**Block size.**  Any size works (every loop strides by ``blockDim.x``).  On a GPU it is
the next power of two >= the longest sentence, at most 128 (:func:`block_threads`): up to
128 tokens every key has its own thread in step 2, and a longer sentence's keys are strided
over the block's threads.  In numba's simulator every GPU thread is a Python thread and
every ``syncthreads`` a barrier between them, so there the blocks have at most 8 threads
(each taking several keys) -- an order of magnitude faster, and the same arithmetic.

**What a faster kernel would do** (FlashAttention's recipe): this one is simple and correct,
but it re-reads every key and value row from global memory once per *query*, and a block of
``n`` threads leaves most lanes idle in step 4.  A fast kernel processes a *tile* of queries
per block: it stages tiles of K and V in shared memory once for all of them, computes the
``Q_tile @ K_tile^T`` scores with tensor-core matrix multiplies, keeps a running (online)
softmax maximum and sum per query so the scores never need to be stored whole, and
accumulates ``P @ V`` in registers -- reading each K/V element once per query *tile* and
doing the arithmetic on tensor cores.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from vtnumba.kernels.norm_cuda import threads_for

#: The longest sentence the kernel takes: the size of its shared score buffer (2 KiB of
#: float32; BERT has 512 positions).  :func:`vtnumba.kernels.attention.attention` refuses longer ones.
MAX_KEYS = 512


@cuda.jit
def attention_kernel(qkv, bias, has_bias, offsets, num_heads, head_dim, out):
    """Block ``(i, h)``: ``out[i, h*d : (h+1)*d]`` for query token ``i``, head ``h`` (module docstring)."""
    # Scores of this query against its sentence's keys; a separate line from any other shared
    # array (in the simulator, two shared arrays declared on one line alias each other).
    scores = cuda.shared.array(MAX_KEYS, float32)
    i = cuda.blockIdx.x
    h = cuda.blockIdx.y
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x

    # 1. The sentence of token i: the last b with offsets[b] <= i.
    lo = 0
    hi = offsets.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= i:
            lo = mid
        else:
            hi = mid
    s0 = offsets[lo]
    n = offsets[lo + 1] - s0
    K = num_heads * head_dim
    qc = h * head_dim  # this head's query columns; its keys start at K + qc, its values at 2K + qc
    # On a GPU the host checks the offsets only when it reads them; with a caller's max_len it
    # trusts them.  A sentence longer than MAX_KEYS must not write past the score buffer (that
    # corrupts memory silently), nor be cut to its first MAX_KEYS keys (a quietly wrong answer);
    # one that reaches past qkv's rows (offsets beyond T) must not read there (an illegal
    # address kills the whole CUDA context), and an empty or reversed one has no keys to
    # average.  Their rows come out NaN, which every check downstream sees.  (The whole block
    # takes this branch: s0 and n are the same for all its threads, so no barrier is skipped.)
    if n < 1 or n > MAX_KEYS or s0 < 0 or s0 + n > qkv.shape[0]:
        for c in range(t, head_dim, nt):
            out[i, qc + c] = float32(math.nan)
        return

    # 2. scores[j] = q_i . k_j for this thread's keys.
    for j in range(t, n, nt):
        acc = float32(0.0)
        for c in range(head_dim):
            q = qkv[i, qc + c]
            k = qkv[s0 + j, K + qc + c]
            if has_bias:
                q += bias[qc + c]
                k += bias[K + qc + c]
            acc += q * k
        scores[j] = acc
    cuda.syncthreads()  # every score is written before anyone reads the row

    # 3. Softmax.  Every thread reads the whole row to find its maximum -- n reads of one shared
    # address at a time, which the hardware broadcasts to all threads -- instead of a tree
    # reduction with log2(blockDim) barriers.  Shifting by the maximum keeps exp from overflowing.
    m = scores[0]
    for j in range(1, n):
        m = max(m, scores[j])
    cuda.syncthreads()  # everyone has the maximum before the scores are overwritten
    for j in range(t, n, nt):
        scores[j] = math.exp(scores[j] - m)
    cuda.syncthreads()  # every exponential is written before the sums below read them
    total = float32(0.0)
    for j in range(n):
        total += scores[j]
    inv = float32(1.0) / total

    # 4. out[i, c] = sum_j p_j * v_j[c] for this thread's columns of the head.
    for c in range(t, head_dim, nt):
        acc = float32(0.0)
        for j in range(n):
            acc += scores[j] * qkv[s0 + j, 2 * K + qc + c]
        v = acc * inv
        if has_bias:
            v += bias[2 * K + qc + c]
        out[i, qc + c] = v


#: Threads per block at most: on a GPU, and in the simulator (see the module docstring).
MAX_BLOCK = 128
MAX_BLOCK_SIMULATOR = 8


def block_threads(max_len: int) -> int:
    """Threads per (query, head) block for sentences of up to ``max_len`` tokens."""
    from vtnumba.backend.arrays import simulator_active

    return min(threads_for(int(max_len)), MAX_BLOCK_SIMULATOR if simulator_active() else MAX_BLOCK)


def launch_attention(qkv, bias, offsets, num_heads, head_dim, max_len, out, stream, *, threads=None) -> None:
    """Launch :func:`attention_kernel` on a ``(T, num_heads)`` grid (host twin:
    :func:`vtnumba.kernels.attention.attention_host`).  ``threads`` (1..1024, CUDA's limit)
    overrides :func:`block_threads`."""
    T = int(qkv.shape[0])
    if T == 0:
        return
    threads = block_threads(max_len) if threads is None else int(threads)
    if not 1 <= threads <= 1024:
        raise ValueError(f"threads={threads} must be in 1..1024 (CUDA's largest block)")
    # Kernels take no None: an absent bias is replaced by a row of ``qkv`` (same type), which
    # the has_bias flag guarantees is never read.
    attention_kernel[(T, int(num_heads)), threads, stream](
        qkv, qkv[0] if bias is None else bias, int(bias is not None), offsets, int(num_heads), int(head_dim), out)


PTX_SIGNATURES = [
    ("attention", attention_kernel,
     "void(float32[:, ::1], float32[::1], int64, int64[::1], int64, int64, float32[:, ::1])"),
]
