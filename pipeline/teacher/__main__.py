"""``python -m pipeline.teacher import SOURCE OUT_DIR``: :func:`pipeline.teacher.importer.main`."""

import sys

from pipeline.teacher.importer import main

sys.exit(main())
