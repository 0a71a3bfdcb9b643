"""Matrix multiply: ``C = A @ B (+ bias)``, ``x @ W.T (+ bias)``, and TPSP's rows-to-destinations epilogue.

The projection in TPSP (seed: ``tpsp_cuda.py``) is ``partial = x @ W.T`` with ``x`` the
``[T, K_local]`` activations and ``W`` the ``[H, K_local]`` row-parallel weight shard (the
nn.Linear layout).  Three entry points cover what the runtime needs:

* :func:`matmul` -- ``a [M, K] @ b [K, N] (+ bias [N])``;
* :func:`linear` -- ``x [M, K] @ w.T (+ bias)`` for ``w [N, K]``, without transposing ``w``;
* :func:`linear_rows_to` -- ``linear`` whose output rows go to several destinations:
  rows ``[d*R, (d+1)*R)`` land in ``dests[d]`` (``R = rows_per_dest``).  TPSP uses it to
  write the rows of rank r's token shard straight into rank r's inbox, so the
  reduce-scatter needs no separate copy.  Rows past ``M`` in the last destinations are
  zero-filled (the zero padding of the token shards when ``T % tp != 0`` or ``T < tp``).

Inputs are float32, or float16 with float32 accumulation; the output is always float32.

**Where it runs** (see :mod:`vtnumba.kernels._common`): numpy arrays run the host
reference :func:`matmul_rows_host` -- numpy's BLAS, as the design asks ("do not hand-write
what numpy does"); device arrays run one step of the CUDA ladder in
:mod:`vtnumba.kernels.matmul_cuda`, chosen by ``variant`` -- one of :data:`VARIANTS`, in
ladder order ``"naive"`` | ``"smem"`` | ``"regtile"`` | ``"wide"`` | ``"warptile"`` | ``"dbuf"`` |
``"async"``, each described in one line by :data:`LADDER`; when not given, :func:`default_variant`
(``$VTNUMBA_MATMUL_VARIANT`` if set, else :data:`DEFAULT_VARIANT` on a GPU and ``"naive"`` in
the simulator); host arrays take no variant.  The ladder's docstring
explains each step.

**One launch per destination** in :func:`linear_rows_to`: a CUDA launch takes a fixed list
of array arguments, and TPSP's destinations are separate allocations (a peer's inbox is
an IPC mapping of *its* buffer), so they cannot be stacked into one 3-D array.  Each
destination is therefore its own launch over its own row range, all submitted together
in one queue operation.  With ``tp`` destinations of ``R`` rows each this launches exactly
the blocks one big launch would (plus at most one partial tile row per destination).
"""

from __future__ import annotations

import functools
import os

import numpy as np

from vtnumba.backend.arrays import is_int
from vtnumba.kernels._common import HOST, check_array, check_outputs_apart, common_kind, empty, run

#: The CUDA ladder in order, each step with the one idea it adds to the step before (tutorial
#: 04 and ``vtnumba bench kernels`` list and plot the rungs in this order).
LADDER = {
    "naive": "one thread per output element, operands read straight from global memory",
    "smem": "16 x 16 tiles of A and B staged in shared memory, reused by the whole block",
    "regtile": "128 x 128 block tile, 8 x 8 outputs per thread in registers (outer products)",
    "wide": "128-bit loads and stores (4 floats per instruction) and the k-step unrolled: fewer instructions per FMA",
    "warptile": "each warp owns a 64 x 32 sub-tile: a third less shared-memory traffic per FMA",
    "dbuf": "two shared buffers: the next tile's global loads overlap this tile's math",
    "async": "cp.async copies global -> shared without registers, three tiles in flight",
}
VARIANTS = tuple(LADDER)
#: The variant used when none is named, on a GPU.  ``regtile`` is the fastest rung *measured* on a
#: GPU so far (the H200 run of issue 17); the rungs above it are verified in the simulator and
#: compile without spills, but have not been timed yet -- the default moves once they have.
DEFAULT_VARIANT = "regtile"
#: The environment variable that names the variant every device matmul runs when none is named -- the
#: model's projections, TPSP's fused op and its regular forward, and the benchmarks' "matmul
#: alone" at once -- so a GPU run can put the fastest rung it measured behind all of them and
#: still compare like with like.  (The ladder's own rows name their rungs: it does not move them.)
VARIANT_ENV = "VTNUMBA_MATMUL_VARIANT"
_IN_DTYPES = (np.float32, np.float16)
_OUT_DTYPES = (np.float32,)


# ---------------------------------------------------------------------------- host reference
def matmul_rows_host(a, b, bias, c, m0: int, m_valid: int, trans_b: bool) -> None:
    """Host reference of the kernels' contract (same arguments as
    :func:`vtnumba.kernels.matmul_cuda.launch_matmul_rows`)::

        c[i] = a[m0 + i] @ B (+ bias)   for i < m_valid,   c[i] = 0 after that,

    with ``B = b.T if trans_b else b``.  numpy's BLAS does the work; ``b.T`` is a view, so
    the transposed case costs no copy.  float16 inputs are widened to float32 first (numpy
    has no float16 BLAS; its float16 matmul would also round every partial sum).
    """
    rows = c.shape[0]
    n = max(0, min(int(m_valid), rows))
    if n:
        a_rows = a[m0:m0 + n]
        bm = b.T if trans_b else b
        if a_rows.dtype != np.float32:
            a_rows = a_rows.astype(np.float32)
        if bm.dtype != np.float32:
            bm = bm.astype(np.float32)
        np.matmul(a_rows, bm, out=c[:n])
        if bias is not None:
            c[:n] += bias.astype(np.float32, copy=False)
    if n < rows:
        c[n:] = 0.0


# ---------------------------------------------------------------------------- validation
def variant_from_env() -> str | None:
    """The rung ``$VTNUMBA_MATMUL_VARIANT`` names, None when it is unset or empty; ValueError
    naming the variable for anything else (the programs check it at start-up, a usage error)."""
    chosen = os.environ.get(VARIANT_ENV)
    if not chosen:
        return None
    if chosen not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={chosen!r} is not a matmul variant; expected one of {', '.join(VARIANTS)} "
                         "(or unset, for the default)")
    return chosen


def default_variant() -> str:
    """The variant a matmul on device arrays runs when none is named: ``$VTNUMBA_MATMUL_VARIANT``
    (:data:`VARIANT_ENV`) if set, else :data:`DEFAULT_VARIANT` on a GPU and ``"naive"`` in the
    simulator.  Read at every call, so a program (or a test) may change it between calls."""
    chosen = variant_from_env()
    if chosen is not None:
        return chosen
    # The ladder's speed order holds on a GPU.  numba's simulator runs every GPU thread as a
    # Python thread and every syncthreads as a thread barrier, so there the barrier-free naive
    # kernel is the fastest (6x192 @ 192x384: 2.4 s vs 16 s regtile).
    from vtnumba.backend.cuda import simulator_active

    return "naive" if simulator_active() else DEFAULT_VARIANT


def _check_variant(variant, kind: str) -> str:
    if variant is None:
        # (Host arrays run numpy's BLAS whatever the rung: the environment is not read for them.)
        return DEFAULT_VARIANT if kind == HOST else default_variant()
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a matmul variant; expected one of {', '.join(VARIANTS)}")
    return variant


def _check_inputs(a_name, a, b_name, b, trans_b: bool, bias) -> tuple[int, int, int]:
    check_array(a_name, a, ndim=2, dtypes=_IN_DTYPES)
    check_array(b_name, b, ndim=2, dtypes=_IN_DTYPES)
    if np.dtype(a.dtype) != np.dtype(b.dtype):
        raise TypeError(f"{a_name} ({np.dtype(a.dtype).name}) and {b_name} ({np.dtype(b.dtype).name}) "
                        "must have the same dtype")
    M, K = a.shape
    if trans_b:
        N, Kb = b.shape
        layout = f"[N, K] = [?, {K}]"
    else:
        Kb, N = b.shape
        layout = f"[K, N] = [{K}, ?]"
    if Kb != K:
        raise ValueError(f"{b_name} has shape {tuple(b.shape)} but {a_name} has K={K} columns; "
                         f"expected {b_name} shaped {layout}")
    if bias is not None:
        check_array("bias", bias, ndim=1, dtypes=_IN_DTYPES, shape=(N,))
    return M, K, N


def _launch(variant, a, b, bias, c, m0, m_valid, trans_b, stream):
    from vtnumba.kernels.matmul_cuda import launch_matmul_rows  # imports numba.cuda: only for device arrays

    launch_matmul_rows(variant, a, b, bias, c, m0, m_valid, trans_b, stream)


def _matmul_into(name, a_name, a, b_name, b, trans_b, bias, out, queue, backend, variant):
    kind = common_kind({a_name: a, b_name: b, "bias": bias, "out": out})
    variant = _check_variant(variant, kind)
    M, K, N = _check_inputs(a_name, a, b_name, b, trans_b, bias)
    if out is None:
        out = empty(kind, (M, N), np.float32)
    check_array("out", out, ndim=2, dtypes=_OUT_DTYPES, shape=(M, N), writable=True)
    check_outputs_apart({"out": out}, {a_name: a, b_name: b, "bias": bias})
    run(kind, name if kind == HOST else f"{name}[{variant}]", queue, backend, uses=(a, b, bias, out),
        host_fn=lambda: matmul_rows_host(a, b, bias, out, 0, M, trans_b),
        launch_fn=lambda stream: _launch(variant, a, b, bias, out, 0, M, trans_b, stream),
        flops=2 * M * N * K)
    return out


# ---------------------------------------------------------------------------- public API
def matmul(a, b, bias=None, out=None, queue=None, backend=None, variant: str | None = None):
    """``out = a @ b (+ bias)`` for ``a [M, K]``, ``b [K, N]``, ``bias [N]``; returns ``out [M, N]`` float32.

    ``a``/``b`` are both float32 or both float16 (accumulation is float32 either way).
    numpy arrays run the host reference, device arrays the CUDA ``variant``.  With a
    ``queue`` the work is submitted in queue order (asynchronous on asynchronous queues);
    without, it is finished when the call returns.
    """
    return _matmul_into("matmul", "a", a, "b", b, False, bias, out, queue, backend, variant)


def linear(x, w, bias=None, out=None, queue=None, backend=None, variant: str | None = None):
    """``out = x @ w.T (+ bias)`` for ``x [M, K]``, ``w [N, K]`` (nn.Linear layout); returns ``out [M, N]``."""
    return _matmul_into("linear", "x", x, "w", w, True, bias, out, queue, backend, variant)


def linear_rows_to(x, w, bias, dests, rows_per_dest: int, queue=None, backend=None,
                   variant: str | None = None):
    """``x @ w.T (+ bias)`` with output rows ``[d*R, (d+1)*R)`` written to ``dests[d]``.

    ``dests`` is a list of float32 ``[R, N]`` arrays (``R = rows_per_dest``) with
    ``len(dests) * R >= M``; rows of a destination past the end of ``x`` are set to zero.
    Returns ``dests``.  See the module docstring for why this is one launch per destination.
    """
    if not is_int(rows_per_dest) or rows_per_dest < 1:
        raise ValueError(f"rows_per_dest={rows_per_dest!r} must be a positive int")
    R = int(rows_per_dest)
    if not isinstance(dests, (list, tuple)) or not dests:
        raise TypeError(f"dests must be a non-empty list of [rows_per_dest, N] arrays, got {type(dests).__name__}"
                        + (" (empty)" if isinstance(dests, (list, tuple)) else ""))
    arrays = {"x": x, "w": w, "bias": bias}
    arrays.update({f"dests[{d}]": dest for d, dest in enumerate(dests)})
    kind = common_kind(arrays)
    variant = _check_variant(variant, kind)
    M, K, N = _check_inputs("x", x, "w", w, True, bias)
    if len(dests) * R < M:
        raise ValueError(f"dests hold len(dests) * rows_per_dest = {len(dests)} * {R} = {len(dests) * R} rows "
                         f"but x has M={M} rows; expected at least {M}")
    for d, dest in enumerate(dests):
        check_array(f"dests[{d}]", dest, ndim=2, dtypes=_OUT_DTYPES, shape=(R, N), writable=True)
    check_outputs_apart({f"dests[{d}]": dest for d, dest in enumerate(dests)}, {"x": x, "w": w, "bias": bias})
    queue_linear_rows_to(kind, x, w, bias, list(dests), R, queue, backend, variant)
    return dests


def queue_linear_rows_to(kind: str, x, w, bias, dests: list, rows_per_dest: int, queue=None, backend=None,
                         variant: str | None = None) -> None:
    """:func:`linear_rows_to` without its argument checks, for a caller that checked its arrays
    once and queues this per chunk over slices it derived (the TPSP strategies; see the same
    pair in :mod:`vtnumba.kernels.peer`).  ``kind``: "host" or "device" (see ``common_kind``);
    a wrong argument here is not named, it is a bug."""
    variant = _check_variant(variant, kind)
    R = rows_per_dest
    M, K = x.shape
    N = w.shape[0]

    def host_fn():
        # Widen float16 once, not once per destination.
        xf, wf = (x, w) if x.dtype == np.float32 else (x.astype(np.float32), w.astype(np.float32))
        for d, dest in enumerate(dests):
            matmul_rows_host(xf, wf, bias, dest, d * R, M - d * R, True)

    launch_fn = None
    if kind != HOST:
        # The launcher itself, bound to its arguments: a reader (or a debugger) stepping from
        # here goes straight into matmul_cuda, without coming back to this file.
        from vtnumba.kernels.matmul_cuda import launch_linear_rows_to  # imports numba.cuda

        launch_fn = functools.partial(launch_linear_rows_to, variant, x, w, bias, dests, R)
    run(kind, "linear_rows_to" if kind == HOST else f"linear_rows_to[{variant}]", queue, backend,
        uses=(x, w, bias, *dests),
        host_fn=host_fn, launch_fn=launch_fn, flops=2 * M * N * K, dests=len(dests))


__all__ = ["LADDER", "VARIANTS", "DEFAULT_VARIANT", "VARIANT_ENV", "default_variant", "matmul", "linear",
           "linear_rows_to", "queue_linear_rows_to",
           "matmul_rows_host"]
