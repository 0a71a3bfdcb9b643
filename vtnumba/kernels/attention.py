"""Multi-head self-attention over packed variable-length sentences, each attending only to itself.

A batch of ``B`` sentences is one packed matrix of ``T`` token rows (no padding rows: the
dense layers spend no work on padding); ``offsets [B + 1]`` says where each sentence starts
and ends (sentence ``b`` is rows ``offsets[b] .. offsets[b+1] - 1``).  For every token ``i``
of sentence ``b`` and every head ``h`` (``K = num_heads * head_dim``, ``c = h * head_dim``)::

    q_i = qkv[i, c : c+d] + bias[c : c+d]                 # queries: already scaled by 1/sqrt(d)
    k_j = qkv[j, K+c : K+c+d] + bias[K+c : K+c+d]         # for the keys j of sentence b only
    v_j = qkv[j, 2K+c : 2K+c+d] + bias[2K+c : 2K+c+d]
    out[i, c : c+d] = sum_j softmax_j(q_i . k_j) * v_j

``qkv`` is ``[T, 3K]`` -- this rank's query, key and value columns, heads contiguous (a
tensor-parallel rank holds whole heads, so attention needs no communication); ``bias``
``[3K]`` (or None) is added on the way in; ``out`` is ``[T, K]`` in the same head order.
The scale ``1/sqrt(head_dim)`` is *not* applied here: the model folds it into the query
weights once (for ``head_dim`` 64 it is 1/8, a power of two, so that is bit-exact).

**The contract that matters: no padding ever reaches a real token's output.**  Token ``i``
sees exactly the keys of its own sentence -- not those of its neighbours in the packed
stream, and nothing of any padding the implementation may use internally.

Two implementations, one contract (the one launch pattern of :mod:`vtnumba.kernels._common`):

* **host** (:func:`attention_host`, the ``cpu`` target): packed rows -> padded per-head blocks
  ``[B, heads, L, d]`` (``L`` = the longest sentence) -> two batched BLAS products -> packed
  rows.  Padded *keys* get weight exactly 0 (``-inf`` before the exponential), padded
  *queries* produce rows that are never copied back, and padding rows are zero-filled, not
  left uninitialised (``0 * NaN = NaN`` would otherwise leak through a product).  The copies
  are numba loops over contiguous runs (memcpy speed, with the QKV bias added on the way
  in); the products are numpy's batched matmul (one gemm per sentence and head); the
  softmax is split so the exponential runs in numpy's SIMD ``exp``.  Its temporaries are an
  :class:`AttentionWorkspace` -- the caller may carve it from a step arena.
* **device** (:mod:`vtnumba.kernels.attention_cuda`): one block per (query token, head), the
  sentence's scores in shared memory; see that module for what a faster kernel would do.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from vtnumba.backend.arrays import check_int, check_outputs_apart, host_view, to_host
from vtnumba.kernels._common import HOST, _resolve_backend, check_array, common_kind, empty, run

_F32 = (np.float32,)

# Flags of the host loops.  error_model="numpy" drops Python's ZeroDivisionError check on "/",
# which otherwise blocks SIMD vectorisation of the loops that divide.  fastmath only where no
# infinities are involved: the masking step writes -inf on purpose.
_COPY_JIT = dict(cache=True, nogil=True, error_model="numpy")
_VEC_JIT = dict(cache=True, nogil=True, fastmath=True, error_model="numpy")


class AttentionWorkspace(NamedTuple):
    """The host reference's temporaries for ``B`` sentences of at most ``L`` tokens.

    ``q``, ``k``, ``v``, ``ctx``: ``[B, heads, L, d]``; ``scores``: ``[B, heads, L, L]``; all float32.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scores: np.ndarray
    ctx: np.ndarray

    @staticmethod
    def shapes(num_sentences: int, max_len: int, num_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
        """Field name -> shape, for a caller that allocates the arrays itself (e.g. from a StepArena)."""
        num_sentences = check_int("num_sentences", num_sentences, min_value=0)
        max_len = check_int("max_len", max_len, min_value=0)
        num_heads = check_int("num_heads", num_heads, min_value=1)
        head_dim = check_int("head_dim", head_dim, min_value=1)
        blocks = (num_sentences, num_heads, max_len, head_dim)
        return {"q": blocks, "k": blocks, "v": blocks, "scores": (num_sentences, num_heads, max_len, max_len),
                "ctx": blocks}

    @classmethod
    def allocate(cls, num_sentences: int, max_len: int, num_heads: int, head_dim: int, alloc=None):
        """A workspace whose arrays come from ``alloc(shape) -> float32 array`` (default ``np.empty``)."""
        alloc = alloc or (lambda shape: np.empty(shape, np.float32))
        return cls(**{name: alloc(shape) for name, shape in cls.shapes(num_sentences, max_len, num_heads,
                                                                        head_dim).items()})


# ---------------------------------------------------------------------------- host reference
@numba.njit(**_COPY_JIT)
def _scatter_heads(qkv, bias, offsets, q, k, v):
    # qkv [T, 3K] (+ bias [3K]) -> q, k, v [B, nh, L, d]; padding rows zeroed so that nothing
    # uninitialised (possibly NaN: 0 * NaN = NaN) ever enters a product.
    B, nh, L, d = q.shape
    K = nh * d
    for b in range(B):
        s = offsets[b]
        n = offsets[b + 1] - s
        for h in range(nh):
            c = h * d
            for i in range(n):
                row = qkv[s + i]
                for j in range(d):
                    q[b, h, i, j] = row[c + j] + bias[c + j]
                    k[b, h, i, j] = row[K + c + j] + bias[K + c + j]
                    v[b, h, i, j] = row[2 * K + c + j] + bias[2 * K + c + j]
            for i in range(n, L):
                for j in range(d):
                    q[b, h, i, j] = 0.0
                    k[b, h, i, j] = 0.0
                    v[b, h, i, j] = 0.0


@numba.njit(**_COPY_JIT)
def _softmax_shift_mask_(scores, offsets):
    # Before exp: subtract each real query row's max over its real keys (exp never overflows)
    # and set padded keys to -inf (exp gives exactly 0).  Padded query rows are never read
    # back; they are set to 0 so they stay finite.
    B, nh, L, _ = scores.shape
    for b in range(B):
        n = offsets[b + 1] - offsets[b]
        for h in range(nh):
            for i in range(L):
                r = scores[b, h, i]
                if i >= n:
                    r[:] = 0.0
                    continue
                m = r[0]
                for j in range(1, n):
                    m = max(m, r[j])
                for j in range(n):
                    r[j] -= m
                for j in range(n, L):
                    r[j] = -np.inf


@numba.njit(**_VEC_JIT)
def _softmax_normalise_(scores):
    B, nh, L, _ = scores.shape
    for b in range(B):
        for h in range(nh):
            for i in range(L):
                r = scores[b, h, i]
                s = 0.0
                for j in range(L):
                    s += r[j]
                inv = np.float32(1.0 / s)
                for j in range(L):
                    r[j] *= inv


@numba.njit(**_COPY_JIT)
def _gather_heads(ctx, offsets, out):
    # ctx [B, nh, L, d] -> out [T, nh * d], real rows only, heads side by side again.
    B, nh, _, d = ctx.shape
    for b in range(B):
        s = offsets[b]
        n = offsets[b + 1] - s
        for i in range(n):
            row = out[s + i]
            for h in range(nh):
                for j in range(d):
                    row[h * d + j] = ctx[b, h, i, j]


def attention_host(qkv, bias, offsets, num_heads: int, head_dim: int, max_len: int, out, workspace=None) -> None:
    """Host reference of :func:`vtnumba.kernels.attention_cuda.launch_attention` (same arguments
    minus the stream, plus where the temporaries live: an :class:`AttentionWorkspace` for
    ``(B, max_len)``, allocated when None)."""
    B, K = int(offsets.shape[0]) - 1, num_heads * head_dim
    ws = workspace or AttentionWorkspace.allocate(B, max_len, num_heads, head_dim)
    _scatter_heads(qkv, np.zeros(3 * K, np.float32) if bias is None else bias, offsets, ws.q, ws.k, ws.v)
    scores = np.matmul(ws.q, ws.k.transpose(0, 1, 3, 2), out=ws.scores)  # one gemm per (sentence, head)
    _softmax_shift_mask_(scores, offsets)
    np.exp(scores, out=scores)
    _softmax_normalise_(scores)
    np.matmul(scores, ws.v, out=ws.ctx)
    _gather_heads(ws.ctx, offsets, out)


# ---------------------------------------------------------------------------- public API
def _launch(qkv, bias, offsets, num_heads, head_dim, max_len, out, stream):
    from vtnumba.kernels.attention_cuda import launch_attention  # imports numba.cuda: device arrays only

    launch_attention(qkv, bias, offsets, num_heads, head_dim, max_len, out, stream)


def _check_offsets(offsets: np.ndarray, T: int) -> int:
    """Validate host offsets against ``T`` rows; returns the longest sentence."""
    lengths = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != T or (lengths < 1).any():
        shown = offsets.tolist() if offsets.size <= 8 else offsets.tolist()[:8] + ["..."]
        raise ValueError(f"offsets={shown} must start at 0, end at T={T} and grow by >= 1 "
                         "(every sentence has at least one token)")
    return int(lengths.max())


def _check_workspace(workspace, B: int, L: int, nh: int, d: int) -> None:
    if not isinstance(workspace, AttentionWorkspace):
        raise TypeError(f"workspace must be an AttentionWorkspace or None, got {type(workspace).__name__}")
    for name, shape in AttentionWorkspace.shapes(B, L, nh, d).items():
        check_array(f"workspace.{name}", getattr(workspace, name), ndim=4, dtypes=_F32, shape=shape)


def attention(qkv, offsets, num_heads: int, head_dim: int, *, bias=None, out=None, max_len: int | None = None,
              workspace: AttentionWorkspace | None = None, queue=None, backend=None):
    """Packed multi-head self-attention (see the module docstring); returns ``out [T, num_heads * head_dim]``.

    ``offsets`` (int64 ``[B + 1]``) lives where ``qkv`` does (numpy with numpy, a device
    array with device arrays).  ``max_len`` is the longest sentence: computed from
    ``offsets`` when None (on a GPU that reads the offsets back; the model passes it) --
    with a ``queue``, after the work queued on it has finished, since that work may be what
    writes the offsets.  ``workspace`` (host only) holds the temporaries; allocated when None.
    """
    kind = common_kind({"qkv": qkv, "offsets": offsets, "bias": bias, "out": out})
    num_heads = check_int("num_heads", num_heads, min_value=1)
    head_dim = check_int("head_dim", head_dim, min_value=1)
    K = num_heads * head_dim
    check_array("qkv", qkv, ndim=2, dtypes=_F32, shape=(None, 3 * K))
    T = int(qkv.shape[0])
    check_array("offsets", offsets, ndim=1, dtypes=(np.int64,))
    B = int(offsets.shape[0]) - 1
    if B < 1:
        raise ValueError(f"offsets has shape {tuple(offsets.shape)}; expected [B + 1] with B >= 1 sentences")
    if bias is not None:
        check_array("bias", bias, ndim=1, dtypes=_F32, shape=(3 * K,))
    if max_len is None and queue is not None:
        # The offsets are read now, on this thread, but the work queued before this call runs
        # later (a threaded cpu queue, a GPU stream -- and on a GPU copy_to_host reads on the
        # default stream, which does not wait for the backend's non-blocking streams): if that
        # work writes the offsets, reading them first would see stale values.  Let it finish.
        _resolve_backend(kind, queue, backend).synchronize(queue)
    if max_len is None or kind == HOST or host_view(offsets) is not None:
        # (Where the offsets can be read without a copy -- the host, the simulator -- they are
        # always checked; on a GPU only when max_len is not given, as reading them back syncs.)
        longest = _check_offsets(to_host(offsets), T)
        if max_len is not None and check_int("max_len", max_len, min_value=1) != longest:
            raise ValueError(f"max_len={max_len} but the longest sentence in offsets has {longest} tokens")
        max_len = longest
    max_len = check_int("max_len", max_len, min_value=1)
    if kind != HOST:
        from vtnumba.kernels.attention_cuda import MAX_KEYS  # device arrays: numba.cuda is loaded anyway

        if max_len > MAX_KEYS:
            raise ValueError(f"a sentence has {max_len} tokens; the CUDA attention kernel takes at most {MAX_KEYS} "
                             "(its shared-memory score buffer)")
    if out is None:
        out = empty(kind, (T, K), np.float32)
    check_array("out", out, ndim=2, dtypes=_F32, shape=(T, K), writable=True)
    # Every block reads the K and V rows of its whole sentence while other blocks write their
    # rows of out: an out inside qkv would be read after another block overwrote it (on the
    # host the workspace happens to hide that; a GPU's concurrent blocks would not).
    check_outputs_apart({"out": out}, {"qkv": qkv, "bias": bias, "offsets": offsets})
    if workspace is not None:
        if kind != HOST:
            raise ValueError("workspace is for the host reference; the CUDA kernel keeps its scores in shared memory")
        _check_workspace(workspace, B, max_len, num_heads, head_dim)
    run(kind, "attention", queue, backend,
        host_fn=lambda: attention_host(qkv, bias, offsets, num_heads, head_dim, max_len, out, workspace),
        launch_fn=lambda stream: _launch(qkv, bias, offsets, num_heads, head_dim, max_len, out, stream),
        tokens=T, heads=num_heads)
    return out


__all__ = ["AttentionWorkspace", "attention", "attention_host"]
