"""``python -m vtnumba`` -- see :mod:`vtnumba.apps.cli`."""

import sys

from vtnumba.apps.processes import exit_quietly_when_interrupted


def _run_cli() -> int:
    from vtnumba.apps.cli import run  # (in here: a Ctrl-C while its modules load is one line too)

    return run()


sys.exit(exit_quietly_when_interrupted(_run_cli))
