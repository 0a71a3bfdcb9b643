"""``python -m vtnumba`` -- see :mod:`vtnumba.apps.cli`."""

import sys

from vtnumba.apps.cli import main

sys.exit(main())
