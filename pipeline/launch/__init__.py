"""How a stage runs: on one process or several, in how much memory.

- :mod:`pipeline.launch.launcher`: ``python -m pipeline.launch SCRIPT [ARGS]`` starts a stage script on one process
  or several (torchrun) from the ``launch`` section of ``params.yaml``; ``python -m pipeline.launch plan`` prints the
  memory and disk each stage needs.
- :mod:`pipeline.launch.processes`: the launch settings a stage runs under (what the launcher hands it).
- :mod:`pipeline.launch.ranks`: how a launched stage's ranks form their process group and wait for one another.
- :mod:`pipeline.launch.memory_plan`: the memory and disk of a run, stage by stage, before it starts.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
