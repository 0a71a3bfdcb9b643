"""``python -m vtnumba`` -- see :mod:`vtnumba.cli`."""

import sys

from vtnumba.cli import main

sys.exit(main())
