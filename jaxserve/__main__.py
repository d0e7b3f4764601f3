"""``python -m jaxserve``: the ``jaxserve`` command, for when its script is not on PATH."""

import sys

from jaxserve.cli import main

sys.exit(main())
