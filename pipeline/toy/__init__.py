"""The toy world: procedurally generated vision-language tasks and a tiny Mllama teacher (README, "The toy
world"). Importing it registers its tasks with ``pipeline.eval.tasks`` and its ``toy`` image pool with
``pipeline.teacher.images``."""

from pipeline.toy import tasks  # noqa: F401  (registers the tasks and the image pool)
