"""``python -m pipeline.launch SCRIPT [ARGS]`` and ``python -m pipeline.launch plan``: :func:`pipeline.launch.launcher.main`."""

from pipeline.launch.launcher import main

main()
