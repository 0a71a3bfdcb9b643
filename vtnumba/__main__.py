"""``python -m vtnumba`` -- see :mod:`vtnumba.apps.cli`."""

import sys

from vtnumba.apps.cli import run

sys.exit(run())
