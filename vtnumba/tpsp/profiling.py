"""Deciding when TPSP runs: static profiles, measured chunk/threshold search, and the parity check.

Upstream: vLLM's ``profile_tpsp`` in ``vllm/model_executor/tpsp.py``.  ``backend.profile(ops_groups,
max_batched_tokens, ...)`` does, for a list of :class:`~vtnumba.tpsp.config.TPSPOpsGroup`:

1. **open** one handle per group (if any rank cannot, every rank gets ``None``);
2. **config**: the given :class:`~vtnumba.tpsp.config.TPSPConfig`, or the backend's
   default, or -- with ``search=True`` -- a measured *chunk search*: microchunk sizes
   (granularity x powers of two, and the whole shard) are timed at ``max_batched_tokens``,
   each the second-fastest of a few trials, then the two best are timed again;
3. **threshold**: the given ``threshold_tokens`` (default 1: always fused), or -- with
   ``search=True`` -- a measured scan: from ``max_batched_tokens`` *down* through halving
   token counts, the fused op (all groups summed) against the regular forward, trials
   interleaved; a size counts as a win only when the lower 95 % confidence bound of the
   saving is clearly positive.  The threshold is the smallest size of the unbroken run of
   wins from the top (scanning downwards means a budget that runs out still leaves a
   conservative threshold, measured where it matters most);
4. **parity check**: the fused op and the regular forward on the same small batch must
   agree; if they do not on *any* rank, every rank disables TPSP (with a warning).

Every time is the *slowest rank's* (an all-reduce MAX per trial, after a barrier): a
collective is as slow as its slowest member.  ``budget_s`` bounds the search; whether it
has run out is also agreed by all-reduce, so every rank stops at the same step.  A
profile that does not enable TPSP warns (:class:`TPSPDisabledWarning`), closes its handles
and returns ``None``: callers use the regular forward.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from vtnumba.backend.arrays import is_int, to_host
from vtnumba.dist import all_ranks_ready, allreduce_max, barrier, get_group
from vtnumba.dist.comm import agree_errors, allgather_bytes
from vtnumba.tpsp.config import TPSPConfig, TPSPContext, TPSPProfile, check_ops_groups
from vtnumba.tpsp.norm_type import get_tpsp_norm_type
from vtnumba.tpsp.regular import regular_matmul_rs_norm_ag
from vtnumba.tpsp.sharding import shard_rows

_LOG = logging.getLogger(__name__)

_SCREEN_TRIALS = 3
_TRIALS = 5
_T_975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365}
PARITY_RTOL = 2e-4
PARITY_ATOL = 2e-4


class TPSPDisabledWarning(RuntimeWarning):
    """TPSP was not enabled by a profile; the regular forward will be used."""


@dataclass
class ProfileReport:
    """What a profile measured (kept on the returned context as ``context.report``)."""

    #: The chunk search, per ops group name -- ``[(chunk_tokens_per_rank, ms), ...]`` in the order tried, each
    #: the second-fastest of a few trials of the slowest rank.  Empty without ``search=True``.
    chunks: dict = field(default_factory=dict)
    #: The :class:`~vtnumba.tpsp.config.TPSPConfig` each ops group runs with (given, default or searched).
    chosen: dict = field(default_factory=dict)
    #: The threshold scan, from the largest size down -- rows ``(tokens, regular_ms, fused_ms, lower_saving_ms)``;
    #: times are medians of all groups summed, ``lower_saving_ms`` the lower 95 % bound of regular - fused.
    threshold_scan: list = field(default_factory=list)
    #: The largest absolute difference between the fused and the regular outputs in the parity
    #: check (this rank's); None when the check did not run.
    parity_max_err: float | None = None
    #: Wall-clock seconds the whole profile took on this rank.
    elapsed_s: float = 0.0



class _Runner:
    """One ops group's fused and regular paths on random inputs of a given token count."""

    def __init__(self, backend, handle, ops, group):
        self.backend, self.handle, self.ops, self.group = backend, handle, ops, group
        self.norm = get_tpsp_norm_type(ops.norm)
        self.eps = float(ops.norm.eps)
        self.proj = backend.prepare_weights(handle, ops.projection)
        self.normw = backend.prepare_weights(handle, ops.norm)
        self.K = int(self.proj.weight.shape[1])
        self.H = int(self.proj.weight.shape[0])
        self._inputs: dict[int, tuple] = {}

    def inputs(self, tokens: int):
        if tokens not in self._inputs:
            tp, rank = self.group.size, self.group.rank
            rng = np.random.default_rng(1831 + 7919 * rank + tokens)
            x = rng.standard_normal((tokens, self.K), dtype=np.float32)
            # The residual is one [T, H] tensor seen by all ranks: same seed everywhere, then sharded.
            full = np.random.default_rng(407 + tokens).standard_normal((tokens, self.H), dtype=np.float32)
            R = shard_rows(tokens, tp)
            shard = np.zeros((R, self.H), dtype=np.float32)
            lo = min(rank * R, tokens)
            shard[: min(R, tokens - lo)] = full[lo:lo + R]
            to = self.backend._to_target
            self._inputs[tokens] = (to(x), to(shard))
            if len(self._inputs) > 3:  # keep memory bounded during a long scan
                self._inputs.pop(next(iter(self._inputs)))
        return self._inputs[tokens]

    def fused(self, tokens: int, config=None):
        x, res = self.inputs(tokens)
        return self.backend.tpsp_matmul_rs_norm_ag(self.handle, x, self.proj.weight, self.proj.bias, res,
                                                   self.normw.weight, self.eps, self.normw.bias, norm=self.norm,
                                                   config=config)

    def regular(self, tokens: int):
        x, res = self.inputs(tokens)
        return regular_matmul_rs_norm_ag(self.group, x, self.proj.weight, self.proj.bias, res, self.normw.weight,
                                         self.eps, self.normw.bias, norm=self.norm,
                                         timeout_s=self.backend.timeout_s)


def _time_ms(fn, group, backend) -> float:
    """Wall time of ``fn()`` on the slowest rank, in ms (barrier first so all ranks start together)."""
    barrier(group, backend.timeout_s)
    t0 = time.perf_counter()
    fn()
    backend.data_backend.synchronize()
    return allreduce_max((time.perf_counter() - t0) * 1e3, group, "TPSP profile timing", backend.timeout_s)


def _expired(deadline: float, group, timeout_s: float) -> bool:
    return allreduce_max(1.0 if time.monotonic() >= deadline else 0.0, group, "TPSP profile timing", timeout_s) > 0


def chunk_candidates(granularity: int, shard_rows_max: int) -> list[int]:
    """granularity * 2^k below the shard, then the whole shard (one chunk, no pipelining)."""
    out, c = [], granularity
    while c < shard_rows_max:
        out.append(c)
        c *= 2
    out.append(shard_rows_max)
    return out


def _scan_chunk(runner: _Runner, tokens: int, deadline: float, report: ProfileReport) -> TPSPConfig | None:
    backend, group = runner.backend, runner.group
    rows = min(shard_rows(tokens, group.size), runner.handle.max_chunk_rows)
    results: list[tuple[int, float]] = []
    # The search varies the microchunk under the handle's SM budget (a GPU's exchange bound).
    budget = runner.handle.config.sm_count_target
    for chunk in chunk_candidates(backend.tpsp_chunk_granularity, rows):
        cfg = TPSPConfig(chunk, sm_count_target=budget)
        _time_ms(lambda cfg=cfg: runner.fused(tokens, cfg), group, backend)  # warm-up (first touch, jit)
        trials = []
        for _ in range(_SCREEN_TRIALS):
            trials.append(_time_ms(lambda cfg=cfg: runner.fused(tokens, cfg), group, backend))
        results.append((chunk, sorted(trials)[1]))
        if _expired(deadline, group, backend.timeout_s):
            break
    report.chunks[runner.ops.name] = results
    if not results:
        return None
    finalists = sorted(results, key=lambda r: r[1])[:2]
    if len(finalists) > 1 and not _expired(deadline, group, backend.timeout_s):
        retimed = []
        for chunk, _ in finalists:
            cfg = TPSPConfig(chunk, sm_count_target=budget)
            times = [_time_ms(lambda cfg=cfg: runner.fused(tokens, cfg), group, backend)
                     for _ in range(_SCREEN_TRIALS)]
            retimed.append((chunk, sorted(times)[1]))
        finalists = retimed
    best = min(finalists, key=lambda r: r[1])[0]
    return TPSPConfig(best, sm_count_target=budget)


def _measure_size(runners, tokens: int, report: ProfileReport) -> tuple[float, float, float]:
    """(regular ms, fused ms, lower 95% bound of the saving in ms) for ``tokens``, all groups summed."""
    backend, group = runners[0].backend, runners[0].group
    for r in runners:  # warm-up both paths
        _time_ms(lambda r=r: r.regular(tokens), group, backend)
        _time_ms(lambda r=r: r.fused(tokens), group, backend)
    regular, fused = [], []
    for trial in range(_TRIALS):
        order = (False, True) if trial % 2 == 0 else (True, False)
        sums = {False: 0.0, True: 0.0}
        for r in runners:
            for use_fused in order:
                fn = (lambda r=r: r.fused(tokens)) if use_fused else (lambda r=r: r.regular(tokens))
                sums[use_fused] += _time_ms(fn, group, backend)
        regular.append(sums[False])
        fused.append(sums[True])
    savings = [a - b for a, b in zip(regular, fused, strict=True)]
    lower = statistics.mean(savings) - _T_975[_TRIALS] * statistics.stdev(savings) / math.sqrt(_TRIALS)
    row = (tokens, statistics.median(regular), statistics.median(fused), lower)
    report.threshold_scan.append(row)
    return row[1], row[2], lower


def threshold_sizes(max_batched_tokens: int, smallest: int = 1) -> list[int]:
    """max_batched_tokens, then halving down to ``smallest`` (the scan goes from large to small)."""
    sizes, t = [], max_batched_tokens
    while True:
        sizes.append(t)
        if t <= smallest:
            return sizes
        t = max(smallest, t // 2)


def _scan_threshold(runners, max_batched_tokens: int, deadline: float, report: ProfileReport) -> tuple[int | None, str]:
    group, backend = runners[0].group, runners[0].backend
    threshold = None
    for tokens in threshold_sizes(max_batched_tokens, smallest=min(max_batched_tokens, 16)):
        regular_ms, _, lower = _measure_size(runners, tokens, report)
        if lower <= max(0.05, 0.02 * regular_ms):
            break  # the run of wins from the top ends here
        threshold = tokens
        if _expired(deadline, group, backend.timeout_s):
            break
    if threshold is None:
        return None, "the fused op was not measurably faster than the regular forward at max_batched_tokens"
    return threshold, ""


def _host(arr) -> np.ndarray:
    return to_host(arr)


def _parity(runners, report: ProfileReport) -> tuple[bool, str]:
    worst, detail = 0.0, ""
    ok = True
    for r in runners:
        tokens = min(r.handle.max_batched_tokens, r.group.size * 5 + 1)
        try:
            g_fused, res_fused = (_host(a).copy() for a in r.fused(tokens))
        except Exception as exc:  # noqa: BLE001 - a fused call that fails is a parity failure too
            return False, f"{r.ops.name}: the fused op failed: {exc}"
        g_reg, res_reg = (_host(a) for a in r.regular(tokens))
        for what, a, b in (("gathered", g_fused, g_reg), ("new_residual", res_fused, res_reg)):
            err = float(np.max(np.abs(a - b))) if a.size else 0.0
            worst = max(worst, err)
            if not np.allclose(a, b, rtol=PARITY_RTOL, atol=PARITY_ATOL) or not np.all(np.isfinite(a)):
                ok = False
                detail = f"{r.ops.name}: {what} differs from the regular forward by up to {err:.3g}"
    report.parity_max_err = worst
    return ok, detail


def profile_tpsp(backend, ops_groups, max_batched_tokens: int, *, search: bool = False,
                 threshold_tokens: int | None = None, config=None, budget_s: float = 60.0,
                 parity_check: bool = True) -> TPSPContext | None:
    """Open, configure and (optionally) measure TPSP for ``ops_groups``; see the module docstring."""
    if backend is None:
        raise ValueError("TPSP profiling requires a backend")
    if backend.closed:
        raise RuntimeError(f"{type(backend).__name__} is closed")
    group = get_group(backend.group_name)
    # Every rank checks its own arguments, then the ranks agree -- on whether all passed and on
    # the arguments themselves -- before any collective: a rank that refused would leave the
    # others waiting for it until the timeout, and ranks with different thresholds would take
    # different paths at the same call (fused on one, regular on another: a hang).
    error = None
    try:
        groups = check_ops_groups(ops_groups)
        if not is_int(max_batched_tokens) or max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens={max_batched_tokens!r} must be a positive int")
        if threshold_tokens is not None and (not is_int(threshold_tokens)
                                             or not 1 <= threshold_tokens <= max_batched_tokens):
            raise ValueError(f"threshold_tokens={threshold_tokens!r} must be an int in 1..max_batched_tokens="
                             f"{max_batched_tokens}")
        if isinstance(budget_s, (bool, np.bool_)) or not isinstance(budget_s, (int, float, np.integer, np.floating)) \
                or not 0 < budget_s < math.inf:
            raise ValueError(f"budget_s={budget_s!r} must be a positive number of seconds")
        for name, flag in (("search", search), ("parity_check", parity_check)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name}={flag!r} must be True or False")  # ('no' would be truthy)
        if config is not None and not isinstance(config, TPSPConfig):
            config = TPSPConfig(config)  # an int microchunk; TPSPConfig validates it
    except (ValueError, TypeError) as exc:
        error = exc
    agree_errors(error, group, context="profile", timeout_s=backend.timeout_s)
    # The ops groups too: each is opened, measured and checked collectively, in order -- ranks
    # with other groups (another count, names, widths or dtypes) waited for each other's calls
    # until the timeout, and then blamed the parity check.  (Not the projection's input width:
    # a row-parallel shard of K may be a row narrower on some ranks.)
    # The norm's kind and eps, and which biases exist, too: a rank normalising differently only
    # showed up later, as a failed parity check -- a warning and the regular forward.
    def norm_kind(norm):
        try:
            return get_tpsp_norm_type(norm)
        except (TypeError, ValueError) as exc:  # (said on every rank alike: the shapes differ or not)
            return f"unknown ({exc})"

    shapes = [(ops.name, int(ops.projection.weight.shape[0]), np.dtype(ops.projection.weight.dtype).name,
               tuple(ops.norm.weight.shape), norm_kind(ops.norm), float(getattr(ops.norm, "eps", math.nan)),
               getattr(ops.projection, "bias", None) is not None, getattr(ops.norm, "bias", None) is not None)
              for ops in groups]
    mine = repr((int(max_batched_tokens), threshold_tokens, bool(search), config, float(budget_s),
                 bool(parity_check), shapes)).encode()
    everyone = allgather_bytes(mine, group, backend.timeout_s)
    if any(b != mine for b in everyone):
        shown = "; ".join(f"rank {r}: {b.decode()}" for r, b in enumerate(everyone))
        raise ValueError("profile: the ranks passed different arguments (max_batched_tokens, threshold_tokens, "
                         "search, config, budget_s, parity_check, and each ops group's name, output width, "
                         "dtype, norm weight shape, norm type, eps, and whether the projection and the norm have a "
                         f"bias) -- {shown}; every rank must pass the same ones")
    hidden = int(np.prod(groups[0].norm.weight.shape))
    started = time.monotonic()
    deadline = started + float(budget_s)
    report = ProfileReport()
    handles: dict[str, object] = {}
    enabled = False

    def disabled(reason: str) -> None:
        warnings.warn(f"TPSP using the regular forward: {reason}", TPSPDisabledWarning, stacklevel=4)
        return None

    try:
        for ops in groups:
            handle = backend.open(dtype=np.dtype(ops.projection.weight.dtype), tp_size=group.size,
                                  hidden_size=hidden, max_batched_tokens=max_batched_tokens, name=ops.name)
            if handle is None:
                return disabled(f"the fused backend is unavailable for ops group {ops.name!r}")
            handles[ops.name] = handle
            if config is not None:
                backend.set_config(handle, config)
        runners = [_Runner(backend, handles[ops.name], ops, group) for ops in groups]
        for r in runners:
            report.chosen[r.ops.name] = r.handle.config
        threshold = 1 if threshold_tokens is None else threshold_tokens
        reason = "static profile"
        if search:
            if config is None:
                for r in runners:
                    best = _scan_chunk(r, max_batched_tokens, deadline, report)
                    if best is None:
                        return disabled(f"the chunk search for {r.ops.name!r} ran out of its {budget_s:g} s budget")
                    backend.set_config(r.handle, best)
                    report.chosen[r.ops.name] = best
            if threshold_tokens is None:
                threshold, why = _scan_threshold(runners, max_batched_tokens, deadline, report)
                if threshold is None:
                    return disabled(why)
            reason = "measured profile"
        if parity_check:
            ok, detail = _parity(runners, report)
            if not all_ranks_ready(ok, group, backend.timeout_s):
                return disabled(f"parity check against the regular forward failed "
                                f"({detail or 'on another rank'})")
        enabled = True
        report.elapsed_s = time.monotonic() - started
        return TPSPContext(TPSPProfile(True, int(threshold), max_batched_tokens, reason), backend, handles, report)
    except BaseException as exc:
        # This rank leaves the profile mid-way: its peers may be inside a measurement's
        # collective it will never join, so a collective close would wait for them while they
        # wait for it -- until both timed out, and the timeout replaced this error.  The group's
        # collectives cannot match up again: say so (the teardown's barriers then end at once),
        # release this rank's part, and let the error itself reach the caller (run_collectively
        # tells the peers).
        if handles and not group.unusable:
            group.unusable = f"profile_tpsp failed on rank {group.rank} ({type(exc).__name__}) before its teardown"
        for h in handles.values():
            try:
                backend.close(h)
            except Exception as close_exc:  # (expected: the barriers refused; the mappings are released)
                _LOG.debug("profile_tpsp: closing %r after a failure: %s", h, close_exc)
        handles.clear()
        raise
    finally:
        # The other way out without a context: a ``disabled(...)`` return.  Every rank decided it
        # together (an agreed open, search or parity result), so the usual collective close is safe.
        # (After an exception the handles were released above and cleared.)
        if not enabled:
            for h in handles.values():
                backend.close(h)


__all__ = ["profile_tpsp", "TPSPDisabledWarning", "ProfileReport", "chunk_candidates", "threshold_sizes"]
