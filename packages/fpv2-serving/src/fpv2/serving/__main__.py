"""``python -m fpv2.serving``: the ``fpv2`` command line without an installed console script."""

import sys

from .cli import main

sys.exit(main())
