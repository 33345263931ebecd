"""``python -m pipeline.sqt``: see :mod:`pipeline.sqt.write`."""

import sys

from pipeline.sqt.write import main

sys.exit(main())
