#!/usr/bin/env python
"""Run a tensor-parallel MLP model with TPSP and with the regular forward; compare outputs and time.

    mpiexec -n 2 python mpi/tpsp_model.py [--target cpu] [--layers 4] [--tokens 512]
                                          [--hidden 1024] [--ffn 4096] [--norm rms|layer]
                                          [--chunk C] [--search] [--repeat 3]

The model is :class:`vtnumba.nn.ParallelMLPStack`: an input norm and L blocks of
column-parallel up-projection -> activation -> row-parallel down-projection, each
down-projection fused with the next norm.  Random weights, identical on every rank.

* **regular**: the residual is replicated; each block all-reduces its ``[T, H]`` partial
  (``MPI_Allreduce``) and every rank normalises all ``T`` rows;
* **TPSP**: the residual is sharded by token rows; each block is one fused
  matmul -> reduce-scatter -> bias + residual + norm -> all-gather over peer memory
  (:mod:`vtnumba.tpsp`), configured by a static profile (``--chunk``) or a measured one
  (``--search``).

It prints the largest absolute difference between the two final hidden states and the
largest relative difference between their residuals (the TPSP residual shards are gathered
for the comparison), each forward's time on the
slowest rank, and their ratio; it exits with status 1 if the outputs disagree.

Failures end the job (``docs/failure_model``): the ranks first check they were started with
the same arguments; a rank that raises tells the others at once (they stop waiting and
say which rank failed and what it was doing), and a rank that is stopped or hung makes the
others give up after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings


def parse_args(argv=None):
    from vtnumba.apps.processes import RankZeroErrorsParser, choose_target
    from vtnumba.bench.runner import check_hidden_split, default_hidden_size, non_negative_int

    # (A usage error is printed by rank 0 only; every rank exits with status 2.)
    p = RankZeroErrorsParser(description="TPSP vs. the regular tensor-parallel forward on an MLP stack "
                                            "(run under mpiexec -n N)")
    p.add_argument("--target", choices=("auto", "cpu", "cudasim", "cuda"), default=None,
                   help="execution target (default: $VTNUMBA_TARGET or auto)")
    p.add_argument("--layers", type=int, default=4, help="number of MLP blocks (default 4)")
    p.add_argument("--tokens", type=int, default=512, help="tokens in the batch, T (default 512)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size H, a multiple of the rank count (default 1024, rounded up to a multiple of "
                        "8 x ranks: 1032 on 3)")
    p.add_argument("--ffn", type=int, default=4096, help="MLP inner size F (default 4096)")
    p.add_argument("--norm", choices=("rms", "layer"), default="rms", help="the norm after each block (default rms)")
    p.add_argument("--act", choices=("relu", "gelu", "silu", "gelu_erf"), default="gelu",
                   help="activation (default gelu, the tanh form; gelu_erf is BERT's)")
    p.add_argument("--chunk", type=int, default=None,
                   help="TPSP microchunk, token rows per rank per step (default: the backend's)")
    p.add_argument("--search", action="store_true", help="measure the chunk size and token threshold first")
    p.add_argument("--budget", type=float, default=20.0, help="time budget of --search in seconds (default 20)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each forward (default 3)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="weight/input seed (default 0)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest accepted difference (default 1e-4)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any wait for another rank may take before this rank gives up (default 60)")
    # Test hook: make one rank fail at a given point, e.g. raise:1:between, kill:0:tpsp, stop:1:regular
    # (points: setup, profile, regular, between, tpsp).
    p.add_argument("--inject", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.timeout > 0 and args.timeout < float("inf")):
        p.error(f"--timeout={args.timeout} must be a positive number of seconds")
    # (NaN compares unequal to itself: every rank would see the others "started with different
    # arguments"; a negative tolerance would fail a run that matches exactly.)
    if not (0 <= args.tol < float("inf")):
        p.error(f"--tol={args.tol} must be a finite number >= 0 (the largest accepted difference)")
    if not (0 < args.budget < float("inf")):
        p.error(f"--budget={args.budget} must be a positive number of seconds")
    from mpi4py import MPI

    ranks = MPI.COMM_WORLD.Get_size()
    if args.hidden is None:  # (the hidden size is split over the ranks)
        args.hidden = default_hidden_size(1024, ranks)
    for name in ("layers", "tokens", "hidden", "ffn", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.chunk is not None and args.chunk < 1:
        p.error("--chunk must be >= 1")
    try:
        check_hidden_split(args.hidden, ranks)
    except ValueError as exc:
        p.error(str(exc))
    if args.ffn < ranks:
        p.error(f"--ffn={args.ffn} is smaller than the {ranks} ranks (each rank holds a non-empty slice of "
                "the feed-forward width)")
    if args.inject is not None:
        from vtnumba.faults import FaultInjection

        try:  # (every rank passes every point; the job's size bounds the rank)
            args.inject = FaultInjection.parse(args.inject, inject_passes(args.repeat), ranks)
        except ValueError as exc:
            p.error(str(exc))
    choose_target(p, args.target)  # last: a usage error, and before anything imports numba.cuda
    return args


# Where the hidden --inject test flag (vtnumba.faults: how:rank:point[@n]) can make a rank fail:
# "regular" and "tpsp" are passed once per timed round (@n picks the round), the others once.
INJECT_POINTS = ("setup", "profile", "regular", "between", "tpsp")


def inject_passes(repeat: int) -> dict:
    """How many times a run passes each of INJECT_POINTS."""
    return {p: repeat if p in ("regular", "tpsp") else 1 for p in INJECT_POINTS}


def main(argv=None) -> int:
    from vtnumba.apps.processes import share_cores_between_local_ranks
    from vtnumba.target import current_target

    share_cores_between_local_ranks()  # before numpy loads its BLAS (choosing the target may load it)
    args = parse_args(argv)
    target = current_target()  # (chosen by parse_args)
    from vtnumba.dist import run_collectively

    return run_collectively(lambda: _run(args, target, args.inject), timeout_s=args.timeout)


def _run(args, target, inject) -> int:
    import json

    import numpy as np
    from mpi4py import MPI

    from vtnumba.backend import default_backend
    from vtnumba.dist import (
        agree_errors,
        allgather_bytes,
        allreduce_max,
        barrier,
        destroy_distributed,
        init_distributed,
        phase,
    )
    from vtnumba.dist.comm import set_default_timeout
    from vtnumba.nn import ParallelMLPStack
    from vtnumba.tpsp import TPSPDisabledWarning, TPSPOp, get_tpsp_backend, shard_residual

    set_default_timeout(args.timeout)  # every wait for another rank, in vtnumba too
    group = init_distributed()
    tp, rank = group.size, group.rank
    hook = inject.on_point(MPI.COMM_WORLD.Get_rank()) if inject is not None else None

    def _fault(point: str) -> None:
        if hook is not None:
            hook(point)

    say = print if rank == 0 else (lambda *a, **k: None)

    # Every rank must build the same model: compare the arguments before anything else, so a
    # mismatch reads as what it is -- not as TPSP disagreeing with the regular forward later.
    # (The resolved target, not the flag: --target cpu on one rank and VTNUMBA_TARGET=cpu on
    # another agree; the fault spec as text, so a fault given to only some ranks is refused.)
    mine = dict(vars(args), target=target.name, inject=None if inject is None else inject._text())
    everyone = [json.loads(b) for b in allgather_bytes(json.dumps(mine, sort_keys=True).encode(), group)]
    differ = sorted({k for other in everyone for k in mine if other.get(k) != mine[k]})
    agree_errors(None if not differ else
                 f"the ranks were started with different arguments ({', '.join('--' + d for d in differ)}: "
                 + "; ".join(f"rank {r}: {', '.join(f'{d}={e[d]}' for d in differ)}" for r, e in enumerate(everyone))
                 + "); start every rank with the same command line", group, default_type=ValueError)
    T, H = args.tokens, args.hidden
    say(f"tpsp_model: {tp} ranks, target {target.name}, {args.layers} blocks, T={T} H={H} F={args.ffn} "
        f"norm={args.norm} act={args.act}")

    with phase("building the model"):
        _fault("setup")
        stack = ParallelMLPStack(args.layers, H, args.ffn, norm=args.norm, act=args.act, seed=args.seed)
        embeddings = np.random.default_rng(args.seed + 99).standard_normal((T, H), dtype=np.float32)
        # The target's backend says where the layers compute: numpy on cpu, device arrays on
        # cuda/cudasim.  Inputs go there once; the layers upload their weights once themselves.
        data = default_backend()
        to_host = data.to_host
        emb = data.asarray(embeddings)
        shard0 = data.asarray(shard_residual(embeddings, tp, rank))

    with phase("profiling TPSP"):
        _fault("profile")
        backend = get_tpsp_backend("tp", timeout_s=args.timeout)
        t0 = time.perf_counter()
        # Why TPSP is off, if it is, is said once below (every rank would warn).
        with warnings.catch_warnings(record=True) as disabled:
            warnings.simplefilter("always", TPSPDisabledWarning)
            context = backend.profile(stack.ops_groups(), max_batched_tokens=T, search=args.search,
                                      config=args.chunk, budget_s=args.budget)
        why_off = sorted({str(w.message).split(": ", 1)[-1] for w in disabled
                          if issubclass(w.category, TPSPDisabledWarning)})
    say(f"profile ({'measured' if args.search else 'static'}, {time.perf_counter() - t0:.1f} s): "
        + (f"TPSP disabled ({'; '.join(why_off) or 'no reason given'}), regular forward everywhere"
           if context is None else
           f"TPSP from {context.profile.threshold_tokens} tokens, chunks "
           f"{ {n: h.config.chunk_tokens_per_rank for n, h in context.handles.items()} }"))
    ops = [TPSPOp(context, g.name, norm=args.norm, group=group, timeout_s=args.timeout) for g in stack.ops_groups()]

    def timed(what, fn, point, k):
        """One run of one forward; its time on the slowest rank (each rank's own clock)."""
        with phase(f"{what}, run {k + 1} of {args.repeat + 1}"):
            barrier(group)
            if k >= 1:  # the timed rounds: --inject ...:tpsp@2 fails in the second
                _fault(point)
            start = time.perf_counter()
            result = fn()
            mine = time.perf_counter() - start
            # With a deadline (a blocking allreduce would wait forever for a stopped rank).
            slowest = allreduce_max(mine, group, f"the timing of {what}")
        return slowest, result

    # The two forwards run in interleaved rounds (regular, then TPSP, repeat), so a noisy
    # neighbour on a shared machine slows both alike; round 0 warms up (jit, page faults)
    # and is not counted.
    t_regs, t_tpsps = [], []
    for k in range(args.repeat + 1):
        t, (x_reg, res_reg) = timed("the regular forward", lambda: stack.forward_regular(emb, group), "regular", k)
        if k == 0:
            with phase("between the forwards"):
                _fault("between")
        t_regs.append(t)
        t, (x_tpsp, res_shard) = timed("the TPSP forward", lambda: stack.forward_tpsp(emb, shard0, ops), "tpsp", k)
        t_tpsps.append(t)
    t_reg, t_tpsp = float(np.median(t_regs[1:])), float(np.median(t_tpsps[1:]))

    with phase("comparing the results"):
        x_reg, res_reg, x_tpsp = to_host(x_reg), to_host(res_reg), to_host(x_tpsp)
        mine = np.ascontiguousarray(to_host(res_shard), dtype=np.float32)
        shards = [np.frombuffer(b, np.float32).reshape(-1, H) for b in allgather_bytes(mine.tobytes(), group)]
        res_tpsp = np.concatenate(shards, axis=0)[:T]
        err_x = float(np.max(np.abs(x_tpsp - x_reg)))
        err_res = float(np.max(np.abs(res_tpsp - res_reg)) / max(1.0, float(np.max(np.abs(res_reg)))))
        err = allreduce_max(max(err_x, err_res), group, "the comparison of the results")
    fused = sum(op.fused_calls for op in ops)
    say(f"regular forward: {t_reg * 1e3:9.2f} ms   (all-reduce of [T, H] per block, replicated residual)")
    say(f"TPSP forward:    {t_tpsp * 1e3:9.2f} ms   ({fused} fused calls, "
        f"{sum(op.regular_calls for op in ops)} regular; sharded residual)")
    if fused:
        say(f"time ratio TPSP / regular: {t_tpsp / t_reg:.3f}")
        # The same explanation the demo prints: TPSP's speed-up with its per-round range, a
        # verdict that says whether the rounds agree, and one line on why for this target.
        from vtnumba.apps.pipeline_demo import explain_speedup

        for line in explain_speedup(t_reg / t_tpsp, [r / t for r, t in zip(t_regs[1:], t_tpsps[1:])], target.name,
                                    label="speed-up of TPSP (regular time / TPSP time)"):
            say(line)
    else:
        # Both rows ran the regular forward (the second on a sharded residual): a ratio of
        # the two would be noise presented as a TPSP speed-up.
        say("no TPSP speed-up to report: no fused call ran, so both forwards above are the regular one"
            + (" (TPSP needs 2 or more ranks: run under mpiexec -n 2)" if tp == 1 else ""))
    say(f"max |hidden difference| = {err_x:.3g}, max relative residual difference = {err_res:.3g} "
        f"(largest over ranks: {err:.3g}, tolerance {args.tol:g})")
    ok = err <= args.tol
    what = "TPSP" if fused else "the fallback (sharded residual, regular calls)"
    say(f"OK: {what} matches the regular forward" if ok else f"MISMATCH: {what} differs from the regular forward")

    with phase("closing"):
        if context is not None:
            context.close()
        backend.close()
        destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    from vtnumba.apps.processes import exit_quietly_when_interrupted

    sys.exit(exit_quietly_when_interrupted(main))
