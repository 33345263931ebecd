"""``python -m pipeline.synthetic PRESET``: :func:`pipeline.synthetic.text.main`."""

from pipeline.synthetic.text import main

raise SystemExit(main())
