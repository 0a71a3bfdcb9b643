"""``vtnumba embed``: sentence embeddings from all-MiniLM-L6-v2, tensor-parallel over the ranks.

``mpiexec -n N python -m vtnumba embed [--no-tpsp] [--json] TEXT...`` runs the encoder with
tensor-parallel size N (N must divide the 12 attention heads: 1, 2, 3, 4, 6 or 12) and
prints, on rank 0, one embedding per text -- or, with ``--json``, a list of
``{"text", "embedding"}`` objects.

Bad input ends the command with status 2 and one message on rank 0, on every rank alike:
each rank gets the same arguments, and the encoder's ranks agree on its input before any
forward.  A TEXT whose bytes are not UTF-8 (the shell passes bytes; Python keeps the ones
it cannot decode as lone surrogates) is refused before the model is even loaded, and so is
a rank count that does not divide the heads (read from the model's config alone) -- and a
missing or damaged model, when every rank finds the same problem.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np


def _bad_argument(texts) -> str | None:
    """The message for the first TEXT that is not valid text, or None."""
    from vtnumba.models.minilm_tokenizer import invalid_text

    for i, text in enumerate(texts):
        bad = invalid_text(text)
        if bad:
            return f"TEXT argument {i + 1} ({text!r}) {bad}"
    return None


#: Where the hidden ``--inject how:rank:point`` test flag (:mod:`vtnumba.faults`) can make a
#: rank fail, and how many times a run passes each.
INJECT_POINTS = {"loading": 1, "encoding": 1}


class InputRejected(ValueError):
    """Input that every rank rejects alike (they all got the same command line): the one error
    after which the ranks may leave together, through the collective teardown."""


def run_embed(args) -> int:
    """The ``embed`` command (collective over the world): print embeddings on rank 0; the exit status.

    Run it under :func:`vtnumba.dist.run_collectively` (the CLI does): a rank that fails for
    any other reason than bad input tells the others, and the whole job ends.
    """
    from mpi4py import MPI

    from vtnumba.dist import allgather_bytes, destroy_distributed, init_distributed, phase
    from vtnumba.faults import parse_inject
    from vtnumba.models import MiniLMConfig, TruncationWarning, check_tp_size, find_minilm_dir
    from vtnumba.models.minilm_tokenizer import NO_PIECES, first_without_pieces_in
    from vtnumba.models.tp_runtime import TensorParallelEncoder

    group = init_distributed()

    def agree(problem: str, error=ValueError, what: str = "refused their input") -> None:
        """Every rank's verdict on its input (``problem``: "" if fine).  The same refusal on every
        rank -- one command line -- is InputRejected, said once; a refusal on some ranks only
        (``mpiexec ... : ...``, another environment) is this rank's failure (an ``error``), or
        its reason to stop (the failing ranks ``what``), so the job ends naming them."""
        problems = [b.decode() for b in allgather_bytes(problem.encode(), group)]
        if problem and len(set(problems)) == 1:
            raise InputRejected(problem)
        if problem:
            raise error(problem)
        if any(problems):
            stop = RuntimeError(f"rank(s) {[r for r, p in enumerate(problems) if p]} {what}")
            stop.caused_by_peer = True  # (vtnumba.dist.failures: this rank stopped because of them)
            raise stop

    try:
        agree(_bad_argument(args.texts) or "")
        world = MPI.COMM_WORLD
        try:
            hook, problem = parse_inject(getattr(args, "inject", None), INJECT_POINTS, world.Get_rank(),
                                         world.Get_size()), ""
        except ValueError as exc:
            hook, problem = None, str(exc)
        agree(problem)
        hook = hook or (lambda _point: None)
        # The job's size is the tensor-parallel size: one that does not divide the model's heads
        # is refused by every rank alike, from the config alone -- before loading the weights,
        # and said once (it was a failure printed by every rank, after loading).
        with phase("loading the model"):
            try:
                config, problem = MiniLMConfig.from_dir(find_minilm_dir()), ""
            except (OSError, ValueError) as exc:
                config, problem = None, str(exc)
            # No model, or a damaged one.  Ranks that read the same files fail alike: then it
            # is said once.  Otherwise each failing rank says its own, and the others stop too.
            agree(problem, FileNotFoundError, "could not read the model")
        try:
            check_tp_size(group.size, config)
        except ValueError as exc:
            raise InputRejected(f"{exc} -- run it with mpiexec -n set to one of those") from None
        # Progress on rank 0, to stderr (stdout is the result, e.g. --json): loading and the
        # first call's kernel compilation take seconds.
        say = (lambda text: print(text, file=sys.stderr, flush=True)) if group.rank == 0 else (lambda text: None)
        say(f"vtnumba embed: loading all-MiniLM-L6-v2 on {group.size} rank(s) ...")
        if not args.no_tpsp and group.size > 1:  # (one rank has nothing to exchange: no TPSP)
            from vtnumba.target import current_target

            slow = current_target().name == "cudasim"
            # (Opening TPSP checks the fused op against the regular forward on every projection:
            # quick on cpu and a GPU, many minutes in the simulator's ~7000 threads/s.)
            say("vtnumba embed: opening TPSP: a fused and a regular forward of each of the model's "
                f"{2 * config.num_hidden_layers} row-parallel projections, compared"
                + (" -- many minutes in the CUDA simulator; --no-tpsp skips it" if slow else " ..."))
        with phase("loading the model"):
            hook("loading")
            tpe = TensorParallelEncoder(group, use_tpsp=not args.no_tpsp)
        say(f"vtnumba embed: encoding {len(args.texts)} text(s) (a first run also compiles the kernels) ...")
        with tpe, phase("encoding the texts"):
            # A text of control characters or zero-width spaces only passes _bad_argument and
            # has no word piece: only the tokenizer can tell.  Every rank finds the same one.
            tokenizer = tpe.encoder.tokenizer
            counts = tokenizer.token_counts(args.texts)
            empty = first_without_pieces_in(counts)
            agree("" if empty is None else f"TEXT argument {empty + 1} ({args.texts[empty]!r}) {NO_PIECES}")
            # Truncation is said here, by TEXT argument (the tokenizer's warning counts from 0).
            for i, n in enumerate(counts):
                if n > tokenizer.max_seq_length:
                    say(f"vtnumba embed: warning: TEXT argument {i + 1} has {n} tokens; only its first "
                        f"{tokenizer.max_seq_length} are embedded, as sentence-transformers does")
            warnings.filterwarnings("ignore", category=TruncationWarning)
            hook("encoding")
            emb = tpe.encoder.encode(args.texts)
            mode = "TPSP" if tpe.tpsp_enabled and tpe.fused_calls() else "regular forward"
    except InputRejected as exc:
        # Bad input, rejected by every rank alike: they may leave together, through the
        # collective teardown.  (Any other error -- even a ValueError, which one rank alone
        # may raise -- goes to run_collectively, which tells the others.)
        if group.rank == 0:
            print(f"vtnumba embed: error: {exc}", file=sys.stderr)
        destroy_distributed()
        return 2
    # Not in a ``finally``: after any other failure the teardown (collective) must not run --
    # the failure board it closes is how this rank's report reaches the others
    # (run_collectively, vtnumba.dist.failures).
    destroy_distributed()
    if group.rank != 0:
        return 0
    if args.json:
        print(json.dumps([{"text": t, "embedding": [float(v) for v in e]} for t, e in zip(args.texts, emb)]))
        return 0
    np.set_printoptions(precision=4, suppress=True, linewidth=120)
    print(f"all-MiniLM-L6-v2, tensor-parallel size {group.size} ({mode}), {emb.shape[1]}-dim unit vectors:")
    for text, e in zip(args.texts, emb):
        print(f"- {text!r}\n  [{', '.join(f'{v:+.4f}' for v in e[:8])}, ... ]  (norm {np.linalg.norm(e):.4f})")
    if len(args.texts) > 1:
        sims = emb @ emb.T
        print("cosine similarities:")
        for i, t in enumerate(args.texts):
            print(f"  {i}: " + " ".join(f"{sims[i, j]:+.3f}" for j in range(len(args.texts))) + f"  {t[:40]!r}")
    sys.stdout.flush()
    return 0
