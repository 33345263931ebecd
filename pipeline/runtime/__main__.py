"""``python -m pipeline.runtime``: see :mod:`pipeline.runtime.generation`."""

from pipeline.runtime.generation import main

raise SystemExit(main())
