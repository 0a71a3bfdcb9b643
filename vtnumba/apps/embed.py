"""``vtnumba embed``: sentence embeddings from all-MiniLM-L6-v2, tensor-parallel over the ranks.

``mpiexec -n N python -m vtnumba embed [--no-tpsp] [--json] TEXT...`` runs the encoder with
tensor-parallel size N (N must divide the 12 attention heads: 1, 2, 3, 4, 6 or 12) and
prints, on rank 0, one embedding per text -- or, with ``--json``, a list of
``{"text", "embedding"}`` objects.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def run_embed(args) -> int:
    from vtnumba.dist import destroy_distributed, init_distributed
    from vtnumba.models.tp_runtime import TensorParallelEncoder

    group = init_distributed()
    try:
        with TensorParallelEncoder(group, use_tpsp=not args.no_tpsp) as tpe:
            emb = tpe.encoder.encode(args.texts)
            mode = "TPSP" if tpe.tpsp_enabled and tpe.fused_calls() else "regular forward"
    except ValueError as exc:
        # Bad input: every rank raised the same error (the encoder's ranks agree first).
        if group.rank == 0:
            print(f"vtnumba embed: error: {exc}", file=sys.stderr)
        return 2
    finally:
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
